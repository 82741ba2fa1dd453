"""Layer specs: the per-layer MLP choice happens here, when the spec list is built.

Builds on ``megatron.core.models.gpt.gpt_layer_specs``: the dense layer spec is upstream's (local or
Transformer Engine); a STEM layer is the same spec with ``TokenContextTransformerLayer`` as the
module and ``StemMLP`` as the MLP, built from the same fc1/fc2 builders. The list is sliced for
this pipeline stage exactly as upstream's ``get_gpt_decoder_block_spec`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, List, Optional, Sequence

from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_ext.models.layer import TokenContextTransformerLayer
from megatron_ext.models.norm import SequenceParallelTorchNorm
from megatron_ext.sigma.layer import SigmaMoELayer
from megatron_ext.sigma.router import SigmaRouter
from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.mlp import StemMLP
from megatron_ext.structmoe.mlp import StructMoEMLP

try:
    from megatron.core.extensions.transformer_engine import TENorm

    HAVE_TE = True
except ImportError:  # pragma: no cover - depends on the installation
    TENorm = None
    HAVE_TE = False


def te_available() -> bool:
    """Transformer Engine is importable (its extension module needs CUDA to load)."""
    if not HAVE_TE:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _swap_norm(spec, new):
    """Replace Megatron's torch-norm wrapper (which refuses sequence parallelism) by ``new``."""
    return new if spec is WrappedTorchNorm else spec


def dense_layer_spec(use_te: bool, qk_layernorm: bool = False,
                     num_experts: Optional[int] = None,
                     moe_grouped_gemm: bool = False) -> ModuleSpec:
    """Upstream's GPT layer spec (dense, or upstream's MoE layer when ``num_experts`` is given);
    the local one with sequence-parallel-capable torch norms."""
    moe = dict(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm) if num_experts else {}
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **moe)
    sub = spec.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        q_layernorm=_swap_norm(attn.submodules.q_layernorm, SequenceParallelTorchNorm),
        k_layernorm=_swap_norm(attn.submodules.k_layernorm, SequenceParallelTorchNorm),
    )
    new_sub = dataclasses.replace(
        sub,
        input_layernorm=_swap_norm(sub.input_layernorm, SequenceParallelTorchNorm),
        pre_mlp_layernorm=_swap_norm(sub.pre_mlp_layernorm, SequenceParallelTorchNorm),
        self_attention=ModuleSpec(module=attn.module, params=dict(attn.params),
                                  submodules=attn_sub),
    )
    return ModuleSpec(module=spec.module, params=dict(spec.params), submodules=new_sub)


def final_norm_impl(use_te: bool):
    if use_te:
        return TENorm
    return _swap_norm(LNImpl, SequenceParallelTorchNorm)


def _mlp_submodules(layer_spec: ModuleSpec) -> MLPSubmodules:
    mlp = layer_spec.submodules.mlp
    submodules = getattr(mlp, "keywords", {}).get("submodules") if isinstance(
        mlp, functools.partial) else getattr(mlp, "submodules", None)
    if not isinstance(submodules, MLPSubmodules):
        raise TypeError(f"cannot derive fc1/fc2 builders from the dense MLP spec {mlp!r}")
    return submodules


def with_mlp(dense: ModuleSpec, mlp_builder, layer_module=None, **builder_kwargs) -> ModuleSpec:
    """The dense layer spec with its MLP built by ``mlp_builder`` (an ``as_mlp_submodule``
    classmethod) from the dense MLP's own fc1/fc2 builders (local or Transformer Engine)."""
    mlp_sub = _mlp_submodules(dense)
    submodules = dataclasses.replace(
        copy.deepcopy(dense.submodules),
        mlp=functools.partial(
            mlp_builder,
            submodules=MLPSubmodules(linear_fc1=mlp_sub.linear_fc1,
                                     linear_fc2=mlp_sub.linear_fc2),
            **builder_kwargs,
        ),
    )
    return ModuleSpec(module=layer_module or dense.module, params=dict(dense.params),
                      submodules=submodules)


def stem_layer_spec(dense: ModuleSpec, stem: StemConfig, vocab_size: int) -> ModuleSpec:
    """A STEM layer: the layer that hands token ids to its MLP, with a STEM MLP."""
    return with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextTransformerLayer, stem=stem,
                    vocab_size=vocab_size)


def structmoe_layer_spec(dense: ModuleSpec, structmoe, mlp_block: Optional[int] = None,
                         num_mlp_blocks: Optional[int] = None) -> ModuleSpec:
    """A StructMoE layer: the dense layer (or the hybrid path's ``MLPLayer``) with a StructMoE MLP;
    ``mlp_block`` and ``num_mlp_blocks`` where the layers are not the MLP blocks (the hybrid path)."""
    return with_mlp(dense, StructMoEMLP.as_mlp_submodule, structmoe=structmoe,
                    mlp_block=mlp_block, num_mlp_blocks=num_mlp_blocks)


def sigma_layer_spec(moe_spec: ModuleSpec, sigma, layer_index: int) -> ModuleSpec:
    """A Sigma layer: upstream's MoE layer spec (experts, dispatchers) with ``SigmaMoELayer`` (a
    top-k per layer) and ``SigmaRouter`` (global-batch / Top-1 load balancing)."""
    mlp = moe_spec.submodules.mlp
    moe_sub = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else None
    if not isinstance(moe_sub, MoESubmodules):
        raise TypeError(f"cannot derive the experts builder from the MoE spec {mlp!r}")
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


LayerFn = Callable[[int, ModuleSpec], ModuleSpec]


def stem_layers_fn(config: TransformerConfig, stem: StemConfig, vocab_size: int) -> LayerFn:
    """STEM where ``stem`` selects the layer, dense elsewhere."""
    stem_ids = set(stem.stem_layers(config.num_layers))
    return lambda i, dense: (stem_layer_spec(dense, stem, vocab_size) if i in stem_ids
                             else copy.deepcopy(dense))


def structmoe_layers_fn(structmoe) -> LayerFn:
    """StructMoE in every layer (the paper augments each MLP)."""
    return lambda i, dense: structmoe_layer_spec(dense, structmoe)


def decoder_layer_specs(config: TransformerConfig, use_te: bool,
                        layer_fn: Optional[LayerFn] = None) -> List[ModuleSpec]:
    """One spec per global layer, chosen by ``layer_fn(layer_index, dense_spec)``."""
    dense = dense_layer_spec(use_te, qk_layernorm=config.qk_layernorm)
    return [layer_fn(i, dense) if layer_fn is not None else copy.deepcopy(dense)
            for i in range(config.num_layers)]


def slice_for_stage(config: TransformerConfig, layer_specs: Sequence[ModuleSpec],
                    vp_stage: Optional[int] = None,
                    pp_rank: Optional[int] = None) -> List[ModuleSpec]:
    """The layers of this pipeline (and virtual pipeline) stage, as upstream slices them."""
    if config.pipeline_model_parallel_layout is not None:
        layout = config.pipeline_model_parallel_layout
        assert isinstance(layout, PipelineParallelLayerLayout)
        return [layer_specs[i] for i in layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)]
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(layer_specs[offset:offset + n])


def block_spec(config: TransformerConfig, use_te: bool, layer_fn: Optional[LayerFn] = None,
               vp_stage: Optional[int] = None,
               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    layer_specs = decoder_layer_specs(config, use_te, layer_fn)
    return TransformerBlockSubmodules(
        layer_specs=slice_for_stage(config, layer_specs, vp_stage, pp_rank),
        layer_norm=final_norm_impl(use_te),
    )


def decoder_block_spec(config: TransformerConfig, stem: Optional[StemConfig], vocab_size: int,
                       use_te: bool, vp_stage: Optional[int] = None,
                       pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """Dense (``stem=None``) or STEM block spec."""
    layer_fn = stem_layers_fn(config, stem, vocab_size) if stem is not None else None
    return block_spec(config, use_te, layer_fn, vp_stage, pp_rank)


def stage_has_token_layers(block_spec: TransformerBlockSubmodules) -> bool:
    return any(spec.module is TokenContextTransformerLayer for spec in block_spec.layer_specs)
