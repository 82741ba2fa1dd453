"""The StructMoE MLP against a plain-PyTorch reference of Eqs. 5-6 (one rank, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

H, FF, L, R, S, B = 16, 40, 6, 3, 5, 2


def build(gated, fusion, topk, backend, init="small"):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    config = TransformerConfig(num_layers=4, hidden_size=H, ffn_hidden_size=FF,
                               num_attention_heads=4, gated_linear_unit=gated,
                               activation_func=F.silu if gated else F.gelu,
                               add_bias_linear=False, use_cpu_initialization=True)
    smoe = StructMoEConfig(num_experts=L, rank=R, topk=topk, fusion=fusion, backend=backend,
                           init=init)
    return StructMoEMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        structmoe=smoe, config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def reference(x, w1, wr, a, b, w2, gated, fusion, topk):
    """Eqs. 5-6 written per token; SwiGLU and GLU modes as documented in structmoe/mlp.py."""
    xs = x.reshape(-1, H)
    rows = []
    for n in range(xs.shape[0]):
        s = torch.softmax(xs[n] @ wr.t(), dim=-1)
        rows.append(sum(s[l] * (xs[n] @ a[l] @ b[l]) for l in torch.topk(s, topk).indices.tolist()))
    upd = torch.stack(rows).reshape(S, B, -1)
    base = x @ w1.t()
    if gated:
        gate, up = base[..., :w2.shape[1]], base[..., w2.shape[1]:]
        inner = (F.silu(gate + upd) * up if fusion == "additive"
                 else F.silu(gate) * up * (1 + upd))
    else:
        inner = F.gelu(base + upd) if fusion == "additive" else F.gelu(base) * (1 + upd)
    return inner @ w2.t()


@pytest.mark.parametrize("backend", ["reference", "dense-masked"])
@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("fusion", ["additive", "glu"])
@pytest.mark.parametrize("gated", [False, True])
def test_matches_eqs_5_6(mcore_single_rank, gated, fusion, topk, backend):
    torch.manual_seed(0)
    mlp = build(gated, fusion, topk, backend)
    x = torch.randn(S, B, H, requires_grad=True)
    grad = torch.randn(S, B, H)
    out, bias = mlp(x)
    assert bias is None
    out.backward(grad)
    params = [mlp.linear_fc1.weight, mlp.router, mlp.lore_a, mlp.lore_b, mlp.linear_fc2.weight]
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference(x_ref, *leaves, gated, fusion, topk)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for p, leaf in zip(params, leaves):
        torch.testing.assert_close(p.grad, leaf.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_param_matched_counts(mcore_single_rank, gated):
    mlp = build(gated, "additive", 1, "dense-masked")
    counted = sum(p.numel() for p in mlp.parameters())
    assert counted == mlp.budget.params
    assert mlp.budget.params <= mlp.budget.dense_params
    assert mlp.budget.ffn < FF


def test_small_init_scales(mcore_single_rank):
    mlp = build(False, "additive", 1, "dense-masked")
    assert abs(mlp.lore_a.std().item() - math.sqrt(2 / (5 * H))) < 0.05
    assert abs(mlp.lore_b.std().item() - math.sqrt(2 / (5 * R))) < 0.1
    assert abs(mlp.linear_fc2.weight.std().item() - 2 / (4 * math.sqrt(mlp.budget.ffn))) < 0.02
