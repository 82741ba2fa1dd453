"""CPU AdamW for STEM table rows against independent plain-PyTorch references: ``dense`` equals
torch.optim.AdamW on the whole table; ``sparse`` follows its documented semantics (AdamW, with
``eps`` neglected in the steps of a row while it is untouched), checked against a float64
iteration-by-iteration reference that steps every row at every iteration, including rows left
untouched for several iterations, for longer than the catch-up's horizon, and rows never touched;
and it equals torch.optim.AdamW where ``eps`` is negligible."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.runtime.row_adam import (
    AdamHyper,
    RowAdamW,
    RowClock,
    catch_up_rows,
    deepspeed_op,
)
from megatron_ext_kernels.row_adam_cpu import RowKernelError

ROWS, WIDTH = 12, 20
# Touched rows per iteration: row 3 every time, row 7 at iterations 1 and 5 only, row 11 never.
TOUCHED = [[0, 3, 7], [3, 5], [1, 3, 4], [3], [3, 7, 9, 10], [2, 3]]
LRS = [0.0, 8e-3, 6e-3, 5e-3, 3e-3, 2e-3]  # warm-up from 0, then decaying
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def kernels(mode):
    from megatron_ext_kernels import row_adam_cpu

    found = ["torch"]
    if mode == "dense" and deepspeed_op() is not None:
        found.append("deepspeed")
    if mode == "sparse" and row_adam_cpu.load() is not None:
        found.append("rowwise")
    return found


def grads_for(step):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.tensor(TOUCHED[step])
    return rows, torch.randn(rows.numel(), WIDTH, generator=g)


def hyper(lr):
    return AdamHyper(lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)


def initial():
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


def adamw_step(ref, ref_opt, rows, g, lr):
    """torch.optim.AdamW's step of the whole table ``ref``: the touched rows' gradients, zeros
    elsewhere."""
    dense = torch.zeros(ROWS, WIDTH)
    dense[rows] = g
    ref.grad = dense
    ref_opt.param_groups[0]["lr"] = lr
    ref_opt.step()


@pytest.mark.parametrize("kernel", kernels("dense"))
def test_dense_equals_torch_adamw(kernel):
    shard = initial()
    opt = RowAdamW([shard], mode="dense", kernel=kernel)
    ref = torch.nn.Parameter(initial())
    ref_opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        opt.step([(rows, g)], hyper(lr))
        adamw_step(ref, ref_opt, rows, g, lr)
        torch.testing.assert_close(shard, ref.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(shard[11], initial()[11])  # untouched rows move (momentum, decay)


def sparse_reference(steps, eps=EPS, betas=BETAS, lrs=LRS, grads=None, init=None,
                     reads=None):
    """The documented sparse semantics, in float64, every row at every iteration: AdamW with the
    iteration's bias correction; a row without a gradient at iteration ``j`` takes the step AdamW
    gives a zero gradient, with ``eps b2^((j-s0)/2) / sqrt(1-b2^j)`` in place of ``eps`` (``s0``:
    its last iteration with a gradient; 0 where ``v`` is). ``reads``: iteration -> rows whose
    values to record after it. Returns p, m, v (fp32) and the recorded reads."""
    grads = grads or grads_for
    p = (initial() if init is None else init).double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    seen = {}
    last_grad = [0] * p.shape[0]
    b1, b2 = betas
    for step in range(steps):
        t, lr = step + 1, lrs[step]
        rows, g = grads(step)
        full = torch.zeros_like(p)
        full[rows] = g.double()
        touched = torch.zeros(p.shape[0], dtype=torch.bool)
        touched[rows] = True
        p *= 1 - lr * WD
        m = b1 * m + (1 - b1) * full
        v = b2 * v + (1 - b2) * full ** 2
        mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        for row in range(p.shape[0]):
            if touched[row]:
                p[row] -= lr * mhat[row] / (vhat[row].sqrt() + eps)
                last_grad[row] = t
            else:
                e = eps * b2 ** ((t - last_grad[row]) / 2) / (1 - b2 ** t) ** 0.5
                ratio = torch.where(v[row] > 0, mhat[row] / (vhat[row].sqrt() + e),
                                    torch.zeros_like(p[row]))
                p[row] -= lr * ratio
        for row in (reads or {}).get(step, []):
            seen[(step, row)] = p[row].float().clone()
    return p.float(), m.float(), v.float(), seen


@pytest.mark.parametrize("kernel", kernels("sparse"))
@pytest.mark.parametrize("eps", [EPS, 0.3])
def test_sparse_matches_documented_semantics(kernel, eps):
    """With a large ``eps`` too (0.3, against |g| ~ 1): the only place the semantics leave AdamW
    is there, so the reference must leave it in the same way. Reads of rows between iterations,
    with rows repeated, do not change the numbers."""
    shard = initial()
    opt = RowAdamW([shard], mode="sparse", kernel=kernel)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        opt.step([(rows, g)], AdamHyper(lr, *BETAS, eps, WD))
        if step in (2, 3):  # a read may ask for a row twice (two ranks asking its owner)
            opt.catch_up(0, torch.tensor([0, 5, 6, 5, 0]))
    p_ref, m_ref, v_ref, _ = sparse_reference(len(LRS), eps=eps)
    # Rows touched at the last iteration are current; the others are brought up to date when read.
    last = TOUCHED[-1]
    torch.testing.assert_close(shard[last], p_ref[last], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(shard[11], p_ref[11])
    assert not torch.allclose(opt.exp_avg_sq[0][7], v_ref[7])
    opt.materialize()
    torch.testing.assert_close(shard, p_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.exp_avg[0], m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.exp_avg_sq[0], v_ref, rtol=1e-6, atol=1e-9)
    # Row 11 was never touched: only decay, no momentum to move it.
    decay = torch.prod(torch.tensor([1 - lr * WD for lr in LRS], dtype=torch.float64))
    torch.testing.assert_close(shard[11], (initial()[11].double() * decay).float())


@pytest.mark.parametrize("kernel", kernels("sparse"))
def test_sparse_is_adamw_where_eps_is_negligible(kernel):
    """The sparse optimizer computes only touched rows, yet its rows and moments are
    torch.optim.AdamW's on the whole table (eps 1e-8 against |g| ~ 1); with eps comparable to
    sqrt(v) the two part (the one documented difference)."""
    for eps, same in ((EPS, True), (0.3, False)):
        shard = initial()
        opt = RowAdamW([shard], mode="sparse", kernel=kernel)
        ref = torch.nn.Parameter(initial())
        ref_opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=eps, weight_decay=WD)
        for step, lr in enumerate(LRS):
            rows, g = grads_for(step)
            opt.step([(rows, g)], AdamHyper(lr, *BETAS, eps, WD))
            adamw_step(ref, ref_opt, rows, g, lr)
        opt.materialize()
        close = torch.allclose(shard, ref.detach(), rtol=1e-5, atol=1e-6)
        assert close == same, (eps, (shard - ref.detach()).abs().max())
        if same:
            state = ref_opt.state[ref]
            torch.testing.assert_close(opt.exp_avg[0], state["exp_avg"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.exp_avg_sq[0], state["exp_avg_sq"], rtol=1e-6,
                                       atol=1e-9)


@pytest.mark.parametrize("kernel", kernels("sparse"))
def test_sparse_rows_untouched_past_the_horizon(kernel):
    """A long run (betas 0.5, 0.9: a catch-up horizon of 47 iterations) where rows stay untouched
    for 1 to over 100 iterations, a warm-up from lr 0 and reads at random iterations: each read
    sees the reference's row of that iteration, and the end state is the reference's. Row 5 is
    touched once, at iteration 3, and caught up only at the end, 157 iterations later."""
    betas, rows_n, steps = (0.5, 0.9), 24, 160
    lrs = [1e-2 * min(1.0, s / 20) for s in range(steps)]
    gen = torch.Generator().manual_seed(7)
    schedule, reads = [], {}
    for step in range(steps):
        hot = [0] if step % 3 else [0, 1]
        rare = (6 + torch.randperm(rows_n - 6, generator=gen)[:2]).tolist() \
            if step % 37 == 5 else []
        rows = torch.tensor(sorted(set(hot + rare + ([5] if step == 2 else []))))
        schedule.append((rows, torch.randn(rows.numel(), WIDTH, generator=gen)))
        if step % 11 == 10:
            reads[step] = [r for r in torch.randperm(rows_n, generator=gen)[:6].tolist()
                           if r != 5]
    init = torch.randn(rows_n, WIDTH, generator=gen)
    p_ref, m_ref, v_ref, seen = sparse_reference(steps, betas=betas, lrs=lrs,
                                                 grads=lambda s: schedule[s], init=init,
                                                 reads=reads)
    shard = init.clone()
    opt = RowAdamW([shard], mode="sparse", kernel=kernel)
    for step in range(steps):
        opt.step([schedule[step]], AdamHyper(lrs[step], *betas, EPS, WD))
        for row in reads.get(step, []):
            opt.catch_up(0, torch.tensor([row]))
            torch.testing.assert_close(shard[row], seen[(step, row)], rtol=1e-5, atol=1e-6)
    assert opt.lazy.clock.horizon == 47
    assert int(opt.lazy.last[0][5]) == 3 and float(opt.exp_avg[0][5].abs().max()) > 0.1
    opt.materialize()
    torch.testing.assert_close(shard, p_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.exp_avg[0], m_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(opt.exp_avg_sq[0], v_ref, rtol=1e-5, atol=1e-9)


def test_sparse_needs_a_converging_momentum():
    opt = RowAdamW([initial()], mode="sparse", kernel="torch")
    with pytest.raises(ValueError, match="adam_beta1 < sqrt\\(adam_beta2\\); got --adam-beta1 "
                                         "0.99, --adam-beta2 0.95"):
        opt.step([grads_for(0)], AdamHyper(1e-3, 0.99, 0.95, EPS, WD))


def test_bad_input():
    with pytest.raises(ValueError, match="--stem-optimizer='lazy'"):
        RowAdamW([initial()], mode="lazy")
    with pytest.raises(ValueError, match="2-D fp32 tensors, got torch.float64"):
        RowAdamW([initial().double()])
    with pytest.raises(ValueError, match="the deepspeed kernel is for the dense optimizer"):
        RowAdamW([initial()], mode="sparse", kernel="deepspeed")
    with pytest.raises(ValueError, match="2 gradients for 1 table shards"):
        RowAdamW([initial()], kernel="torch").step([grads_for(0)] * 2, hyper(1e-3))


def _clock(steps: int, betas=(0.5, 0.9), seed: int = 0) -> RowClock:
    """A sparse optimizer's clock after ``steps`` iterations of a warm-up-and-decay learning
    rate (betas 0.5, 0.9: a catch-up horizon of 47 iterations)."""
    clock = RowClock()
    for t in range(1, steps + 1):
        clock.advance(t, AdamHyper(1e-2 * min(1.0, t / 10) / (1 + t / 50), *betas, 1e-3, 0.1))
    return clock


def _cast_cases() -> torch.Tensor:
    """fp32 values whose casts are easy to get wrong, by their bits: signed zeros, the smallest
    and largest subnormals, the largest finite value (rounds to inf in bf16), the infinities,
    NaNs whose payload is only in the low 16 bits (a rounding add without the NaN check makes
    them inf) or everywhere (0xFFFFFFFF: the add wraps to zero), and bf16 ties (low 16 bits
    exactly 0x8000) with the kept bit even and odd, one below and one above each; for fp16 its
    largest value, the tie above it (rounds to inf), its smallest subnormal, the tie below it
    (rounds to zero) and ties at 1 (low 13 bits 0x1000, kept bit even and odd)."""
    bits = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
            0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0x7FC00000,
            0x477FE000, 0x477FF000, 0x33800000, 0x33000000, 0xB3000001, 0x3F801000, 0x3F803000]
    for base in (0x3F800000, 0x3F810000, 0xC0490000, 0x3F7F0000):  # kept bit even / odd
        bits += [base + 0x8000, base + 0x7FFF, base + 0x8001]
    as_int32 = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]
    return torch.tensor(as_int32, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_gather_casts_like_torch(dtype):
    """The compiled gather-with-cast of rows wide enough for the vector loop, and not a multiple
    of its width (203 columns: the last 3 take the scalar remainder), holding every hard case of
    ``_cast_cases`` (and random values around them) in the vector columns and in the remainder,
    gives torch's cast bit for bit; a NaN stays a NaN."""
    _, kernel = _row_kernel()
    cases = _cast_cases()
    n, width = cases.numel(), 203
    g = torch.Generator().manual_seed(5)
    shard = torch.randn(33, width, generator=g) * 3
    for r in range(0, 30, 3):  # the hard cases at varied columns of every third row
        shard[r, (torch.arange(n) * 5 + r) % width] = cases
    for i in range(0, n, 3):  # and, three by three, in the last columns of the rows between
        part = cases[i: i + 3]
        shard[i + 1, width - part.numel():] = part
    index = torch.cat([torch.randperm(33, generator=g), torch.tensor([3, 0])])
    out = torch.empty(index.numel(), width, dtype=dtype)
    kernel.gather_rows_(shard, index, out)
    want = shard[index].to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    int_type = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    assert torch.equal(out.view(int_type)[~nan], want.view(int_type)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_row_kernels_match_torch(dtype):
    """The compiled gather-with-cast equals the torch ops it replaces (bitwise: round-to-nearest-
    even casts), and the compiled catch-up the torch path (``RowClock.coefficients`` and
    ``row_adam.catch_up_rows``) for rows current 0 to 120 iterations ago (within and past the
    catch-up's horizon), one never stepped (``v`` = 0: no momentum to move it); rows already
    current are left as they are, bit for bit, and every row's last iteration is moved to ``u``."""
    _, kernel = _row_kernel()
    g = torch.Generator().manual_seed(3)
    shard = torch.randn(40, 33, generator=g) * 100
    index = torch.randint(0, 40, (25,), generator=g)
    out = torch.empty(25, 33, dtype=dtype)
    kernel.gather_rows_(shard, index, out)
    assert torch.equal(out, shard[index].to(dtype))
    rows = torch.unique(index)
    m, v = torch.randn(40, 33, generator=g), torch.rand(40, 33, generator=g)
    m[rows[0]], v[rows[0]] = 0.0, 0.0
    u = 130
    clock = _clock(u)
    last = torch.randint(0, u + 1, (40,), generator=g)
    last[rows[1]] = u  # current: nothing owed
    touched = (last - torch.randint(0, 30, (40,), generator=g)).clamp(min=0)
    assert ((u - last[rows]) > clock.horizon).any() and ((u - last[rows]) < clock.horizon).any()
    late = rows[last[rows] < u]
    factors = clock.coefficients(last[late], touched[late], u)
    want = [x.clone() for x in (shard, m, v)]
    got = catch_up_rows(*(x[late] for x in want),
                        *(f.to(torch.float32).unsqueeze(1) for f in factors))
    for x, y in zip(want, got):
        x[late] = y
    kernel_last = last.clone()
    kernel.catch_up_rows_(shard, m, v, rows, kernel_last, touched, clock.kernel_state(u))
    for x, y in zip((shard, m, v), want):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-5)
        assert torch.equal(x[rows[1]], y[rows[1]])
    assert torch.isfinite(shard).all()
    want_last = last.clone()
    want_last[rows] = u
    assert torch.equal(kernel_last, want_last)
    # A row whose last iteration the clock does not know is refused before anything moves
    # (tests/test_row_kernel_refusals.py: every refusal of every kernel).
    kernel_last[rows[2]] = u + 5
    before = shard.clone()
    with pytest.raises(RowKernelError, match=rf"^catch_up_rows_: row {int(rows[2])} was last "
                                             rf"brought up to date at iteration {u + 5}, "
                                             rf"outside the clock's 0\.\.{u}$"):
        kernel.catch_up_rows_(shard, m, v, rows, kernel_last, touched, clock.kernel_state(u - 3))
    assert torch.equal(shard, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_of_host_rows_as_of_now_leaves_them_as_they_are(dtype):
    """The compiled read of rows as of iteration ``u`` (``gather_current_rows_``) gives, bit for
    bit, what the in-place catch-up then the gather give, for rows current 0 to 120 iterations
    ago (within and past the catch-up's horizon), a row never stepped (``v`` = 0), a row current
    at ``u`` and rows asked for twice, in 203 columns (the casts' vector loop and its
    remainder); the rows, their moments and last iterations are left as they are, bit for bit. A
    row whose last iteration the clock does not know is refused."""
    _, kernel = _row_kernel()
    g = torch.Generator().manual_seed(11)
    nrows, width, u = 50, 203, 130
    shard = torch.randn(nrows, width, generator=g) * 10
    m, v = torch.randn(nrows, width, generator=g), torch.rand(nrows, width, generator=g)
    index = torch.cat([torch.randperm(nrows, generator=g)[:30], torch.tensor([5, 5, 9])])
    m[index[0]], v[index[0]] = 0.0, 0.0
    clock = _clock(u)
    last = torch.randint(0, u + 1, (nrows,), generator=g)
    last[index[1]] = u
    touched = (last - torch.randint(0, 30, (nrows,), generator=g)).clamp(min=0)
    assert ((u - last[index]) > clock.horizon).any() and ((u - last[index]) < clock.horizon).any()
    state = [x.clone() for x in (shard, m, v, last, touched)]
    out = torch.full((index.numel(), width), 7.0, dtype=dtype)
    kernel.gather_current_rows_(shard, m, v, index, last, touched, clock.kernel_state(u), out)
    for x, y in zip((shard, m, v, last, touched), state):
        assert torch.equal(x, y)
    settled = [x.clone() for x in (shard, m, v, last)]
    kernel.catch_up_rows_(*settled[:3], torch.unique(index), settled[3], touched,
                          clock.kernel_state(u))
    want = torch.empty_like(out)
    kernel.gather_rows_(settled[0], index, want)
    assert not torch.equal(settled[0][index[2]], shard[index[2]])  # the rows owed a catch-up
    int_type = {4: torch.int32, 2: torch.int16}[dtype.itemsize]
    assert torch.equal(out.view(int_type), want.view(int_type))
    bad = last.clone()
    bad[index[3]] = u + 5
    with pytest.raises(RowKernelError, match=rf"^gather_current_rows_: row {int(index[3])} was "
                                             rf"last brought up to date at iteration {u + 5}"):
        kernel.gather_current_rows_(shard, m, v, index, bad, touched, clock.kernel_state(u - 3),
                                    out)


def test_lazy_read_then_step_equals_settle_then_step():
    """A read of host rows (``LazyRows.read_into``) leaves them owing, and their step brings them
    up to date in its own pass. As in training, where every row a micro-batch reads is stepped at
    the end of the iteration: the values read and the table after each step are, bit for bit,
    those of the in-place catch-up at the read (``settle``) then the step. Reads of rows that are
    not stepped (an evaluation's) write nothing, so they change none of the later numbers, and
    they see the rows brought forward."""
    _row_kernel()
    tables = [initial(), initial()]
    lazy_opt, settle_opt = (RowAdamW([t], mode="sparse", kernel="rowwise") for t in tables)
    everything = torch.arange(ROWS)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        before = tables[0].clone()
        seen = torch.empty(ROWS, WIDTH)
        assert lazy_opt.lazy.read_into(0, everything, seen)  # an evaluation's read
        if step >= 2:  # rows owe a catch-up once a step with lr > 0 has passed them by
            assert not torch.equal(seen, before)
        read = torch.cat([rows, rows[:1]])  # a micro-batch's read, one row asked twice
        out = torch.empty(read.numel(), WIDTH, dtype=torch.bfloat16)
        assert lazy_opt.lazy.read_into(0, read, out)
        assert torch.equal(tables[0], before)  # nothing written by the reads
        assert torch.equal(seen[read].to(torch.bfloat16), out)
        settle_opt.lazy.settle(0, read)
        assert torch.equal(out, tables[1][read].to(torch.bfloat16))
        lazy_opt.step([(rows, g)], hyper(lr))
        settle_opt.step([(rows, g)], hyper(lr))
        assert torch.equal(tables[0], tables[1])
    assert not torch.equal(tables[0], initial())


@pytest.mark.parametrize("kernel", kernels("sparse"))
def test_sparse_step_in_parts_with_reads_between(kernel):
    """The overlapped table step (``TableSteps.step_table``): an iteration's rows step
    in two parts, and rows outside the second part are read (brought up to date) between them. The
    result is bitwise that of the one-call step followed by the same reads, and the
    reference's."""
    parts_shard, whole_shard = initial(), initial()
    parts = RowAdamW([parts_shard], mode="sparse", kernel=kernel)
    whole = RowAdamW([whole_shard], mode="sparse", kernel=kernel)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        later = set(rows[1::2].tolist())
        read = torch.tensor([r for r in range(ROWS) if r not in later])
        whole.step([(rows, g)], hyper(lr))
        whole.catch_up(0, read)
        plan = parts.begin_step(hyper(lr))
        parts.step_rows(0, rows[::2], g[::2], plan)
        parts.catch_up(0, read)
        parts.step_rows(0, rows[1::2], g[1::2], plan)
    parts.materialize()
    whole.materialize()
    assert torch.equal(parts_shard, whole_shard)
    assert torch.equal(parts.exp_avg[0], whole.exp_avg[0])
    torch.testing.assert_close(parts_shard, sparse_reference(len(LRS))[0], rtol=1e-6, atol=1e-7)


def _row_kernel():
    from megatron_ext_kernels import row_adam_cpu

    kernel = row_adam_cpu.load()
    if kernel is None:
        pytest.skip("no C++ compiler")
    return row_adam_cpu, kernel


def _adamw_inputs(rows: int, width: int, touched: int, seed: int = 0):
    """Arguments of a compiled sparse step at iteration 41 of rows current 0 to 40 iterations
    ago."""
    g = torch.Generator().manual_seed(seed)
    p, m = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    v = torch.rand(rows, width, generator=g)
    index = torch.randperm(rows, generator=g)[:touched]
    grad = torch.randn(touched, width, generator=g)
    last = torch.randint(0, 41, (rows,), generator=g)
    touched_at = (last - torch.randint(0, 5, (rows,), generator=g)).clamp(min=0)
    return [p, m, v, index, grad, last, touched_at, _clock(40, (0.9, 0.95)).kernel_state(40),
            1e-3 / 0.1, 1.0 / 0.05 ** 0.5, 1 - 1e-4]


def test_row_kernels_run_the_threads_asked_and_give_the_same_bits():
    """Each call runs an OpenMP team of exactly ``threads()`` (whatever OMP_NUM_THREADS and
    torch's intra-op count say), and rows are independent, so the thread count does not change
    a bit of the result."""
    module, kernel = _row_kernel()
    for n in (1, 2, 3):
        assert kernel.team_size(n) == n
    results = []
    try:
        for n in (1, 3):
            module.set_threads(n)
            args = _adamw_inputs(300, 70, 200)
            kernel.sparse_adamw_(*args)
            out = torch.empty(200, 70, dtype=torch.bfloat16)
            kernel.gather_rows_(args[0], args[3], out)
            results.append((args[0], args[1], args[2], out))
    finally:
        module.set_threads(0)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert module.threads() == module.default_threads()
    with pytest.raises(ValueError, match="must be >= 0"):
        module.set_threads(-1)


@pytest.mark.parametrize("cuda", [False, True])
def test_default_threads_share_the_affinity_mask(monkeypatch, cuda):
    """The ranks of a node share its cores; with a GPU each rank leaves one of its share (when it
    has more than two) to its training thread, which launches the GPU's work."""
    module, _ = _row_kernel()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(module, "affinity_cores", lambda: 16)
    for local, want in ((1, 15 if cuda else 16), (4, 3 if cuda else 4), (8, 2), (32, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        assert module.default_threads() == want, (local, cuda)


def test_threads_ignore_torchruns_omp_setting():
    """torchrun sets OMP_NUM_THREADS=1 for several ranks per node; the kernels' team size is
    still the one asked (run in a fresh process, where the variable is read at start-up)."""
    _row_kernel()  # built and cached
    import os
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from megatron_ext_kernels import row_adam_cpu as r\n"
            "r.set_threads(2); print(r.load().team_size(r.threads()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "2"


def test_row_kernels_release_the_gil():
    """A row step in the background thread must not stop the training thread: the main thread
    runs while the kernel call is still in progress (with the GIL held it could only resume
    after the call returned)."""
    import threading
    import time

    module, kernel = _row_kernel()
    args = _adamw_inputs(16384, 2048, 16384, seed=1)  # one call of tens of milliseconds

    def attempt():
        times = {}
        started = threading.Event()

        def work():
            started.set()
            times["call"] = time.perf_counter()
            try:
                kernel.sparse_adamw_(*args)
            except BaseException as e:  # re-raised by the test's thread, with its cause
                times["error"] = e
            times["returned"] = time.perf_counter()

        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        resumed = time.perf_counter()
        worker.join()
        if "error" in times:
            raise times["error"]
        return resumed - times["call"], times["returned"] - times["call"]

    # With the GIL held through the call the main thread can only resume after it returns, so
    # one early resume proves the release; a few tries keep a busy machine (the suite runs two
    # test files at once) from failing it by scheduling the main thread late.
    module.set_threads(1)
    try:
        tries = []
        for _ in range(3):
            resumed, took = attempt()
            tries.append((resumed, took))
            assert took > 0.01, f"the kernel call took {took:.4f} s: too short to tell"
            if resumed < 0.5 * took:
                break
    finally:
        module.set_threads(0)
    assert resumed < 0.5 * took, (
        "main thread resumed late into every kernel call (resumed s, call s): " + ", ".join(
            f"({r:.4f}, {t:.4f})" for r, t in tries))
