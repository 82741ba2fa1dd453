"""Analytic parameter and FLOP accounting for dense SwiGLU GPT and STEM models, from plain numbers.

Conventions (per token; training = forward + backward):

* A matrix product with a weight ``W`` of ``m x n`` costs ``2mn`` FLOPs forward and ``4mn`` backward
  (input gradient + weight gradient): ``6mn`` per token. This covers the attention projections
  (QKV: ``h x (q + 2kv)``, output: ``q x h``), the MLP linears and the output layer (``h x V``,
  also when it is tied to the input embedding: the logits are computed either way).
* Attention core, per layer: ``Q K^T`` and ``softmax(.) V`` each cost ``2 s q`` FLOPs per token
  forward (``s`` the sequence length, ``q = heads x kv_channels``), three times that for training:
  ``6 * 2 * s * q``. The full ``s x s`` score matrix is counted, as the paper's Sec. 3.1 does
  (``2 L^2 d``) and as Megatron's unfused local attention computes it; ``causal=True`` halves it,
  Megatron's convention in ``megatron.training.training.num_floating_point_operations``.
* Not counted: embedding and STEM-table lookups (row copies), element-wise work (norms, SiLU, the
  gating product, rotary, softmax, residual adds), the loss and the optimizer. Table 1 of the STEM
  paper counts the element-wise ``d_ff`` term; it is the same for a dense and a STEM layer and does
  not change the saving.

STEM (Sec. 2.2, Table 1, Sec. 3.1 of the paper): variant ``up`` replaces the up-projection ``W_up``
(``h x f``) by a table row ``U[t]``: ``-6 h f`` training FLOPs per token per STEM layer (Table 1:
``Delta = d D L`` multiply-adds per forward of ``L`` tokens; x2 FLOPs per multiply-add, x3 for
forward + backward). ``gate`` removes ``W_gate`` instead: same saving. ``dagger`` keeps ``W_up``
and adds the row: no saving. With multi-head attention our per-layer saving fraction is
``6hf / (6(4h^2 + 2sh + 3hf)) = f / (4h + 2s + 3f)``, the paper's formula.

Parameters: *total* counts every parameter once (a tied output layer is the embedding). *Active
per token* counts what one token touches in a forward pass: all dense weights and norms, one row of
the word (and learned position) embedding, one row (``f`` values) of each STEM table, and the whole
output layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

VARIANTS = ("up", "gate", "dagger")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


@dataclass(frozen=True)
class ModelShape:
    """The numbers that fix a GPT/STEM model's parameters and FLOPs.

    ``vocab_size`` is the vocabulary the embedding, output layer and STEM tables hold (Megatron's
    padded vocabulary, see :func:`padded_vocab_size`). ``stem_layers`` are 0-based layer indices
    (empty: the dense baseline).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    stem_layers: Tuple[int, ...] = ()
    stem_variant: str = "up"
    untie_embeddings: bool = True
    position_embedding_type: str = "rope"
    max_position_embeddings: Optional[int] = None
    normalization: str = "RMSNorm"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        object.__setattr__(self, "stem_layers", tuple(sorted(self.stem_layers)))
        bad = [i for i in self.stem_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.stem_layers)) != len(self.stem_layers):
            raise ValueError(f"stem_layers={list(self.stem_layers)}: indices must be distinct "
                             f"and in 0..{self.num_layers - 1}")
        if self.stem_variant not in VARIANTS:
            raise ValueError(f"stem_variant={self.stem_variant!r}: allowed {', '.join(VARIANTS)}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}: allowed "
                             f"{', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding_type={self.position_embedding_type!r}: allowed "
                             f"{', '.join(POSITION_EMBEDDINGS)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}; give kv_channels")
        if self.num_attention_heads % self.groups:
            raise ValueError(f"num_query_groups={self.groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.groups * self.head_dim

    def is_stem(self, layer: int) -> bool:
        return layer in self.stem_layers

    @classmethod
    def from_megatron_args(cls, args) -> "ModelShape":
        """The shape of the model ``launch/pretrain.py`` builds from parsed Megatron args."""
        from megatron_ext.stem.family import stem_config

        stem = stem_config(args)
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        return cls(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
            vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
            num_query_groups=groups, kv_channels=args.kv_channels,
            stem_layers=tuple(stem.stem_layers(args.num_layers)) if stem else (),
            stem_variant=stem.variant if stem else "up",
            untie_embeddings=args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            max_position_embeddings=args.max_position_embeddings,
            normalization=args.normalization)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's padding of the tokenizer vocabulary (``--make-vocab-size-divisible-by``)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


# ---------------------------------------------------------------------------------------------
# parameters


@dataclass(frozen=True)
class ParameterCounts:
    embedding: int
    position_embedding: int
    attention: int
    mlp: int  # dense MLP weights (W_gate, W_up, W_down) of all layers, tables excluded
    stem_tables: int
    norms: int
    output_layer: int  # 0 when tied to the embedding
    active_per_token: int

    @property
    def total(self) -> int:
        return (self.embedding + self.position_embedding + self.attention + self.mlp
                + self.stem_tables + self.norms + self.output_layer)

    @property
    def dense(self) -> int:
        """Everything but the STEM tables."""
        return self.total - self.stem_tables


def mlp_weights(shape: ModelShape, layer: int) -> int:
    """Dense MLP weights of one layer: SwiGLU has three ``h x f`` matrices, STEM up/gate two."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if shape.is_stem(layer) and shape.stem_variant in ("up", "gate"):
        return 2 * h * f
    return 3 * h * f


def attention_weights(shape: ModelShape) -> int:
    h = shape.hidden_size
    return h * (shape.q_size + 2 * shape.kv_size) + shape.q_size * h


def parameter_counts(shape: ModelShape) -> ParameterCounts:
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    norm = h if shape.normalization == "RMSNorm" else 2 * h  # LayerNorm has a bias
    position = 0
    if shape.position_embedding_type == "learned_absolute":
        position = (shape.max_position_embeddings or shape.seq_length) * h
    attention = shape.num_layers * attention_weights(shape)
    mlp = sum(mlp_weights(shape, i) for i in range(shape.num_layers))
    n_stem = len(shape.stem_layers)
    tables = n_stem * v * f
    norms = (2 * shape.num_layers + 1) * norm  # input + pre-MLP norm per layer, final norm
    output = v * h if shape.untie_embeddings else 0
    active = (h + (h if position else 0) + attention + mlp + n_stem * f + norms + v * h)
    return ParameterCounts(embedding=v * h, position_embedding=position, attention=attention,
                           mlp=mlp, stem_tables=tables, norms=norms, output_layer=output,
                           active_per_token=active)


# ---------------------------------------------------------------------------------------------
# FLOPs


@dataclass(frozen=True)
class FlopCounts:
    """Training (forward + backward) FLOPs per token, by part."""

    attention_linear: float
    attention_core: float
    mlp: float
    output_layer: float

    @property
    def total(self) -> float:
        return self.attention_linear + self.attention_core + self.mlp + self.output_layer

    @property
    def forward(self) -> float:
        return self.total / 3.0


def layer_training_flops(shape: ModelShape, layer: int, causal: bool = False) -> float:
    """Training FLOPs per token of one decoder layer (attention + MLP)."""
    core = 6 * 2 * shape.seq_length * shape.q_size * (0.5 if causal else 1.0)
    return 6 * attention_weights(shape) + core + 6 * mlp_weights(shape, layer)


def training_flops_per_token(shape: ModelShape, causal: bool = False) -> FlopCounts:
    layers = range(shape.num_layers)
    core = 6 * 2 * shape.seq_length * shape.q_size * (0.5 if causal else 1.0)
    return FlopCounts(
        attention_linear=6.0 * shape.num_layers * attention_weights(shape),
        attention_core=float(shape.num_layers * core),
        mlp=6.0 * sum(mlp_weights(shape, i) for i in layers),
        output_layer=6.0 * shape.hidden_size * shape.vocab_size,
    )


def stem_flop_saving_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token the STEM layers save against the dense model of the same shape."""
    if shape.stem_variant == "dagger":
        return 0.0
    return 6.0 * shape.hidden_size * shape.ffn_hidden_size * len(shape.stem_layers)


def dense_baseline(shape: ModelShape) -> ModelShape:
    """The dense SwiGLU model with the same shape (no STEM layers)."""
    from dataclasses import replace

    return replace(shape, stem_layers=())


def flop_ratio(shape: ModelShape, baseline: ModelShape, causal: bool = False) -> float:
    """Training FLOPs per token of ``shape`` over those of ``baseline`` (same token budget)."""
    return (training_flops_per_token(shape, causal).total
            / training_flops_per_token(baseline, causal).total)


# ---------------------------------------------------------------------------------------------
# training ROI (Sec. 4 of the paper)


def training_roi(quality: float, total_training_flops: float) -> float:
    """The paper's training ROI: model quality (average downstream accuracy) / training FLOPs."""
    if total_training_flops <= 0:
        raise ValueError(f"total_training_flops={total_training_flops}: must be > 0")
    return quality / total_training_flops


def relative_roi(quality: float, total_training_flops: float, baseline_quality: float,
                 baseline_training_flops: float) -> float:
    """ROI normalised to the baseline (Table 3 reports it so: baseline = 1x)."""
    return (training_roi(quality, total_training_flops)
            / training_roi(baseline_quality, baseline_training_flops))


def proxy_quality(validation_loss: float) -> float:
    """A PROXY for accuracy, not the paper's measure: ``exp(-loss)``.

    ``exp(-mean cross-entropy)`` is the geometric mean of the probability the model gives the
    correct next token (1 / perplexity), a number in (0, 1] that rises as the model improves, as
    an accuracy does. The paper's ROI uses the average accuracy of eight downstream benchmarks,
    which a tiny CPU run cannot measure; a ratio of this proxy is only indicative.
    """
    return math.exp(-validation_loss)


def proxy_relative_roi(validation_loss: float, total_training_flops: float,
                       baseline_validation_loss: float, baseline_training_flops: float) -> float:
    """Relative training ROI with :func:`proxy_quality` in place of downstream accuracy."""
    return relative_roi(proxy_quality(validation_loss), total_training_flops,
                        proxy_quality(baseline_validation_loss), baseline_training_flops)


def summary(shape: ModelShape, causal: bool = False) -> Dict[str, float]:
    """Headline numbers of one model (plain dict, for JSON)."""
    params = parameter_counts(shape)
    flops = training_flops_per_token(shape, causal)
    return {
        "total_params": params.total,
        "dense_params": params.dense,
        "stem_table_params": params.stem_tables,
        "active_params_per_token": params.active_per_token,
        "train_flops_per_token": flops.total,
        "forward_flops_per_token": flops.forward,
        "stem_layers": list(shape.stem_layers),
    }


# ---------------------------------------------------------------------------------------------
# built models


def count_model_parameters(model) -> Dict[str, int]:
    """Parameters of a built model (or a list of model chunks), each tensor counted once.

    ``stem_tables`` are the ``table`` parameters of :class:`megatron_ext.stem.mlp.StemMLP`
    modules; ``dense`` is the rest. Under tensor/pipeline parallelism this counts this rank's
    shards only.
    """
    from megatron_ext.stem.mlp import StemMLP

    chunks: Iterable = model if isinstance(model, (list, tuple)) else [model]
    seen, total, tables = set(), 0, 0
    for chunk in chunks:
        table_ids = {id(m.table) for m in chunk.modules() if isinstance(m, StemMLP)}
        for param in chunk.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel()
            if id(param) in table_ids:
                tables += param.numel()
    return {"total": total, "stem_tables": tables, "dense": total - tables}
