"""The dense SwiGLU GPT baseline as a family (``--model-family gpt``): a block spec and the width
its checkpoints are checked for (``models/registry.py``)."""

from __future__ import annotations

from typing import Optional

from megatron_ext.models import hybrid_specs, saved_settings
from megatron_ext.models.family import Family
from megatron_ext.models.hybrid_pattern import mlp_block_count
from megatron_ext.models.specs import block_spec as dense_block_spec


def block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    return dense_block_spec(config, use_te, vp_stage=vp_stage)


def hybrid_stack_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    return hybrid_specs.hybrid_stack_spec(config, args.hybrid_layer_pattern, use_te)


def hf_mlp_layers(args, iteration, gated: bool, refuse) -> list:
    refuse(getattr(args, "num_experts", None) is not None,
           "upstream MoE (gpt with --num-experts) is not supported; use --model-family sigma")
    return [{"type": "dense", "intermediate_size": args.ffn_hidden_size}
            for _ in range(mlp_block_count(args))]


def check_checkpoint(chunks, args, cfg, load_dir: str, step: Optional[int],
                     tokenizer_vocab_size: Optional[int]) -> None:
    """The checkpoint's dense MLPs have this run's width (models/saved_settings.py)."""
    saved_settings.check(load_dir, step, args, (saved_settings.FFN,))


FAMILY = Family("gpt", "dense SwiGLU GPT (the baseline)", block_spec,
                hybrid_stack_spec=hybrid_stack_spec, hf_mlp_layers=hf_mlp_layers,
                check_checkpoint=check_checkpoint)
