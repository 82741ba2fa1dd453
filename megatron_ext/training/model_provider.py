"""Model provider for ``megatron.training.pretrain``: builds the per-layer spec list and the model,
on the GPT path (``GPTModel``, deprecated upstream) or, when ``--hybrid-layer-pattern`` is given,
on the hybrid path (``HybridModel``, ``models/hybrid.py``; the family's ``hybrid_stack_spec``)."""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.training import get_args
from megatron.training.argument_utils import core_transformer_config_from_args

from megatron_ext.models.family import FamilyRun
from megatron_ext.models.gpt import TokenIdsGPTModel
from megatron_ext.models.hybrid import TokenIdsHybridModel, stack_has_token_layers
from megatron_ext.models.registry import get_family
from megatron_ext.models.specs import (core_attention_choice, stage_has_token_layers,
                                       te_available)
from megatron_ext.training.batch import HostTokenGroup


def model_provider(pre_process: bool = True, post_process: bool = True,
                   vp_stage: Optional[int] = None, config=None, pg_collection=None, *,
                   run: Optional[FamilyRun] = None,
                   host_group: Optional[HostTokenGroup] = None):
    """One model chunk. ``run``: the family's run of this training (``FamilyRun``; the trainer
    binds it, ``functools.partial(model_provider, run=...)``), whose ``token_tables`` the model
    builds and keeps and whose ``model_state`` sees the chunk; without one, a run that does
    nothing (a model built outside a training). ``host_group``: the training's gloo copy of the
    tensor-parallel group, made here when the run's batches route the tokens' host copy."""
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
    run = run if run is not None else FamilyRun()

    def token_tables(model):  # the runtime a token-indexed model owns (STEM's managed tables)
        return run.token_tables(model, config)
    # The families' spec builders take --ext-core-attention from here (models/specs.py).
    with core_attention_choice(getattr(args, "ext_core_attention", None)):
        if getattr(args, "hybrid_layer_pattern", None):
            model = _hybrid_model(args, config, family, use_te, pre_process, post_process,
                                  vp_stage, pg_collection, token_tables)
        else:
            model = _gpt_model(args, config, family, use_te, pre_process, post_process,
                               vp_stage, pg_collection, token_tables)
    run.model_state(model, config)
    if getattr(args, "use_gloo_process_groups", True) and run.host_tokens \
            and host_group is not None:
        host_group.make()  # every rank, the first chunk: a collective
    return model


def _gpt_model(args, config, family, use_te, pre_process, post_process, vp_stage,
               pg_collection, token_tables):
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
    if needs_ids:
        return TokenIdsGPTModel(**kwargs, token_tables=token_tables)
    return GPTModel(**kwargs)


def _hybrid_model(args, config, family, use_te, pre_process, post_process, vp_stage,
                  pg_collection, token_tables):
    if family.hybrid_stack_spec is None:
        raise ValueError(f"--hybrid-layer-pattern: --model-family {args.model_family} does not "
                         "build on the hybrid path yet; drop --hybrid-layer-pattern")
    if args.use_rope_scaling:
        raise ValueError("--use-rope-scaling: HybridModel has no RoPE scaling; drop it or "
                         "--hybrid-layer-pattern")
    stack_spec = family.hybrid_stack_spec(args, config, use_te, vp_stage=vp_stage)
    token_ids = stack_has_token_layers(stack_spec)
    kwargs = dict(token_tables=token_tables) if token_ids else {}
    return (TokenIdsHybridModel if token_ids else HybridModel)(
        **kwargs,
        config=config,
        hybrid_stack_spec=stack_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
