"""Sigma options, sparsification schedule, presets and the parameter counts printed at build time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def cfg(**kw):
    from megatron_ext.sigma.config import SigmaConfig

    base = dict(num_layers=8, num_experts=16, topk=1)
    base.update(kw)
    return SigmaConfig(**base)


def test_parse_schedule_and_switch_point():
    from megatron_ext.sigma.config import parse_sparsify_at, parse_topk_schedule

    assert parse_topk_schedule("[8,8,6,6,4,4,2,2]") == (8, 8, 6, 6, 4, 4, 2, 2)
    assert parse_topk_schedule("4, 2") == (4, 2)
    assert parse_topk_schedule(None) is None
    assert parse_sparsify_at("0.9") == 0.9 and isinstance(parse_sparsify_at("0.9"), float)
    assert parse_sparsify_at("1000") == 1000 and isinstance(parse_sparsify_at("1000"), int)
    for bad in ("[8,a]", "[]", "[1.5]"):
        with pytest.raises(ValueError, match="--sigma-topk-schedule"):
            parse_topk_schedule(bad)
    for bad in ("1.5", "-3", "x", "0.0"):
        with pytest.raises(ValueError, match="--sigma-sparsify-at"):
            parse_sparsify_at(bad)


def test_topk_before_and_after_the_switch():
    c = cfg(topk_schedule=(8, 8, 6, 6, 4, 4, 2, 2), sparsify_at=0.9, num_layers=10)
    assert c.switch_iteration(100) == 90
    assert list(c.topks_at(0, 100)) == [8, 8, 6, 6, 4, 4, 2, 2, 1, 1]
    assert list(c.topks_at(89, 100)) == [8, 8, 6, 6, 4, 4, 2, 2, 1, 1]  # step 90: still initial
    assert list(c.topks_at(90, 100)) == [1] * 10  # step 91: target
    step = cfg(topk_schedule=(2,), sparsify_at=3)
    assert list(step.topks_at(2, None))[:2] == [2, 1] and list(step.topks_at(3, None)) == [1] * 8
    assert list(cfg().topks_at(0, 10)) == [1] * 8
    with pytest.raises(ValueError, match="needs --train-iters"):
        cfg(topk_schedule=(2,), sparsify_at=0.5).switch_iteration(None)


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts=6, ep_size=4), "--num-experts=6 is not divisible by "
                                     "--expert-model-parallel-size=4"),
    (dict(topk=17), r"--moe-router-topk=17: must be in 1..16"),
    (dict(topk_schedule=(2,) * 9, sparsify_at=0.5), "9 entries but the model has 8 layers"),
    (dict(topk_schedule=(32,), sparsify_at=0.5), r"entry 0 \(layer 0\) is 32: must be in 1..16"),
    (dict(topk_schedule=(2,)), "needs --sigma-sparsify-at"),
    (dict(sparsify_at=5), "nothing to switch"),
    (dict(lbl="aux"), "--sigma-lbl='aux'"),
    (dict(lbl_coeff=-1.0), "--sigma-lbl-coeff=-1.0"),
    (dict(top1_temperature=0.0), "--sigma-top1-lbl-temperature=0.0"),
])
def test_bad_layouts_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_preset_expansion_and_family_flags(tmp_path):
    from megatron_ext.training.presets import expand_argv, load_preset

    argv = expand_argv(["--sigma-preset", "sigma_cpu", "--num-layers", "6"])
    assert argv.index("--num-layers") < len(argv) - 1
    # preset flags first, the explicit one later (argparse keeps the last value)
    positions = [i for i, a in enumerate(argv) if a == "--num-layers"]
    assert [argv[i + 1] for i in positions] == ["4", "6"]
    for flag in ("--moe-router-pre-softmax", "--qk-layernorm", "--moe-router-dtype"):
        assert flag in argv
    assert load_preset("sigma_moe_tiny")["num-experts"] == 96
    # explicit values are kept, not duplicated
    argv = expand_argv(["--model-family", "sigma", "--moe-router-dtype", "fp64"])
    assert argv.count("--moe-router-dtype") == 1
    assert expand_argv(["--num-layers", "2"]) == ["--num-layers", "2"]  # other families untouched
    with pytest.raises(ValueError, match="no such preset"):
        expand_argv(["--sigma-preset", "nope"])


def test_sigma_moe_tiny_counts_match_the_report():
    """Table 1: 20B total / 0.5B activated; Table 3: 0.65B activated before the switch. The report
    does not give the vocabulary: with a 150k vocabulary (untied) the total is ~19.8B."""
    from megatron_ext.sigma.budget import SigmaBudget
    from megatron_ext.sigma.config import SigmaConfig, parse_topk_schedule
    from megatron_ext.training.presets import load_preset

    p = load_preset("sigma_moe_tiny")
    b = SigmaBudget(p["num-layers"], p["hidden-size"], p["num-attention-heads"],
                    p["num-query-groups"], p["hidden-size"] // p["num-attention-heads"],
                    p["num-experts"], p["moe-ffn-hidden-size"], vocab=150_000,
                    tied_embeddings=False)
    s = SigmaConfig(num_layers=56, num_experts=96, topk=1,
                    topk_schedule=parse_topk_schedule(p["sigma-topk-schedule"]), sparsify_at=0.9)
    assert 19.0e9 < b.non_embedding < 19.6e9 and 19.5e9 < b.total < 20.5e9
    assert 0.50e9 < b.active(s.target_topks()) < 0.55e9
    assert 0.63e9 < b.active(s.initial_topks()) < 0.67e9


def test_counts_equal_the_parameters_of_a_built_model(mcore_single_rank):
    """Total = parameters of a built GPT model with Sigma layers; active = everything but experts
    plus k_l / N_E of layer l's experts, counted from the modules."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sigma.budget import SigmaBudget
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec

    sigma = SigmaConfig(num_layers=3, num_experts=4, topk=1, topk_schedule=(3, 2),
                        sparsify_at=5)
    for tied in (True, False):
        config = TransformerConfig(
            num_layers=3, hidden_size=24, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=48, num_moe_experts=4, moe_ffn_hidden_size=10, moe_router_topk=1,
            moe_router_pre_softmax=True, moe_router_dtype="fp32", qk_layernorm=True,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, use_cpu_initialization=True,
            moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall")
        model = GPTModel(config=config, transformer_layer_spec=sigma_block_spec(config, sigma,
                                                                                False),
                         vocab_size=50, max_sequence_length=16, position_embedding_type="rope",
                         share_embeddings_and_output_weights=tied)
        budget = SigmaBudget.from_config(config, 50, tied=tied)
        counted = sum(p.numel() for p in model.parameters())
        assert budget.total == counted
        embedding = sum(p.numel() for n, p in model.named_parameters()
                        if n.startswith(("embedding.", "output_layer.")))
        assert budget.non_embedding == counted - embedding
        expert_per_layer = {}
        for n, p in model.named_parameters():
            if ".experts." in n:
                layer = int(n.split("decoder.layers.")[1].split(".")[0])
                expert_per_layer[layer] = expert_per_layer.get(layer, 0) + p.numel()
        for topks in (sigma.initial_topks(), sigma.target_topks()):
            active = counted - embedding - sum(expert_per_layer.values()) + sum(
                expert_per_layer[l] * k // 4 for l, k in enumerate(topks))
            assert budget.active(topks) == active
        assert [m.topk for m in model.modules() if hasattr(m, "layer_index")
                and hasattr(m, "set_topk") and not hasattr(m, "sigma_acc")] == [3, 2, 1]
    assert torch.is_tensor(model.decoder.layers[0].mlp.router.sigma_prev_f)
