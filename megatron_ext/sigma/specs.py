"""Sigma's layer specs (``models/specs.py`` holds the generic pieces): upstream's MoE layer spec
(experts, dispatchers) with ``SigmaMoELayer`` and ``SigmaRouter``, in every layer."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models.specs import (dense_layer_spec, final_norm_impl, moe_submodules,
                                       slice_for_stage)
from megatron_ext.sigma.layer import SigmaMoELayer
from megatron_ext.sigma.router import SigmaRouter


def sigma_layer_spec(moe_spec: ModuleSpec, sigma, layer_index: int) -> ModuleSpec:
    """A Sigma layer: upstream's MoE layer spec (experts, dispatchers) with ``SigmaMoELayer`` (a
    top-k per layer) and ``SigmaRouter`` (global-batch / Top-1 load balancing)."""
    moe_sub = moe_submodules(moe_spec.submodules.mlp)
    submodules = dataclasses.replace(
        copy.deepcopy(moe_spec.submodules),
        mlp=functools.partial(
            SigmaMoELayer,
            submodules=dataclasses.replace(moe_sub, shared_experts=None,
                                           router=functools.partial(SigmaRouter, sigma=sigma)),
            sigma=sigma, layer_index=layer_index),
    )
    return ModuleSpec(module=moe_spec.module, params=dict(moe_spec.params), submodules=submodules)


def sigma_block_spec(config: TransformerConfig, sigma, use_te: bool,
                     vp_stage: Optional[int] = None,
                     pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Every layer a Sigma MoE layer (no dense FFN anywhere, as in the report's Sec. 2.1)."""
    moe = dense_layer_spec(use_te, qk_layernorm=config.qk_layernorm,
                           num_experts=config.num_moe_experts,
                           moe_grouped_gemm=bool(config.moe_grouped_gemm))
    layer_specs = [sigma_layer_spec(moe, sigma, i) for i in range(config.num_layers)]
    return TransformerBlockSubmodules(
        layer_specs=slice_for_stage(config, layer_specs, vp_stage, pp_rank),
        layer_norm=final_norm_impl(use_te),
    )
