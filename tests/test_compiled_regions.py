"""The families' compiled regions (``--structmoe-compile routed``, ``--sigma-compile router``,
``--stem-compile gate``; ``megatron_ext/compiled.py``) against their eager selves, on the CPU
(Inductor's C++ backend): forward values and every gradient, on tiny shapes.

Tolerance: the regions are fp32 throughout (the StructMoE router and Sigma's statistics are fp32
by design; the tiny models here are fp32), so compiled and eager differ only by fp32 rounding:
Inductor sums reductions (softmax denominators, the column sums of the statistics, the
backward's sums over tokens) in another order and vectorises ``exp`` with its own
approximation (Sleef), each a few ulp. ``RTOL = 1e-5`` is about 80 ulp of fp32 (2^-23 ~ 1.2e-7)
relative to each tensor's largest value, far inside what a wrong op would give (the checks
below fail with a region's op changed) and above what reordering sums of <= 48 terms gives.

The last block runs the regions themselves on CUDA (Inductor's Triton kernels) in bf16 and fp32
at 4096 tokens, with a bf16 tolerance of its own (stated there); it skips without CUDA.

Every compile of a region costs seconds on the CPU (about 5-25 s each here, forward and backward
graphs), so each family gets one test with as few shapes as it can.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

RTOL = 1e-5


def assert_close(actual, expected, what):
    """Within RTOL of the expected tensor's largest magnitude (fp32 rounding, module doc)."""
    scale = max(float(expected.detach().abs().max()), 1e-30)
    err = float((actual.detach().float() - expected.detach().float()).abs().max())
    assert err <= RTOL * scale, f"{what}: max |compiled - eager| {err:.3g} > {RTOL} x {scale:.3g}"


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (a region run eagerly adds none)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# -- no graph breaks on the training path ---------------------------------------------------------
def test_regions_trace_whole():
    """``fullgraph=True`` raises at the first graph break; ``explain`` says so without compiling,
    for each region with the arguments a training passes it."""
    from megatron_ext.sigma.router import compiled_routing
    from megatron_ext.stem.mlp import gate_product
    from megatron_ext.structmoe.balance import lbl_statistics
    from megatron_ext.structmoe.routed import dense_masked_route_tail, route_head

    torch.manual_seed(0)
    n, h, e, r = 12, 8, 4, 3
    logits, x, a = torch.randn(n, e), torch.randn(n, h), torch.randn(e, h, r)
    probs, _, indices = route_head(logits, 2)
    f = torch.randn(n, 1, 6)
    cases = [(route_head, (logits, 2), {}), (dense_masked_route_tail, (logits, x, a, 2), {}),
             (lbl_statistics, (probs, indices), {}),
             (gate_product, (f, torch.randn(n, 1, 6), "up", F.silu), {}),
             (gate_product, (torch.randn(n, 1, 12), torch.randn(n, 1, 6), "dagger", F.silu,
                             torch.float32), {})]
    for lbl in ("global", "top1"):
        cases.append((compiled_routing,
                      (logits, torch.zeros(3 * e + 2), torch.rand(e), torch.rand(e),
                       torch.rand(1)),
                      dict(topk=2, pre_softmax=True, num_groups=None, group_topk=None,
                           scaling_factor=None, score_function="softmax", lbl=lbl, coeff=1.0,
                           temperature=0.7, scale=0.1)))
    for fn, args, kwargs in cases:
        found = torch._dynamo.explain(fn)(*args, **kwargs)
        assert (found.graph_count, found.graph_break_count) == (1, 0), \
            (fn.__name__, found.break_reasons)


# -- StructMoE ------------------------------------------------------------------------------------
def structmoe_mlp(backend: str, compile: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    torch.manual_seed(3)
    config = TransformerConfig(num_layers=2, hidden_size=16, ffn_hidden_size=40,
                               num_attention_heads=4, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               use_cpu_initialization=True)
    mlp = StructMoEMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        structmoe=StructMoEConfig(num_experts=4, rank=3, topk=2, backend=backend,
                                  ffn_hidden_size=24, aux_loss_coeff=0.5, compile=compile),
        config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    mlp.set_layer_number(1)
    return mlp.train()


@pytest.mark.parametrize("backend", ["dense-masked", "grouped"])
def test_structmoe_compiled_routed_path_matches_eager(mcore_single_rank, backend):
    """The MLP's output, the gradients of x, the router, A, B and the linear layers (the
    load-balancing loss attached, so the router's gradient has its term) and the recorded
    statistics, compiled against eager."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_ext.structmoe.balance import LOSS_NAME, fraction_name

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 2, 16, generator=g)
    grad = torch.randn(6, 2, 16, generator=g)
    results = {}
    for compile in ("none", "routed"):
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        tracker = get_moe_metrics_tracker()
        tracker.metrics.clear()
        mlp = structmoe_mlp(backend, compile)
        before = compiled_graphs()
        x = x0.clone().requires_grad_(True)
        out, _ = mlp(x)
        out.backward(grad)
        # forward + backward of two regions (dense-masked: its tail; grouped: the router head)
        # and the statistics: Dynamo compiled them, none fell back to eager.
        assert (compiled_graphs() > before) == (compile == "routed")
        recorded = [tracker.metrics[LOSS_NAME].values.clone()] + \
            [tracker.metrics[fraction_name(l)].values.clone() for l in range(4)]
        results[compile] = ([out, x.grad] + [p.grad for _, p in mlp.named_parameters()]
                            + recorded)
    names = ["out", "x.grad"] + [f"{n}.grad" for n, _ in mlp.named_parameters()] + \
        ["loss", "fractions 0", "1", "2", "3"]
    for name, eager, compiled in zip(names, results["none"], results["routed"]):
        assert_close(compiled, eager, f"{backend} {name}")


def test_structmoe_compile_refusals():
    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.routed import check_compile

    with pytest.raises(ValueError, match="--structmoe-compile='all': allowed none, routed"):
        StructMoEConfig(compile="all")
    line = check_compile("triton", "routed")
    assert "--structmoe-backend triton" in line and "\n" not in line
    assert check_compile("dense-masked", "routed") is None


# -- Sigma ----------------------------------------------------------------------------------------
E, H = 8, 16


def sigma_router(lbl: str, compile: str, topk: int = 2, **config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.router import SigmaRouter

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4,
                            num_moe_experts=E, moe_router_topk=topk,
                            moe_router_pre_softmax=True, moe_router_dtype="fp32",
                            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                            moe_ffn_hidden_size=12, ffn_hidden_size=32, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False,
                            use_cpu_initialization=True, init_method_std=0.5, **config)
    sigma = SigmaConfig(num_layers=2, num_experts=E, topk=topk, lbl=lbl, lbl_coeff=1.0,
                        top1_temperature=0.7, compile=compile)
    router = SigmaRouter(cfg, ProcessGroupCollection.use_mpu_process_groups(), sigma=sigma)
    router.layer_index = 0
    router.set_layer_number(1)
    return router.train()


@pytest.mark.parametrize("lbl", ["global", "top1"])
def test_sigma_compiled_router_matches_eager(mcore_single_rank, lbl):
    """Two global batches of two micro-batches (the second step's loss has the first's
    statistics as weights): the routing, the router weight's gradient with a gradient through the
    gates too, and the global-batch statistics, compiled against eager."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 2, H, generator=g) for _ in range(2)]
    gate_grads = [torch.randn(12, E, generator=g) for _ in range(2)]
    results = {}
    for compile in ("none", "router"):
        router = sigma_router(lbl, compile)
        before = compiled_graphs()
        out = []
        for _ in range(2):
            router.weight.grad = None
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5))
            for x, gg in zip(batches, gate_grads):
                probs, routing_map = router(x)
                (probs * gg).sum().backward()
                out += [probs, routing_map.float()]
            stats = router.end_global_batch()
            out += [router.weight.grad.clone(), stats.f, stats.p, stats.fhat, stats.pbar,
                    stats.tokens]
        assert (compiled_graphs() > before) == (compile == "router")
        results[compile] = out
    for i, (eager, compiled) in enumerate(zip(results["none"], results["router"])):
        assert_close(compiled, eager, f"{lbl} output {i}")


def test_sigma_compile_refusals(mcore_single_rank):
    from megatron_ext.sigma.config import SigmaConfig

    with pytest.raises(ValueError, match="--sigma-compile='x': allowed none, router"):
        SigmaConfig(num_layers=1, num_experts=2, topk=1, compile="x")
    with pytest.raises(ValueError, match="without --moe-z-loss-coeff; drop --moe-z-loss-coeff "
                                         "or pass --sigma-compile none"):
        sigma_router("global", "router", moe_z_loss_coeff=1e-3)


# -- STEM -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["up", "dagger"])
def test_stem_compiled_gate_matches_eager(mcore_single_rank, variant):
    """The MLP's output and the gradients of x, the linear layers and the table (its row-sparse
    backward stays eager), compiled against eager; repeated ids, as in text."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.mlp import StemMLP

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 2, 16, generator=g)
    ids = torch.tensor([[1, 1], [3, 1], [29, 0], [3, 3], [7, 1]])
    grad = torch.randn(5, 2, 16, generator=g)
    results = {}
    for compile in ("none", "gate"):
        torch.manual_seed(0)
        mlp = StemMLP.as_mlp_submodule(
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                     linear_fc2=RowParallelLinear),
            stem=StemConfig(variant=variant, init="fan-in", kernel="torch", compile=compile),
            vocab_size=30, config=TransformerConfig(
                num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                use_cpu_initialization=True, init_method_std=0.02),
            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        before = compiled_graphs()
        x = x0.clone().requires_grad_(True)
        out, _ = mlp(x, context=ids)
        out.backward(grad)
        assert (compiled_graphs() > before) == (compile == "gate")
        results[compile] = [out, x.grad] + [p.grad for _, p in mlp.named_parameters()]
    for i, (eager, compiled) in enumerate(zip(results["none"], results["gate"])):
        assert_close(compiled, eager, f"{variant} output {i}")


# -- availability ---------------------------------------------------------------------------------
def test_unavailable_names_the_flag_in_one_line(monkeypatch):
    from megatron_ext import compiled

    assert compiled.unavailable("--sigma-compile", on_gpu=False) is None  # g++ is here
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    line = compiled.unavailable("--sigma-compile", on_gpu=False)
    assert line.startswith("--sigma-compile: torch.compile on the CPU needs a C++ compiler")
    assert line.endswith("pass --sigma-compile none") and "\n" not in line
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        compiled.check_available("--structmoe-compile", on_gpu=False)


# -- the flags' refusals, from the command line ---------------------------------------------------
@pytest.mark.parametrize("family,flags,line", [
    ("structmoe", ["--structmoe-backend", "triton", "--structmoe-compile", "routed"],
     "--structmoe-compile routed: --structmoe-backend triton already fuses"),
    ("sigma", ["--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "1",
               "--moe-router-pre-softmax", "--moe-router-dtype", "fp32", "--qk-layernorm",
               "--moe-router-load-balancing-type", "none", "--sigma-compile", "router",
               "--moe-z-loss-coeff", "0.001"],
     "--sigma-compile router: the compiled router region is upstream's plain top-k routing, "
     "without --moe-z-loss-coeff"),
    ("stem", ["--stem-kernel", "triton", "--stem-compile", "gate"],
     "--stem-compile gate compiles the PyTorch path, and --stem-kernel triton"),
])
def test_compile_flags_refused_in_one_line(family, flags, line):
    from tests_helpers import parse_tiny_args

    from megatron_ext.models.registry import get_family

    args = parse_tiny_args(["--model-family", family, *flags])
    with pytest.raises(ValueError) as refused:
        get_family(family).validate_args(args)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


# -- benchmarks/compiled_regions.py: kernels per region ---------------------------------------------
def test_compiled_regions_counts_launches():
    """The generated code's launches are read from its ``call`` (comments left out), and the
    STEM product, 2 aten ops forward and 3 backward eagerly, is one fused kernel each way."""
    from tests_helpers import load_script

    from megatron_ext.stem.mlp import gate_product

    bench = load_script("benchmarks/compiled_regions.py", "compiled_regions_bench")
    code = ("import torch\ndef call(args):\n    # Source Nodes: [aten.mul, aten.silu]\n"
            "    cpp_fused_mul_0(buf0)\n    extern_kernels.mm(a, b, out=c)  # aten.mm\n"
            "    aten.scatter_reduce_.two(buf0, 0)\n    triton_poi_fused_1.run(x, grid=g)\n"
            "    buf1 = torch.ops.aten.topk.default(x, 1)\n")
    assert bench.launches(code) == {"fused": 2, "extern": 1,
                                    "fallback": ["scatter_reduce_", "topk"]}
    args = (torch.randn(8, 1, 6, requires_grad=True), torch.randn(8, 1, 6, requires_grad=True),
            "up", F.silu)
    assert bench.eager_ops(gate_product, args, {}) == [2, 3]
    assert [(g["fused"], g["extern"], g["fallback"]) for g in bench.count(gate_product, args, {})] \
        == [(1, 0, []), (1, 0, [])]


# -- on CUDA: Inductor's GPU (Triton) kernels against eager, bf16 and fp32 ------------------------
# The regions themselves (what each family's flag hands to ``compile_region``), with the dtypes a
# bf16 training gives them, at a small but real shape: 4096 tokens (2048 x 2), StructMoE at hidden
# 2048 with 8 experts of rank 16, top-2; Sigma-MoE-Tiny's 96 experts, top-8 (its first layers'
# top-k); STEM at d_ff 5632. One GPU run of this block says whether the compiled regions may be
# used in bf16 training on that GPU.
#
# bf16 tolerance, relative to each tensor's largest magnitude like ``RTOL``: eager rounds every
# op's result to bf16, Inductor computes a fused kernel's ops in fp32 and rounds once at its
# output (``emulate_precision_casts`` is off), so a region of a few elementwise ops differs by a
# few bf16 roundings (unit roundoff 2^-8 ~ 3.9e-3) of each element; the GEMMs are the same
# cuBLAS calls on inputs that differ by those roundings, summed in fp32. 2^-5 is eight such
# roundings of the largest value. On the CPU (these functions with ``device="cpu"``, 2 cores)
# the bf16 cases differed by at most 0.0069 of the largest value (Sigma's logits gradient), and
# a wrong op was caught: SiLU replaced by GELU in the STEM region by 0.073, Sigma's top-1
# temperature 0.7 -> 0.8 by far more; another expert selected or a lost gate moves values by
# O(1). fp32 (at most 1.4e-6 on the CPU): the reductions over 4096 tokens in another
# order and Triton's ``exp`` (``ex2.approx``-based, a few ulp) against CUDA's, ``1e-4`` (about
# 800 ulp), still far from a wrong op.
TOLERANCE = {torch.bfloat16: 2.0 ** -5, torch.float32: 1e-4}
TOKENS = 4096


def assert_close_to(actual, expected, tolerance, what):
    """``assert_close`` with a dtype's tolerance (block comment above); integer outputs (counts,
    routing maps) must be equal."""
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: compiled and eager differ"
        return
    scale = max(float(expected.detach().abs().max()), 1e-30)
    err = float((actual.detach().float() - expected.detach().float()).abs().max())
    assert err <= tolerance * scale, \
        f"{what}: max |compiled - eager| {err:.3g} > {tolerance:.3g} x {scale:.3g}"


def separated_logits(n: int, e: int, device, dtype=torch.float32, seed: int = 0):
    """Router logits whose experts are at least 0.15 apart in every token (each token a random
    order of the levels 0, 0.25, ... plus noise below 0.1): compiled and eager select the same
    experts whatever their rounding, so a difference in selection is an error, not a near-tie."""
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(n, e, generator=g).argsort(dim=-1).float()
    logits = order * 0.25 + 0.1 * torch.rand(n, e, generator=g) - 0.125 * e
    return logits.to(device=device, dtype=dtype)


def eager_and_compiled(fn, inputs, run):
    """``run(fn, leaves)`` with fresh leaf copies of ``inputs`` (those that are floating point
    require grad), eagerly and through ``compile_region``: the two lists of results."""
    from megatron_ext.compiled import compile_region

    results = []
    for f in (fn, compile_region(fn)):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        results.append(run(f, leaves))
    return results


def compare(names, results, tolerance, what):
    eager, compiled = results
    assert len(names) == len(eager) == len(compiled)
    for name, e, c in zip(names, eager, compiled):
        assert_close_to(c, e, tolerance, f"{what} {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_structmoe_regions_on_cuda(dtype, device="cuda"):
    """``--structmoe-compile routed``: dense-masked's tail (fp32 logits, x and A in ``dtype``),
    the other backends' router head and the load-balancing statistics (fp32 by design): values,
    selected experts, counts and every input's gradient."""
    from megatron_ext.structmoe.balance import lbl_statistics
    from megatron_ext.structmoe.routed import dense_masked_route_tail, route_head

    n, h, e, r, k = TOKENS, 2048, 8, 16, 2
    g = torch.Generator().manual_seed(1)
    logits = separated_logits(n, e, device)
    x = torch.randn(n, h, generator=g).to(device, dtype)
    a = (torch.randn(e, h, r, generator=g) / h ** 0.5).to(device, dtype)
    grad_probs, grad_weights = (torch.randn(n, e, generator=g).to(device),
                                torch.randn(n, k, generator=g).to(device))
    grad_codes = torch.randn(n, e * r, generator=g).to(device, dtype)
    tol = TOLERANCE[dtype]

    def tail(f, leaves):
        probs, weights, indices, codes = f(*leaves, k)
        torch.autograd.backward([probs, weights, codes], [grad_probs, grad_weights, grad_codes])
        return [probs, weights, indices, codes] + [t.grad for t in leaves]

    compare(["probs", "weights", "indices", "codes", "logits.grad", "x.grad", "a.grad"],
            eager_and_compiled(dense_masked_route_tail, [logits, x, a], tail), tol, "tail")

    def head(f, leaves):
        probs, weights, indices = f(*leaves, k)
        torch.autograd.backward([probs, weights], [grad_probs, grad_weights])
        return [probs, weights, indices, leaves[0].grad]

    compare(["probs", "weights", "indices", "logits.grad"],
            eager_and_compiled(route_head, [logits], head), TOLERANCE[torch.float32], "head")

    probs = torch.softmax(logits, dim=-1)
    indices = probs.topk(k, dim=-1).indices

    def statistics(f, leaves):
        counts, loss = f(*leaves)
        loss.backward()
        return [counts, loss, leaves[0].grad]

    compare(["counts", "loss", "probs.grad"],
            eager_and_compiled(lbl_statistics, [probs, indices], statistics),
            TOLERANCE[torch.float32], "statistics")


@pytest.mark.parametrize("lbl", ["global", "top1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sigma_region_on_cuda(dtype, lbl, device="cuda"):
    """``--sigma-compile router``: upstream's top-k routing and Sigma's statistics on logits in
    ``dtype`` (bf16 where ``--moe-router-dtype`` is not fp32): the gates, the routing map, the
    loss term, the statistics added into the accumulator, the logits' gradient (from the gates
    and, weighted to be seen beside it, from the loss)."""
    from megatron_ext.sigma.router import compiled_routing

    n, e, k = TOKENS, 96, 8
    g = torch.Generator().manual_seed(2)
    logits = separated_logits(n, e, device, dtype, seed=3)
    prev_f = (torch.rand(e, generator=g) * 2 * k / e).to(device)
    prev_fhat = torch.rand(e, generator=g).to(device) / e
    prev_pbar = torch.rand(1, generator=g).to(device)
    grad_probs = torch.randn(n, e, generator=g).to(device, dtype)
    options = dict(topk=k, pre_softmax=True, num_groups=None, group_topk=None,
                   scaling_factor=None, score_function="softmax", lbl=lbl, coeff=1.0,
                   temperature=0.7, scale=1.0 / n)

    def run(f, leaves):
        acc = torch.zeros(3 * e + 2, device=device)
        probs, routing_map, loss = f(leaves[0], acc, prev_f, prev_fhat, prev_pbar, **options)
        # The loss term is scaled by 1/n: weighted by n, its gradient is as large as the gates'.
        torch.autograd.backward([probs, loss], [grad_probs, torch.tensor(float(n), device=device)])
        return [probs, routing_map, loss, acc, leaves[0].grad]

    compare(["probs", "routing_map", "loss", "acc", "logits.grad"],
            eager_and_compiled(compiled_routing, [logits], run), TOLERANCE[dtype], lbl)


@pytest.mark.parametrize("dtype,variant,table_dtype", [
    (dtype, variant, None) for dtype in (torch.bfloat16, torch.float32)
    for variant in ("up", "gate", "dagger")] + [(torch.bfloat16, "up", torch.float32)],
    ids=["bf16-up", "bf16-gate", "bf16-dagger", "fp32-up", "fp32-gate", "fp32-dagger",
         "bf16-up-fp32-table"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stem_region_on_cuda(dtype, variant, table_dtype, device="cuda"):
    """``--stem-compile gate``: each variant's product of ``linear_fc1``'s output (``dtype``) and
    the gathered rows, in ``dtype`` or (managed tables) fp32 rows cast to ``dtype`` in the
    region: the product and both gradients."""
    from megatron_ext.stem.mlp import gate_product

    d_ff = 5632
    g = torch.Generator().manual_seed(4)
    fc1 = torch.randn(2048, 2, d_ff * (2 if variant == "dagger" else 1), generator=g)
    rows = torch.randn(2048, 2, d_ff, generator=g) * 0.1
    grad = torch.randn(2048, 2, d_ff, generator=g).to(device, dtype)
    fc1, rows = fc1.to(device, dtype), rows.to(device, table_dtype or dtype)
    cast = dtype if table_dtype is not None else None

    def run(f, leaves):
        out = f(leaves[0], leaves[1], variant, F.silu, cast)
        out.backward(grad)
        return [out, leaves[0].grad, leaves[1].grad]

    compare(["out", "fc1.grad", "rows.grad"],
            eager_and_compiled(gate_product, [fc1, rows], run), TOLERANCE[dtype], variant)
