"""AdamW for the rows of STEM tables a rank owns: ``dense`` and ``sparse`` semantics.

Both are AdamW as Megatron configures it for the rest of the model (``lr`` from the schedule,
``betas``, ``eps``, decoupled ``weight_decay``, one bias correction from the iteration count);
they differ in which rows are computed at each iteration:

* ``dense``: every owned row steps every iteration, untouched rows with a zero gradient. This *is*
  torch.optim.AdamW on the whole table, computed by DeepSpeed's CPU Adam kernel over the shard
  (host) or torch ops (device).
* ``sparse``: only the rows the global batch touched are computed at an iteration. A row untouched
  since iteration ``s`` is brought to iteration ``u`` when it is next read or stepped, in O(1),
  where AdamW with zero gradients would have put it (``LazyRows.settle``): its moments decay,
  ``m <- b1^(u-s) m``, ``v <- b2^(u-s) v``, and the row keeps moving with its momentum and decays,
  ``p <- p D_u/D_s - F_u(s) m/(sqrt(v) + e)``, with ``D`` the running product of
  ``1 - lr_j wd``, ``F_u(s) = sum_{s<j<=u} c_j r^(j-s) D_u/D_j``,
  ``c_j = lr_j sqrt(1-b2^j)/(1-b1^j)``, ``r = b1/sqrt(b2)`` (``RowClock``), and
  ``e = eps b2^((s-s0)/2)``, ``s0`` the row's last iteration with a gradient.
  The one difference from AdamW: an untouched step ``j`` of a row uses, in place of ``eps``,
  ``eps b2^((j-s0)/2) / sqrt(1-b2^j)``: eps shrinks with ``sqrt(v)`` while the row is untouched
  (what makes the move O(1); the same order as ``eps`` for a few dozen iterations, when the
  momentum moves the row). So every read of a row sees AdamW's values up to that, whenever and
  however often the row was read before (how far that is from AdamW, measured:
  ``benchmarks/stem_sparse_semantics.py``, docs/stem.md; bounded by
  ``tests/test_stem_sparse_semantics.py``). Lazy Adam (moments frozen while untouched, FBGEMM's
  row-wise and TF's LazyAdam) moves a row 1 lr per gradient impulse where AdamW moves it about
  ``sum r^j`` lr (13 with betas 0.9, 0.95), and cost this project's main job 0.014 of validation
  loss (docs/benchmarks.md). Needs ``b1 < sqrt(b2)`` (the momentum's move converges).

Kernels: ``deepspeed`` (dense on the host: DeepSpeed's ``cpu_adam`` op over the whole shard, SIMD +
OpenMP; its first use JIT-compiles it), ``rowwise`` (sparse on the host:
``kernels/row_adam_cpu.py``, catch-up and step fused, in place, per touched row) and
``torch`` (vectorised torch ops: device shards, and the fallback where nothing compiles).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_ext.stem.runtime import host_memory
from megatron_ext.stem.runtime.direct_reads import DirectReads
from megatron_ext.stem.runtime.tiers import TierGrads, TieredShard, layer_stack, split_grads
from megatron_ext.stem.runtime.transfer import to_device
from megatron_ext_kernels import deepspeed_builder, row_adam_cpu, row_adam_gpu
from megatron_ext_kernels._build_dir import build_environment

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


# The id this module's optimizer has in DeepSpeed's op, away from DeepSpeedCPUAdam's own counter.
DEEPSPEED_OPTIMIZER_ID = 1 << 20


@functools.lru_cache(maxsize=None)  # a compiled extension: loaded (or refused) once per process
def deepspeed_op():
    """DeepSpeed's ``cpu_adam`` extension, or None if it cannot be loaded or built."""
    try:
        with build_environment():  # a build folder per virtualenv and CPU (_build_dir.py)
            # DeepSpeed's builder, its CPU flags asked once per machine (deepspeed_builder.py)
            op = deepspeed_builder.builder().load(verbose=False)
        op.create_adam(DEEPSPEED_OPTIMIZER_ID, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, False)
        return op
    except Exception as exc:  # no compiler, no deepspeed: the torch kernel still works
        logger.warning("DeepSpeed's cpu_adam op is unavailable (%s); STEM tables step with "
                       "the torch kernel", exc)
        return None


@dataclass(frozen=True)
class StepPlan:
    """One iteration of ``RowAdamW`` (``begin_step``): its hyper-parameters, its step count and,
    sparse, the running decay product before and after it."""
    hyper: AdamHyper
    step: int
    decay_before: float
    decay_after: float


class LazyView:
    """The sparse optimizer's lazy-row state (``self.lazy``, a ``LazyRows`` or a tiered one) under
    the names checkpoints and tests use."""

    @property
    def decay_product(self) -> float:
        """Sparse: the running product of ``(1 - lr_s wd)`` over the iterations stepped."""
        return self.lazy.clock.product


class KernelTimes:
    """What the row kernel's sparse steps took since the last ``take``: row parameters stepped,
    seconds of the kernel's row loop (its OpenMP team at work) and seconds of the calls as the
    calling thread saw them (checks, and the GIL taken back after the call: behind a thread that
    runs Python, up to ``sys.getswitchinterval()`` each). Written by the thread that steps (the
    tables' worker), read by the training thread's report: under a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sums = [0, 0.0, 0.0]

    def add(self, params: int, loop: float, call: float) -> None:
        with self._lock:
            self._sums[0] += params
            self._sums[1] += loop
            self._sums[2] += call

    def take(self) -> Tuple[int, float, float]:
        """``(params, loop seconds, call seconds)`` since the last take, and start again."""
        with self._lock:
            sums, self._sums = tuple(self._sums), [0, 0.0, 0.0]
        return sums


class RowAdamW(LazyView):
    """Optimizer state and step for a list of row shards (one per STEM layer) held by this rank.

    ``shards``: fp32 tensors ``[rows, width]`` (host or device), updated in place. ``step()``
    takes, per shard, the local indices of the touched rows (unique) and their gradients.
    ``lazy`` (sparse): the ``LazyRows`` of these shards that whoever reads them settles (default:
    a private one); this optimizer gives it the moments. Dense: only its ``reads`` are used (the
    GPU reads of the rows that a step waits for first). ``huge_pages``: host moments (and the
    dense optimizer's gradient) on transparent huge pages (``host_memory.py``); sparse: the
    ``lazy``'s choice.
    """

    def __init__(self, shards: Sequence[torch.Tensor], mode: str = "dense", kernel: str = "auto",
                 lazy: Optional["LazyRows"] = None, huge_pages: bool = True):
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
        if kernel == "deepspeed" and mode != "dense":
            # Its SIMD loop's tail depends on how many rows a call takes, so a step in parts (the
            # overlapped step) would not give the bits of the whole step.
            raise ValueError("the deepspeed kernel is for the dense optimizer")
        # Device-resident shards (--stem-table-placement gpu with vocab sharding, the GPU tier)
        # step with the torch kernel where they are. Sparse on the host: the in-place row-wise
        # kernel (kernels/row_adam_cpu.py); dense: DeepSpeed's over the shard.
        self.rowwise = None
        if mode == "sparse" and on_host and kernel in ("auto", "rowwise"):
            self.rowwise = row_adam_cpu.load()
            if kernel == "rowwise" and self.rowwise is None:
                raise RuntimeError("the rowwise kernel was requested but cannot be built")
        self.op = deepspeed_op() if (kernel in ("auto", "deepspeed") and on_host
                                     and mode == "dense") else None
        if kernel == "deepspeed" and self.op is None:
            raise RuntimeError("the deepspeed kernel was requested but cpu_adam cannot be built")
        self.step_count = 0  # iterations stepped (every row's step count; sparse: the clock's)
        if mode == "sparse":
            # The rows' lazy state: the store of the rows may hold it (``stem/runtime/store.py``: its
            # row reads settle it), else this optimizer keeps its own.
            if lazy is not None and [d.shape for d in lazy.shards] != \
                    [s.shape for s in self.shards]:
                raise ValueError("the lazy-row state is for other shards")
            self.lazy = lazy if lazy is not None else LazyRows(self.shards,
                                                               huge_pages=huge_pages)
            self.exp_avg, self.exp_avg_sq = self.lazy.bind_moments()
        else:
            self.lazy = lazy  # the store's: its direct reads (``_before_write``), nothing owed
            self.exp_avg = [host_memory.zeros_like(s, huge_pages) for s in self.shards]
            self.exp_avg_sq = [host_memory.zeros_like(s, huge_pages) for s in self.shards]
        self.huge_pages = huge_pages
        self._dense_grads: List[Optional[torch.Tensor]] = [None] * len(self.shards)
        self.kernel_times = KernelTimes()  # the row kernel's steps (stats)
        # The sparse step of every layer at once on the GPU (``_step_stacked``): ``torch`` (the
        # reference ops) or ``triton`` (kernels/row_adam_gpu.py: one kernel, within a few ulp
        # on the CPU's interpreter, the torch path's bits on a GPU to be measured first).
        self.gpu_kernel = "torch"

    def _before_write(self, rows: Optional[torch.Tensor]) -> None:
        """Wait for the GPU's direct reads still queued of ``rows`` (host indices; None: every
        row) of these shards before the step writes them (``direct_reads.py``)."""
        reads = self.lazy.reads if self.lazy is not None else None
        if reads is not None:
            reads.before_write(rows)

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
        another thread, in parts: ``stem/runtime/optimizer.py`` steps first the rows the next
        micro-batch reads). Sparse: the clock moves on now, so a row read after this call is
        brought to this iteration (with a zero gradient) unless it is stepped first."""
        self.step_count += 1
        if self.mode != "sparse":
            return StepPlan(hyper, self.step_count, 1.0, 1.0)
        before = self.lazy.clock.product
        self.lazy.clock.advance(self.step_count, hyper)
        return StepPlan(hyper, self.step_count, before, self.lazy.clock.product)

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

    def step_shards(self, items: Sequence[Tuple[int, torch.Tensor, torch.Tensor]],
                    plan: "StepPlan") -> None:
        """``step_rows(i, rows, rows_grad, plan)`` for each ``(i, rows, rows_grad)`` of ``items``.
        Sparse on the torch path (the GPU tier, device shards), with every shard's rows the same
        (as a chunk's layers are: the same tokens touch them) and its state in one tensor per
        kind (``stacked``): all layers step together, one op per tensor instead of one per layer
        (on a GPU each op is a kernel launch). The same bits as the step per shard."""
        if not (self.mode == "sparse" and self.rowwise is None and len(items) > 1 and
                self._step_stacked(items, plan)):
            for i, rows, rows_grad in items:
                self.step_rows(i, rows, rows_grad, plan)

    def _step_stacked(self, items, plan: "StepPlan") -> bool:
        """The sparse torch step of every shard at once (``step_shards``); False (nothing done)
        where the shards, their rows or their state cannot be taken as one."""
        lazy = self.lazy
        if [i for i, _, _ in items] != list(range(len(self.shards))):
            return False
        state = lazy.stacks()
        if state is None:
            return False
        # The per-row state is on the host, and so are the rows (host tensors: comparing them
        # waits for nothing); layers given one tensor of rows (``tiers.split_layers``, the table
        # step's chunks) are not compared at all.
        rows = [r.cpu().to(torch.long) for _, r, _ in items]
        if rows[0].numel() == 0 or any(r is not rows[0] and (
                r.shape != rows[0].shape or not torch.equal(r, rows[0])) for r in rows[1:]):
            return False
        shards, exp_avg, exp_avg_sq, last, touched = state
        rows = rows[0]
        self._before_write(rows)
        dev = shards.device
        factors = lazy.clock.coefficients(last[:, rows], touched[:, rows], plan.step - 1)
        index = to_device(rows, dev)
        grads = [grad for _, _, grad in items]
        g = layer_stack(grads)  # the layers' gradients as one tensor's: read in place
        if g is None or g.device != dev or g.dtype != torch.float32:
            g = torch.stack([grad.to(dev, torch.float32) for grad in grads])
        if self.gpu_kernel == "triton" and row_adam_gpu.usable(shards):
            hyper = plan.hyper
            row_adam_gpu.sparse_adamw_rows(
                shards, exp_avg, exp_avg_sq, g, index,
                to_device(torch.stack(factors).to(torch.float32), dev), hyper.lr, hyper.beta1,
                hyper.beta2, hyper.eps, hyper.weight_decay, plan.step)
            last[:, rows] = touched[:, rows] = plan.step
            return True
        p, m, v = catch_up_rows(shards.index_select(1, index), exp_avg.index_select(1, index),
                                exp_avg_sq.index_select(1, index), *factor_columns(factors, dev))
        _torch_adamw(p, g, m, v, plan.hyper, plan.step)
        shards[:, index], exp_avg[:, index], exp_avg_sq[:, index] = p, m, v
        last[:, rows] = touched[:, rows] = plan.step
        return True

    def _dense_step(self, i: int, rows: torch.Tensor, rows_grad: torch.Tensor,
                    plan: "StepPlan") -> None:
        hyper = plan.hyper
        shard = self.shards[i]
        if self._dense_grads[i] is None:
            self._dense_grads[i] = host_memory.zeros_like(shard, self.huge_pages)
        grad = self._dense_grads[i]
        self._before_write(None)  # every row of the shard steps
        grad.zero_()
        grad.index_copy_(0, rows, rows_grad.to(torch.float32))
        if self.op is not None:
            self.op.adam_update(DEEPSPEED_OPTIMIZER_ID, plan.step, hyper.lr, hyper.beta1,
                                hyper.beta2, hyper.eps, hyper.weight_decay, True, shard, grad,
                                self.exp_avg[i], self.exp_avg_sq[i])
        else:
            _torch_adamw(shard, grad, self.exp_avg[i], self.exp_avg_sq[i], hyper, plan.step)

    def _sparse_step(self, i: int, rows: torch.Tensor, rows_grad: torch.Tensor,
                     plan: "StepPlan") -> None:
        """The touched ``rows`` are brought to the previous iteration (``LazyRows``), then take
        this iteration's AdamW step with their gradients."""
        hyper = plan.hyper
        if rows.numel() == 0:
            return
        rows = rows.cpu().to(torch.long)  # the per-row state (last steps) is on the host
        self._before_write(rows)
        lazy = self.lazy
        if self.rowwise is not None:  # catch-up and step in one pass over each row
            bc1 = 1.0 - hyper.beta1 ** plan.step
            bc2 = 1.0 - hyper.beta2 ** plan.step
            rows = rows.contiguous()
            grad = rows_grad.to(torch.float32).contiguous()
            clock = lazy.clock.kernel_state(plan.step - 1)
            start = time.perf_counter()
            loop = self.rowwise.sparse_adamw_(
                self.shards[i], self.exp_avg[i], self.exp_avg_sq[i], rows, grad, lazy.last[i],
                lazy.touched[i], clock, hyper.lr / bc1, 1.0 / math.sqrt(bc2),
                1.0 - hyper.lr * hyper.weight_decay)
            self.kernel_times.add(grad.numel(), loop, time.perf_counter() - start)
            return
        # Gather, catch up and step, scatter back: touched rows are few against the shard. One
        # gather and one scatter of the rows and moments, one copy of the factors to the shard's
        # device (the GPU tier): a row already current has factors that leave it as it is.
        factors = lazy.clock.coefficients(lazy.last[i][rows], lazy.touched[i][rows],
                                          plan.step - 1)
        dev = self.shards[i].device
        index = to_device(rows, dev)
        g = rows_grad.to(dev, torch.float32).contiguous()
        p, m, v = catch_up_rows(self.shards[i][index], self.exp_avg[i][index],
                                self.exp_avg_sq[i][index], *factor_columns(factors, dev))
        _torch_adamw(p, g, m, v, hyper, plan.step)
        self.shards[i][index] = p
        self.exp_avg[i][index] = m
        self.exp_avg_sq[i][index] = v
        lazy.last[i][rows] = lazy.touched[i][rows] = plan.step

    def catch_up(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """Sparse: bring rows of shard ``i`` to iteration ``upto`` (default: now), as AdamW
        would have moved them untouched. What every read of rows does first."""
        if self.mode == "sparse":
            self.lazy.settle(i, rows, upto)

    def materialize(self) -> None:
        """Sparse: bring every row to now, so the shards and moments hold AdamW's values (before
        saving or reading them whole)."""
        if self.mode == "sparse":
            self.lazy.settle_all()


# Rows untouched for longer than the horizon H of a clock are past their momentum's move: the
# part of F_u(s) after s + H is below this fraction of it.
_HORIZON_TAIL = 1e-13


class RowClock:
    """The iteration clock of a sparse AdamW and the per-iteration history its catch-up needs.

    ``step``: iterations stepped; ``product``: ``D_step``, the running product of ``1 - lr_j wd``.
    For the catch-up of a row from iteration ``s`` to ``u`` (``LazyRows``) it keeps, from its
    ``base`` (the start, or the last ``reset``) on, ``D_j`` and ``c_j = lr_j sqrt(bc2_j)/bc1_j``
    per iteration, in float64; ``F_u(s)`` is summed over at most ``H`` iterations (the horizon,
    ``r^H < 1e-13``): for rows untouched longer, ``F_u(s) = G_s D_u / D_(s+H)`` with
    ``G_s = F_(s+H)(s)`` kept per iteration once it is complete. Positive terms only: no
    cancellation, whatever the run's length (24 bytes per iteration)."""

    def __init__(self, step: int = 0, product: float = 1.0):
        self.reset(step, product)

    def reset(self, step: int, product: float) -> None:
        """Every row is current at iteration ``step`` (the start, a checkpoint load)."""
        self.step, self.product, self.base = int(step), float(product), int(step)
        self._d = _Series([self.product])  # D_j, j = base..step
        self._c = _Series([0.0])           # c_j, j = base..step (c_base unused)
        self._g = _Series([])              # G_s, s = base..step - H
        self._windows = {}         # u -> F_u(s) for s in [max(base, u - H), u]
        self.betas: Optional[Tuple[float, float]] = None
        self.eps = 0.0
        self.r = 0.0
        self.horizon = 1

    def advance(self, step: int, hyper: AdamHyper) -> None:
        """Iteration ``step`` (the next one) steps with ``hyper``."""
        if step != self.step + 1:
            raise RuntimeError(f"sparse STEM optimizer clock at {self.step} asked to step "
                               f"iteration {step}")
        betas = (hyper.beta1, hyper.beta2)
        if self.betas is None:
            self._set_betas(betas)
            self.eps = hyper.eps
        elif betas != self.betas or hyper.eps != self.eps:
            raise ValueError(f"the sparse STEM optimizer's betas and eps changed from "
                             f"{self.betas}, {self.eps} to {betas}, {hyper.eps} during training")
        self.step = step
        self.product *= 1.0 - hyper.lr * hyper.weight_decay
        bc1 = 1.0 - hyper.beta1 ** step
        bc2 = 1.0 - hyper.beta2 ** step
        self._d.append(self.product)
        self._c.append(hyper.lr * math.sqrt(bc2) / bc1)
        for u in [u for u in self._windows if u < step - 1]:
            del self._windows[u]
        # Made here, on the thread that steps the clock (the training thread): the host worker's
        # row steps and reads of this iteration and the next only look it up. About 20 small ops;
        # on the worker, beside a training thread running Python, each could wait for the GIL.
        window = self._window(step)
        s = step - self.horizon
        if s >= self.base:  # G_s is complete: F_step(s)
            self._g.append(float(window[0]))

    def _set_betas(self, betas: Tuple[float, float]) -> None:
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 < b2 < 1.0) or b1 >= math.sqrt(b2):
            raise ValueError(
                f"--stem-optimizer sparse brings untouched rows up to date as AdamW moves them "
                f"with their momentum, which converges only for adam_beta1 < sqrt(adam_beta2); "
                f"got --adam-beta1 {b1}, --adam-beta2 {b2} (use --stem-optimizer dense)")
        self.betas = betas
        self.r = b1 / math.sqrt(b2)
        self.horizon = 1 if self.r == 0.0 else \
            max(1, math.ceil(math.log(_HORIZON_TAIL) / math.log(self.r)))

    def _window(self, u: int) -> torch.Tensor:
        """``F_u(s)`` for ``s`` in ``[max(base, u - H), u]`` (float64), cached per ``u``."""
        window = self._windows.get(u)
        if window is None:
            lo = max(self.base, u - self.horizon)
            d = self._d.values[lo - self.base: u - self.base + 1]
            c = self._c.values[lo - self.base: u - self.base + 1]
            window = torch.zeros(u - lo + 1, dtype=torch.float64)
            if u > lo and self.r > 0.0:
                # x_j = c_j D_u/D_j r^(j-u) for j in (lo, u]; F_u(s) = r^(u-s) sum_{j>s} x_j:
                # suffix sums of positive terms (r^(j-u) <= r^-H, far from overflow).
                k = torch.arange(u - lo - 1, -1, -1, dtype=torch.float64)  # u - j, j = lo+1..u
                x = c[1:] * (d[-1] / d[1:]) * self.r ** (-k)
                suffix = torch.flip(torch.cumsum(torch.flip(x, (0,)), 0), (0,))
                window[:-1] = self.r ** torch.arange(u - lo, 0, -1, dtype=torch.float64) * suffix
            self._windows[u] = window
        return window

    def kernel_state(self, u: int) -> tuple:
        """What the compiled row kernels (``kernels/row_adam_cpu.py``) compute
        ``coefficients`` from, for rows brought to ``u``: ``(D_j, F_u(s) for s in
        [u - n + 1, u], G_s, base, H, u, b1, b2, eps)``, the series as float64 tensors."""
        self._check_upto(u)
        b1, b2 = self.betas
        return (self._d.values, self._window(u), self._g.values, self.base, self.horizon, u,
                b1, b2, self.eps)

    def _check_upto(self, u: int) -> None:
        if u < self.base or u > self.step:
            raise RuntimeError(f"sparse STEM rows asked up to iteration {u}; the clock knows "
                               f"{self.base}..{self.step}")

    def coefficients(self, last: torch.Tensor, touched: torch.Tensor, u: int):
        """For rows current at iterations ``last`` (int64, each at most ``u``) and last touched at
        ``touched``, brought to ``u``: ``(owed decay D_u/D_s, momentum move F_u(s), b1^(u-s),
        b2^(u-s), eps of their moments e = eps b2^((s-s0)/2))``, float64 tensors."""
        self._check_upto(u)
        s = last.to(torch.long)
        d = self._d.values
        owed = d[u - self.base] / d[s - self.base]
        lag = (u - s).to(torch.float64)
        move = torch.zeros_like(owed)
        if self.r > 0.0:
            window = self._window(u)
            near = (u - s) <= self.horizon
            move[near] = window[s[near] - (u - window.numel() + 1)]
            far = ~near
            if bool(far.any()):
                sf = s[far]
                g = self._g.values
                move[far] = g[sf - self.base] * d[u - self.base] / d[sf + self.horizon - self.base]
        b1, b2 = self.betas if self.betas is not None else (0.0, 0.0)
        since = (s - touched.to(torch.long)).to(torch.float64)
        return (owed, move, torch.pow(b1, lag), torch.pow(b2, lag),
                self.eps * torch.pow(b2, since / 2))


class _Series:
    """A float64 series that grows by one value per iteration (doubling its storage)."""

    def __init__(self, values: Sequence[float]):
        self._data = torch.zeros(max(len(values), 64), dtype=torch.float64)
        self._data[: len(values)] = torch.tensor(list(values), dtype=torch.float64)
        self._n = len(values)

    def append(self, value: float) -> None:
        if self._n == self._data.numel():
            grown = torch.zeros(2 * self._n, dtype=torch.float64)
            grown[: self._n] = self._data
            self._data = grown
        self._data[self._n] = value
        self._n += 1

    @property
    def values(self) -> torch.Tensor:
        return self._data[: self._n]


class LazyRows:
    """What rows of ``shards`` owe under the sparse AdamW: a row current at iteration
    ``last[i][row]`` (and last touched, given a gradient, at ``touched[i][row]``) is brought to a
    later one by ``settle`` (its decay, its momentum's move, its moments' decay; ``RowClock`` has
    the coefficients). Every read of a row sees it brought up to date: host rows are read as of
    now without being written (``read_into``: the fetches), device rows and whole shards are
    settled in place first (the GPU tier's fetches, checkpoints), and the sparse step settles and
    steps the rows it steps, so the values anyone sees are AdamW's. ``bind_moments`` (the sparse
    optimizer) allocates the moments (host ones on transparent huge pages if ``huge_pages``,
    ``host_memory.py``); with the clock never moved (the dense optimizer) nothing is owed and
    ``settle`` returns at once."""

    def __init__(self, shards: Sequence, clock: Optional[RowClock] = None,
                 last: Optional[List[torch.Tensor]] = None,
                 touched: Optional[List[torch.Tensor]] = None, huge_pages: bool = True):
        self.shards = list(shards)
        self.huge_pages = huge_pages
        self.clock = clock if clock is not None else RowClock()
        self.last = last if last is not None else _per_row_steps(self.shards)
        self.touched = touched if touched is not None else _per_row_steps(self.shards)
        self.exp_avg: Optional[List[torch.Tensor]] = None
        self.exp_avg_sq: Optional[List[torch.Tensor]] = None
        self._kernel = None
        # The direct reads of these (host) shards still queued on the GPU, which every write of
        # their rows waits for first (``direct_reads.py``); None: no GPU kernel reads them.
        self.reads: Optional[DirectReads] = None

    def bind_moments(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The Adam moments of the shards (zeros, allocated on first call), which the catch-up
        reads and the sparse optimizer steps."""
        if self.exp_avg is None:
            stack = stacked(self.shards) if len(self.shards) > 1 else None
            if stack is not None:  # shards in one tensor (the store's device shards): their
                # moments too, so that the torch path steps and settles every layer at once
                self.exp_avg = list(host_memory.zeros_like(stack, self.huge_pages).unbind(0))
                self.exp_avg_sq = list(host_memory.zeros_like(stack, self.huge_pages).unbind(0))
            else:
                self.exp_avg = [host_memory.zeros_like(s, self.huge_pages) for s in self.shards]
                self.exp_avg_sq = [host_memory.zeros_like(s, self.huge_pages)
                                   for s in self.shards]
        return self.exp_avg, self.exp_avg_sq

    def stacks(self):
        """``(rows, exp_avg, exp_avg_sq, last, touched)``, each every shard's in one tensor
        (``stacked``: layer first), where the rows step and settle with torch ops (no row kernel)
        and each kind of state is one tensor; else None."""
        if self.exp_avg is None or len(self.shards) < 2 or \
                self._row_kernel(self.shards[0]) is not None:
            return None
        state = [stacked(x) for x in (self.shards, self.exp_avg, self.exp_avg_sq, self.last,
                                      self.touched)]
        return None if any(x is None for x in state) else state

    def settle_shards(self, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """``settle(i, rows, upto)`` for every shard: on the torch path with the state in one
        tensor per kind (``stacks``), every layer at once, one op per tensor instead of one per
        layer; the same bits."""
        upto = self.clock.step if upto is None else upto
        if upto == self.clock.base or rows.numel() == 0 or self.exp_avg is None:
            return
        state = self.stacks()
        if state is None:
            for i in range(len(self.shards)):
                self.settle(i, rows, upto)
            return
        shards, exp_avg, exp_avg_sq, last_all, touched_all = state
        rows = torch.unique(rows.cpu().to(torch.long))
        if self.reads is not None:  # a GPU kernel may still read these rows: it reads first
            self.reads.before_write(rows)
        last = last_all[:, rows]
        late = last < upto  # [layers, rows], on the host
        some = late.any(0)
        if not bool(some.any()):
            return
        if not bool(some.all()):
            rows, last, late = rows[some], last[:, some], late[:, some]
        factors = self.clock.coefficients(last, touched_all[:, rows], upto)
        dev = shards.device
        index = to_device(rows, dev)
        p, m, v = (x.index_select(1, index) for x in (shards, exp_avg, exp_avg_sq))
        pr, mr, vr = catch_up_rows(p, m, v, *factor_columns(factors, dev))
        if not bool(late.all()):  # a row already current in some layer stays as it is there
            keep = to_device(late, dev).unsqueeze(-1)
            pr, mr, vr = torch.where(keep, pr, p), torch.where(keep, mr, m), \
                torch.where(keep, vr, v)
        shards[:, index], exp_avg[:, index], exp_avg_sq[:, index] = pr, mr, vr
        last_all[:, rows] = torch.where(late, upto, last)

    def settle(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """Bring rows ``rows`` (local indices, repeats allowed) of shard ``i`` to iteration
        ``upto`` (default: the clock's)."""
        upto = self.clock.step if upto is None else upto
        if upto == self.clock.base or rows.numel() == 0 or self.exp_avg is None:
            return  # nothing stepped since every row was current
        # The last steps live on the host. A read may ask for a row more than once (rows two
        # ranks ask an owner for): each row is brought up to date once.
        rows = torch.unique(rows.cpu().to(torch.long))
        if self.reads is not None:  # a GPU kernel may still read these rows: it reads first
            self.reads.before_write(rows)
        p, m, v = self.shards[i], self.exp_avg[i], self.exp_avg_sq[i]
        kernel = self._row_kernel(p)
        if kernel is not None:  # skips the rows already current, moves their last steps
            kernel.catch_up_rows_(p, m, v, rows, self.last[i], self.touched[i],
                                  self.clock.kernel_state(upto))
            return
        last = self.last[i][rows]
        late = last < upto
        if not bool(late.any()):
            return
        rows, last = rows[late], last[late]
        factors = self.clock.coefficients(last, self.touched[i][rows], upto)
        index = to_device(rows, p.device)
        pr, mr, vr = catch_up_rows(p[index], m[index], v[index],
                                   *factor_columns(factors, p.device))
        p[index], m[index], v[index] = pr, mr, vr
        self.last[i][rows] = upto

    def read_into(self, i: int, index: torch.Tensor, out: torch.Tensor) -> bool:
        """``out[:] = shard i's rows index`` (local indices, repeats allowed) as of the clock's
        iteration, cast to ``out``'s dtype, leaving the rows, their moments and last steps as
        they are: what ``settle`` then a gather give, bit for bit, with one read of each row and
        its moments and no write to them (the compiled ``gather_current_rows_``). The row's
        step brings it up to date in its own pass. Host shards only, with the kernel; False
        (nothing done) otherwise, and the caller settles and gathers."""
        kernel = self._row_kernel(self.shards[i])
        if kernel is None or not out.is_contiguous() or out.device.type != "cpu" or \
                out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        index = index.to(torch.long).contiguous()
        if self.exp_avg is None or self.clock.step == self.clock.base:
            kernel.gather_rows_(self.shards[i], index, out)  # nothing owed
            return True
        kernel.gather_current_rows_(self.shards[i], self.exp_avg[i], self.exp_avg_sq[i], index,
                                    self.last[i], self.touched[i],
                                    self.clock.kernel_state(self.clock.step), out)
        return True

    def settle_all(self) -> None:
        for i, shard in enumerate(self.shards):
            self.settle(i, torch.arange(shard.shape[0]))

    def reset(self, step: int, product: float) -> None:
        """Every row holds its values at iteration ``step`` (a checkpoint load; ``touched`` is
        loaded with them)."""
        self.clock.reset(step, product)
        for last in self.last:
            last.fill_(step)

    def _row_kernel(self, shard: torch.Tensor):
        if shard.device.type != "cpu" or shard.dtype != torch.float32 or \
                not shard.is_contiguous():
            return None
        if self._kernel is None:
            self._kernel = row_adam_cpu.load() or False
        return self._kernel or None


def factor_columns(factors: Sequence[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """``RowClock.coefficients``' float64 factors as fp32 columns ``[rows, 1]`` on ``device``,
    rounded as the compiled kernel rounds them, in one copy (a device shard: one host-to-device
    transfer, not one per factor)."""
    return list(to_device(torch.stack(factors).to(torch.float32), device).unsqueeze(-1)
                .unbind(0))


def stacked(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One tensor ``T`` with ``T[k]`` the storage of ``tensors[k]`` (a view, no copy), where they
    are equal-shaped views of one base at evenly spaced, non-overlapping offsets (the layers of a
    store's device shards and their state: ``TableStore``, ``bind_moments``,
    ``_per_row_steps``); else None."""
    if not tensors or any(not isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tensors[0]
    base = first._base
    if base is None or len(tensors) < 2:
        return None
    step = tensors[1].storage_offset() - first.storage_offset()
    extent = 1 + sum((n - 1) * st for n, st in zip(first.shape, first.stride()))
    if step < extent:
        return None
    for k, t in enumerate(tensors):
        if t._base is not base or t.shape != first.shape or t.stride() != first.stride() or \
                t.dtype != first.dtype or t.storage_offset() != first.storage_offset() + k * step:
            return None
    return base.as_strided((len(tensors),) + tuple(first.shape), (step,) + first.stride(),
                           first.storage_offset())


def _per_row_steps(shards: Sequence) -> List[torch.Tensor]:
    """Zeroed per-row iteration counts of each shard, in one ``[layers, rows]`` tensor where the
    shards have the same rows (``stacked`` finds it)."""
    counts = {s.shape[0] for s in shards}
    if len(shards) > 1 and len(counts) == 1:
        return list(torch.zeros(len(shards), counts.pop(), dtype=torch.long).unbind(0))
    return [torch.zeros(s.shape[0], dtype=torch.long) for s in shards]


def catch_up_rows(p, m, v, owed, move, m_scale, v_scale, eps):
    """Rows ``p``, moments ``m``, ``v`` brought forward with fp32 factors ``[rows, 1]``: the
    formula of ``LazyRows`` (and of the compiled ``catch_up_rows_``); ``m/(sqrt(v) + eps)`` is 0
    where ``v`` is (a row never stepped)."""
    ratio = torch.where(v > 0, m / (v.sqrt() + eps), torch.zeros_like(m))
    return p * owed - move * ratio, m * m_scale, v * v_scale


def _torch_adamw(p, g, m, v, hyper: AdamHyper, step: int) -> None:
    """AdamW (torch.optim.AdamW's formula) on rows at iteration ``step``."""
    p.mul_(1.0 - hyper.lr * hyper.weight_decay)
    m.mul_(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    bc1 = 1.0 - hyper.beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - hyper.beta2 ** step)
    denom = v.sqrt() / bc2_sqrt + hyper.eps
    p.addcdiv_(m, denom, value=-hyper.lr / bc1)


# -- the tiered variant (--stem-table-placement tiered: stem/runtime/tiers.py) ---------------

class TieredLazyRows(LazyRows):
    """``LazyRows`` of tiered shards: one clock, the last and touched steps of all owned rows
    (host, local order), viewed as those of each tier (``hot``, ``cold``: what each tier's optimizer uses); each
    tier's moments live with its rows."""

    def __init__(self, shards: Sequence[TieredShard], huge_pages: bool = True):
        super().__init__(shards, huge_pages=huge_pages)
        self.hot = LazyRows([s.hot for s in self.shards], self.clock,
                            [m[: s.num_hot] for m, s in zip(self.last, self.shards)],
                            [m[: s.num_hot] for m, s in zip(self.touched, self.shards)],
                            huge_pages)
        self.cold = LazyRows([s.cold for s in self.shards], self.clock,
                             [m[s.num_hot:] for m, s in zip(self.last, self.shards)],
                             [m[s.num_hot:] for m, s in zip(self.touched, self.shards)],
                             huge_pages)

    def bind_moments(self):
        raise TypeError("a tiered store's moments are bound per tier (hot, cold)")

    def settle(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """Each tier settles its own rows of ``rows`` (local indices)."""
        if (self.clock.step if upto is None else upto) == self.clock.base or rows.numel() == 0:
            return
        _, hot_rows, _, cold_rows = self.shards[i].split(rows)
        self.hot.settle(i, hot_rows, upto)
        self.cold.settle(i, cold_rows, upto)

    def settle_shards(self, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """Each tier settles its rows of ``rows`` in every shard (the tiers split once)."""
        if (self.clock.step if upto is None else upto) == self.clock.base or rows.numel() == 0 \
                or not self.shards:
            return
        _, hot_rows, _, cold_rows = self.shards[0].split(rows)
        self.hot.settle_shards(hot_rows, upto)
        self.cold.settle_shards(cold_rows, upto)


class TieredRowAdamW(LazyView):
    """``RowAdamW``'s interface over tiered shards: one ``RowAdamW`` for the GPU tier (torch
    kernel, on the model's device) and one for the host tier (CPU kernels), advanced together
    (one iteration clock, the same learning rate), each stepping its own rows.
    ``lazy``: the shards' ``TieredLazyRows`` (default: a private one; dense: only its tiers'
    direct reads are used)."""

    def __init__(self, shards: Sequence[TieredShard], mode: str = "dense",
                 lazy: Optional[TieredLazyRows] = None, huge_pages: bool = True):
        self.shards = list(shards)
        self.mode = mode
        self.lazy = lazy if lazy is not None else TieredLazyRows(self.shards, huge_pages)
        # Dense: each tier's lazy rows for their direct reads alone (``RowAdamW``).
        self.hot = RowAdamW([s.hot for s in self.shards], mode=mode, lazy=self.lazy.hot,
                            huge_pages=huge_pages)
        self.cold = RowAdamW([s.cold for s in self.shards], mode=mode, lazy=self.lazy.cold,
                             huge_pages=huge_pages)

    @property
    def kernel(self) -> str:
        return self.cold.kernel

    @property
    def step_count(self) -> int:
        return self.hot.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.hot.step_count = self.cold.step_count = value

    def _pair(self, name: str) -> List[TieredShard]:
        return [TieredShard(h, c) for h, c in zip(getattr(self.hot, name),
                                                  getattr(self.cold, name))]

    @property
    def exp_avg(self) -> List[TieredShard]:
        return self._pair("exp_avg")

    @property
    def exp_avg_sq(self) -> List[TieredShard]:
        return self._pair("exp_avg_sq")

    def begin_step(self, hyper: AdamHyper) -> StepPlan:
        plan = self.hot.begin_step(hyper)  # moves the shared clock once
        self.cold.step_count = plan.step
        return plan

    def step_rows(self, i: int, rows: torch.Tensor, rows_grad, plan: StepPlan) -> None:
        """Shard ``i``'s rows (local indices) step in the tier that holds them; dense: each tier
        steps all its rows (the others with a zero gradient). ``rows_grad``: a tensor, or the
        ``TierGrads`` of ``split_grads`` (the rows hot first)."""
        self.step_shards([(i, rows, rows_grad)], plan)

    def step_shards(self, items, plan: StepPlan) -> None:
        """``step_rows`` for each ``(i, rows, rows_grad)`` of ``items``; each tier steps its rows
        of all of them in one call (``RowAdamW.step_shards``: the GPU tier's layers together)."""
        per_tier = ([], [])
        locals_ = {}  # each tier's local rows, once for the layers that share their rows
        for i, rows, rows_grad in items:
            shard = self.shards[i]
            if not isinstance(rows_grad, TierGrads):
                rows, rows_grad = split_grads(shard, rows, rows_grad)
            key = (id(rows), rows_grad.num_hot, shard.num_hot, shard.hot.device,
                   shard.cold.device)
            if key not in locals_:
                r, n = rows.cpu().to(torch.long), rows_grad.num_hot
                hot_local, cold_local = r[:n], r[n:] - shard.num_hot
                if self.mode == "dense":
                    # Dense zero-fills a tier-sized gradient on the tier's device and writes the
                    # rows there (their indices go along); sparse keeps its per-row last steps
                    # on the host and takes host indices.
                    hot_local = to_device(hot_local, shard.hot.device)
                    cold_local = to_device(cold_local, shard.cold.device)
                locals_[key] = (rows, hot_local, cold_local)  # rows: kept alive for its id
            _, hot_local, cold_local = locals_[key]
            for todo, local, grad, tier in ((per_tier[0], hot_local, rows_grad.hot, shard.hot),
                                            (per_tier[1], cold_local, rows_grad.cold,
                                             shard.cold)):
                if tier.shape[0] and (local.numel() or self.mode == "dense"):
                    todo.append((i, local, grad.to(tier.device)))
        for opt, todo in zip((self.hot, self.cold), per_tier):
            if todo:
                opt.step_shards(todo, plan)

    def catch_up(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        if self.mode == "sparse":
            self.lazy.settle(i, rows, upto)

    def materialize(self) -> None:
        if self.mode == "sparse":
            self.lazy.settle_all()
