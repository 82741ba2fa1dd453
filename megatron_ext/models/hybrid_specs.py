"""Stack specs of the hybrid path (``models/hybrid.py``), built from the same layer specs as the
GPT path (``models/specs.py``).

A GPT layer is an attention half and an MLP half; on the hybrid path they are two layers of the
pattern, ``*`` (attention: ``input_layernorm``, self-attention) and ``-`` (``MLPLayer``:
``pre_mlp_layernorm``, MLP), so ``*-`` repeated n times is the same computation as an n-layer
GPT model. With Transformer Engine the slots are upstream's (``hybrid_layer_specs.py``, norms
fused into the linear layers); without it (the CPU), they are cut from upstream's local GPT layer
spec, since upstream's hybrid stack spec exists for Transformer Engine only.

A family's MLP choice counts the ``-`` symbols: the i-th MLP block of the model is the i-th
``-`` of the pattern (``mlp_layer_indices``), whatever sits between them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Optional

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as te_stack_spec
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models.hybrid import TokenHybridStackSubmodules, TokenIdsHybridStack, layer_choice
from megatron_ext.models.specs import dense_layer_spec, final_norm_impl

# (mlp_index, dense MLP layer spec) -> the spec of that MLP layer
MLPLayerFn = Callable[[int, ModuleSpec], ModuleSpec]


def main_pattern(pattern: str) -> str:
    """The decoder's layer symbols, pipeline boundaries (``|``) and MTP depths dropped."""
    return (parse_hybrid_pattern(pattern).main_pattern or "").replace(Symbols.PIPE, "")


def mlp_layer_indices(pattern: str) -> List[int]:
    """Global layer index of each ``-`` of the pattern, in order."""
    return [i for i, s in enumerate(main_pattern(pattern)) if s == Symbols.MLP]


def mlp_block_count(args) -> int:
    """The model's MLP blocks, which the families' layer flags (``--stem-layers``) count: the
    ``-`` symbols on the hybrid path, the transformer layers on the GPT path."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    return len(mlp_layer_indices(pattern)) if pattern else args.num_layers


def _local_slots(config: TransformerConfig):
    dense = dense_layer_spec(False, qk_layernorm=config.qk_layernorm)
    sub = dense.submodules
    attention = ModuleSpec(module=dense.module, params=dict(dense.params),
                           submodules=dataclasses.replace(
                               copy.deepcopy(sub), pre_mlp_layernorm=IdentityOp, mlp=IdentityOp,
                               mlp_bda=IdentityFuncOp))
    mlp = ModuleSpec(module=MLPLayer, submodules=dataclasses.replace(
        copy.deepcopy(sub), input_layernorm=IdentityOp, self_attention=IdentityOp,
        self_attn_bda=IdentityFuncOp))
    return attention, mlp


def _te_slots(config: TransformerConfig):
    if config.qk_layernorm:
        raise ValueError("--qk-layernorm: not on the hybrid path with Transformer Engine yet")
    sub = te_stack_spec.submodules
    return copy.deepcopy(sub.attention_layer), copy.deepcopy(sub.mlp_layer)


def hybrid_stack_spec(config: TransformerConfig, pattern: str, use_te: bool,
                      mlp_fn: Optional[MLPLayerFn] = None) -> ModuleSpec:
    """The stack spec: upstream's layer slots (local or Transformer Engine), the ``k``-th ``-``
    built from ``mlp_fn(k, dense_mlp_spec)`` where that differs from the dense one."""
    attention, mlp = _te_slots(config) if use_te else _local_slots(config)
    by_index: Dict[int, ModuleSpec] = {}
    if mlp_fn is not None:
        for k, index in enumerate(mlp_layer_indices(pattern)):
            spec = mlp_fn(k, mlp)
            if spec is not mlp:
                by_index[index] = spec
    return ModuleSpec(module=TokenIdsHybridStack, submodules=TokenHybridStackSubmodules(
        attention_layer=attention, mlp_layer=layer_choice(mlp, by_index),
        final_norm=final_norm_impl(use_te)))
