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
  (``stem/worker.py``), overlapping the next training step: first the rows the next step's first
  micro-batch reads, then that micro-batch's read is released (``StemTables.release``), then the
  other rows. Every later read of the rows is queued behind the step, so it sees it.

Checkpoint state (the tables' moments, fp32 rows) is laid out by
``stem/checkpoint.py``. ``install()`` wraps ``megatron.training.training.get_megatron_optimizer``
so ``pretrain`` builds this optimizer whenever the model has managed tables.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function
from megatron.core import parallel_state as ps
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.utils import get_attr_wrapped_model

from megatron_ext.stem import checkpoint, host_memory
from megatron_ext.stem.exchange import comm_device
from megatron_ext.stem.row_adam import AdamHyper, RowAdamW
from megatron_ext.stem.store import PinnedStaging
from megatron_ext.stem.tiers import (
    TierGrads,
    TieredRowAdamW,
    grad_tensors,
    split_grads,
    take_rows,
)
from megatron_ext.stem.transfer import Arrival, stage_to_host, to_device
from megatron_ext.stem.worker import mark
from megatron_ext_kernels import row_adam_cpu


class OwedStep:
    """The part of a sparse table step not run yet, kept by the store (``TableStore.owed_step``).

    ``step(positions)`` steps the rows at ``positions`` (one index tensor per shard) of the step's
    gradients. A read of the store first steps the rows it reads (``settle``); the worker runs
    the rest in chunks of about ``CHUNK_ELEMENTS`` row elements (``run_chunk``), so a read
    queued meanwhile waits for one chunk, not for the whole step. Every row is stepped once,
    whichever comes first: rows step independently (each is brought up to date from its own last
    step), so the numbers are those of one step of every row. Used on the worker thread only."""

    CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 rows: a few milliseconds of CPU AdamW

    def __init__(self, step: Callable, rows: Sequence[torch.Tensor], widths: Sequence[int]):
        self._step = step
        self.rows = list(rows)
        self.widths = list(widths)
        self.left = [torch.arange(r.numel()) for r in self.rows]  # positions not stepped yet
        self.seconds = 0.0            # every part's step time
        self.seconds_in_reads = 0.0   # the parts reads waited for (on a read's path)
        self.store = None             # the store that keeps it, until it is done

    def _run(self, positions) -> float:
        if not any(p.numel() for p in positions):
            return 0.0
        took = self._step(positions)
        self.seconds += took
        return took

    def settle(self, local_rows: torch.Tensor) -> None:
        """Step the rows of ``local_rows`` not stepped yet."""
        positions = []
        for i, left in enumerate(self.left):
            if left.numel() == 0:
                positions.append(left)
                continue
            hit = torch.isin(self.rows[i][left], local_rows)
            positions.append(left[hit])
            self.left[i] = left[~hit]
        self.seconds_in_reads += self._run(positions)

    def run_chunk(self) -> bool:
        """Step the next chunk of rows; True once every row is stepped."""
        budget = self.CHUNK_ELEMENTS
        positions = []
        for i, left in enumerate(self.left):
            n = min(left.numel(), max(budget // max(self.widths[i], 1), 0))
            if n == 0 and left.numel() and not any(p.numel() for p in positions):
                n = 1  # progress whatever the width
            positions.append(left[:n])
            self.left[i] = left[n:]
            budget -= n * self.widths[i]
        self._run(positions)
        if self.done and self.store is not None and self.store.owed_step is self:
            self.store.owed_step = None
        return self.done

    @property
    def done(self) -> bool:
        return not any(left.numel() for left in self.left)

    def finish(self) -> None:
        while not self.run_chunk():
            pass

    def result(self) -> Tuple[float, float]:
        """(seconds of the whole step, seconds of it that reads waited for), as the table
        step's tasks report them."""
        return self.seconds, self.seconds_in_reads


class TableSteps:
    """The row steps of each iteration's tables as they run, and the wait for them: what
    ``StemTablesOptimizer`` does with an iteration's row gradients once they are final (its
    ``step_with_ready_grads``), apart from Megatron's optimizer, so that it runs alone as well
    (``benchmarks/stem_worker_schedule.py``, tests). ``mode``: ``--stem-optimizer``."""

    def __init__(self, mode: str, worker):
        self.mode = mode
        self.worker = worker  # the training's host worker (stem/worker.py)
        # (table, future of (seconds, seconds before its read), the step's gradient waits), not
        # waited for yet
        self.tasks = []

    def drain(self, tables: Sequence) -> None:
        """Wait for the tables' host work (the last step's rows, reads queued behind it). The
        waited time counts as exposed optimizer time (once, on the first of ``tables``); the
        background steps' own times are counted now, with the iteration they overlapped."""
        waited = self.worker.wait()
        if tables:  # one wait for every chunk: counted once
            tables[0].stats["optimizer_seconds_exposed"] += waited
        for t, done, grad_wait in self.tasks:
            took, before_read = done.result()
            t.stats["optimizer_seconds"] += took
            t.stats["optimizer_seconds_before_fetch"] += before_read
            t.stats["optimizer_seconds_grad_wait"] += grad_wait[0]
        self.tasks.clear()

    def step_table(self, t, adam, plan, grads, arrived, made=None) -> None:
        """Step one chunk's rows. Without a deferred read (no overlap), here and now. With one,
        on the worker. Dense steps every row in one pass, so its whole step precedes the read.
        Sparse leaves the step with the store (``OwedStep``) and runs it in the background in
        chunks; the deferred read, and every later read of this step, runs before the rest of it
        and steps the rows it needs first. ``made``: the event after which the GPU holds what
        they read (``worker.mark``), so their GPU work and copies overlap the model's step."""

        grad_wait = [0.0]  # seconds the step waited for its host gradients' copy (in its time)

        def step(positions=None):
            """Step the rows at ``positions`` (per shard; None: all) of ``grads``."""
            start = time.perf_counter()
            with record_function("stem/table-step"):
                if arrived is not None:  # the gradients are read only after their copy landed
                    # (those of the rows the next step's first micro-batch reads land first)
                    first = positions is not None and all(
                        isinstance(g, TierGrads) and g.within_first(p)
                        for (_, g), p in zip(grads, positions))
                    with record_function("stem/wait-grads"):
                        (arrived.synchronize_first if first else arrived.synchronize)()
                    grad_wait[0] += time.perf_counter() - start
                for i, (rows, grad) in enumerate(grads):
                    if positions is not None:
                        rows, grad = take_rows(rows, grad, positions[i])
                    if rows.numel() or self.mode != "sparse":
                        adam.step_rows(i, rows, grad, plan)
            return time.perf_counter() - start

        fetch = t.deferred
        if fetch is None:
            t.stats["optimizer_seconds_exposed"] += self.worker.wait()
            took = step()
            t.stats["optimizer_seconds"] += took
            t.stats["optimizer_seconds_exposed"] += took
            t.stats["optimizer_seconds_grad_wait"] += grad_wait[0]
            return
        # Read on the worker's side stream.
        self.worker.hand_over(x for _, g in grads for x in grad_tensors(g))
        if self.mode != "sparse":
            def whole():
                took = step()
                return took, took

            self.tasks.append((t, self.worker.submit(whole, after=made), grad_wait))
            t.release(fetch, after=made)
            return
        owed = OwedStep(step, [rows for rows, _ in grads], t.store.widths)
        # The worker is idle for this store: the step drained it.
        owed.store, t.store.owed_step = t.store, owed
        t.release(fetch, after=made)
        self.tasks.append((t, self.worker.submit_background(owed, after=made), grad_wait))


class StemTablesOptimizer(ChainedOptimizer):
    def __init__(self, inner, tables: List, mode: str, worker):
        chained = list(inner.chained_optimizers) if isinstance(inner, ChainedOptimizer) \
            else [inner]
        super().__init__(chained)
        self.tables = tables
        self.mode = mode
        self.shards = [s for t in tables for s in t.store.shards]
        self.tiered = any(t.tiered for t in tables)
        # One row optimizer per chunk, over its store's shards and lazy-row state; all advance
        # their clocks alike at every step.
        lazy = (lambda t: t.store.lazy) if mode == "sparse" else (lambda t: None)
        self.row_adams = [TieredRowAdamW(t.store.shards, mode=mode, lazy=lazy(t),
                                         huge_pages=t.store.huge_pages) if t.tiered
                          else RowAdamW(t.store.shards, mode=mode, lazy=lazy(t),
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
                per_table.append([split_grads(s, rows, g, first)
                                  for s, (rows, g) in zip(t.store.shards, per)])
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
        """Megatron's optimizer state, plus the tables' (``stem/checkpoint.py``). Collective over
        the data-parallel group."""
        inner = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        return {"model_optim": inner, "stem_tables": checkpoint.optimizer_state(self)}

    def load_state_dict(self, state_dict):
        if "model_optim" not in state_dict:
            raise RuntimeError("this optimizer state has no STEM table state (saved by a run with "
                               "ordinary STEM tables?): load it with --no-load-optim")
        super().load_state_dict(state_dict["model_optim"])
        checkpoint.load_optimizer_state(self, state_dict["stem_tables"])


def dump_tables(optimizers: Sequence[StemTablesOptimizer], directory: str) -> None:
    """Write this rank's table rows after training, for inspection and tests:
    ``directory/tables_tp{t}_pp{p}_dp{d}.pt`` = {"layers": [layer numbers], "ids": [owned global
    ids per chunk], "rows": [[rows per layer]]} (sparse: every row brought up to date)."""
    for optimizer in optimizers:
        optimizer.drain()
        payload = {"chunks": [{
            "layers": [layer.layer_number for layer in t.layers],
            "ids": t.owned_ids.clone(),
            "rows": [t.store.read(i).detach().cpu().clone() for i in range(len(t.shards))]}
            for t in optimizer.tables]}
        os.makedirs(directory, exist_ok=True)
        name = (f"tables_tp{ps.get_tensor_model_parallel_rank()}_pp"
                f"{ps.get_pipeline_model_parallel_rank()}_dp{ps.get_data_parallel_rank()}.pt")
        torch.save(payload, os.path.join(directory, name))


def report_stats(optimizers: Sequence[StemTablesOptimizer], args, iteration: int,
                 total_loss_dict: dict, writer, wandb_writer) -> None:
    """Per-iteration table traffic and optimizer time, summed (times: max) over all ranks, to
    Megatron's tensorboard/wandb writers: unique rows fetched, bytes each way for row fetches and
    gradient pushes, the part of the owners' reads and row gradients that is in host memory (what
    crosses between host and device: all of it with host tables, the host tier's rows with
    tiered ones, none with device tables), fetch time the forward step waited for (exposed) and
    background fetch time it did not wait for (hidden, with prefetch), CPU optimizer time and the
    part of it the training thread waited for (exposed; with the overlapped step, the wait of the
    next step's first micro-batch for its rows' step is in the exposed fetch time) and, overlapped,
    the time from the start of the step to the start of that micro-batch's fetch (routing its ids
    and stepping the rows it reads), the part of the optimizer time it waited for the host
    tier's gradients to arrive from the GPU (the copies of ``transfer.stage_to_host``), and the
    time to collect the row gradients and exchange them with their owners; and the CPU row
    kernel's own share of the optimizer time (``RowAdamW.kernel_times``): the row parameters it
    stepped, the seconds of its row loops and of its calls as the worker saw them (their
    difference is the way into and out of the kernel: checks and the GIL taken back). A table
    step that runs in the background (overlapped) is logged with the iteration it overlaps, the
    next one. The first call also prints where the row kernel's team runs
    (``worker_team_report``). A ``log_report`` of the STEM family; collective where Megatron
    makes a writer (``--tensorboard-dir``, ``--wandb-project``), and only the writing rank reads
    the sums back from the GPU; without either, nothing is reduced."""
    summed = ["stem/unique-rows-fetched", "stem/fetch-bytes-to-device", "stem/fetch-bytes-served",
              "stem/grad-bytes-sent", "stem/grad-bytes-received", "stem/fetch-bytes-from-host",
              "stem/grad-bytes-to-host", "stem/optimizer-kernel-params"]
    maxed = ["stem/fetch-seconds-exposed", "stem/fetch-seconds-hidden", "stem/optimizer-seconds",
             "stem/optimizer-seconds-exposed", "stem/optimizer-seconds-before-fetch",
             "stem/optimizer-seconds-grad-wait", "stem/grad-exchange-seconds",
             "stem/optimizer-kernel-loop-seconds", "stem/optimizer-kernel-call-seconds"]
    if not optimizers:  # no managed tables in this run (the same on every rank)
        return
    for optimizer in optimizers:  # once, after the first iteration (communicators made, worker up)
        if not optimizer.team_reported:
            optimizer.team_reported = True
            team = worker_team_report(optimizer)
            if team is not None:
                print(f"[rank {dist.get_rank()}] > {team}", flush=True)
    sums = dict.fromkeys(summed, 0.0)
    maxes = dict.fromkeys(maxed, 0.0)
    for optimizer in optimizers:
        local = dict.fromkeys(maxed, 0.0)  # summed over this rank's chunks
        for t in optimizer.tables:
            st, rb, gb = t.stats, t.row_bytes, t.grad_row_bytes
            for name, value in (("stem/unique-rows-fetched", st["unique_rows"]),
                                ("stem/fetch-bytes-to-device", st["fetch_rows_in"] * rb),
                                ("stem/fetch-bytes-served", st["fetch_rows_out"] * rb),
                                ("stem/grad-bytes-sent", st["grad_rows_out"] * gb),
                                ("stem/grad-bytes-received", st["grad_rows_in"] * gb),
                                ("stem/fetch-bytes-from-host", st["fetch_rows_host"] * rb),
                                ("stem/grad-bytes-to-host", st["grad_rows_host"] * gb)):
                sums[name] += value
            for name, key in (("stem/fetch-seconds-exposed", "fetch_seconds"),
                              ("stem/fetch-seconds-hidden", "fetch_seconds_hidden"),
                              ("stem/optimizer-seconds", "optimizer_seconds"),
                              ("stem/optimizer-seconds-exposed", "optimizer_seconds_exposed"),
                              ("stem/optimizer-seconds-before-fetch",
                               "optimizer_seconds_before_fetch"),
                              ("stem/optimizer-seconds-grad-wait", "optimizer_seconds_grad_wait")):
                local[name] += st[key]
            t.reset_stats()
        local["stem/grad-exchange-seconds"] = optimizer.grad_seconds
        for r in host_row_adams(optimizer):  # the CPU row kernel's own share of the step
            params, loop, call = r.kernel_times.take()
            sums["stem/optimizer-kernel-params"] += params
            local["stem/optimizer-kernel-loop-seconds"] += loop
            local["stem/optimizer-kernel-call-seconds"] += call
        maxes = {name: max(maxes[name], local[name]) for name in maxed}
        optimizer.grad_seconds = 0.0
    if not (getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)):
        return  # no writer on any rank (Megatron makes them from these flags): nothing to reduce
    # One all-gather rather than an all-reduce each for the sums and the maxima: every
    # collective is a wait for the other ranks.
    device = comm_device(dist.group.WORLD)
    local = to_device(torch.tensor([sums[name] for name in summed] +
                                   [maxes[name] for name in maxed], dtype=torch.float64), device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    if writer is None and wandb_writer is None:  # only the writing rank reads them back
        return
    every = torch.stack(every).cpu()
    values = dict(zip(summed, every[:, :len(summed)].sum(0).tolist()))
    values.update(zip(maxed, every[:, len(summed):].amax(0).tolist()))
    for name, value in values.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)


def host_row_adams(optimizer: StemTablesOptimizer) -> List[RowAdamW]:
    """The row optimizers of host-resident rows (a tiered one's host tier)."""
    return [r.cold if isinstance(r, TieredRowAdamW) else r for r in optimizer.row_adams]


def host_row_tensors(optimizer: StemTablesOptimizer) -> List[torch.Tensor]:
    """The host-resident tensors of the table rows: shards (a tiered one's host tier) and their
    Adam moments."""
    return [t for r in host_row_adams(optimizer) for t in (*r.shards, *r.exp_avg, *r.exp_avg_sq)
            if t.device.type == "cpu"]


def host_memory_report(optimizer: StemTablesOptimizer) -> str:
    tables = sum(t.host_bytes() for t in optimizer.tables)
    moments = 2 * tables
    pages = ""
    if tables:
        if not all(t.store.huge_pages for t in optimizer.tables):
            pages = " (ordinary pages: --no-stem-host-huge-pages)"
        else:
            huge = host_memory.huge_bytes(host_row_tensors(optimizer))
            pages = (f" ({huge / 2**20:.1f} MiB on huge pages, transparent huge pages: "
                     f"{host_memory.thp_setting() or 'unknown'})" if huge is not None else "")

    cores = row_adam_cpu.affinity_cores()  # the CPU optimizer's threads share them
    threads = row_adam_cpu.threads() if optimizer.kernel == "rowwise" else \
        torch.get_num_threads()
    tier = ""
    if optimizer.tiered:
        rows = sum(s.num_hot for s in optimizer.shards)
        hot = 3 * sum(s.hot_bytes() for s in optimizer.shards)  # rows and their two moments
        tier = (f" ({rows:,} in the GPU tier: {hot / 2**20:.1f} MiB with their Adam moments, "
                "on the model's device)")
    return (f"STEM tables on this rank: {len(optimizer.shards)} shards, "
            f"{sum(s.shape[0] for s in optimizer.shards):,} rows{tier}; host memory: tables (fp32, "
            f"also the master copy) {tables / 2**20:.1f} MiB, Adam moments {moments / 2**20:.1f} "
            f"MiB, total {(tables + moments) / 2**20:.1f} MiB{pages}; optimizer "
            f"{optimizer.mode} ({optimizer.kernel} kernel, {threads} CPU "
            f"threads, {cores} cores in this process's affinity mask; row gathers "
            f"{row_adam_cpu.threads()} threads)")


def worker_team_report(optimizer: StemTablesOptimizer) -> Optional[str]:
    """Where the CPU row kernel's OpenMP team runs when the tables' worker starts one (a task
    on the worker, which makes the team the table steps reuse): the worker thread's affinity,
    and the CPUs the team's threads were on after a short spin. A team on fewer CPUs than
    threads steps rows one core's worth at a time; None without host rows on the row kernel."""
    kernels = [r.rowwise for r in host_row_adams(optimizer) if r.rowwise is not None]
    if not kernels:
        return None

    def probe():  # on the worker: its mask, and the team size its calls ask for there
        threads = row_adam_cpu.threads()
        team = kernels[0].team_cpus(threads)
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return (len(cpus) if cpus else os.cpu_count()), team

    worker_cpus, team = optimizer.steps.worker.submit(probe).result()
    return describe_team(team, worker_cpus, os.environ)


def describe_team(team, worker_cpus: int, environ) -> str:
    """The start-up line of ``worker_team_report``: ``team`` as ``team_cpus`` gives it, with a
    warning when its threads may share fewer CPUs than there are threads (a mask narrower than
    the team, or the threads seen on fewer than half as many CPUs)."""
    allowed = sorted({a for _, a in team})
    on = len({c for c, _ in team})
    omp = [f"{k}={v}" for k, v in sorted(environ.items())
           if k.startswith(("OMP_", "GOMP_", "KMP_"))]
    report = (f"CPU row kernel team (started on the tables' worker): {len(team)} threads on "
              f"{on} CPUs, each allowed {'/'.join(map(str, allowed))}; the worker thread allowed "
              f"{worker_cpus}" + (f"; {' '.join(omp)}" if omp else ""))
    known = [a for a in allowed if a > 0]  # -1: the OS would not say
    if (known and min(known) < len(team)) or on < len(team) // 2:
        report += (" -- fewer CPUs than threads: the table step runs a core's worth at a time "
                   "(check the launcher's CPU binding and OMP_PROC_BIND / OMP_PLACES)")
    return report


def wrap_optimizer(optimizer, model_chunks, stem_cpu_threads: int, mode: str, worker):
    """Megatron's optimizer with the table optimizer chained onto it (managed tables; their
    host work on ``worker``). Every rank wraps (also a pipeline stage without STEM layers): the
    norm and the skip flag are reduced over all ranks."""
    tables = [get_attr_wrapped_model(m, "token_tables", allow_none=True) for m in model_chunks]
    tables = [t for t in tables if t is not None]
    row_adam_cpu.set_threads(stem_cpu_threads)
    wrapped = StemTablesOptimizer(optimizer, tables, mode, worker)
    print(f"[rank {dist.get_rank()}] > {host_memory_report(wrapped)}", flush=True)
    return wrapped
