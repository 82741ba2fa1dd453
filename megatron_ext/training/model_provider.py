"""Model provider for ``megatron.training.pretrain``: builds the per-layer spec list and the model."""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.training import get_args, print_rank_0
from megatron.training.argument_utils import core_transformer_config_from_args

from megatron_ext.models.gpt import TokenIdsGPTModel
from megatron_ext.models.registry import get_family
from megatron_ext.models.specs import stage_has_token_layers, te_available
from megatron_ext.structmoe.config import layer_budget
from megatron_ext.training.arguments import (
    sigma_config_from_args,
    stem_config_from_args,
    structmoe_config_from_args,
)


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
    model.stem_tables = None  # managed STEM tables of this chunk, if any (set below)
    stem = stem_config_from_args(args)
    if stem is not None:
        print_rank_0(f"> STEM layers (0-based): {stem.stem_layers(config.num_layers)} "
                     f"variant={stem.variant} init={stem.init} tables: "
                     f"placement={stem.placement} sharding={stem.sharding}")
        if stem.managed_tables:
            from megatron.core import parallel_state

            from megatron_ext.stem.tables import StemTables, chunk_stem_layers

            layers = chunk_stem_layers(model)
            hot = None
            if stem.placement == "tiered" and layers:
                from megatron_ext.stem.tiers import choose_hot_mask

                hot, how = choose_hot_mask(args, args.padded_vocab_size, stem.gpu_tier)
                print_rank_0(f"> STEM GPU tier: {int(hot.sum())} of {args.padded_vocab_size} "
                             f"rows (--stem-gpu-tier {stem.gpu_tier}): {how}")
            # A plain attribute, not a submodule: the rows are not parameters of the model.
            model.stem_tables = StemTables(
                layers, stem, args.padded_vocab_size, parallel_state.get_data_parallel_group(),
                hot_mask=hot) if layers else None
    smoe = structmoe_config_from_args(args)
    if smoe is not None:
        budget = layer_budget(smoe, config.hidden_size, config.ffn_hidden_size,
                              bool(config.gated_linear_unit))
        print_rank_0(f"> per layer (Eqs. 7-9): {budget.describe()}")
    sigma = sigma_config_from_args(args)
    if sigma is not None:
        from megatron_ext.sigma import monitor
        from megatron_ext.sigma.budget import SigmaBudget
        from megatron_ext.sigma.schedule import sigma_layers

        budget = SigmaBudget.from_config(config, args.padded_vocab_size,
                                         tied=not args.untie_embeddings_and_output_weights)
        print_rank_0(f"> {budget.describe(sigma.target_topks(), sigma.initial_topks())}")
        print_rank_0(f"> Sigma top-k per layer: {list(sigma.initial_topks())}, after step "
                     f"{sigma.switch_iteration(args.train_iters)}: {list(sigma.target_topks())}"
                     if sigma.topk_schedule else
                     f"> Sigma top-k per layer: {list(sigma.target_topks())}")
        # A plain list attribute (not submodules): the forward step applies the schedule to it.
        model.sigma_layers = sigma_layers(model)
        # Close each global batch in the routers once its gradients are final (megatron.training
        # keeps a finalize function the model builder set).
        config.finalize_model_grads_func = monitor.finalize_model_grads
    return model
