"""StructMoE's fused Triton router + codes kernel (``--structmoe-backend triton``) against the
plain-PyTorch path: ``route()`` with the ``reference`` backend (Algorithm 1) and the dense-masked
codes of ``megatron_ext/structmoe/routed.py``, forward and backward, with the Switch loss on the
router probabilities; then the whole StructMoE MLP with backend triton vs reference.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before anything imports Triton), at small shapes. Tolerances: fp32 ``rtol = atol = 1e-5``; bf16 a max
error of 2% of the largest magnitude of each tensor, against fp32 computed from the same
bf16-valued inputs (measured at these shapes: the kernel up to 1.0%, the bf16 reference backend
up to 0.7%; a wrong mask or score is off by tens of percent).
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

from megatron_ext.structmoe.balance import switch_loss  # noqa: E402
from megatron_ext.structmoe.routed import (  # noqa: E402
    Routing,
    dense_masked_codes,
    dense_masked_expand,
    route,
    route_codes_stages,
    routed,
    triton_route_codes,
)
from tests_helpers import offline_builds  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_TOL = 2e-2
AUX = 0.5  # weight of the Switch loss in the checked objective: large enough to matter

SHAPES = {  # N, H, L, r, D
    "4x4": (16, 24, 4, 4, 12),            # N a multiple of the interpreter's 16-token block
    "5x3-ragged": (37, 20, 5, 3, 7),      # N, H, L, L r all off the power-of-two tiles
    "16x16": (24, 32, 16, 16, 24),        # the default L x r
    "one-token": (1, 16, 16, 16, 8),
}


def leaves(shape, dtype, seed, skew=False):
    """x, W_R, A, B at O(1) scale (``x A_l B_l`` of unit size), as leaves on DEVICE."""
    n, h, l, r, d = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = 0.5 * torch.randn(l, h, generator=g)
    a = torch.randn(l, h, r, generator=g) / h ** 0.5
    b = torch.randn(l, r, d, generator=g) / r ** 0.5
    if skew:  # a feature every token has, that only expert 3 reads: it wins every token
        x[:, 0] = 3.0 + 0.1 * x[:, 0].abs()
        w[:, 0] = 0.0
        w[3, 0] = 4.0
    return [t.to(DEVICE, dtype).requires_grad_(True) for t in (x, w, a, b)]


def objective(out, routing, grad_out):
    """LM-loss stand-in plus the Switch loss on the router probabilities (as the MLP attaches)."""
    return (out.float() * grad_out).sum() + AUX * switch_loss(routing)


def run(backend, x, w, a, b, k, grad_out):
    """Output, routing, codes and the gradients of x, W_R, A, B of one backend."""
    route_codes, expand = route_codes_stages(backend)
    routing, codes = route_codes(x, w, a, k)
    out = expand(codes, b, routing)
    grads = torch.autograd.grad(objective(out, routing, grad_out), (x, w, a, b))
    return out, routing, codes, grads


def max_err(got, want):
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(),
                                                                 1e-30)


def check_close(got, want, dtype, what):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    else:
        err = max_err(got, want)
        assert err <= BF16_TOL, f"{what}: max error {err:.3g} of the largest magnitude"


def compare_to_reference(shape, dtype, k, seed, skew=False):
    x, w, a, b = leaves(shape, dtype, seed, skew)
    grad_out = torch.randn(shape[0], shape[-1], generator=torch.Generator().manual_seed(seed + 1))
    grad_out = grad_out.to(DEVICE)
    out, routing, codes, grads = run("triton", x, w, a, b, k, grad_out)

    # The reference: route() + Algorithm 1, in fp32 from the same (bf16-valued) numbers.
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (x, w, a, b)]
    ref_out, ref_routing, _, ref_grads = run("reference", *ref_leaves, k, grad_out)
    ref_codes = dense_masked_codes(ref_leaves[0], ref_leaves[2], ref_routing)

    torch.testing.assert_close(routing.indices, ref_routing.indices, rtol=0, atol=0)
    torch.testing.assert_close(routing.tokens_per_expert(),
                               torch.bincount(ref_routing.indices.reshape(-1),
                                              minlength=shape[2]), rtol=0, atol=0)
    assert routing.probs.dtype == routing.weights.dtype == torch.float32
    assert codes.dtype == out.dtype == dtype
    # The router runs in fp32 from the upcast operands at either dtype.
    torch.testing.assert_close(routing.probs, ref_routing.probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.weights, ref_routing.weights, rtol=1e-5, atol=1e-6)
    check_close(codes, ref_codes, dtype, "codes")
    check_close(out, ref_out, dtype, "routed output")
    for name, got, want in zip(("x", "W_R", "A", "B"), grads, ref_grads):
        check_close(got, want, dtype, f"grad {name}")
    return routing, grads


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_matches_reference(shape, dtype, k):
    compare_to_reference(SHAPES[shape], dtype, k, seed=10 * list(SHAPES).index(shape) + k)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_expert_gets_every_token(dtype, k):
    shape = SHAPES["16x16"]
    routing, grads = compare_to_reference(shape, dtype, k, seed=5, skew=True)
    counts = routing.tokens_per_expert()
    assert counts[3].item() == shape[0] and (routing.indices[:, 0] == 3).all()
    assert counts.sum().item() == shape[0] * k
    if k == 1:  # fifteen experts without a token: no gradient reaches their A or B
        assert counts.count_nonzero().item() == 1
        others = torch.arange(shape[2], device=DEVICE) != 3
        assert grads[2][others].abs().sum() == 0 and grads[3][others].abs().sum() == 0


def test_counts_come_from_the_kernel(monkeypatch):
    """tokens_per_expert() of the fused routing is the kernel's count: no torch.bincount."""
    x, w, a, _ = leaves(SHAPES["5x3-ragged"], torch.float32, 0)
    routing, _ = triton_route_codes(x, w, a, 2)

    def no_bincount(*args, **kwargs):
        raise AssertionError("torch.bincount called (a host sync on CUDA)")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    assert routing.tokens_per_expert().sum().item() == 2 * x.shape[0]


def test_the_checks_can_fail():
    """A wrong mask, a missing score, or a dropped load-balancing gradient exceeds the tolerance."""
    x, w, a, b = leaves(SHAPES["16x16"], torch.float32, 7)
    routing, codes = triton_route_codes(x, w, a, 1)
    n_exp = a.shape[0]
    u = x @ a.permute(1, 0, 2).reshape(x.shape[1], -1)
    shifted = Routing(routing.probs, (routing.indices + 1) % n_exp, routing.weights)
    unscaled = Routing(routing.probs, routing.indices, torch.ones_like(routing.weights))
    for wrong in (dense_masked_codes(x, a, shifted), dense_masked_codes(x, a, unscaled), u):
        with pytest.raises(AssertionError):
            check_close(codes, wrong, torch.float32, "codes")
        with pytest.raises(AssertionError):
            check_close(codes.bfloat16(), wrong, torch.bfloat16, "codes")

    # The same objective with the probabilities detached (no Switch-loss gradient) is caught.
    grad_out = torch.randn(x.shape[0], b.shape[-1], device=DEVICE)
    out = dense_masked_expand(codes, b, routing)
    full = torch.autograd.grad(objective(out, routing, grad_out), w, retain_graph=True)[0]
    detached = Routing(routing.probs.detach(), routing.indices, routing.weights,
                       _counts=routing.tokens_per_expert())
    partial = torch.autograd.grad(objective(out, detached, grad_out), w)[0]
    with pytest.raises(AssertionError):
        check_close(partial, full, torch.float32, "grad W_R")


def test_backward_with_only_probs_or_only_codes():
    """Each output's gradient alone: probs (aux loss only) and codes (aux loss off)."""
    x, w, a, _ = leaves(SHAPES["4x4"], torch.float32, 11)
    routing, codes = triton_route_codes(x, w, a, 2)
    ref = route(x, w, 2)
    ref_codes = dense_masked_codes(x, a, ref)
    gp = torch.randn_like(routing.probs)
    got = torch.autograd.grad((routing.probs * gp).sum(), (x, w), retain_graph=True)
    want = torch.autograd.grad((ref.probs * gp).sum(), (x, w), retain_graph=True)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    gc = torch.randn_like(codes)
    got = torch.autograd.grad((codes * gc).sum(), (x, w, a))
    want = torch.autograd.grad((ref_codes * gc).sum(), (x, w, a))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    # The scores as an output of their own (a caller using routing.weights elsewhere).
    routing, _ = triton_route_codes(x, w, a, 2)
    gw = torch.randn_like(routing.weights)
    got = torch.autograd.grad((routing.weights * gw).sum(), (x, w))
    want = torch.autograd.grad((route(x, w, 2).weights * gw).sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_routed_helper_refuses_the_fused_backend():
    x, w, a, b = leaves(SHAPES["4x4"], torch.float32, 0)
    with pytest.raises(ValueError, match="computes its own routing"):
        routed(x, a, b, route(x, w, 1), "triton")


def test_refused_where_it_cannot_run(monkeypatch):
    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext_kernels import structmoe_routed

    StructMoEConfig(backend="triton")  # a valid flag value
    x, w, a, _ = leaves(SHAPES["4x4"], torch.float32, 0)
    with pytest.raises(ValueError, match="small L\\*r"):
        structmoe_routed.fused_route_codes(x, w[:1].expand(64, -1),
                                           torch.zeros(64, x.shape[1], 32), 1)
    with pytest.raises(ValueError, match="share a floating-point dtype"):
        structmoe_routed.fused_route_codes(x, w, a.double(), 1)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            structmoe_routed.fused_route_codes(x, w, a, 1)
        with pytest.raises(ValueError, match="--structmoe-backend=triton"):
            route_codes_stages("triton")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert not structmoe_routed.available()
    with pytest.raises(ValueError, match="--structmoe-backend=triton"):
        route_codes_stages("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_flag_refused_before_building_without_cuda(monkeypatch):
    """``--structmoe-backend triton`` without CUDA (and without the interpreter) is refused by the
    entry point's flag checks, with the flag named, before Megatron builds anything."""
    from test_cli_errors import parse

    from megatron_ext.training.arguments import validate_extension_args

    args = parse(["--model-family", "structmoe", "--structmoe-backend", "triton"])
    validate_extension_args(args)  # under the interpreter: accepted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--structmoe-backend=triton needs Triton and a CUDA"):
        validate_extension_args(args)


def build_mlp(backend, gated, fusion, topk):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.nn.functional as F

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    torch.manual_seed(0)  # both backends draw the same parameters
    config = TransformerConfig(num_layers=4, hidden_size=16, ffn_hidden_size=40,
                               num_attention_heads=4, gated_linear_unit=gated,
                               activation_func=F.silu if gated else F.gelu,
                               add_bias_linear=False, use_cpu_initialization=True)
    smoe = StructMoEConfig(num_experts=6, rank=3, topk=topk, fusion=fusion, backend=backend,
                           aux_loss_coeff=0.3)
    mlp = StructMoEMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        structmoe=smoe, config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    mlp.set_layer_number(2)
    return mlp.to(DEVICE)


@pytest.mark.parametrize("gated,fusion,topk", [(True, "additive", 1), (False, "glu", 2)])
def test_mlp_triton_equals_reference_backend(mcore_single_rank, gated, fusion, topk):
    """The whole StructMoE MLP, aux loss attached: output, every gradient and the logged routing
    fractions and loss of backend triton equal backend reference (fp32)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_ext.structmoe.balance import LOSS_NAME, fraction_name

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([0.5], device=DEVICE))
    tracker = get_moe_metrics_tracker()
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grad = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    results = {}
    for backend in ("triton", "reference"):
        mlp = build_mlp(backend, gated, fusion, topk)
        tracker.clear()
        xi = x.clone().requires_grad_(True)
        out, _ = mlp(xi)
        out.backward(grad)
        logged = [tracker.metrics[LOSS_NAME].values[1].item()] + [
            tracker.metrics[fraction_name(l)].values[1].item() for l in range(6)]
        results[backend] = (out.detach(), xi.grad, {n: p.grad for n, p in
                                                   mlp.named_parameters()}, logged)
    tracker.clear()
    (out, gx, grads, logged), (r_out, r_gx, r_grads, r_logged) = results.values()
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, r_gx, rtol=1e-5, atol=1e-6)
    assert grads.keys() == r_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], r_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    assert logged == pytest.approx(r_logged, rel=1e-5)
    assert grads["router"].abs().max() > 0


def test_compiles_for_the_gpu_without_spills():
    """The GPU build, checked offline (no device needed): forward and backward at the default
    L = r = 16 in bf16 (k = 2: both top-k loops) compile for A100 and H100 (sm_80, sm_90) with the
    wrapper's launch options, within one block's shared memory (163 / 227 KiB), without register
    spills."""
    report = offline_builds("structmoe_routed",
                            "{a: offline_build(a, 'bf16', 16, 16, 2) for a in (80, 90)}")
    for arch, limit in (("80", 163 * 1024), ("90", 227 * 1024)):
        for name, use in report[arch].items():
            assert use["shared"] <= limit, (arch, name, use)
            assert use["local"] == 0, f"sm_{arch} {name} spills registers: {use}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_realistic_shape_no_host_sync():
    """The compiled kernel at the paper's shape (N = 8192 tokens, H = 2048, L = r = 16,
    D'_ff = 6618, bf16) against the reference, and forward + backward without a host sync."""
    shape = (8192, 2048, 16, 16, 6618)
    x, w, a, b = leaves(shape, torch.bfloat16, 0)
    grad_out = torch.randn(shape[0], shape[-1], device="cuda")

    def step():
        route_codes, expand = route_codes_stages("triton")
        routing, codes = route_codes(x, w, a, 1)
        out = expand(codes, b, routing)
        return out, routing, torch.autograd.grad(objective(out, routing, grad_out), (x, w, a, b))

    step()  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, routing, grads = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (x, w, a, b)]
    ref_out, ref_routing, _, ref_grads = run("reference", *ref_leaves, 1, grad_out)
    # A near tie in fp32 may route a token differently (summation order): allow a handful.
    same = (routing.indices == ref_routing.indices).all(dim=1)
    assert same.float().mean() > 0.999
    assert max_err(out[same], ref_out[same]) <= BF16_TOL
    if same.all():
        for name, got, want in zip(("x", "W_R", "A", "B"), grads, ref_grads):
            check_close(got, want, torch.bfloat16, f"grad {name}")
