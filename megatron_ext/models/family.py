"""The contract of a model family (``models/registry.py`` keeps the registered ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

BlockSpecFn = Callable[..., Any]  # (args, config, use_te, vp_stage) -> TransformerBlockSubmodules


def _no_config(args) -> None:
    return None


class FamilyRun:
    """What a family does during one training (or one evaluation of a checkpoint,
    ``convert/megatron_logits.py``): ``Family.start_run(args, cfg)`` makes it, it owns what lives
    as long as the run (STEM's host worker and tables, Sigma's layers), and ``close`` ends it.
    Every method is optional: these defaults do nothing."""

    # the forward step's batch routes the tokens' host copy (the same answer on every rank);
    # with TP > 1 the trainer then sends it to every TP rank over a gloo copy of the TP group
    # (``training/batch.py``)
    host_tokens = False

    def model_state(self, model, config) -> None:
        """A model chunk was built (Sigma: its layers' schedule)."""

    def token_tables(self, model, config):
        """The runtime a model with token-indexed layers owns (``models/token_ids.py``; STEM's
        managed tables), built by the model once its layers exist and kept as
        ``model.token_tables``; None for none."""
        return None

    def take_batch(self, model, read_batch: Callable[[], tuple]) -> Tuple[tuple, dict]:
        """Every training micro-batch: the batch the chunk runs now as ``read_batch()`` gives it
        (tokens, labels, loss_mask, attention_mask, position_ids, and the tokens' host copy or
        None) and the keyword arguments of the model's forward for it (STEM: the rows its
        managed tables fetched, ``token_rows``; it reads ahead)."""
        return read_batch(), {}

    def bind_tokens(self, model, tokens) -> dict:
        """A forward outside the trainer of the chunk ``model`` on ``tokens``: the keyword
        arguments of the model's forward beside its inputs."""
        return {}

    def before_forward(self, model) -> None:
        """Every training micro-batch, before the model runs (Sigma: the step's top-k)."""

    def at_iteration(self, chunks: Sequence, iteration: Optional[int]) -> None:
        """A checkpoint of ``iteration`` was loaded for evaluation."""

    def wrap_optimizer(self, optimizer, chunks):
        """The optimizer Megatron built for the model chunks -> the one pretrain uses (STEM
        chains its table optimizer)."""
        return optimizer

    # every iteration, on every rank, before Megatron's training log (collectives allowed):
    # log_report(args, iteration, total_loss_dict, writer, wandb_writer); None: no report
    log_report: Optional[Callable[..., None]] = None

    def after_training(self) -> None:
        """``pretrain`` returned."""

    def close(self) -> None:
        """The run ended (every way out): its background work waited for, what it holds let
        go, so that another run in the same process starts from nothing of this one."""


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
    # before the trainer loads a checkpoint into the model (after its checksums are verified):
    # check_checkpoint(chunks, args, cfg, load_dir, step, tokenizer_vocab_size) refuses one
    # that does not fit the model, naming the flags (ValueError)
    check_checkpoint: Optional[Callable[..., None]] = None
    # what the family does during one training or evaluation: start_run(args, cfg) -> a
    # ``FamilyRun``, made by the trainer's session before the model is built and closed by it
    # after (None: the family does nothing then)
    start_run: Optional[Callable[[Any, Any], "FamilyRun"]] = None
    # to-hf: hf_mlp_layers(args, iteration, gated, refuse) -> the exported config's description
    # of every layer's MLP (dicts with a "type"); refuse(cond, message) stops the conversion
    hf_mlp_layers: Optional[Callable[..., list]] = None
    # to-hf: MLP type -> tensors(plan, layer, description), the Hugging Face tensors of such an
    # MLP (``convert/to_hf.py`` Plan: fc, layer, add, split, down_proj); "dense" is to-hf's own
    hf_mlp_tensors: Dict[str, Callable[..., None]] = field(default_factory=dict)
    # its terms in the parameter, FLOPs and memory estimate (a ``models/terms.py`` MLPTerms;
    # None: the dense MLP's)
    estimate_terms: Any = None
