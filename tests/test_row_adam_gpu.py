"""The GPU tier's sparse row step in one kernel (``kernels/row_adam_gpu.py``) against its
plain-PyTorch reference, which is the torch path of ``RowAdamW._step_stacked`` bit for bit.
Under Triton's interpreter (the CPU; conftest sets it without CUDA) the kernel agrees within a few
ulp of each tensor's magnitude (the module says why not bitwise); on a GPU it is to give the
reference's bits (the marked test)."""

import pytest
import torch

from megatron_ext.stem.runtime.row_adam import (AdamHyper, catch_up_rows, factor_columns,
                                                _torch_adamw)
from megatron_ext_kernels import row_adam_gpu as k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
ARGS = (HYPER.lr, HYPER.beta1, HYPER.beta2, HYPER.eps, HYPER.weight_decay)


def _state(layers=3, rows=40, width=1100, n=7, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(layers, rows, width, generator=g)
    m = torch.randn(layers, rows, width, generator=g) * 1e-2
    v = torch.rand(layers, rows, width, generator=g) * 1e-4
    v[:, 3] = 0  # a row never stepped: its ratio is 0
    index = torch.randperm(rows, generator=g)[:n]
    index[0] = 3
    grad = torch.randn(layers, n, width, generator=g) * 1e-2
    factors = torch.rand(5, layers, n, generator=g, dtype=torch.float64)
    return [x.to(device) for x in (p, m, v, grad, index)] + [factors]


def test_reference_is_the_torch_path_of_the_stacked_step():
    p, m, v, grad, index, factors = _state()
    want = [x.clone() for x in (p, m, v)]
    # RowAdamW._step_stacked's ops: gather, catch_up_rows, _torch_adamw, scatter
    pr, mr, vr = catch_up_rows(*(x.index_select(1, index) for x in want),
                               *factor_columns(factors.unbind(0), torch.device("cpu")))
    _torch_adamw(pr, grad, mr, vr, HYPER, 5)
    want[0][:, index], want[1][:, index], want[2][:, index] = pr, mr, vr
    got = [x.clone() for x in (p, m, v)]
    k.sparse_adamw_rows_reference(*got, grad, index, factors.to(torch.float32), *ARGS, 5)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def _ulps(a, b, scale):
    return float(((a - b).abs() / (scale.abs().max() * torch.finfo(torch.float32).eps)).max())


@pytest.mark.skipif(not k.available(), reason="Triton is not installed")
def test_kernel_agrees_with_the_reference():
    """Touched rows within 2 ulp of the tensor's largest value (cancellation in ``m b1 + (1 - b1)
    g`` makes relative differences of single elements larger); untouched rows bit for bit."""
    p, m, v, grad, index, factors = _state(device=DEVICE)
    f32 = factors.to(torch.float32).to(DEVICE)
    want = [x.clone() for x in (p, m, v)]
    k.sparse_adamw_rows_reference(*want, grad, index, f32, *ARGS, 5)
    got = [x.clone() for x in (p, m, v)]
    k.sparse_adamw_rows(*got, grad, index, f32, *ARGS, 5)
    untouched = torch.ones(p.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[index] = False
    for a, b, before in zip(want, got, (p, m, v)):
        assert torch.equal(b[:, untouched], before[:, untouched])
        assert _ulps(a, b, a) <= 2.0
        assert not torch.equal(b, before)  # it stepped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_gives_the_reference_bits_on_the_gpu():
    p, m, v, grad, index, factors = _state(device="cuda")
    f32 = factors.to(torch.float32).cuda()
    want = [x.clone() for x in (p, m, v)]
    k.sparse_adamw_rows_reference(*want, grad, index, f32, *ARGS, 5)
    got = [x.clone() for x in (p, m, v)]
    k.sparse_adamw_rows(*got, grad, index, f32, *ARGS, 5)
    for a, b in zip(want, got):
        assert torch.equal(a, b), float((a - b).abs().max())


@pytest.mark.skipif(not k.available(), reason="Triton is not installed")
def test_row_adam_steps_the_gpu_tier_with_the_kernel():
    """``TieredRowAdamW``'s GPU tier with ``gpu_kernel="triton"`` over three iterations of the
    same rows' gradients against the torch path: the same per-row steps, rows and moments
    within a few ulp (the kernel ran: they differ somewhere)."""
    from megatron_ext.stem.runtime.row_adam import TieredRowAdamW
    from megatron_ext.stem.runtime.store import TableStore
    from megatron_ext.stem.runtime.tiers import split_layers

    runs = []
    for kernel in ("torch", "triton"):
        g = torch.Generator().manual_seed(0)
        tables = [torch.randn(48, 40, generator=g) for _ in range(3)]
        store = TableStore(tables, torch.arange(48), "tiered", torch.device("cpu"), num_hot=20)
        adam = TieredRowAdamW(store.shards, mode="sparse", lazy=store.lazy)
        adam.hot.rowwise, store.lazy.hot._kernel = None, False  # the torch path, as on a GPU
        adam.hot.gpu_kernel = kernel
        for _ in range(3):
            rows = torch.randperm(48, generator=g)[:18].sort().values
            summed = torch.randn(rows.numel(), 3 * 40, generator=g) * 1e-2
            split = split_layers(store.shards, rows, list(torch.split(summed, 40, dim=1)))
            adam.step_shards([(i, r, tg) for i, (r, tg) in enumerate(split)],
                             adam.begin_step(HYPER))
        runs.append((store, adam))
    (a_store, a), (b_store, b) = runs
    differ = False
    for i in range(3):
        assert torch.equal(a_store.lazy.last[i], b_store.lazy.last[i])
        for x, y in ((a_store.shards[i].hot, b_store.shards[i].hot),
                     (a.hot.exp_avg[i], b.hot.exp_avg[i]),
                     (a.hot.exp_avg_sq[i], b.hot.exp_avg_sq[i])):
            assert _ulps(x, y, x) <= 4.0
            differ = differ or not torch.equal(x, y)
        assert torch.equal(a_store.shards[i].cold, b_store.shards[i].cold)
    assert differ


def test_the_flag_chooses_the_step_of_the_rows_on_the_gpu():
    """``--stem-gpu-step`` (``optimizer.choose_gpu_step``) sets the step of the rows on the GPU:
    the GPU tier's of tiered tables, the table optimizer's own of managed gpu tables; host rows
    keep theirs."""
    from megatron_ext.stem.runtime.optimizer import choose_gpu_step
    from megatron_ext.stem.runtime.row_adam import RowAdamW, TieredRowAdamW
    from megatron_ext.stem.runtime.store import TableStore

    tables = [torch.randn(48, 8) for _ in range(2)]
    tiered = TableStore(tables, torch.arange(48), "tiered", torch.device("cpu"), num_hot=20)
    gpu = TableStore(tables, torch.arange(48), "gpu", torch.device("cpu"))
    adams = [TieredRowAdamW(tiered.shards, mode="sparse", lazy=tiered.lazy),
             RowAdamW(gpu.shards, mode="sparse", lazy=gpu.lazy)]
    assert [adams[0].hot.gpu_kernel, adams[1].gpu_kernel] == ["torch", "torch"]  # the default
    choose_gpu_step(adams, "triton")
    assert [adams[0].hot.gpu_kernel, adams[0].cold.gpu_kernel, adams[1].gpu_kernel] == [
        "triton", "torch", "triton"]
