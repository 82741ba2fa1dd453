"""The STEM MLP against a plain-PyTorch reference of Eqs. 4-5 (and the gate ablation), fp32."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests_helpers import build_tiny_stem_mlp

H, FF, V, S, B = 32, 48, 50, 7, 3


def reference(variant, x, ids, w1, table, w2):
    """Plain PyTorch, written from the paper: y = W_d(SiLU(W_g x) * U[t]) and variants."""
    rows = table[ids]
    h1 = x @ w1.t()
    if variant == "up":  # Eq. 4
        inner = F.silu(h1) * rows
    elif variant == "gate":  # Sec. 4.4.2: the table replaces the gate projection
        inner = F.silu(rows) * h1
    else:  # Eq. 5, STEM-dagger: W_up kept, U[t] added
        gate, up = h1[..., :FF], h1[..., FF:]
        inner = F.silu(gate) * (up + rows)
    return inner @ w2.t()


def build_stem_mlp(variant, init="fan-in", **config_overrides):
    return build_tiny_stem_mlp(variant, hidden=H, ffn=FF, vocab=V, init=init, **config_overrides)


@pytest.mark.parametrize("variant", ["up", "gate", "dagger"])
def test_forward_and_gradients_match_reference(mcore_single_rank, variant):
    torch.manual_seed(0)
    mlp = build_stem_mlp(variant)
    x = torch.randn(S, B, H, requires_grad=True)
    ids = torch.randint(0, V, (S, B))
    ids[0, 0] = ids[1, 2] = ids[4, 1]  # repeated tokens: their row gradients must add up
    grad_out = torch.randn(S, B, H)

    out, bias = mlp(x, context=ids)
    assert bias is None
    out.backward(grad_out)

    w1 = mlp.linear_fc1.weight.detach().clone().requires_grad_(True)
    table = mlp.table.detach().clone().requires_grad_(True)
    w2 = mlp.linear_fc2.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference(variant, x_ref, ids, w1, table, w2)
    ref.backward(grad_out)

    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp.linear_fc1.weight.grad, w1.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp.table.grad, table.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp.linear_fc2.weight.grad, w2.grad, rtol=1e-6, atol=1e-6)
    # Rows of tokens that did not occur get no gradient.
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[ids.flatten()] = False
    assert torch.count_nonzero(mlp.table.grad[untouched]) == 0
    assert torch.count_nonzero(mlp.table.grad[ids[0, 0]]) > 0


def test_fc1_width_per_variant(mcore_single_rank):
    assert build_stem_mlp("up").linear_fc1.weight.shape == (FF, H)
    assert build_stem_mlp("gate").linear_fc1.weight.shape == (FF, H)
    assert build_stem_mlp("dagger").linear_fc1.weight.shape == (2 * FF, H)
    assert build_stem_mlp("up").table.shape == (V, FF)


@pytest.mark.parametrize("init,check", [
    ("normal", lambda t: abs(t.std().item() - 0.02) < 0.002),
    ("fan-in", lambda t: abs(t.std().item() - 0.02 * math.sqrt(H)) < 0.01),
    ("ones", lambda t: bool(torch.all(t == 1))),
])
def test_table_init(mcore_single_rank, init, check):
    assert check(build_stem_mlp("up", init=init).table.detach())


def test_zero_init_only_for_dagger(mcore_single_rank):
    assert torch.count_nonzero(build_stem_mlp("dagger", init="zeros").table) == 0
    with pytest.raises(ValueError, match="--stem-init=zeros"):
        build_stem_mlp("up", init="zeros")


def test_stem_without_gated_activation_is_refused(mcore_single_rank):
    with pytest.raises(ValueError, match="--swiglu"):
        build_stem_mlp("up", gated_linear_unit=False)


def test_forward_without_token_ids_is_refused(mcore_single_rank):
    mlp = build_stem_mlp("up")
    with pytest.raises(RuntimeError, match="without token ids"):
        mlp(torch.randn(S, B, H))


def test_table_is_column_parallel(mcore_single_rank):
    table = build_stem_mlp("up").table
    assert table.tensor_model_parallel and table.partition_dim == 1
