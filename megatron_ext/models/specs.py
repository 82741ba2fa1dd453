"""Layer specs of the GPT path, the generic pieces: the per-layer MLP choice happens when the spec
list is built (``decoder_layer_specs`` with a family's ``layer_fn``).

Builds on ``megatron.core.models.gpt.gpt_layer_specs``: the dense layer spec is upstream's (local or
Transformer Engine, ``dense_layer_spec``; with ``num_experts`` upstream's MoE layer); a family's
layer is that spec with its own MLP built from the same fc1/fc2 builders (``with_mlp``; the
families' own specs: ``stem/specs.py``, ``structmoe/specs.py``, ``sigma/specs.py``). The list is
sliced for this pipeline stage exactly as upstream's ``get_gpt_decoder_block_spec`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import importlib.util
from typing import Callable, List, Optional, Sequence

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
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

from megatron_ext.models.grouped_experts import grouped_experts_builder
from megatron_ext.models.layer import TokenContextTransformerLayer
from megatron_ext.models.norm import SequenceParallelTorchNorm
from megatron_ext.models.sdpa_attention import SDPAttention

try:
    from megatron.core.extensions.transformer_engine import TENorm

    HAVE_TE = True
except ImportError:  # pragma: no cover - depends on the installation
    TENorm = None
    HAVE_TE = False


@functools.lru_cache(maxsize=None)
def te_problem() -> Optional[str]:
    """Why an installed Transformer Engine cannot be used, in one line (its import error), or
    None: it imports, or it is not installed at all (the local backend's normal case, which goes
    unsaid). A broken install, an ABI mismatch with torch or a missing CUDA library shows up
    here as an ImportError, OSError or RuntimeError that used to select the local backend
    silently, exactly as an absent TE does."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # any failure of an installed TE: named, not told apart
        text = " ".join(str(exc).split()) or "(no message)"
        return f"{type(exc).__name__}: {text}"
    if not HAVE_TE:  # TE imports, but upstream's TE layers (extensions/transformer_engine) do not
        return ("megatron.core.extensions.transformer_engine does not import with this "
                "Transformer Engine (a version Megatron-Core does not support)")
    return None


def te_available() -> bool:
    """Transformer Engine is installed and importable (its extension module needs CUDA to
    load), with Megatron-Core's layers over it."""
    return HAVE_TE and importlib.util.find_spec("transformer_engine") is not None \
        and te_problem() is None


CORE_ATTENTION_CHOICES = ("auto", "sdpa", "unfused")
# The training's --ext-core-attention while its model is built (``core_attention_choice``, set
# by the trainer's model provider around the spec builders); ``auto`` outside a training.
# Module-level because Megatron's spec builders (``get_gpt_layer_local_spec`` and the families'
# specs over them) take no argument for it; a context variable, so it holds only inside the
# model provider's ``with``.
_CORE_ATTENTION: contextvars.ContextVar = contextvars.ContextVar("ext_core_attention",
                                                                default="auto")


@contextlib.contextmanager
def core_attention_choice(choice: Optional[str]):
    """Specs built inside take ``choice`` (``--ext-core-attention``) as their core attention."""
    token = _CORE_ATTENTION.set(choice or "auto")
    try:
        yield
    finally:
        _CORE_ATTENTION.reset(token)


def local_core_attention(choice: Optional[str] = None):
    """The local backend's core attention for ``--ext-core-attention`` (``choice``; None: the
    flag of the training building its model, ``core_attention_choice``; ``auto`` outside one): ``sdpa`` PyTorch's fused attention
    (``sdpa_attention.py``), ``unfused`` upstream's ``DotProductAttention``; ``auto`` the fused one
    on a GPU without Transformer Engine (which cannot fit upstream's [b, heads, s, s] scores at
    long sequences); upstream's beside TE (the local backend asked for by name) and on the CPU
    backend, whose saved tensors ``planning/estimate.py`` itemises for upstream's attention."""
    if choice is None:
        # The training's flag, set around the spec builders (every family's local layer comes
        # through dense_layer_spec); ``auto`` when a spec is built outside a training.
        choice = _CORE_ATTENTION.get()
    if choice not in CORE_ATTENTION_CHOICES:
        raise ValueError(f"--ext-core-attention {choice}: choose one of "
                         f"{', '.join(CORE_ATTENTION_CHOICES)}")
    if choice == "auto":
        choice = "sdpa" if torch.cuda.is_available() and not te_available() else "unfused"
    return SDPAttention if choice == "sdpa" else DotProductAttention


def _swap_norm(spec, new):
    """Replace Megatron's torch-norm wrapper (which refuses sequence parallelism) by ``new``."""
    return new if spec is WrappedTorchNorm else spec


def dense_layer_spec(use_te: bool, qk_layernorm: bool = False,
                     num_experts: Optional[int] = None,
                     moe_grouped_gemm: bool = False,
                     core_attention: Optional[str] = None) -> ModuleSpec:
    """Upstream's GPT layer spec (dense, or upstream's MoE layer when ``num_experts`` is given);
    the local one with sequence-parallel-capable torch norms and the core attention of
    ``--ext-core-attention`` (``core_attention``: that flag's value; None reads it,
    ``local_core_attention``), and with ``moe_grouped_gemm`` our grouped experts
    (``grouped_experts.py``) where upstream's local spec builds ``SequentialMLP`` whatever the
    flag says. With Transformer Engine, upstream's spec as it is (TE's grouped linears)."""
    moe = dict(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm) if num_experts else {}
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **moe)
    sub = spec.submodules
    if num_experts and moe_grouped_gemm:
        sub = dataclasses.replace(sub, mlp=_with_grouped_experts(sub.mlp))
    attn = sub.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules,
        q_layernorm=_swap_norm(attn.submodules.q_layernorm, SequenceParallelTorchNorm),
        k_layernorm=_swap_norm(attn.submodules.k_layernorm, SequenceParallelTorchNorm),
        core_attention=local_core_attention(core_attention),
    )
    new_sub = dataclasses.replace(
        sub,
        input_layernorm=_swap_norm(sub.input_layernorm, SequenceParallelTorchNorm),
        pre_mlp_layernorm=_swap_norm(sub.pre_mlp_layernorm, SequenceParallelTorchNorm),
        self_attention=ModuleSpec(module=attn.module, params=dict(attn.params),
                                  submodules=attn_sub),
    )
    return ModuleSpec(module=spec.module, params=dict(spec.params), submodules=new_sub)


def moe_submodules(moe) -> MoESubmodules:
    """The ``MoESubmodules`` of upstream's MoE layer spec (``partial(MoELayer,
    submodules=MoESubmodules(...))``, the MLP slot of its GPT layer spec)."""
    moe_sub = moe.keywords.get("submodules") if isinstance(moe, functools.partial) else None
    if not isinstance(moe_sub, MoESubmodules):
        raise TypeError(f"cannot read the experts and router of the MoE spec {moe!r}")
    return moe_sub


def _with_grouped_experts(moe):
    """Upstream's local MoE layer spec with its experts built as grouped GEMMs (``TEGroupedMLP``
    over torch grouped linears)."""
    moe_sub = moe_submodules(moe)
    return functools.partial(moe.func, *moe.args, **{
        **moe.keywords,
        "submodules": dataclasses.replace(moe_sub, experts=grouped_experts_builder())})


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


LayerFn = Callable[[int, ModuleSpec], ModuleSpec]


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


def stage_has_token_layers(block_spec: TransformerBlockSubmodules) -> bool:
    return any(spec.module is TokenContextTransformerLayer for spec in block_spec.layer_specs)
