"""The optimizer of managed STEM tables, chained with Megatron's optimizer for the rest of the model.

Extends ``megatron.core.optimizer.ChainedOptimizer``: the model's optimizer(s) stay as Megatron
built them; this class adds the tables to each step:

* ``prepare_grads``: the row gradients of the step are pushed to their owners and summed there
  (``StemTables.collect_grads``), then scaled as Megatron's DDP scales parameter gradients
  (``1 / data-parallel size``), divided by the loss scale when a grad scaler is active; a
  non-finite table gradient skips the step like a non-finite parameter gradient does. One
  all-reduce of the tables' squared gradient norm (each row chunk counted once over TP x PP x DP)
  decides both: it is finite exactly when every table gradient is;
* ``get_grad_norm``: that squared norm joins the model's, so clipping uses one global norm;
* ``step_with_ready_grads``: table gradients are clipped with the coefficient Megatron's
  ``clip_grad_by_total_norm_fp32`` applies to the parameters, then the rows step with
  ``RowAdamW`` (``--stem-optimizer dense|sparse``, one per chunk's store) using the learning rate
  and weight decay that Megatron's scheduler set on the default parameter group, and the
  optimizer's betas and eps. Host rows with prefetch step on the worker thread
  (``stem/runtime/worker.py``), overlapping the next training step: first the rows the next step's first
  micro-batch reads, then that micro-batch's read is released (``StemTables.release``), then the
  other rows. Every later read of the rows is queued behind the step, so it sees it.

The host steps' schedule is ``stem/runtime/schedule.py``; checkpoint state (the tables' moments,
fp32 rows) is laid out by ``stem/runtime/checkpoint.py``; reports are ``stem/runtime/report.py``.
The STEM run (``stem/run.py``) chains this optimizer onto the one Megatron builds
(``wrap_optimizer``) when the model has managed tables.
"""
from __future__ import annotations

import math
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer

from megatron_ext.models.token_ids import wrapped_attr
from megatron_ext.stem.runtime import checkpoint
from megatron_ext.stem.runtime.exchange import comm_device
from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW
from megatron_ext.stem.runtime.store import PinnedStaging
from megatron_ext.stem.runtime.schedule import TableSteps
from megatron_ext.stem.runtime.row_adam import TieredRowAdamW
from megatron_ext.stem.runtime.tiers import split_layers
from megatron_ext.stem.runtime.transfer import Arrival, stage_to_host
from megatron_ext.stem.runtime.worker import mark
from megatron_ext_kernels import row_adam_cpu



class StemTablesOptimizer(ChainedOptimizer):
    def __init__(self, inner, tables: List, mode: str, worker):
        chained = list(inner.chained_optimizers) if isinstance(inner, ChainedOptimizer) \
            else [inner]
        super().__init__(chained)
        self.tables = tables
        self.mode = mode
        self.shards = [s for t in tables for s in t.store.shards]
        self.tiered = any(t.tiered for t in tables)
        # One row optimizer per chunk, over its store's shards and lazy-row state (dense: only
        # its GPU reads still queued, which a step waits for); all advance their clocks alike.
        self.row_adams = [TieredRowAdamW(t.store.shards, mode=mode, lazy=t.store.lazy,
                                         huge_pages=t.store.huge_pages) if t.tiered
                          else RowAdamW(t.store.shards, mode=mode, lazy=t.store.lazy,
                                        huge_pages=t.store.huge_pages)
                          for t in tables]
        self.dp_size = tables[0].dp_size if tables else 1
        self.replicated = bool(tables) and tables[0].ownership is None
        self._grads: Optional[list] = None
        self._total_norm: Optional[float] = None
        self._norm_sq: Optional[float] = None  # of the step's table gradients (prepare_grads)
        self.grad_seconds = 0.0  # gradient collection and exchange time of the last step
        self.team_reported = False  # the CPU row kernel team line (report_stats, once)
        self._staging = PinnedStaging()
        self._copy_stream = None  # the host tier's gradients leave the GPU on it (made on use)
        self.steps = TableSteps(mode, worker)  # the row steps as they run on the host worker
        self._step_count = 0   # iterations stepped (every rank, with tables or not)

    @property
    def step_count(self) -> int:
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step_count = value
        for adam in self.row_adams:
            adam.step_count = value

    @property
    def decay_product(self) -> float:
        return self.row_adams[0].decay_product if self.row_adams and self.mode == "sparse" \
            else 1.0

    @property
    def kernel(self) -> str:
        return self.row_adams[0].kernel if self.row_adams else "none"

    def materialize(self) -> None:
        """Sparse: bring every row up to date (before the rows are read whole)."""
        for adam in self.row_adams:
            adam.materialize()

    def drain(self) -> None:
        """Wait for the tables' host work (``TableSteps.drain``): before their state is read
        whole (checkpoints, dumps) or the gradient staging buffer is reused."""
        self.steps.drain(self.tables)

    # -- gradients -----------------------------------------------------------------------------
    def prepare_grads(self) -> bool:
        found_inf = super().prepare_grads()
        self.drain()  # counted as exposed optimizer time, not in the exchange's
        start = time.perf_counter()
        grads = []
        for t in self.tables:
            rows, per_layer = t.collect_grads()
            # The gradients stay where the exchange left them (the GPU under NCCL) for scaling,
            # the finiteness check, the norm and clipping; they go to host shards at the step.
            grads.append([(rows, g) for g in per_layer])
        scale = 1.0 / self.dp_size
        loss_scale = self.get_loss_scale()
        if loss_scale is not None:
            scale = scale / float(loss_scale.item() if torch.is_tensor(loss_scale) else loss_scale)
        for _, g in (x for per_table in grads for x in per_table):
            g.mul_(scale)
        self._grads = grads
        # One all-reduce gives both the finiteness check and the tables' share of the gradient
        # norm: the sum of squares (float64: no finite fp32 value overflows it) is finite exactly
        # when every gradient is, on every rank.
        self._norm_sq = self._reduce_norm_sq()
        self.grad_seconds = time.perf_counter() - start
        return found_inf or not math.isfinite(self._norm_sq)

    def _all_grads(self):
        return [x for per_table in self._grads or [] for x in per_table]

    @torch.no_grad()
    def _reduce_norm_sq(self) -> float:
        """The squared norm of the tables' gradients over every rank (collective over the
        world)."""
        device = comm_device(dist.group.WORLD)
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for _, g in self._all_grads():
            local += (g.double() ** 2).sum().to(device)
        if self.replicated:
            local /= self.dp_size  # every data-parallel rank holds the same summed gradients
        dist.all_reduce(local)
        return float(local.item())

    def table_grad_norm_sq(self) -> float:
        """The squared norm of the step's table gradients, as ``prepare_grads`` reduced it (the
        gradients have not changed since)."""
        if self._norm_sq is None:
            raise RuntimeError("the STEM tables' gradient norm is asked before prepare_grads")
        return self._norm_sq

    @torch.no_grad()
    def get_grad_norm(self):
        base = super().get_grad_norm()
        base = float(base) if base is not None else 0.0
        self._total_norm = math.sqrt(base * base + self.table_grad_norm_sq())
        return self._total_norm

    # -- step ----------------------------------------------------------------------------------
    def _hyper(self) -> AdamHyper:
        groups = [g for g in self.param_groups
                  if g.get("wd_mult", 1.0) == 1.0 and g.get("lr_mult", 1.0) == 1.0
                  and not g.get("is_decoupled_lr", False)]
        if not groups:
            raise RuntimeError("no default parameter group to take the STEM tables' learning "
                               "rate and weight decay from")
        group = next((g for g in groups if g.get("default_config", False)), groups[0])
        return AdamHyper(lr=float(group["lr"]), beta1=self.config.adam_beta1,
                         beta2=self.config.adam_beta2, eps=self.config.adam_eps,
                         weight_decay=float(group["weight_decay"]))

    def _grads_to_shards(self) -> Tuple[list, object]:
        """The step's row gradients (per table) on their shards' device (tiered: ``TierGrads``,
        each tier's part on its device), and the event that marks their arrival there (None:
        they are there). GPU gradients for host rows are copied, all in one pass, into a reusable
        pinned buffer, on a stream of their own after the gradients are final: they are neither
        stuck behind the model's optimizer step nor hold it back, and the CPU steps the rows
        while the GPU runs that step."""
        if self.tiered:
            # The host rows that the next step's first micro-batch reads (its read waits for
            # their step, ``OwedStep``) go first, so that read waits for their copy alone.
            per_table = []
            for t, per in zip(self.tables, self._grads):
                first = t.deferred.route.requested if t.deferred is not None else None
                # Every layer at once: they share the chunk's rows (``prepare_grads``)
                per_table.append(split_layers(t.store.shards, per[0][0], [g for _, g in per],
                                              first) if per else [])
            cold = [tg for per in per_table for _, tg in per if tg.cold.is_cuda]
            if not cold:  # no CUDA: every tier is on the host
                return per_table, None
            views, arrived = self._to_host([tg.cold for tg in cold],
                                           [tg.cold_first for tg in cold])
            for tg, view in zip(cold, views):
                tg.cold = view
            return per_table, arrived
        pairs = self._all_grads()
        moves = [(i, g) for i, ((_, g), s) in enumerate(zip(pairs, self.shards))
                 if g.device != s.device]
        out = [(rows.to(s.device), g) for (rows, g), s in zip(pairs, self.shards)]
        if moves and (moves[0][1].device.type != "cuda" or
                      any(s.device.type != "cpu" for s in self.shards)):
            out = [(rows, g.to(s.device)) for (rows, g), s in zip(out, self.shards)]
            moves = []
        arrived = None
        if moves:
            views, arrived = self._to_host([g for _, g in moves])
            for (i, _), view in zip(moves, views):
                out[i] = (out[i][0], view)
        per_table, base = [], 0
        for t in self.tables:
            per_table.append(out[base: base + len(t.store.shards)])
            base += len(t.store.shards)
        return per_table, arrived

    def _to_host(self, grads: Sequence[torch.Tensor], first: Optional[Sequence[int]] = None
                 ) -> Tuple[List[torch.Tensor], Arrival]:
        """GPU ``grads`` copied as fp32 into views of the pinned staging buffer on the
        optimizer's copy stream (``transfer.stage_to_host``; the ``first`` rows of each before
        the others), so that neither the host nor the model's optimizer step queued next waits
        for them; returns the views and their ``Arrival`` (the buffer is reused at the next step,
        after ``drain``)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        return stage_to_host(grads, self._staging, self._copy_stream, first)

    def step_with_ready_grads(self) -> bool:
        if self._grads is None:
            return super().step_with_ready_grads()
        clip = self.config.clip_grad
        if clip > 0.0 and self._total_norm is not None:
            coeff = clip / (self._total_norm + 1.0e-6)  # as clip_grad_by_total_norm_fp32
            if coeff < 1.0:
                for _, g in self._all_grads():
                    g.mul_(coeff)
        grads, arrived = self._grads_to_shards()
        # Everything the table step and the next step's first read take from the GPU is made
        # by now: on the worker's side stream they wait for this, not for the model's step.
        made = mark()
        # The model's step is queued on the GPU and runs while the CPU steps the rows.
        success = super().step_with_ready_grads()
        hyper = self._hyper()
        self._step_count += 1
        for t, adam, table_grads in zip(self.tables, self.row_adams, grads):
            self.steps.step_table(t, adam, adam.begin_step(hyper), table_grads, arrived, made)
        self._grads = self._norm_sq = None
        return success

    # -- checkpoints ---------------------------------------------------------------------------
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Megatron's optimizer state, plus the tables' (``stem/runtime/checkpoint.py``). Collective over
        the data-parallel group."""
        inner = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        return {"model_optim": inner, "stem_tables": checkpoint.optimizer_state(self)}

    def load_state_dict(self, state_dict):
        if "model_optim" not in state_dict:
            raise RuntimeError("this optimizer state has no STEM table state (saved by a run with "
                               "ordinary STEM tables?): load it with --no-load-optim")
        super().load_state_dict(state_dict["model_optim"])
        checkpoint.load_optimizer_state(self, state_dict["stem_tables"])


def wrap_optimizer(optimizer, model_chunks, stem_cpu_threads: int, mode: str, worker,
                   gpu_step: str = "torch"):
    """Megatron's optimizer with the table optimizer chained onto it (managed tables; their
    host work on ``worker``). Every rank wraps (also a pipeline stage without STEM layers): the
    norm and the skip flag are reduced over all ranks."""
    tables = [wrapped_attr(m, "token_tables") for m in model_chunks]
    tables = [t for t in tables if t is not None]
    row_adam_cpu.set_threads(stem_cpu_threads)
    wrapped = StemTablesOptimizer(optimizer, tables, mode, worker)
    choose_gpu_step(wrapped.row_adams, gpu_step)
    return wrapped


def choose_gpu_step(row_adams: List, gpu_step: str) -> None:
    """``--stem-gpu-step``: what steps the sparse optimizer's rows on the GPU (the GPU tier of
    tiered tables; managed gpu tables), ``torch`` ops or the ``triton`` kernel
    (kernels/row_adam_gpu.py). Host rows keep the CPU row kernel."""
    for adam in row_adams:
        (adam.hot if isinstance(adam, TieredRowAdamW) else adam).gpu_kernel = gpu_step
