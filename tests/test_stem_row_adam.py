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
    from megatron_ext_kernels import row_adam_cpu

    kernel = row_adam_cpu.load()
    if kernel is None:
        pytest.skip("no C++ compiler")
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
