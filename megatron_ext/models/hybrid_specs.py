"""Stack specs of the hybrid path (``models/hybrid.py``), built from the same layer specs as the
GPT path (``models/specs.py``).

A GPT layer is an attention half and an MLP half; on the hybrid path they are two layers of the
pattern, ``*`` (attention: ``input_layernorm``, self-attention) and ``-`` (``MLPLayer``:
``pre_mlp_layernorm``, MLP) or ``E`` (``MoETransformerLayer``: ``pre_mlp_layernorm``, upstream's
``MoELayer``), so ``*-`` (``*E``) repeated n times is the same computation as an n-layer dense
(MoE) GPT model. With Transformer Engine the slots are upstream's (``hybrid_layer_specs.py``,
norms fused into the linear layers); without it (the CPU), they are cut from upstream's local GPT
layer spec (dense, or with ``num_experts`` for ``E``), since upstream's hybrid stack spec exists
for Transformer Engine only.

A family's MLP choice counts the ``-`` symbols: the i-th MLP block of the model is the i-th
``-`` of the pattern (``mlp_layer_indices``), whatever sits between them; its MoE choice counts
the ``E`` symbols the same way (``moe_layer_indices``): the k-th MoE block is the k-th ``E``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Optional

from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as te_stack_spec
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import MoETransformerLayer

from megatron_ext.models.hybrid import TokenHybridStackSubmodules, TokenIdsHybridStack, layer_choice
from megatron_ext.models.hybrid_pattern import mlp_layer_indices, moe_layer_indices
from megatron_ext.models.specs import dense_layer_spec, final_norm_impl

# (mlp_index, dense MLP layer spec) -> the spec of that MLP layer
MLPLayerFn = Callable[[int, ModuleSpec], ModuleSpec]
# (moe_index, upstream's MoE layer spec) -> the spec of that MoE layer (``E``)
MoELayerFn = Callable[[int, ModuleSpec], ModuleSpec]


def _moe_spec(use_te: bool, config: TransformerConfig) -> ModuleSpec:
    """The GPT path's MoE layer spec (``models/specs.py``, upstream's GPT layer spec with
    ``num_experts``), the one an ``E`` slot is cut from."""
    return dense_layer_spec(use_te, qk_layernorm=config.qk_layernorm,
                            num_experts=config.num_moe_experts,
                            moe_grouped_gemm=bool(config.moe_grouped_gemm))


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
    moe = None
    if config.num_moe_experts:
        # Upstream's E layer (hybrid_layer_specs.py: MoETransformerLayer, pre-MLP norm, MoE),
        # its norm and MoE cut from the GPT path's local MoE layer spec.
        moe = ModuleSpec(module=MoETransformerLayer, submodules=dataclasses.replace(
            copy.deepcopy(_moe_spec(False, config).submodules), input_layernorm=IdentityOp,
            self_attention=IdentityOp, self_attn_bda=IdentityFuncOp))
    return attention, mlp, moe


def _te_slots(config: TransformerConfig):
    if config.qk_layernorm:
        raise ValueError("--qk-layernorm: not on the hybrid path with Transformer Engine yet")
    sub = te_stack_spec.submodules
    moe = None
    if config.num_moe_experts:
        # Upstream's E slot; its MoE built for the config's --moe-grouped-gemm as on the GPT
        # path (upstream's slot fixes grouped GEMM on).
        moe = copy.deepcopy(sub.moe_layer)
        moe.submodules = dataclasses.replace(moe.submodules,
                                             mlp=_moe_spec(True, config).submodules.mlp)
    return copy.deepcopy(sub.attention_layer), copy.deepcopy(sub.mlp_layer), moe


def _choices(indices: List[int], default: ModuleSpec, fn) -> Dict[int, ModuleSpec]:
    by_index: Dict[int, ModuleSpec] = {}
    if fn is not None:
        for k, index in enumerate(indices):
            spec = fn(k, default)
            if spec is not default:
                by_index[index] = spec
    return by_index


def hybrid_stack_spec(config: TransformerConfig, pattern: str, use_te: bool,
                      mlp_fn: Optional[MLPLayerFn] = None,
                      moe_fn: Optional[MoELayerFn] = None) -> ModuleSpec:
    """The stack spec: upstream's layer slots (local or Transformer Engine), the ``k``-th ``-``
    built from ``mlp_fn(k, dense_mlp_spec)`` and the ``k``-th ``E`` from
    ``moe_fn(k, moe_layer_spec)`` where those differ from the slot's default."""
    attention, mlp, moe = _te_slots(config) if use_te else _local_slots(config)
    moe_indices = moe_layer_indices(pattern)
    if moe_indices and moe is None:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has MoE layers (E): they need "
                         "--num-experts")
    submodules = TokenHybridStackSubmodules(
        attention_layer=attention,
        mlp_layer=layer_choice(mlp, _choices(mlp_layer_indices(pattern), mlp, mlp_fn)),
        final_norm=final_norm_impl(use_te))
    if moe is not None:
        submodules.moe_layer = layer_choice(moe, _choices(moe_indices, moe, moe_fn))
    return ModuleSpec(module=TokenIdsHybridStack, submodules=submodules)
