"""Layer selection (the paper's rule), STEM config validation, and the per-layer spec list."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.config import StemConfig, parse_layers, select_stem_layers

# Written out by hand from the rule: 1/3 -> (i+1) % 3 == 0, 1/2 -> (i+1) % 2 == 0, full -> i >= 1.
EXPECTED = {
    (8, "1/3"): [2, 5],
    (8, "1/2"): [1, 3, 5, 7],
    (8, "full"): [1, 2, 3, 4, 5, 6, 7],
    (12, "1/3"): [2, 5, 8, 11],
    (12, "1/2"): [1, 3, 5, 7, 9, 11],
    (12, "full"): list(range(1, 12)),
    (16, "1/3"): [2, 5, 8, 11, 14],
    (16, "1/2"): [1, 3, 5, 7, 9, 11, 13, 15],
    (16, "full"): list(range(1, 16)),
    (24, "1/3"): [2, 5, 8, 11, 14, 17, 20, 23],
    (24, "1/2"): [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23],
    (24, "full"): list(range(1, 24)),
}


@pytest.mark.parametrize("num_layers,ratio", sorted(EXPECTED))
def test_ratio_selection(num_layers, ratio):
    layers = select_stem_layers(num_layers, ratio)
    assert layers == EXPECTED[(num_layers, ratio)]
    assert 0 not in layers


def test_explicit_list_wins_over_ratio():
    cfg = StemConfig(ratio="full", layers=[5, 2, 8])
    assert cfg.stem_layers(12) == [2, 5, 8]


def test_parse_layers():
    assert parse_layers("2,5,8") == [2, 5, 8]
    with pytest.raises(ValueError, match="--stem-layers"):
        parse_layers("2,x")


@pytest.mark.parametrize("kwargs,match", [
    (dict(layers=[0, 3]), "layer 0 is never"),
    (dict(layers=[3, 3]), "repeated"),
    (dict(layers=[]), "empty"),
    (dict(ratio="1/4"), "--stem-ratio"),
    (dict(variant="down"), "--stem-variant"),
    (dict(init="xavier"), "--stem-init"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StemConfig(**kwargs)


def test_layer_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range.*1..7"):
        StemConfig(layers=[2, 8]).stem_layers(8)


@pytest.mark.parametrize("ratio", ["1/3", "1/2", "full"])
def test_spec_list_places_stem_layers(mcore_single_rank, ratio):
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.mlp import StemMLP
    from megatron_ext.stem.specs import decoder_block_spec

    config = TransformerConfig(num_layers=8, hidden_size=32, ffn_hidden_size=64,
                               num_attention_heads=4, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               normalization="RMSNorm", use_cpu_initialization=True)
    stem = StemConfig(ratio=ratio)
    model = TokenIdsGPTModel(config=config,
                             transformer_layer_spec=decoder_block_spec(config, stem, 128, False),
                             vocab_size=128, max_sequence_length=16,
                             position_embedding_type="rope")
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    stem_ids = [i for i, k in enumerate(kinds) if k is StemMLP]
    assert stem_ids == EXPECTED[(8, ratio)]
    assert all(k is MLP for i, k in enumerate(kinds) if i not in stem_ids)

    tokens = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    out = model(tokens, pos, None)
    assert out.shape[:2] == (2, 16)
    bad = tokens.clone()
    bad[1, 3] = 128
    with pytest.raises(ValueError, match="outside the STEM tables"):
        model(bad, pos, None)
