"""StructMoE on the hybrid path in one process (``structmoe/family.py`` ``hybrid_stack_spec``):
every ``-`` is an ``MLPLayer`` with a StructMoE MLP, ``*-`` repeated is the GPT path's model (the
same parameters, DeepNorm's depth included, and the same logits), and the router metrics are
recorded per MLP block as on the GPT path. On the hybrid path ``config.num_layers`` counts every
symbol (8 for ``*-*-*-*-``) and the layer numbers are pattern positions; both would halve
DeepNorm's standard deviation and spread the metrics over 8 slots, half of them zero."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

PATTERN = "*-*-*-*-"  # 4 MLP blocks at positions 1, 3, 5, 7
BLOCKS, VOCAB, SEQ, BATCH = 4, 128, 16, 2
H, FF, EXPERTS = 32, 64, 4
MASK = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()  # causal (True: masked)


def _args(pattern=PATTERN):
    return SimpleNamespace(
        hybrid_layer_pattern=pattern, num_layers=8, structmoe_num_experts=EXPERTS,
        structmoe_rank=4, structmoe_topk=2, structmoe_fusion="additive",
        structmoe_param_matched=None, structmoe_ffn_hidden_size=None, structmoe_init="small",
        structmoe_backend="reference", structmoe_aux_loss_coeff=0.01)


def _config(num_layers, hybrid):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # As Megatron's arguments make it (argument_utils.py: is_hybrid_model on the hybrid path).
    return TransformerConfig(num_layers=num_layers, hidden_size=H, ffn_hidden_size=FF,
                             num_attention_heads=4, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False,
                             normalization="RMSNorm", use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, is_hybrid_model=hybrid)


def _hybrid(seed=0):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_ext.models.registry import get_family

    config = _config(2 * BLOCKS, hybrid=True)
    spec = get_family("structmoe").hybrid_stack_spec(_args(), config, False)
    torch.manual_seed(seed)
    return HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=VOCAB,
                       max_sequence_length=SEQ, hybrid_layer_pattern=PATTERN,
                       position_embedding_type="rope")


def _gpt(seed=0):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.models.registry import get_family

    config = _config(BLOCKS, hybrid=False)
    spec = get_family("structmoe").block_spec(_args(None), config, False)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def _inputs():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def _smoe_mlps(model):
    from megatron_ext.structmoe.mlp import StructMoEMLP

    return [m for m in model.modules() if isinstance(m, StructMoEMLP)]


def test_every_mlp_symbol_is_a_structmoe_mlp_layer(mcore_single_rank):
    from megatron.core.ssm.mlp_layer import MLPLayer

    model = _hybrid()
    layers = model.decoder.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["IdentityOp", "StructMoEMLP"] * 4
    assert all(type(layers[i]) is MLPLayer for i in (1, 3, 5, 7))
    assert [layers[i].layer_number for i in (1, 3, 5, 7)] == [2, 4, 6, 8]  # pattern positions
    mlps = _smoe_mlps(model)
    assert [m.layer_number for m in mlps] == [1, 2, 3, 4]  # MLP blocks
    assert {m.num_mlp_blocks for m in mlps} == {BLOCKS}


def test_deepnorm_counts_mlp_blocks_not_pattern_symbols(mcore_single_rank):
    """W2' ~ N(0, (2 / (N sqrt(D')))^2) with N = 4 MLP blocks (Sec. 3.6), not the 8 symbols."""
    for mlp in _smoe_mlps(_hybrid()):
        ffn = mlp.budget.ffn
        std = mlp.linear_fc2.weight.std().item()
        expected = 2.0 / (BLOCKS * math.sqrt(ffn))
        # H x D' = 32 x 49 draws: the sample std is within a few percent; 8 would halve it.
        assert std == pytest.approx(expected, rel=0.1), (std, expected)


def test_star_dash_repeated_is_the_gpt_path(mcore_single_rank):
    """Same seed, same draws in the same order: the same parameters and the same logits."""
    hybrid, gpt = _hybrid(), _gpt()
    hybrid_params = [p for _, p in hybrid.named_parameters()]
    gpt_params = [p for _, p in gpt.named_parameters()]
    assert len(hybrid_params) == len(gpt_params)
    for (name, p), q in zip(hybrid.named_parameters(), gpt_params):
        assert torch.equal(p, q), name
    tokens, pos = _inputs()
    torch.testing.assert_close(hybrid(tokens, pos, MASK), gpt(tokens, pos, MASK),
                               rtol=0, atol=0)


def test_router_metrics_are_recorded_per_mlp_block_as_on_the_gpt_path(mcore_single_rank):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.structmoe.balance import tracked_names

    tracker = get_moe_metrics_tracker()
    recorded = {}
    tokens, pos = _inputs()
    for path, model in (("gpt", _gpt()), ("hybrid", _hybrid())):
        for name in tracked_names(EXPERTS):  # entries keep their size from the first record
            tracker.metrics.pop(name, None)
        model.train()
        model(tokens, pos, MASK)  # training forward with autograd: the MLPs record
        recorded[path] = {n: tracker.metrics[n].values.clone() for n in tracked_names(EXPERTS)}
        tracker.clear()
    for name, values in recorded["hybrid"].items():
        assert values.shape == (BLOCKS,), name
        torch.testing.assert_close(values, recorded["gpt"][name], rtol=0, atol=0, msg=name)
    assert bool((recorded["hybrid"]["load_balancing_loss"] > 0.5).all())  # every block recorded
