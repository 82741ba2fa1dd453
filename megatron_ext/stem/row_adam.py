"""AdamW on the CPU for the rows of STEM tables a rank owns: ``dense`` and ``sparse`` semantics.

Both are AdamW as Megatron configures it for the rest of the model (``lr`` from the schedule,
``betas``, ``eps``, decoupled ``weight_decay``); they differ in which rows step:

* ``dense``: every owned row steps every iteration, untouched rows with a zero gradient (their
  moments decay and they keep moving with their momentum). This *is* AdamW on a GPU-resident table
  (torch.optim.AdamW), computed by DeepSpeed's CPU Adam kernel over the whole shard.
* ``sparse``: only the rows the global batch touched step. Each row has its own step count, used
  for its bias correction; its moments are left unchanged while it is not touched (lazy Adam, as
  FBGEMM's row-wise and TF's LazyAdam). Decoupled weight decay is still applied for every
  iteration: a row's missed decay factors ``prod_s (1 - lr_s wd)`` are applied when it is next
  touched (and before it is read for a checkpoint), from a running product kept in float64, so a
  row touched at iterations i and j ends where decaying it at every iteration would put it.

Kernels: ``deepspeed`` (DeepSpeed's ``cpu_adam`` op: SIMD + OpenMP, about 5x torch on the
development machine; its first use JIT-compiles it) and ``torch`` (vectorised torch ops; used when
the op cannot be built). Per-row bias correction is mapped onto DeepSpeed's op, whose bias
correction takes one step count per call, by calling it without bias correction on groups of rows
with equal step counts ``k`` and rescaled scalars:
``lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) = lr' * m / (sqrt(v) + eps')`` with
``lr' = lr sqrt(bc2) / bc1``, ``eps' = eps sqrt(bc2)``, and ``wd' = wd lr / lr'`` so that the
decoupled decay ``lr' wd'`` stays ``lr wd``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_ext_kernels import row_adam_cpu

logger = logging.getLogger(__name__)

MODES = ("dense", "sparse")
KERNELS = ("auto", "rowwise", "deepspeed", "torch")


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


_DS_OP = None
# The id this module's optimizer has in DeepSpeed's op, away from DeepSpeedCPUAdam's own counter.
DEEPSPEED_OPTIMIZER_ID = 1 << 20


def deepspeed_op():
    """DeepSpeed's ``cpu_adam`` extension, or None if it cannot be loaded or built."""
    global _DS_OP
    if _DS_OP is None:
        try:
            from deepspeed.ops.op_builder import CPUAdamBuilder

            op = CPUAdamBuilder().load(verbose=False)
            op.create_adam(DEEPSPEED_OPTIMIZER_ID, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
            _DS_OP = op
        except Exception as exc:  # no compiler, no deepspeed: the torch kernel still works
            logger.warning("DeepSpeed's cpu_adam op is unavailable (%s); STEM tables step with "
                           "the torch kernel", exc)
            _DS_OP = False
    return _DS_OP or None


@dataclass(frozen=True)
class StepPlan:
    """One iteration of ``RowAdamW`` (``begin_step``): its hyper-parameters, its step count (every
    row's, dense) and, sparse, the running decay product before and after it."""
    hyper: AdamHyper
    step: int
    decay_before: float
    decay_after: float


class OwedDecayView:
    """The sparse optimizer's owed-decay state (``self.decay``, a ``LazyDecay`` or a tiered one)
    under the names checkpoints and tests use."""

    @property
    def decay_product(self) -> float:
        """Sparse: the running product of ``(1 - lr_s wd)`` over the iterations stepped."""
        return self.decay.clock.product

    @decay_product.setter
    def decay_product(self, value: float) -> None:
        self.decay.clock.product = value

    @property
    def row_marks(self) -> List[torch.Tensor]:
        return self.decay.marks


class RowAdamW(OwedDecayView):
    """Optimizer state and step for a list of row shards (one per STEM layer) held by this rank.

    ``shards``: fp32 CPU tensors ``[rows, width]``, updated in place. ``step()`` takes, per shard,
    the local indices of the touched rows (unique) and their gradients. ``decay`` (sparse): the
    ``LazyDecay`` of these shards that whoever reads them settles (default: a private one).
    """

    def __init__(self, shards: Sequence[torch.Tensor], mode: str = "dense", kernel: str = "auto",
                 decay: Optional["LazyDecay"] = None):
        if mode not in MODES:
            raise ValueError(f"--stem-optimizer={mode!r}: allowed {', '.join(MODES)}")
        if kernel not in KERNELS:
            raise ValueError(f"STEM optimizer kernel {kernel!r}: allowed {', '.join(KERNELS)}")
        for shard in shards:
            if shard.dtype != torch.float32 or shard.dim() != 2:
                raise ValueError("STEM optimizer shards must be 2-D fp32 tensors, got "
                                 f"{shard.dtype} {tuple(shard.shape)}")
        self.shards = list(shards)
        self.mode = mode
        on_host = all(s.device.type == "cpu" for s in self.shards)
        if kernel == "deepspeed" and not on_host:
            raise ValueError("the deepspeed CPU Adam kernel needs host-resident shards")
        if kernel == "rowwise" and (not on_host or mode != "sparse"):
            raise ValueError("the rowwise kernel is for the sparse optimizer on host shards")
        # Device-resident shards (--stem-table-placement gpu with vocab sharding) step with the
        # torch kernel where they are. Sparse on the host: the in-place row-wise kernel
        # (megatron_ext_kernels/row_adam_cpu.py), else DeepSpeed's grouped by step count.
        self.rowwise = None
        if mode == "sparse" and on_host and kernel in ("auto", "rowwise"):
            self.rowwise = row_adam_cpu.load()
            if kernel == "rowwise" and self.rowwise is None:
                raise RuntimeError("the rowwise kernel was requested but cannot be built")
        self.op = deepspeed_op() if (kernel in ("auto", "deepspeed") and on_host
                                     and self.rowwise is None) else None
        if kernel == "deepspeed" and self.op is None:
            raise RuntimeError("the deepspeed kernel was requested but cpu_adam cannot be built")
        self.exp_avg = [torch.zeros_like(s) for s in self.shards]
        self.exp_avg_sq = [torch.zeros_like(s) for s in self.shards]
        self.step_count = 0  # iterations stepped (dense: every row's step; sparse: the clock)
        if mode == "sparse":
            self.row_steps = [torch.zeros(s.shape[0], dtype=torch.long) for s in self.shards]
            # The decay rows owe: the store of the rows may hold it (``stem/store.py``: its row
            # reads settle it), else this optimizer keeps its own.
            if decay is not None and [d.shape for d in decay.shards] != \
                    [s.shape for s in self.shards]:
                raise ValueError("the owed-decay state is for other shards")
            self.decay = decay if decay is not None else LazyDecay(self.shards)
        self._dense_grads: List[Optional[torch.Tensor]] = [None] * len(self.shards)

    @property
    def kernel(self) -> str:
        if self.rowwise is not None:
            return "rowwise"
        return "deepspeed" if self.op is not None else "torch"

    # ------------------------------------------------------------------------------------------
    def step(self, grads: Sequence[Tuple[torch.Tensor, torch.Tensor]], hyper: AdamHyper) -> None:
        if len(grads) != len(self.shards):
            raise ValueError(f"{len(grads)} gradients for {len(self.shards)} table shards")
        plan = self.begin_step(hyper)
        for i, (rows, rows_grad) in enumerate(grads):
            self.step_rows(i, rows, rows_grad, plan)

    def begin_step(self, hyper: AdamHyper) -> "StepPlan":
        """Advance the iteration clock; the rows then step with ``step_rows`` (possibly later, in
        another thread, in parts: ``stem/table_optimizer.py`` steps first the rows the next
        micro-batch reads). Sparse: the running decay product moves on now, so a row read after
        this call owes this iteration's decay unless it is stepped."""
        self.step_count += 1
        if self.mode != "sparse":
            return StepPlan(hyper, self.step_count, 1.0, 1.0)
        plan = StepPlan(hyper, self.step_count, self.decay_product,
                        self.decay_product * (1.0 - hyper.lr * hyper.weight_decay))
        self.decay_product = plan.decay_after
        return plan

    def step_rows(self, i: int, rows: torch.Tensor, rows_grad: torch.Tensor,
                  plan: "StepPlan") -> None:
        """Step shard ``i`` for the iteration ``plan`` began. ``rows``: unique local indices with
        gradients. Sparse: those rows step (any subset of the iteration's rows, each once).
        Dense: every row of the shard steps, the others with a zero gradient, so ``rows`` must be
        all of the iteration's rows of the shard, in one call."""
        if self.mode == "dense":
            self._dense_step(i, rows, rows_grad, plan)
        else:
            self._sparse_step(i, rows, rows_grad, plan)

    def _dense_step(self, i: int, rows: torch.Tensor, rows_grad: torch.Tensor,
                    plan: "StepPlan") -> None:
        hyper = plan.hyper
        shard = self.shards[i]
        if self._dense_grads[i] is None:
            self._dense_grads[i] = torch.zeros_like(shard)
        grad = self._dense_grads[i]
        grad.zero_()
        grad.index_copy_(0, rows, rows_grad.to(torch.float32))
        if self.op is not None:
            self.op.adam_update(DEEPSPEED_OPTIMIZER_ID, plan.step, hyper.lr, hyper.beta1,
                                hyper.beta2, hyper.eps, hyper.weight_decay, True, shard, grad,
                                self.exp_avg[i], self.exp_avg_sq[i])
        else:
            _torch_adamw(shard, grad, self.exp_avg[i], self.exp_avg_sq[i], hyper,
                         torch.full((1, 1), float(plan.step), device=shard.device))

    def _sparse_step(self, i: int, rows: torch.Tensor, rows_grad: torch.Tensor,
                     plan: "StepPlan") -> None:
        hyper = plan.hyper
        if rows.numel() == 0:
            return
        if self.rowwise is not None:
            rows = rows.to(torch.long).contiguous()
            steps = self.row_steps[i][rows] + 1
            self.row_steps[i][rows] = steps
            owed = plan.decay_before / self.row_marks[i][rows]
            self.rowwise.sparse_adamw_(
                self.shards[i], self.exp_avg[i], self.exp_avg_sq[i], rows,
                rows_grad.to(torch.float32).contiguous(), steps, owed.contiguous(), hyper.lr,
                hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay)
            self.row_marks[i][rows] = plan.decay_after
            return
        rows = rows.cpu()  # the per-row state (step counts, decay marks) is on the host
        self.catch_up(i, rows, plan.decay_before)
        steps = self.row_steps[i][rows] + 1
        self.row_steps[i][rows] = steps
        # Gather, step, scatter back: touched rows are few against the shard.
        order = torch.argsort(steps, stable=True)
        rows, steps = rows[order], steps[order]
        p = self.shards[i][rows]
        g = rows_grad[order].to(torch.float32).contiguous()
        m = self.exp_avg[i][rows]
        v = self.exp_avg_sq[i][rows]
        if self.op is not None:
            values, counts = torch.unique_consecutive(steps, return_counts=True)
            start = 0
            for k, n in zip(values.tolist(), counts.tolist()):
                bc1 = 1.0 - hyper.beta1 ** k
                sqrt_bc2 = math.sqrt(1.0 - hyper.beta2 ** k)
                lr = hyper.lr * sqrt_bc2 / bc1
                wd = hyper.weight_decay * hyper.lr / lr if lr > 0 else 0.0
                sl = slice(start, start + n)
                self.op.adam_update(DEEPSPEED_OPTIMIZER_ID, k, lr, hyper.beta1, hyper.beta2,
                                    hyper.eps * sqrt_bc2, wd, False, p[sl], g[sl], m[sl], v[sl])
                start += n
        else:
            _torch_adamw(p, g, m, v, hyper, steps.to(p.device, torch.float32).unsqueeze(1))
        self.shards[i][rows] = p
        self.exp_avg[i][rows] = m
        self.exp_avg_sq[i][rows] = v
        self.row_marks[i][rows] = plan.decay_after

    def catch_up(self, i: int, rows: torch.Tensor, product: Optional[float] = None) -> None:
        """Sparse mode: apply the decay rows of shard ``i`` missed since their last update
        (iterations they were not touched), up to the running ``product`` (default: now).
        Called before rows are read or stepped."""
        if self.mode == "sparse":
            self.decay.settle(i, rows, product)

    def materialize(self) -> None:
        """Sparse mode: apply every row's outstanding decay, so the shards hold the values AdamW
        would (before saving or reading them whole)."""
        if self.mode == "sparse":
            self.decay.settle_all()


class DecayClock:
    """The running product of ``(1 - lr_s wd)`` over the iterations a sparse AdamW stepped."""

    def __init__(self, product: float = 1.0):
        self.product = product


class LazyDecay:
    """The decoupled weight decay that rows of ``shards`` owe (sparse AdamW): a row last decayed
    when the clock stood at ``marks[i][row]`` still owes ``clock.product / mark``; ``settle``
    applies it in place. Every read of a row's value settles it first (the rows' store does, for
    fetches and checkpoints), and the sparse step settles and re-marks the rows it steps, so the
    values anyone sees are those of decaying every row at every iteration. With the clock never
    moved (the dense optimizer) nothing is owed and ``settle`` returns at once."""

    def __init__(self, shards: Sequence[torch.Tensor], clock: Optional[DecayClock] = None,
                 marks: Optional[List[torch.Tensor]] = None):
        self.shards = list(shards)
        self.clock = clock if clock is not None else DecayClock()
        self.marks = marks if marks is not None else \
            [torch.ones(s.shape[0], dtype=torch.float64) for s in self.shards]
        self._kernel = None

    def settle(self, i: int, rows: torch.Tensor, product: Optional[float] = None) -> None:
        """Apply the decay rows ``rows`` (local indices) of shard ``i`` owe, up to ``product``
        (default: the clock's)."""
        product = self.clock.product if product is None else product
        if product == 1.0 or rows.numel() == 0:  # never decayed: nothing owed
            return
        rows = rows.cpu()  # the marks live on the host, whatever the shard's device
        owed = product / self.marks[i][rows]
        pending = owed != 1.0
        if bool(pending.any()):
            late = rows[pending]
            shard = self.shards[i]
            kernel = self._row_kernel(shard)
            if kernel is not None:  # in place; the same fp32 products as below
                kernel.scale_rows_(shard, late.to(torch.long).contiguous(),
                                   owed[pending].contiguous())
            else:
                shard[late] *= owed[pending].to(shard.device, torch.float32).unsqueeze(1)
            self.marks[i][late] = product

    def settle_all(self) -> None:
        for i, shard in enumerate(self.shards):
            self.settle(i, torch.arange(shard.shape[0]))

    def reset(self, product: float) -> None:
        """Every row holds its value at clock ``product`` (a checkpoint load)."""
        self.clock.product = product
        for marks in self.marks:
            marks.fill_(product)

    def _row_kernel(self, shard: torch.Tensor):
        if shard.device.type != "cpu" or shard.dtype != torch.float32 or \
                not shard.is_contiguous():
            return None
        if self._kernel is None:
            self._kernel = row_adam_cpu.load() or False
        return self._kernel or None


def _torch_adamw(p, g, m, v, hyper: AdamHyper, steps: torch.Tensor) -> None:
    """AdamW (torch.optim.AdamW's formula) on rows, with per-row step counts ``steps [rows, 1]``."""
    p.mul_(1.0 - hyper.lr * hyper.weight_decay)
    m.mul_(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    bc1 = 1.0 - torch.pow(hyper.beta1, steps)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(hyper.beta2, steps))
    denom = v.sqrt() / bc2_sqrt + hyper.eps
    p.addcdiv_(m, denom * bc1 / hyper.lr, value=-1.0)
