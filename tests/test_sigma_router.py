"""Sigma router on one rank against plain-PyTorch references of the report's Eq. 1 (global-batch
LBL) and Eqs. 2-4 (Top-1 LBL): statistics and values over the micro-batches of a global batch, and
the gradient (weights from the previous global batch, see ``sigma/lbl.py``), plus the MoE layer's
top-k switch against a plain reference of the routed SwiGLU experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

E, H = 8, 16


def make_config(topk=1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
               moe_router_topk=topk, moe_router_pre_softmax=True, moe_router_dtype="fp32",
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_ffn_hidden_size=12, ffn_hidden_size=32, gated_linear_unit=True,
               activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
               init_method_std=0.5, moe_token_dispatcher_type="alltoall")
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def make_router(lbl="global", coeff=1.0, temperature=0.7, topk=1, seed=0):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.router import SigmaRouter

    torch.manual_seed(seed)
    sigma = SigmaConfig(num_layers=2, num_experts=E, topk=topk, lbl=lbl, lbl_coeff=coeff,
                        top1_temperature=temperature)
    router = SigmaRouter(make_config(topk), ProcessGroupCollection.use_mpu_process_groups(),
                         sigma=sigma)
    router.layer_index = 0
    router.set_layer_number(1)
    router.train()
    return router


def run_step(router, micro_batches, scale=None):
    """Megatron's order for one global batch: forward then backward per micro-batch with the
    aux-loss gradient scale 1 / micro-batches, then the end of the global batch. Only the LBL
    reaches the router (the gates' gradient is zero). Returns the router weight's gradient."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    router.weight.grad = None
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale if scale is not None
                                                     else 1.0 / len(micro_batches)))
    for x in micro_batches:
        probs, routing_map = router(x)
        (probs * 0).sum().backward()
    stats = router.end_global_batch()
    grad = router.weight.grad.clone() if router.weight.grad is not None else None
    return grad, stats


# -- plain references of the report's equations ---------------------------------------------------
def ref_stats(weight, x, topk, tau):
    logits = x.reshape(-1, H).float() @ weight.float().t()
    p = torch.softmax(logits, dim=-1)
    idx = torch.topk(p, topk, dim=-1).indices
    counts = torch.zeros(E).index_add_(0, idx.reshape(-1), torch.ones(idx.numel()))
    q = torch.softmax(logits / tau, dim=-1)  # Eq. 3
    T = logits.shape[0]
    return dict(f=counts / (topk * T), P=p.mean(0), fhat=q.mean(0), pbar=q.max(-1).values.mean())


def ref_global_lbl(f, P):  # Eq. 1
    return E * sum(f[i] * P[i] for i in range(E))


def ref_top1_lbl(fhat, pbar):  # Eqs. 2-4
    return E * sum(fhat[i] ** 2 for i in range(E)) / pbar


def batches(seed, n_micro, tokens=6, batch=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, batch, H, generator=g) for _ in range(n_micro)]


@pytest.mark.parametrize("topk", [1, 2])
def test_global_lbl_value_and_statistics(mcore_single_rank, topk):
    router = make_router("global", topk=topk)
    mbs = batches(1, 3)
    _, stats = run_step(router, mbs)
    ref = ref_stats(router.weight.detach(), torch.cat(mbs, 1), topk, 0.7)
    torch.testing.assert_close(stats.f, ref["f"], rtol=0, atol=1e-7)
    torch.testing.assert_close(stats.p, ref["P"], rtol=1e-6, atol=1e-7)
    assert stats.tokens == 3 * 12
    assert abs(stats.global_lbl() - float(ref_global_lbl(ref["f"], ref["P"]))) < 1e-6


def test_global_lbl_gradient(mcore_single_rank):
    """Step 1: no previous statistics -> no LBL gradient. Step 2: the gradient of
    coeff * N_E * sum_i f_i(step 1) * P_i(step 2) (Eq. 1 with f taken as a constant)."""
    coeff = 0.3
    router = make_router("global", coeff=coeff)
    a, b = batches(2, 2), batches(3, 2)
    grad1, _ = run_step(router, a)
    assert grad1 is None or torch.count_nonzero(grad1) == 0
    grad2, stats2 = run_step(router, b)
    w = router.weight.detach().clone().requires_grad_(True)
    f_prev = ref_stats(w.detach(), torch.cat(a, 1), 1, 0.7)["f"]
    logits = torch.cat(b, 1).reshape(-1, H) @ w.t()
    P = torch.softmax(logits, -1).mean(0)
    (coeff * ref_global_lbl(f_prev, P)).backward()
    assert w.grad.abs().max() > 1e-4  # not trivially zero
    torch.testing.assert_close(grad2, w.grad, rtol=1e-5, atol=1e-7)


def test_micro_batch_count_does_not_change_the_gradient(mcore_single_rank):
    """2 micro-batches of n tokens == 1 micro-batch of 2n tokens (value and gradient)."""
    r1, r2 = make_router("global"), make_router("global")
    prev = batches(4, 1, batch=4)
    run_step(r1, prev)
    run_step(r2, [prev[0][:, :2].contiguous(), prev[0][:, 2:].contiguous()])
    x = batches(5, 1, batch=4)[0]
    g1, s1 = run_step(r1, [x])
    g2, s2 = run_step(r2, [x[:, :2].contiguous(), x[:, 2:].contiguous()])
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-7)
    # Equal up to fp32 summation order (the two micro-batches' statistics are summed in another
    # order): within two ulps of the value (one ulp at 1.2 is 1.19e-7).
    lbl = s1.global_lbl()
    assert abs(lbl - s2.global_lbl()) <= 2 * torch.finfo(torch.float32).eps * abs(lbl)


def test_top1_lbl_value_and_gradient(mcore_single_rank):
    """The logged value is Eqs. 2-4 over the global batch; when the previous global batch has the
    same statistics (same tokens, same weights) the gradient is autograd of Eqs. 2-4 itself."""
    tau, coeff = 0.7, 0.5
    router = make_router("top1", coeff=coeff, temperature=tau)
    mbs = batches(6, 2)
    _, stats1 = run_step(router, mbs)
    ref = ref_stats(router.weight.detach(), torch.cat(mbs, 1), 1, tau)
    assert abs(stats1.top1_lbl() - float(ref_top1_lbl(ref["fhat"], ref["pbar"]))) < 1e-6
    torch.testing.assert_close(stats1.fhat, ref["fhat"], rtol=1e-6, atol=1e-7)
    grad, stats2 = run_step(router, mbs)
    w = router.weight.detach().clone().requires_grad_(True)
    st = ref_stats(w, torch.cat(mbs, 1), 1, tau)
    (coeff * ref_top1_lbl(st["fhat"], st["pbar"])).backward()
    assert w.grad.abs().max() > 1e-4
    torch.testing.assert_close(grad, w.grad, rtol=1e-5, atol=1e-7)


def test_top1_lbl_gradient_uses_previous_statistics(mcore_single_rank):
    """Different batches: the gradient is that of the loss linearized at the previous batch's
    (fhat, pbar), d/dW [dL/dfhat . fhat(W) + dL/dpbar pbar(W)], with dL from autograd of Eq. 2."""
    tau, coeff = 0.7, 0.5
    router = make_router("top1", coeff=coeff, temperature=tau)
    a, b = batches(7, 2), batches(8, 2)
    run_step(router, a)
    grad, _ = run_step(router, b)
    st_a = ref_stats(router.weight.detach(), torch.cat(a, 1), 1, tau)
    fhat0 = st_a["fhat"].clone().requires_grad_(True)
    pbar0 = st_a["pbar"].clone().requires_grad_(True)
    ref_top1_lbl(fhat0, pbar0).backward()
    w = router.weight.detach().clone().requires_grad_(True)
    st_b = ref_stats(w, torch.cat(b, 1), 1, tau)
    (coeff * (torch.sum(fhat0.grad * st_b["fhat"]) + pbar0.grad * st_b["pbar"])).backward()
    torch.testing.assert_close(grad, w.grad, rtol=1e-5, atol=1e-7)


def test_lbl_none_and_eval_leave_no_gradient_and_no_statistics(mcore_single_rank):
    router = make_router("none")
    run_step(router, batches(9, 1))
    grad, stats = run_step(router, batches(10, 1))
    assert grad is None or torch.count_nonzero(grad) == 0
    assert stats is not None and stats.tokens == 12  # still monitored
    router.eval()
    router(batches(11, 1)[0])
    assert router.end_global_batch() is None  # evaluation adds nothing


def test_previous_statistics_are_checkpointed(mcore_single_rank):
    router = make_router("top1")
    run_step(router, batches(12, 1))
    sd = router.state_dict()
    assert {"sigma_prev_f", "sigma_prev_fhat", "sigma_prev_pbar"} <= set(sd)
    assert "sigma_acc" not in sd
    fresh = make_router("top1", seed=0)
    fresh.load_state_dict(sd)
    x = batches(13, 1)
    g1, _ = run_step(router, x)
    g2, _ = run_step(fresh, x)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)


# -- the MoE layer and its top-k switch ------------------------------------------------------------
def build_layer(topk_schedule=(2,), sparsify_at=1):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ext.models.specs import dense_layer_spec
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_layer_spec

    torch.manual_seed(0)
    sigma = SigmaConfig(num_layers=2, num_experts=E, topk=1, lbl="global", lbl_coeff=1e-3,
                        topk_schedule=topk_schedule, sparsify_at=sparsify_at)
    config = make_config(1, qk_layernorm=True, normalization="RMSNorm")
    spec = sigma_layer_spec(dense_layer_spec(False, True, num_experts=E), sigma, 0)
    return spec.submodules.mlp(config=config,
                               pg_collection=ProcessGroupCollection.use_mpu_process_groups()), sigma


def ref_moe(layer, x, topk):
    """Plain routed SwiGLU experts: sum over the top-k of softmax(logits) (pre-softmax, not
    renormalized) of p_e * W2_e (silu(W_gate_e x) * W_up_e x)."""
    flat = x.reshape(-1, H)
    p = torch.softmax(flat @ layer.router.weight.t(), -1)
    vals, idx = torch.topk(p, topk, -1)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for v, e in zip(vals[t], idx[t]):
            expert = layer.experts.local_experts[int(e)]
            gate, up = (flat[t] @ expert.linear_fc1.weight.t()).chunk(2)
            out[t] += v * ((F.silu(gate) * up) @ expert.linear_fc2.weight.t())
    return out.reshape(x.shape)


def test_layer_topk_switch_matches_reference(mcore_single_rank):
    from megatron_ext.sigma.layer import SigmaMoELayer
    from megatron_ext.sigma.schedule import apply_schedule

    layer, sigma = build_layer()
    assert isinstance(layer, SigmaMoELayer) and layer.topk == 2  # layer 0 of schedule (2,)
    x = torch.randn(5, 2, H)
    layer.eval()
    with torch.no_grad():
        out2, _ = layer(x)
        torch.testing.assert_close(out2, ref_moe(layer, x, 2), rtol=1e-5, atol=1e-6)
        assert apply_schedule([layer], sigma, 0, None)[0] == 2  # step 1: before the switch
        assert layer.topk == 2 and layer.router.topk == 2
        assert apply_schedule([layer], sigma, 1, None)[0] == 1  # step 2: after it
        assert layer.topk == 1 and layer.router.topk == 1
        assert layer.token_dispatcher.config.moe_router_topk == 1
        out1, _ = layer(x)
        torch.testing.assert_close(out1, ref_moe(layer, x, 1), rtol=1e-5, atol=1e-6)
        _, routing_map = layer.router(x)
        assert routing_map.sum(-1).eq(1).all()
    assert not torch.allclose(out1, out2)
