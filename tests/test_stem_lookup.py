"""The row-sparse table lookup equals F.embedding, with and without Megatron DDP's main_grad."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext_kernels.stem_lookup import lookup_rows

V, FF = 40, 6


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, FF, generator=g)
    ids = torch.randint(0, V, (5, 3), generator=g)
    ids[0, 0] = ids[2, 1] = ids[4, 2]  # repeats
    grad = torch.randn(5, 3, FF, generator=g)
    return table, ids, grad


def dense_reference(table, ids, grad):
    t = table.clone().requires_grad_(True)
    F.embedding(ids, t).backward(grad)
    return t.grad


def test_without_main_grad_matches_embedding():
    table, ids, grad = data()
    t = table.clone().requires_grad_(True)
    out = lookup_rows(t, ids)
    torch.testing.assert_close(out, F.embedding(ids, table), rtol=0, atol=0)
    out.backward(grad)
    torch.testing.assert_close(t.grad, dense_reference(table, ids, grad), rtol=1e-6, atol=1e-6)


def test_accumulates_into_main_grad_over_micro_batches():
    t = torch.nn.Parameter(data()[0])
    t.main_grad = torch.zeros(V, FF)
    t.grad_added_to_main_grad = False
    expected = torch.zeros(V, FF)
    for seed in (0, 1):  # two micro-batches
        table, ids, grad = data(seed)
        lookup_rows(t, ids).backward(grad)
        expected += dense_reference(t.detach(), ids, grad)
    assert t.grad_added_to_main_grad
    torch.testing.assert_close(t.main_grad, expected, rtol=1e-6, atol=1e-6)


def test_inside_megatron_ddp(mcore_single_rank):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from tests_helpers import build_tiny_stem_mlp

    # On a GPU the module runs on the device, as the model provider places it (DDP's buffers
    # are allocated there).
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    mlp = build_tiny_stem_mlp().to(device)
    reference = {n: p.detach().clone() for n, p in mlp.named_parameters()}
    ddp = DistributedDataParallel(mlp.config, DistributedDataParallelConfig(), mlp)
    x = torch.randn(5, 2, mlp.config.hidden_size, device=device)
    ids = torch.randint(0, mlp.vocab_size, (5, 2), device=device)
    ids[0, 0] = ids[3, 1]
    grad = torch.randn(5, 2, mlp.config.hidden_size, device=device)
    ddp.zero_grad_buffer()
    out, _ = ddp(x, context=ids)
    out.backward(grad)
    ddp.finish_grad_sync()

    w1 = reference["linear_fc1.weight"].requires_grad_(True)
    table = reference["table"].requires_grad_(True)
    w2 = reference["linear_fc2.weight"].requires_grad_(True)
    ((F.silu(x @ w1.t()) * table[ids]) @ w2.t()).backward(grad)
    torch.testing.assert_close(mlp.table.main_grad, table.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp.linear_fc1.weight.main_grad, w1.grad, rtol=1e-6, atol=1e-6)
    assert mlp.table.grad is None  # the dummy gradient was dropped by DDP's hook
