"""The contract of a model family (``models/registry.py`` keeps the registered ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

BlockSpecFn = Callable[..., Any]  # (args, config, use_te, vp_stage) -> TransformerBlockSubmodules


def _no_config(args) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One model family. Every hook but ``block_spec`` is optional; ``cfg`` below is what
    ``config_from_args`` returns for the parsed flags (None for a family without options)."""

    name: str
    description: str
    # (args, config, use_te, vp_stage) -> the decoder's TransformerBlockSubmodules
    block_spec: BlockSpecFn
    heterogeneous_layers: bool = False  # layers differ in their parameters (checkpoint per layer)
    # the hybrid path (``--hybrid-layer-pattern``): (args, config, use_te, vp_stage) -> the
    # HybridModel's stack spec (``models/hybrid_specs.py``); None: the family builds on the GPT
    # path only
    hybrid_stack_spec: Optional[BlockSpecFn] = None
    # the pattern symbols the family's hybrid stack builds (attention ``*`` and one kind of MLP
    # block: ``-`` or ``E``); a pattern with others is refused before Megatron starts
    hybrid_symbols: str = "*-"
    # the family's argument group: add_args(parser)
    add_args: Optional[Callable[[Any], None]] = None
    # its options dataclass from the parsed flags (raises ValueError naming a flag)
    config_from_args: Callable[[Any], Any] = _no_config
    # flags the family implies when the command line does not give them: ((flag, value), ...)
    default_flags: Tuple[Tuple[str, Optional[str]], ...] = ()
    # checks before Megatron validates the flags (a message naming our flag rather than one of
    # Megatron's assertions): check_args(args)
    check_args: Optional[Callable[[Any], None]] = None
    # checks that need Megatron's validated flags: validate_args(args, tokenizer_vocab_size)
    validate_args: Optional[Callable[[Any, Optional[int]], None]] = None
    # after the model chunk is built: model_state(model, args, config, cfg) attaches what the
    # family keeps beside the modules (STEM's managed tables, Sigma's layer list)
    model_state: Optional[Callable[[Any, Any, Any, Any], None]] = None
    # the runtime a model with token-indexed layers owns (``models/token_ids.py``; STEM's managed
    # tables): token_tables(model, args, config, cfg) -> the object or None, built by the model
    # once its layers exist and kept as ``model.token_tables``; it gives the forward step each
    # micro-batch's rows (``take_batch``) and saves and loads them with the model
    token_tables: Optional[Callable[[Any, Any, Any, Any], Any]] = None
    # before pretrain: install(args, cfg) (what the family sets up once per training)
    install: Optional[Callable[[Any, Any], None]] = None
    # before the trainer loads a checkpoint into the model (after its checksums are verified):
    # check_checkpoint(chunks, args, cfg, load_dir, step, tokenizer_vocab_size) refuses one
    # that does not fit the model, naming the flags (ValueError)
    check_checkpoint: Optional[Callable[..., None]] = None
    # the optimizer Megatron built for the model chunks: wrap_optimizer(optimizer, chunks, args,
    # cfg) -> the optimizer pretrain uses (STEM chains its table optimizer)
    wrap_optimizer: Optional[Callable[..., Any]] = None
    # every iteration, on every rank, before Megatron's training log (collectives allowed):
    # log_report(args, iteration, total_loss_dict, writer, wandb_writer)
    log_report: Optional[Callable[..., None]] = None
    # every micro-batch: take_batch(model, read_batch, args, cfg) -> (batch, model_kwargs): the
    # batch the chunk runs now as ``read_batch()`` gave it (tokens, labels, loss_mask,
    # attention_mask, position_ids, and the tokens' host copy or None where this rank has them
    # on the GPU only) and the keyword arguments of the model's forward for it (STEM: the rows
    # its managed tables fetched, ``token_rows``; it reads ahead)
    take_batch: Optional[Callable[[Any, Callable[[], tuple], Any, Any], tuple]] = None
    # whether take_batch routes the tokens' host copy (the same answer on every rank):
    # host_tokens(args, cfg); with TP > 1 the trainer then sends it to every TP rank over a gloo
    # copy of the TP group (``training/batch.py``)
    host_tokens: Optional[Callable[[Any, Any], bool]] = None
    # a forward outside the trainer (``convert/megatron_logits.py``) of the chunk ``model`` on
    # ``tokens``: bind_tokens(model, tokens, args, cfg) -> the keyword arguments of the model's
    # forward beside its inputs (STEM fetches the rows of its managed tables: a collective over
    # data parallelism)
    bind_tokens: Optional[Callable[[Any, Any, Any, Any], dict]] = None
    # every training micro-batch, before the model runs: before_forward(model, args, cfg)
    before_forward: Optional[Callable[[Any, Any, Any], None]] = None
    # a checkpoint of ``iteration`` was loaded for evaluation: at_iteration(chunks, args, cfg, it)
    at_iteration: Optional[Callable[[Sequence, Any, Any, Optional[int]], None]] = None
    # after pretrain returned: after_training(args, cfg)
    after_training: Optional[Callable[[Any, Any], None]] = None
    # back to a fresh process's state after a training (``training/teardown.py``, another
    # training follows in the same process): reset() waits for the family's background work and
    # empties its per-process registries
    reset: Optional[Callable[[], None]] = None
    # to-hf: hf_mlp_layers(args, iteration, gated, refuse) -> the exported config's description
    # of every layer's MLP (dicts with a "type"); refuse(cond, message) stops the conversion
    hf_mlp_layers: Optional[Callable[..., list]] = None
    # to-hf: MLP type -> tensors(plan, layer, description), the Hugging Face tensors of such an
    # MLP (``convert/to_hf.py`` Plan: fc, layer, add, split, down_proj); "dense" is to-hf's own
    hf_mlp_tensors: Dict[str, Callable[..., None]] = field(default_factory=dict)
    # its terms in the parameter, FLOPs and memory estimate (a ``models/terms.py`` MLPTerms;
    # None: the dense MLP's)
    estimate_terms: Any = None
