"""The StructMoE MLP against a plain-PyTorch reference of Eqs. 5-6 (one rank, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

H, FF, L, R, S, B = 16, 40, 6, 3, 5, 2


def build(gated, fusion, topk, backend, init="small", aux_loss_coeff=0.0):
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
                           init=init, aux_loss_coeff=aux_loss_coeff)
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


@pytest.mark.parametrize("backend", ["reference", "dense-masked", "grouped"])
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


def switch_loss_reference(x, wr, topk):
    """Switch load-balancing loss written from its definition: L * sum_l f_l P_l, with f_l the
    share of the N k routing slots given to expert l and P_l its mean router probability."""
    probs = torch.softmax(x.reshape(-1, H) @ wr.t(), dim=-1)
    chosen = torch.topk(probs, topk, dim=-1).indices
    f = torch.stack([(chosen == l).sum() for l in range(L)]).float() / chosen.numel()
    return L * (f * probs.mean(dim=0)).sum(), f


@pytest.fixture
def aux_scale():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    yield MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


@pytest.mark.parametrize("backend", ["dense-masked", "grouped"])
@pytest.mark.parametrize("topk", [1, 2])
def test_load_balancing_loss_gradient_and_record(mcore_single_rank, aux_scale, topk, backend):
    """Backward adds coeff x scale x d(Switch loss); the loss and fractions are recorded per layer."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.structmoe.balance import LOSS_NAME, fraction_name

    coeff, scale = 0.3, 0.25
    torch.manual_seed(0)
    mlp = build(True, "additive", topk, backend, aux_loss_coeff=coeff)
    mlp.set_layer_number(3)
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    aux_scale.set_loss_scale(torch.tensor([scale]))
    x = torch.randn(S, B, H, requires_grad=True)
    grad = torch.randn(S, B, H)
    out, _ = mlp(x)
    out.backward(grad)

    params = [mlp.linear_fc1.weight, mlp.router, mlp.lore_a, mlp.lore_b, mlp.linear_fc2.weight]
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    x_ref = x.detach().clone().requires_grad_(True)
    lbl, fractions = switch_loss_reference(x_ref, leaves[1], topk)
    lbl_grad = torch.autograd.grad(lbl, leaves[1], retain_graph=True)[0]
    assert lbl_grad.abs().max() > 1e-3  # the loss reaches the router: the check below can fail
    total = (reference(x_ref, *leaves, True, "additive", topk) * grad).sum() + scale * coeff * lbl
    total.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp.router.grad, leaves[1].grad, rtol=1e-5, atol=1e-6)

    recorded = tracker.metrics[LOSS_NAME].values
    assert recorded[2].item() == pytest.approx(lbl.item(), rel=1e-5)  # layer 3, unscaled
    assert recorded.count_nonzero() == 1
    got = torch.stack([tracker.metrics[fraction_name(l)].values[2] for l in range(L)])
    torch.testing.assert_close(got, fractions)
    tracker.clear()


def test_nothing_recorded_or_attached_without_grad(mcore_single_rank, aux_scale):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.structmoe.balance import LOSS_NAME

    mlp = build(False, "additive", 1, "dense-masked", aux_loss_coeff=0.3)
    mlp.set_layer_number(1)
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    with torch.no_grad():
        mlp(torch.randn(S, B, H))
    mlp.eval()
    mlp(torch.randn(S, B, H, requires_grad=True))
    assert LOSS_NAME not in tracker.metrics or tracker.metrics[LOSS_NAME].values.sum() == 0


@pytest.mark.parametrize("gated", [False, True])
def test_param_matched_counts(mcore_single_rank, gated):
    mlp = build(gated, "additive", 1, "dense-masked")
    counted = sum(p.numel() for p in mlp.parameters())
    assert counted == mlp.budget.params
    assert mlp.budget.params <= mlp.budget.dense_params
    assert mlp.budget.ffn < FF


def assert_normal_std(t, std, z=4.0):
    """``t``'s entries are draws of N(0, std^2): the sample std within ``z`` standard errors of
    the estimator (std / sqrt(2 (n - 1)) for a normal sample), the mean within ``z`` of its
    (std / sqrt(n)). Tight enough that a factor sqrt(2) either way fails."""
    n = t.numel()
    assert z / math.sqrt(2 * (n - 1)) < 1 - 1 / math.sqrt(2), "too few draws to tell sqrt(2)"
    got = t.detach().double()
    assert abs(got.std().item() - std) <= z * std / math.sqrt(2 * (n - 1)), (got.std(), std)
    assert abs(got.mean().item()) <= z * std / math.sqrt(n), got.mean()


def test_small_init_scales(mcore_single_rank):
    """SmallInit N(0, 2 / (5 d)) for the gate's input-side weights, DeepNorm's
    N(0, (2 / (N_layers sqrt(d)))^2) for fc2 (Sec. 3.6 of the StructMoE paper)."""
    mlp = build(False, "additive", 1, "dense-masked")
    ffn = mlp.budget.ffn
    assert_normal_std(mlp.linear_fc1.weight, math.sqrt(2 / (5 * H)))
    assert_normal_std(mlp.lore_a, math.sqrt(2 / (5 * H)))
    assert_normal_std(mlp.lore_b, math.sqrt(2 / (5 * R)))
    assert_normal_std(mlp.linear_fc2.weight, 2 / (4 * math.sqrt(ffn)))  # 4 layers in build()
