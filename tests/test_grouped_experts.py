"""The torch grouped experts (``megatron_ext/models/grouped_experts.py``: upstream's TEGroupedMLP
over torch grouped-GEMM linears, what ``--moe-grouped-gemm`` builds without Transformer Engine)
against upstream's ``SequentialMLP`` with the same weights: outputs and every gradient, both GEMM
paths, empty experts; the checkpoint entries; the initialisation's distribution; the runtime
choice of GEMM; the spec selection; the refusals. One process, fp32, CPU.

Trainings (EP=2, TP=2 + SP + EP=2, checkpoints both ways): ``tests/test_parallel_sigma.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.models import grouped_experts as ge


def _config(gated=True, topk=2, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=1, ffn_hidden_size=8,
        num_moe_experts=4, moe_ffn_hidden_size=8, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu, add_bias_linear=False,
        moe_router_topk=topk, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", hidden_dropout=0.0,
        **{"use_cpu_initialization": True, **kw})


def _pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _sequential(cfg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP(cfg.num_moe_experts, cfg, MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=_pg())


def _copy_weights(sequential, grouped):
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            grouped.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            grouped.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)


def _run(experts, x, counts, probs, grad):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out, bias = experts(x, torch.tensor(counts), probs)
    assert bias is None
    (out.sum() if grad is None else (out * grad).sum()).backward()
    return out, x.grad, probs.grad


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("counts,grad", [([3, 0, 5, 2], "random"), ([0, 4, 0, 1], "sum"),
                                         ([0, 0, 0, 0], "random")])
def test_grouped_experts_match_sequential(mcore_single_rank, gemm, gated, counts, grad):
    """Outputs and the gradients of the input, the probabilities and every weight equal
    SequentialMLP's (fp32, same weights), with experts that get no token, and with the
    expanded (stride-0) gradient of ``out.sum()``; a call with no token at all takes the loop
    (torch refuses an empty contraction) and still gives each weight its zero gradient."""
    cfg = _config(gated)
    torch.manual_seed(0)
    sequential = _sequential(cfg)
    grouped = ge.grouped_experts_builder(gemm)(cfg.num_moe_experts, cfg, pg_collection=_pg())
    _copy_weights(sequential, grouped)
    g = torch.Generator().manual_seed(1)
    rows = sum(counts)
    x, probs = torch.randn(rows, 16, generator=g), torch.rand(rows, generator=g)
    dy = torch.randn(rows, 16, generator=g) if grad == "random" else None
    if gemm == "grouped_mm" and rows == 0:
        with pytest.raises(RuntimeError, match="no tokens"):
            _run(grouped, x, counts, probs, dy)
        return
    want = _run(sequential, x, counts, probs, dy)
    got = _run(grouped, x, counts, probs, dy)
    assert grouped.linear_fc1.last_path.startswith(gemm)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for name in ("linear_fc1", "linear_fc2"):
        want_w = torch.stack([getattr(e, name).weight.grad for e in sequential.local_experts])
        torch.testing.assert_close(getattr(grouped, name).weight.grad, want_w, rtol=1e-6,
                                   atol=1e-6)


def test_moe_layer_top2_with_grouped_experts_matches_sequential(mcore_single_rank):
    """A whole MoE layer (router, alltoall dispatcher, top-2) built by the local spec with
    ``moe_grouped_gemm``: our experts; with the sequential layer's weights, the same output and
    gradients (input, router: the probabilities' path, experts)."""
    from megatron_ext.models.specs import dense_layer_spec

    cfg = _config(gated=True, topk=2, moe_grouped_gemm=True)
    layers = {}
    for grouped in (False, True):
        torch.manual_seed(0)
        mlp = dense_layer_spec(False, num_experts=4, moe_grouped_gemm=grouped).submodules.mlp
        layers[grouped] = mlp(config=cfg, pg_collection=_pg(), layer_number=1)
    assert type(layers[True].experts).__name__ == "TEGroupedMLP"
    assert type(layers[False].experts).__name__ == "SequentialMLP"
    with torch.no_grad():
        layers[True].router.weight.copy_(layers[False].router.weight)
    _copy_weights(layers[False].experts, layers[True].experts)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 16, generator=g)
    dy = torch.randn(6, 2, 16, generator=g)
    results = {}
    for grouped, layer in layers.items():
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        (out * dy).sum().backward()
        results[grouped] = (out, xi.grad, layer.router.weight.grad)
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _entries(sharded):
    """``(key, global shape, global offset, replica id, data)`` of every tensor a sharded state
    dict saves (factories built), sorted; ShardedObjects as ``(key, shape, offset, replica)``."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    out = []

    def visit(v):
        if isinstance(v, ShardedTensorFactory):
            visit(v.build())
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit(item)
        elif isinstance(v, ShardedObject):
            out.append((v.key, tuple(v.global_shape), tuple(v.global_offset), v.replica_id,
                        None))
        else:
            out.append((v.key, tuple(v.global_shape), tuple(v.global_offset), v.replica_id,
                        v.data.detach().clone()))
    visit(sharded)
    return sorted(out, key=lambda e: e[:4])


@pytest.mark.parametrize("gated", [True, False])
def test_checkpoint_entries_are_sequential_ones(mcore_single_rank, gated):
    """Inside a TEGroupedMLP, the grouped linears save exactly SequentialMLP's entries (keys,
    global shapes and offsets, replicas, values; the gated fc1's halves as upstream's swiglu
    factory splits them), the optimizer's state tensors split the same way (a factory over
    the stacked parameter), and what the loader hands back merges into the stacked weight."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    cfg = _config(gated)
    torch.manual_seed(0)
    sequential = _sequential(cfg)
    grouped = ge.grouped_experts_builder()(cfg.num_moe_experts, cfg, pg_collection=_pg())
    _copy_weights(sequential, grouped)
    offsets = ((0, 0, 1),)  # a layer axis, as the decoder prepends
    want = _entries(sequential.sharded_state_dict("mlp.experts.", offsets))
    got_sd = grouped.sharded_state_dict("mlp.experts.", offsets)
    got = _entries(got_sd)
    assert [e[:4] for e in got] == [e[:4] for e in want]
    for a, b in zip(got, want):
        assert (a[4] is None) == (b[4] is None) and (a[4] is None or torch.equal(a[4], b[4]))

    fc1 = got_sd["mlp.experts.linear_fc1.weight"]
    assert fc1.data is grouped.linear_fc1.weight  # the optimizer finds it by identity
    state = torch.randn_like(grouped.linear_fc1.weight)
    opt = _entries(make_sharded_optimizer_tensor(fc1, state, "optimizer.state.exp_avg"))
    fc1_want = [e for e in want if e[0].endswith("linear_fc1.weight")]
    assert [e[0] for e in opt] == ["optimizer.state.exp_avg." + e[0] for e in fc1_want]
    assert [e[1:4] for e in opt] == [e[1:4] for e in fc1_want]
    # What the loader hands back: the built structure with each entry's tensor.
    loaded = [[t.data for t in e] if isinstance(e, list) else e.data for e in fc1.build()]
    merged = fc1.merge_fn(loaded)
    assert torch.equal(merged, grouped.linear_fc1.weight)


def test_initialisation_has_sequentials_distribution(mcore_single_rank):
    """Same init method, per expert, as SequentialMLP's linears (CPU initialization from the
    master weight; GPU-style under the expert-parallel RNG): the same spread (not the same
    draws)."""
    for cpu_init in (True, False):
        cfg = _config(True, use_cpu_initialization=cpu_init, init_method_std=0.02)
        sequential = _sequential(cfg)
        grouped = ge.grouped_experts_builder()(cfg.num_moe_experts, cfg, pg_collection=_pg())
        for name in ("linear_fc1", "linear_fc2"):
            want = torch.stack([getattr(e, name).weight for e in sequential.local_experts])
            got = getattr(grouped, name).weight
            assert got.shape == want.shape
            assert not torch.equal(got, torch.zeros_like(got))
            assert abs(got.std().item() / want.std().item() - 1) < 0.15, (cpu_init, name)
            assert abs(got.mean().item()) < 3 * want.std().item() / got.numel() ** 0.5 + 1e-3
        assert grouped.linear_fc1.weight.allreduce is True  # EP=1, expert TP = TP: DP reduce


def _stand_in(dtype=torch.bfloat16, cuda=True):
    return SimpleNamespace(dtype=dtype, is_cuda=cuda, device="cuda:0",
                           element_size=lambda: torch.empty(0, dtype=dtype).element_size())


@pytest.mark.parametrize("dtype,capability,counts,dims,why", [
    (torch.bfloat16, (9, 0), [3, 0, 5], (16, 8), None),
    (torch.float32, (9, 0), [3, 0, 5], (16, 8), "float32 on CUDA"),
    (torch.bfloat16, (8, 0), [3, 1, 5], (16, 8), "sm8x"),
    (torch.bfloat16, (10, 0), [3, 0, 5], (16, 8), "sm100"),
    (torch.bfloat16, (10, 0), [3, 1, 5], (16, 8), None),
    (torch.bfloat16, (9, 0), [3, 1, 5], (12, 8), "not multiples of 16 bytes"),
    (torch.bfloat16, (9, 0), [0, 0, 0], (16, 8), "no tokens"),
])
def test_grouped_mm_is_chosen_where_torchs_kernel_runs(monkeypatch, dtype, capability, counts,
                                                       dims, why):
    """On CUDA: bf16 on sm90, and sm100 without an empty expert; the loop elsewhere, with the
    reason it logs."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    weight = SimpleNamespace(shape=(3, dims[1], dims[0]))
    problem = ge.grouped_mm_problem(_stand_in(dtype), weight, counts)
    assert problem is None if why is None else why in problem


def test_the_path_that_ran_is_said_once(mcore_single_rank, capsys):
    cfg = _config(False)
    experts = ge.grouped_experts_builder()(cfg.num_moe_experts, cfg, pg_collection=_pg())
    ge._say_once.cache_clear()
    for counts in ([2, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]):
        _run(experts, torch.randn(sum(counts), 16), counts, torch.rand(sum(counts)), None)
    lines = [line for line in capsys.readouterr().out.splitlines() if "grouped experts" in line]
    assert lines == ["megatron-ext: grouped experts, fc1: grouped_mm",
                     "megatron-ext: grouped experts, fc2: grouped_mm",
                     "megatron-ext: grouped experts, fc1: loop (no tokens in this call)",
                     "megatron-ext: grouped experts, fc2: loop (no tokens in this call)"]


def test_specs_build_grouped_experts_only_on_the_local_backend_with_the_flag(monkeypatch):
    """The local spec with ``moe_grouped_gemm``: our builder (upstream's would build
    SequentialMLP); without the flag SequentialMLP; with Transformer Engine, upstream's spec
    untouched. Sigma's block spec and the hybrid stack's ``E`` layers come from the same spec."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from megatron_ext.models import specs
    from megatron_ext.models.hybrid_specs import _local_slots
    from megatron_ext.models.specs import dense_layer_spec
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec

    def experts(spec):
        return spec.submodules.mlp.keywords["submodules"].experts

    grouped = experts(dense_layer_spec(False, num_experts=4, moe_grouped_gemm=True))
    assert grouped.func is TEGroupedMLP
    assert grouped.keywords["submodules"].linear_fc1.func is ge.GroupedColumnLinear
    assert grouped.keywords["submodules"].linear_fc2.func is ge.GroupedRowLinear
    assert experts(dense_layer_spec(False, num_experts=4)).func is SequentialMLP
    # With TE: upstream's spec function's result, as it is (TE does not import here).
    upstream = object()
    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: upstream if kw["moe_grouped_gemm"] else None)
    assert dense_layer_spec(True, num_experts=4, moe_grouped_gemm=True) is upstream

    cfg = _config(moe_grouped_gemm=True)
    sigma = SigmaConfig(num_layers=2, num_experts=4, topk=2)
    block = sigma_block_spec(cfg, sigma, use_te=False)
    assert all(experts(s).func is TEGroupedMLP for s in block.layer_specs)
    _, _, moe = _local_slots(cfg)
    assert experts(moe).func is TEGroupedMLP


@pytest.mark.parametrize("flags,named", [
    (dict(fp8="hybrid"), "--fp8-format hybrid"),
    (dict(add_bias_linear=True), "--add-bias-linear"),
    (dict(delay_wgrad_compute=True), "--delay-wgrad-compute"),
    (dict(moe_latent_size=8), "--moe-latent-size 8"),
    (dict(moe_mlp_glu_interleave_size=32), "--moe-mlp-glu-interleave-size 32"),
])
def test_what_they_cannot_do_is_refused_in_one_line(flags, named):
    from megatron_ext.training.preflight import check_grouped_experts

    args = SimpleNamespace(moe_grouped_gemm=True, num_experts=4, transformer_impl="local",
                           **flags)
    with pytest.raises(ValueError) as err:
        check_grouped_experts(args)
    line = str(err.value)
    assert named in line and "\n" not in line and "drop --moe-grouped-gemm" in line
    # With Transformer Engine (upstream's experts) or without the flag: not ours to refuse.
    check_grouped_experts(SimpleNamespace(**{**vars(args), "transformer_impl":
                                             "transformer_engine"}))
    check_grouped_experts(SimpleNamespace(**{**vars(args), "moe_grouped_gemm": False}))
    check_grouped_experts(SimpleNamespace(moe_grouped_gemm=True, num_experts=4,
                                          transformer_impl="local", add_bias_linear=False))


def test_capability_check_passes_on_the_cpu_backend_only_while_validating(mcore_single_rank):
    """Upstream's ``validate_args`` asserts compute capability >= 8 for ``--moe-grouped-gemm``
    (the CPU backend reports (0, 0)); the entry point validates inside
    ``cpu.grouped_gemm_validation``."""
    from megatron_ext.compat import cpu

    assert torch.cuda.get_device_capability() == (0, 0)
    with cpu.grouped_gemm_validation():
        assert torch.cuda.get_device_capability()[0] >= 8
    assert torch.cuda.get_device_capability() == (0, 0)


def test_builder_refuses_an_unknown_gemm():
    with pytest.raises(ValueError, match="gemm='fast'"):
        ge.grouped_experts_builder("fast")



def test_sigma_step_benchmark_builds_and_records_the_experts(mcore_single_rank):
    """``benchmarks/sigma_step.py --moe-grouped-gemm``: both sides' experts grouped, and the
    JSON's ``experts`` says which ran; without the flag (or from a shape without it, as
    ``host_overhead.py`` builds), SequentialMLP."""
    import argparse
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")
    sys.path.insert(0, bench)
    try:
        import sigma_step
        from common import wrap_ddp
    finally:
        sys.path.remove(bench)
    shape = dict(layers=1, hidden=16, heads=2, groups=1, experts=4, expert_ffn=8, topk=1,
                 seq=8, vocab=64)
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    inputs = (tokens, torch.arange(8).unsqueeze(0), torch.roll(tokens, -1, dims=1))
    for flag in (True, False, None):
        args = argparse.Namespace(**shape, **({} if flag is None else {"moe_grouped_gemm": flag}))
        for side in ("upstream", "sigma"):
            model = wrap_ddp(sigma_step.build(args, torch.float32, side))
            sigma_step.step_fn(side, model, *inputs)()
            want = {"class": "TEGroupedMLP", "linear_fc1": "grouped_mm",
                    "linear_fc2": "grouped_mm"} if flag else {"class": "SequentialMLP"}
            assert sigma_step.experts_ran(model) == want, (flag, side)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_grouped_experts_match_sequential(mcore_single_rank):
    """On a GPU, bf16, a Sigma-MoE-Tiny-sized expert (768 of H 1536), 16 experts with skewed
    counts and an empty one: torch's grouped kernel where it runs (sm90; the loop elsewhere, the
    reason named), outputs and gradients within bf16 rounding of SequentialMLP's (each side
    rounds its own GEMMs)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=1536, num_attention_heads=8, ffn_hidden_size=768,
        num_moe_experts=16, moe_ffn_hidden_size=768, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, moe_router_topk=1,
        moe_router_pre_softmax=True, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", hidden_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    sequential = _sequential(cfg).cuda()
    grouped = ge.grouped_experts_builder()(cfg.num_moe_experts, cfg, pg_collection=_pg())
    _copy_weights(sequential, grouped)
    counts = [400, 0, 200, 100, 75, 60, 50, 40, 30, 20, 10, 8, 4, 2, 1, 24]
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = sum(counts)
    x = torch.randn(rows, 1536, generator=g, device="cuda").to(torch.bfloat16)
    probs = torch.rand(rows, generator=g, device="cuda")
    dy = torch.randn(rows, 1536, generator=g, device="cuda").to(torch.bfloat16)
    want = _run(sequential, x, counts, probs, dy)
    got = _run(grouped, x, counts, probs, dy)
    major = torch.cuda.get_device_capability()[0]
    path = grouped.linear_fc1.last_path
    assert path == "grouped_mm" if major == 9 else path.startswith("loop ("), path
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for name in ("linear_fc1", "linear_fc2"):
        want_w = torch.stack([getattr(e, name).weight.grad for e in sequential.local_experts])
        torch.testing.assert_close(getattr(grouped, name).weight.grad.float(), want_w.float(),
                                   rtol=2e-2, atol=2e-2)
