"""Analytic parameter/FLOP counts (planning/model_shape.py) against built Megatron models, the paper
and Megatron's FLOPs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.stem.config import select_stem_layers
from megatron_ext.stem.mlp import StemMLP
from megatron_ext.planning.model_shape import (
    ModelShape,
    dense_baseline,
    flop_ratio,
    layer_training_flops,
    padded_vocab_size,
    parameter_counts,
    proxy_quality,
    proxy_relative_roi,
    relative_roi,
    stem_flop_saving_per_token,
    training_flops_per_token,
)

L, H, FF, HEADS, V, S = 6, 32, 48, 4, 96, 16


def build_model(ratio=None, variant="up", untie=True, groups=None):
    """A small Megatron GPT (dense when ratio is None) built from the plugin's specs."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.specs import decoder_block_spec

    config = TransformerConfig(
        num_layers=L, hidden_size=H, ffn_hidden_size=FF, num_attention_heads=HEADS,
        num_query_groups=groups, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, normalization="RMSNorm", use_cpu_initialization=True)
    stem = StemConfig(ratio=ratio, variant=variant) if ratio else None
    spec = decoder_block_spec(config, stem, V, use_te=False)
    cls = TokenIdsGPTModel if stem else GPTModel
    return cls(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=S,
               pre_process=True, post_process=True, position_embedding_type="rope",
               share_embeddings_and_output_weights=not untie)


def count_model_parameters(model):
    """Parameters of a built model (or a list of model chunks), each tensor counted once;
    ``stem_tables`` are the ``table`` parameters of the STEM MLPs, ``dense`` the rest."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    seen, total, tables = set(), 0, 0
    for chunk in chunks:
        table_ids = {id(m.table) for m in chunk.modules() if isinstance(m, StemMLP)}
        for param in chunk.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            if id(param) in table_ids:
                tables += param.numel()
    return {"total": total, "stem_tables": tables, "dense": total - tables}


def shape(ratio=None, variant="up", untie=True, groups=None):
    """A STEM model's shape (without STEM layers: its dense baseline)."""
    return ModelShape(family="stem", num_layers=L, hidden=H, ffn=FF, heads=HEADS, vocab=V,
                      seq_length=S, query_groups=groups,
                      stem_layers=select_stem_layers(L, ratio) if ratio else (),
                      stem_variant=variant, untied=untie)


@pytest.mark.parametrize("ratio,variant,untie,groups", [
    (None, "up", True, None),
    (None, "up", False, 2),
    ("1/3", "up", True, None),
    ("1/2", "up", True, None),
    ("full", "up", True, 2),
    ("1/3", "dagger", True, None),
    ("1/3", "gate", False, None),
])
def test_parameter_counts_match_built_model(mcore_single_rank, ratio, variant, untie, groups):
    built = count_model_parameters(build_model(ratio, variant, untie, groups))
    analytic = parameter_counts(shape(ratio, variant, untie, groups))
    assert built == {"total": analytic.total, "stem_tables": analytic.stem_tables,
                     "dense": analytic.dense}
    n_stem = len(select_stem_layers(L, ratio)) if ratio else 0
    assert analytic.stem_tables == n_stem * V * FF


def test_active_parameters():
    dense, stem = parameter_counts(shape()), parameter_counts(shape("1/3"))
    # Dense: everything but the V-1 unused embedding rows.
    assert dense.active_per_token == dense.total - (V - 1) * H
    # A STEM-up layer drops W_up (H*FF) and activates one table row (FF) per token.
    n_stem = len(select_stem_layers(L, "1/3"))
    assert stem.active_per_token == dense.active_per_token - n_stem * (H * FF - FF)
    assert stem.total == dense.total - n_stem * H * FF + n_stem * V * FF


def test_flops_by_hand():
    s = shape()
    flops = training_flops_per_token(s)
    per_layer = 6 * (4 * H * H + 3 * H * FF) + 6 * 2 * S * H
    assert flops.total == L * per_layer + 6 * H * V
    assert flops.forward == pytest.approx(flops.total / 3)
    assert training_flops_per_token(s, causal=True).attention_core == L * 6 * S * H


@pytest.mark.parametrize("ratio,variant", [("1/3", "up"), ("1/2", "up"), ("full", "up"),
                                           ("1/3", "gate"), ("1/3", "dagger")])
def test_stem_saving(ratio, variant):
    s = shape(ratio, variant)
    base = dense_baseline(s)
    saved = training_flops_per_token(base).total - training_flops_per_token(s).total
    n_stem = len(select_stem_layers(L, ratio))
    expected = 0 if variant == "dagger" else 6 * H * FF * n_stem  # Table 1 / Sec. 3.1
    assert saved == stem_flop_saving_per_token(s) == expected
    assert flop_ratio(s, base) == pytest.approx(1 - expected / training_flops_per_token(base).total)


def test_saving_fraction_matches_paper_sec_3_1():
    # Qwen2.5-1.5B layer shape (d=1536, d_ff=8960) at L=4096 with multi-head attention, the
    # paper's 21.7%: d_ff / (4d + 2L + 3 d_ff).
    d, f, seq = 1536, 8960, 4096
    s = ModelShape(family="stem", num_layers=2, hidden=d, ffn=f, heads=12, vocab=151936,
                   seq_length=seq, stem_layers=(1,))
    fraction = 1 - layer_training_flops(s, 1) / layer_training_flops(s, 0)
    assert fraction == pytest.approx(f / (4 * d + 2 * seq + 3 * f))
    assert round(100 * fraction, 1) == 21.7


class _Args(SimpleNamespace):
    """Megatron args: the named fields, None for every other option."""

    def __getattr__(self, name):
        return None


def test_dense_matches_megatron_num_floating_point_operations():
    from megatron.training.training import num_floating_point_operations

    args = _Args(num_layers=L, hidden_size=H, ffn_hidden_size=FF, num_attention_heads=HEADS,
                 num_query_groups=2, group_query_attention=True, kv_channels=H // HEADS,
                 seq_length=S, padded_vocab_size=V, swiglu=True, attention_output_gate=False,
                 multi_latent_attention=False, mtp_num_layers=None, num_experts=None)
    batch = 3
    megatron = num_floating_point_operations(args, batch)
    ours = training_flops_per_token(shape(groups=2), causal=True).total * batch * S
    assert ours == pytest.approx(megatron, rel=1e-12)


def test_roi():
    assert relative_roi(0.5, 2.0, 0.5, 2.0) == 1.0
    # Same quality for 0.9x the FLOPs -> ROI 1/0.9.
    assert relative_roi(0.5, 0.9, 0.5, 1.0) == pytest.approx(1 / 0.9)
    assert proxy_quality(0.0) == 1.0
    assert proxy_relative_roi(3.0, 0.9, 3.0, 1.0) == pytest.approx(1 / 0.9)
    assert proxy_relative_roi(2.9, 1.0, 3.0, 1.0) == pytest.approx(math.exp(0.1))


def test_padded_vocab_and_validation():
    assert padded_vocab_size(8192) == 8192
    assert padded_vocab_size(1000) == 1024
    assert padded_vocab_size(1000, 128, 2) == 1024
    assert padded_vocab_size(1100, 128, 4) == 1536
    with pytest.raises(ValueError, match="stem_layers"):
        ModelShape(family="stem", num_layers=4, hidden=8, ffn=8, heads=2, vocab=16,
                   seq_length=4, stem_layers=(4,))
    with pytest.raises(ValueError, match="stem_variant"):
        ModelShape(family="stem", num_layers=4, hidden=8, ffn=8, heads=2, vocab=16,
                   seq_length=4, stem_variant="down")


@pytest.mark.parametrize("pattern, stem_blocks", [("*-*-*-*-*-*-", (2, 5)),
                                                  ("*-*--*--", (1, 4)), ("*--*-", ())])
def test_hybrid_parameter_counts_match_built_model(mcore_single_rank, pattern, stem_blocks):
    """A HybridModel built from the pattern (upstream's, local layer slots; STEM layers are MLP
    blocks) holds the parameters ModelShape counts from the same pattern, whatever the mix of
    attention and MLP blocks."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models import hybrid_specs
    from megatron_ext.models.hybrid import TokenIdsHybridModel
    from megatron_ext.models.layer import TokenContextMLPLayer
    from megatron_ext.models.specs import with_mlp
    from megatron_ext.stem.config import StemConfig

    config = TransformerConfig(
        num_layers=len(pattern), hidden_size=H, ffn_hidden_size=FF, num_attention_heads=HEADS,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", use_cpu_initialization=True)
    stem = StemConfig(layers=stem_blocks) if stem_blocks else None
    mlp_fn = (lambda k, dense: with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextMLPLayer,
                                        stem=stem, vocab_size=V) if k in stem_blocks else dense)
    spec = hybrid_specs.hybrid_stack_spec(config, pattern, False, mlp_fn if stem else None)
    model = (TokenIdsHybridModel if stem else HybridModel)(
        config=config, hybrid_stack_spec=spec, vocab_size=V, max_sequence_length=S,
        hybrid_layer_pattern=pattern, position_embedding_type="rope")
    blocks = pattern.count("-")
    analytic = parameter_counts(ModelShape(
        family="stem", num_layers=blocks, hidden=H, ffn=FF, heads=HEADS, vocab=V, seq_length=S,
        stem_layers=stem_blocks, hybrid_layer_pattern=pattern))
    assert count_model_parameters(model) == {"total": analytic.total,
                                             "stem_tables": analytic.stem_tables,
                                             "dense": analytic.dense}
    flops = training_flops_per_token(ModelShape(
        family="stem", num_layers=blocks, hidden=H, ffn=FF, heads=HEADS, vocab=V, seq_length=S,
        stem_layers=stem_blocks, hybrid_layer_pattern=pattern))
    attention = pattern.count("*")
    assert flops.total == (attention * (6 * 4 * H * H + 6 * 2 * S * H)
                           + 6 * H * FF * (3 * blocks - len(stem_blocks)) + 6 * H * V)
