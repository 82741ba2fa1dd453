"""Model provider for ``megatron.training.pretrain``: builds the per-layer spec list and the model."""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.training import get_args
from megatron.training.argument_utils import core_transformer_config_from_args

from megatron_ext.models.gpt import TokenIdsGPTModel
from megatron_ext.models.registry import get_family
from megatron_ext.models.specs import stage_has_token_layers, te_available


def model_provider(pre_process: bool = True, post_process: bool = True,
                   vp_stage: Optional[int] = None, config=None, pg_collection=None):
    args = get_args()
    use_te = args.transformer_impl == "transformer_engine"
    if use_te and not te_available():
        raise ValueError("--transformer-impl transformer_engine: Transformer Engine is not "
                         "installed (or has no GPU); use --transformer-impl local")
    if config is None:
        config = core_transformer_config_from_args(args)
    family = get_family(args.model_family)
    if family.heterogeneous_layers:
        # Layers differ (e.g. only STEM layers hold a table): save each layer under its own key.
        config.hetereogenous_dist_checkpoint = True
    block_spec = family.block_spec(args, config, use_te, vp_stage=vp_stage)
    needs_ids = stage_has_token_layers(block_spec)
    kwargs = dict(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    model = TokenIdsGPTModel(**kwargs) if needs_ids else GPTModel(**kwargs)
    model.needs_token_ids = needs_ids
    model.stem_tables = None  # managed STEM tables of this chunk, if any (the STEM family)
    if family.model_state is not None:  # what the family keeps beside the modules
        family.model_state(model, args, config, family.config_from_args(args))
    return model
