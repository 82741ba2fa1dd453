"""STEM's layer specs on the GPT path (``models/specs.py`` holds the generic pieces): a STEM layer
is upstream's dense layer spec with ``TokenContextTransformerLayer`` as the module (it hands the
token ids to its MLP) and ``StemMLP`` as the MLP, built from the same fc1/fc2 builders."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models.layer import TokenContextTransformerLayer
from megatron_ext.models.specs import LayerFn, block_spec, with_mlp
from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.mlp import StemMLP


def stem_layer_spec(dense: ModuleSpec, stem: StemConfig, vocab_size: int,
                    kept_rows: Optional[torch.Tensor] = None) -> ModuleSpec:
    """A STEM layer: the layer that hands token ids to its MLP, with a STEM MLP (``kept_rows``:
    the rows of a managed table this rank draws, None for every row)."""
    return with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextTransformerLayer, stem=stem,
                    vocab_size=vocab_size, kept_rows=kept_rows)


def stem_layers_fn(config: TransformerConfig, stem: StemConfig, vocab_size: int,
                   kept_rows: Optional[torch.Tensor] = None) -> LayerFn:
    """STEM where ``stem`` selects the layer, dense elsewhere."""
    stem_ids = set(stem.stem_layers(config.num_layers))
    return lambda i, dense: (stem_layer_spec(dense, stem, vocab_size, kept_rows)
                             if i in stem_ids else copy.deepcopy(dense))


def decoder_block_spec(config: TransformerConfig, stem: Optional[StemConfig], vocab_size: int,
                       use_te: bool, vp_stage: Optional[int] = None,
                       pp_rank: Optional[int] = None,
                       kept_rows: Optional[torch.Tensor] = None) -> TransformerBlockSubmodules:
    """Dense (``stem=None``) or STEM block spec."""
    layer_fn = stem_layers_fn(config, stem, vocab_size, kept_rows) if stem is not None else None
    return block_spec(config, use_te, layer_fn, vp_stage, pp_rank)
