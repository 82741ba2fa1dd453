"""Model families and how each builds its decoder block spec.

A family registers a function ``block_spec(args, config, use_te, vp_stage) ->
TransformerBlockSubmodules``; the model provider looks the family up by ``--model-family`` and
derives from the spec whether this stage needs token ids. Choosing the MLP
of each layer happens inside these functions, when the spec list is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


BlockSpecFn = Callable[..., TransformerBlockSubmodules]


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    block_spec: BlockSpecFn
    heterogeneous_layers: bool  # layers differ in their parameters (checkpoint per layer)


_FAMILIES: Dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"--model-family={name}: not available (registered: "
                         f"{', '.join(sorted(_FAMILIES))})") from None


def registered_families() -> Tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def _gpt_block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    from megatron_ext.models.specs import decoder_block_spec

    return decoder_block_spec(config, None, args.padded_vocab_size, use_te, vp_stage=vp_stage)


def _stem_block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    from megatron_ext.models.specs import decoder_block_spec
    from megatron_ext.training.arguments import stem_config_from_args

    return decoder_block_spec(config, stem_config_from_args(args), args.padded_vocab_size,
                              use_te, vp_stage=vp_stage)


def _structmoe_block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    from megatron_ext.models.specs import block_spec, structmoe_layers_fn
    from megatron_ext.training.arguments import structmoe_config_from_args

    return block_spec(config, use_te, structmoe_layers_fn(structmoe_config_from_args(args)),
                      vp_stage=vp_stage)


def _sigma_block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    from megatron_ext.models.specs import sigma_block_spec
    from megatron_ext.training.arguments import sigma_config_from_args

    return sigma_block_spec(config, sigma_config_from_args(args), use_te, vp_stage=vp_stage)


register_family(Family("gpt", "dense SwiGLU GPT (the baseline)", _gpt_block_spec, False))
register_family(Family("stem", "STEM: token-indexed up-projection tables", _stem_block_spec, True))
register_family(Family("structmoe", "StructMoE: routed low-rank experts inside the dense MLP",
                       _structmoe_block_spec, False))
register_family(Family("sigma", "Sigma MoE: every layer MoE, top-1, global-batch LBL",
                       _sigma_block_spec, False))
