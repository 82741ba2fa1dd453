"""CPU AdamW for STEM table rows against independent plain-PyTorch references: ``dense`` equals
torch.optim.AdamW on the whole table; ``sparse`` follows its documented semantics row by row,
including rows left untouched for several iterations and rows never touched."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.row_adam import AdamHyper, RowAdamW, deepspeed_op

ROWS, WIDTH = 12, 20
# Touched rows per iteration: row 3 every time, row 7 at iterations 1 and 5 only, row 11 never.
TOUCHED = [[0, 3, 7], [3, 5], [1, 3, 4], [3], [3, 7, 9, 10], [2, 3]]
LRS = [0.0, 8e-3, 6e-3, 5e-3, 3e-3, 2e-3]  # warm-up from 0, then decaying
BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1


def kernels(mode):
    from megatron_ext_kernels import row_adam_cpu

    found = ["torch"] + (["deepspeed"] if deepspeed_op() is not None else [])
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


@pytest.mark.parametrize("kernel", kernels("dense"))
def test_dense_equals_torch_adamw(kernel):
    shard = initial()
    opt = RowAdamW([shard], mode="dense", kernel=kernel)
    ref = torch.nn.Parameter(initial())
    ref_opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WD)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        opt.step([(rows, g)], hyper(lr))
        dense = torch.zeros(ROWS, WIDTH)
        dense[rows] = g
        ref.grad = dense
        ref_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
        torch.testing.assert_close(shard, ref.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(shard[11], initial()[11])  # untouched rows move (momentum, decay)


def sparse_reference(steps):
    """Documented sparse semantics, one row at a time: every row decays by (1 - lr wd) each
    iteration; a touched row takes an AdamW step with its own step count; untouched rows keep
    their moments."""
    p = initial().double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    count = [0] * ROWS
    for step in range(steps):
        lr = LRS[step]
        rows, g = grads_for(step)
        p *= 1 - lr * WD
        for j, row in enumerate(rows.tolist()):
            count[row] += 1
            k = count[row]
            m[row] = BETAS[0] * m[row] + (1 - BETAS[0]) * g[j].double()
            v[row] = BETAS[1] * v[row] + (1 - BETAS[1]) * g[j].double() ** 2
            mhat = m[row] / (1 - BETAS[0] ** k)
            vhat = v[row] / (1 - BETAS[1] ** k)
            p[row] -= lr * mhat / (vhat.sqrt() + EPS)
    return p.float(), m.float(), v.float(), count


@pytest.mark.parametrize("kernel", kernels("sparse"))
def test_sparse_matches_documented_semantics(kernel):
    shard = initial()
    opt = RowAdamW([shard], mode="sparse", kernel=kernel)
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        opt.step([(rows, g)], hyper(lr))
    p_ref, m_ref, v_ref, count = sparse_reference(len(LRS))
    assert opt.row_steps[0].tolist() == count
    torch.testing.assert_close(opt.exp_avg[0], m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.exp_avg_sq[0], v_ref, rtol=1e-6, atol=1e-9)
    # Rows touched at the last iteration are current; the others still owe decay until read.
    last = TOUCHED[-1]
    torch.testing.assert_close(shard[last], p_ref[last], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(shard[11], p_ref[11])
    opt.materialize()
    torch.testing.assert_close(shard, p_ref, rtol=1e-6, atol=1e-7)
    # Row 11 was never touched: only decay, no Adam update.
    decay = torch.prod(torch.tensor([1 - lr * WD for lr in LRS], dtype=torch.float64))
    torch.testing.assert_close(shard[11], (initial()[11].double() * decay).float())


def test_sparse_differs_from_dense():
    """The two semantics are different optimizers (the tests above cannot both pass trivially)."""
    a, b = initial(), initial()
    dense, sparse = RowAdamW([a], "dense", "torch"), RowAdamW([b], "sparse", "torch")
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        dense.step([(rows, g)], hyper(lr))
        sparse.step([(rows, g)], hyper(lr))
    sparse.materialize()
    assert (a - b).abs().max() > 1e-3


def test_bad_input():
    with pytest.raises(ValueError, match="--stem-optimizer='lazy'"):
        RowAdamW([initial()], mode="lazy")
    with pytest.raises(ValueError, match="2-D fp32 tensors, got torch.float64"):
        RowAdamW([initial().double()])
    with pytest.raises(ValueError, match="2 gradients for 1 table shards"):
        RowAdamW([initial()], kernel="torch").step([grads_for(0)] * 2, hyper(1e-3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_row_kernels_match_torch(dtype):
    """The compiled gather-with-cast and in-place row scaling equal the torch ops they replace
    (bitwise: same fp32 products, round-to-nearest-even casts)."""
    _, kernel = _row_kernel()
    g = torch.Generator().manual_seed(3)
    shard = torch.randn(40, 33, generator=g) * 100
    index = torch.randint(0, 40, (25,), generator=g)
    out = torch.empty(25, 33, dtype=dtype)
    kernel.gather_rows_(shard, index, out)
    assert torch.equal(out, shard[index].to(dtype))
    rows = torch.unique(index)
    factors = torch.rand(rows.numel(), dtype=torch.float64, generator=g) + 0.5
    want = shard.clone()
    want[rows] *= factors.to(torch.float32).unsqueeze(1)
    kernel.scale_rows_(shard, rows, factors)
    assert torch.equal(shard, want)


@pytest.mark.parametrize("kernel", kernels("sparse"))
def test_sparse_step_in_parts_with_reads_between(kernel):
    """The overlapped table step (``StemTablesOptimizer._step_table``): an iteration's rows step
    in two parts, and rows outside the second part are read (owed decay applied) between them. The
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
    g = torch.Generator().manual_seed(seed)
    p, m = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    v = torch.rand(rows, width, generator=g)
    index = torch.randperm(rows, generator=g)[:touched]
    grad = torch.randn(touched, width, generator=g)
    steps = torch.randint(1, 50, (touched,), generator=g)
    owed = torch.rand(touched, dtype=torch.float64, generator=g) * 0.1 + 0.9
    return [p, m, v, index, grad, steps, owed, 1e-3, 0.9, 0.95, 1e-8, 0.1]


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
            kernel.sparse_adamw_(*args)
            times["returned"] = time.perf_counter()

        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        resumed = time.perf_counter()
        worker.join()
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
