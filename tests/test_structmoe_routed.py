"""StructMoE: the routed low-rank path (both backends) against a per-token reference of Eq. 5, and
the parameter/FLOP budget (Eqs. 7-9, Table 1)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.structmoe.config import (
    StructMoEConfig,
    layer_budget,
    param_matched_ffn,
)
from megatron_ext.structmoe.routed import BACKENDS, route, routed

N, H, L, R, D = 11, 8, 5, 3, 7


def eq5_reference(x, w_router, a, b, k):
    """Written from Eq. 5 token by token: sum over the top-k experts of s_l(x) x A_l B_l."""
    out = []
    for n in range(x.shape[0]):
        s = torch.softmax(x[n].float() @ w_router.float().t(), dim=-1)
        top = torch.topk(s, k).indices
        out.append(sum(s[l] * (x[n] @ a[l] @ b[l]) for l in top.tolist()))
    return torch.stack(out)


def leaves(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_(True)
            for shape in ((N, H), (L, H), (L, H, R), (L, R, D))]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("k", [1, 2])
def test_backend_matches_eq5(backend, k):
    x, w, a, b = leaves(0)
    grad = torch.randn(N, D, generator=torch.Generator().manual_seed(1))
    out = routed(x, a, b, route(x, w, k), backend)
    out.backward(grad)
    got = [t.grad.clone() for t in (x, w, a, b)]

    x2, w2, a2, b2 = [t.detach().clone().requires_grad_(True) for t in (x, w, a, b)]
    ref = eq5_reference(x2, w2, a2, b2, k)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, t in zip(got, (x2, w2, a2, b2)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)
    assert w.grad.abs().sum() > 0  # the router is trained through the scores


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_one_expert_gets_every_token(backend):
    x, w, a, b = leaves(2)
    routing = route(x, w, 1)
    routing.indices.fill_(3)  # every token to expert 3; the other experts get none
    out = routed(x, a, b, routing, backend)
    expected = routing.weights * ((x @ a[3]) @ b[3])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_backends_agree_on_one_token():
    x, w, a, b = leaves(3)
    r = route(x[:1], w, 2)
    torch.testing.assert_close(routed(x[:1], a, b, r, "reference"),
                               routed(x[:1], a, b, r, "dense-masked"), rtol=1e-6, atol=1e-6)


def test_unknown_backend_is_refused():
    x, w, a, b = leaves(0)
    with pytest.raises(ValueError, match="--structmoe-backend"):
        routed(x, a, b, route(x, w, 1), "megablocks")


def test_table1_param_matched_width():
    # Table 1 of the StructMoE paper: H=2048, D_ff=7168, L=16, r=16 -> D'_ff = 6618.
    assert param_matched_ffn(2048, 7168, 16, 16) == 6618


@pytest.mark.parametrize("gated", [False, True])
def test_param_matching_is_tight(gated):
    cfg = StructMoEConfig()
    budget = layer_budget(cfg, 2048, 7168, gated)
    assert budget.params <= budget.dense_params
    wider = layer_budget(StructMoEConfig(ffn_hidden_size=budget.ffn + 1, param_matched=False),
                         2048, 7168, gated)
    assert wider.params > budget.dense_params
    assert budget.flops < budget.dense_flops  # Eq. 9: rho < 1 for k < L


def test_eq7_and_eq9_by_hand():
    b = layer_budget(StructMoEConfig(num_experts=4, rank=2, topk=1, ffn_hidden_size=10,
                                     param_matched=False), 6, 12, gated=False)
    assert b.params == 2 * 6 * 10 + 4 * 2 * (6 + 10) + 6 * 4
    assert b.flops == 4 * 6 * 10 + 2 * 6 * 4 + 2 * 1 * 2 * (6 + 10)
    assert b.dense_params == 2 * 6 * 12 and b.dense_flops == 4 * 6 * 12


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk=3, num_experts=2), "--structmoe-topk"),
    (dict(rank=0), "--structmoe-rank"),
    (dict(fusion="mul"), "--structmoe-fusion"),
    (dict(backend="cuda"), "--structmoe-backend"),
    (dict(aux_loss_coeff=-1.0), "--structmoe-aux-loss-coeff"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructMoEConfig(**kwargs)


def test_experts_larger_than_dense_mlp_are_refused():
    with pytest.raises(ValueError, match="exceed the dense MLP"):
        param_matched_ffn(16, 4, 64, 8)
