"""A model's shape and what follows from it without building it: parameters, training FLOPs per
token and the STEM paper's training ROI, for every family.

:class:`ModelShape` is read from Megatron's parsed arguments (:meth:`ModelShape.from_args`: the
dry run, the run report), from a command line of flags (:meth:`ModelShape.from_flags`: the
scaling harness, before it launches anything) or written out by hand (tests, the main job). What
differs between families goes through the family's terms (``models/terms.py``, the registry's
``estimate_terms``); nothing here asks which family it is. The memory per rank is
``planning/estimate.py``'s, the layout rules ``planning/layout.py``'s.

**Parameters** are counted as the model provider builds them (``tests/test_estimate.py`` checks
every family against built models under TP=2 x PP=2, and EP=2 for Sigma; ``tests/test_flops.py``
dense and STEM models built in-process):

* attention: QKV ``h (a + 2g) d`` and output ``a d h`` (``a`` heads, ``g`` query groups, ``d``
  head dim), biases ``(a + 2g) d + h`` with ``--add-bias-linear``, QK-norm ``2d`` (RMSNorm;
  LayerNorm ``4d``); two norms of ``h`` per layer (LayerNorm ``2h``) and a final one;
* MLP: ``m h f`` with ``m = 3`` for SwiGLU, 2 otherwise; STEM ``up``/``gate`` layers ``(m - 1) h f``
  plus a ``V x f`` table (``dagger``: ``m h f`` plus the table); StructMoE Eq. 7 of its paper
  (``m h D' + L r (h + D') + h L``); Sigma a router ``E h`` plus ``E`` SwiGLU experts ``3 h F``;
* word embedding ``V h`` (``V`` Megatron's padded vocabulary, :func:`padded_vocab_size`), learned
  positions, and the output layer ``V h`` when untied (a tied one is the embedding).

**Blocks.** On the GPT path ``--num-layers`` counts transformer layers, each one attention block
and one MLP block. On the hybrid path (``--hybrid-layer-pattern``, ``docs/hybrid.md``) Megatron's
``--num-layers`` counts every symbol; the counts take the attention blocks from the ``*`` symbols
and the MLP blocks from the ``-``/``E`` symbols (``models/hybrid_pattern.py``), each with its own
norm, so ``*-`` repeated ``n`` times counts as the ``n``-layer GPT model and ``*-*--`` as two
attention and three MLP blocks. ``ModelShape.num_layers`` is the MLP blocks (the index the
families' layer terms take: STEM's layers, Sigma's top-k), ``attention_layers`` the attention
blocks.

*Active* parameters per token count what one token touches in a forward pass: every dense weight
and norm, one row of the word (and learned position) embedding, one STEM table row (``f``), the
selected ``k`` StructMoE experts (``k r (h + D')``) and Sigma experts (``k_l`` in layer ``l``), and
the whole output layer. The STEM paper's Table 3 counts the whole input embedding as active and
its ``#GFLOPs`` column, the denominator of its ROI, is ``2 x`` those active parameters
(:func:`paper_active_params`).

**Training FLOPs per token** (forward + backward):

* a matrix product with a weight ``W`` of ``m x n`` costs ``2mn`` FLOPs forward and ``4mn``
  backward (input gradient + weight gradient): ``6mn`` per token. This covers the attention
  projections, the MLP's active matmuls, routers and the output layer (``h x V``, also when it is
  tied to the input embedding: the logits are computed either way);
* attention core, per layer: ``Q K^T`` and ``softmax(.) V`` each cost ``2 s q`` FLOPs per token
  forward (``s`` the sequence length, ``q = heads x head dim``), three times that for training:
  ``12 s q``. The full ``s x s`` score matrix is counted, as the STEM paper's Sec. 3.1 does
  (``2 L^2 d``) and as Megatron's unfused local attention computes it; ``causal=True`` halves it,
  Megatron's convention in ``megatron.training.training.num_floating_point_operations``;
* not counted: embedding and STEM-table lookups (row copies), element-wise work (norms, SiLU, the
  gating product, rotary, softmax, residual adds), the loss and the optimizer. Table 1 of the
  STEM paper counts the element-wise ``d_ff`` term; it is the same for a dense and a STEM layer
  and does not change the saving.

STEM (Sec. 2.2, Table 1, Sec. 3.1 of the paper): variant ``up`` replaces the up-projection
``W_up`` (``h x f``) by a table row ``U[t]``: ``-6 h f`` training FLOPs per token per STEM layer
(Table 1: ``Delta = d D L`` multiply-adds per forward of ``L`` tokens; x2 FLOPs per multiply-add,
x3 for forward + backward). ``gate`` removes ``W_gate`` instead: same saving. ``dagger`` keeps
``W_up`` and adds the row: no saving. With multi-head attention the per-layer saving fraction is
``6hf / (6(4h^2 + 2sh + 3hf)) = f / (4h + 2s + 3f)``, the paper's formula.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

from megatron_ext.flags import flag_value, has_flag
from megatron_ext.models.hybrid_pattern import HybridLayers
from megatron_ext.models.registry import family_config, get_family, registered_families
from megatron_ext.models.terms import MLPTerms
from megatron_ext.stem.config import VARIANTS


def family_terms(family: str) -> MLPTerms:
    """The family's terms in the counts (``models/terms.py``; the dense MLP's by default)."""
    return get_family(family).estimate_terms or MLPTerms()


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel: int = 1) -> int:
    """Megatron's padding of the tokenizer vocabulary (``--make-vocab-size-divisible-by``)."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ModelShape:
    """The numbers that fix a model's parameters and FLOPs, for any family.

    ``vocab`` is the vocabulary the embedding, output layer and STEM tables hold (Megatron's
    padded vocabulary). ``query_groups`` None: one per head (no GQA); ``head_dim`` None:
    ``hidden / heads``; both are resolved when the shape is built. ``sequence_parallel`` is
    Megatron's ``TransformerConfig`` switch: the model's norms, dropout and MoE dispatch work on
    sequence shards (it changes activations, not parameters or FLOPs). ``stem_layers`` are 0-based
    layer indices. The family-specific fields are set by the family's terms
    (``spec_fields``) and mean nothing to the others.

    ``hybrid_layer_pattern`` (the hybrid path's ``--hybrid-layer-pattern``): ``num_layers`` is then
    its MLP blocks (``-``/``E``), :attr:`attention_layers` its ``*`` symbols; empty: the GPT path,
    ``num_layers`` transformer layers of one attention and one MLP block each.
    """

    family: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq_length: int
    query_groups: Optional[int] = None
    head_dim: Optional[int] = None
    gated: bool = True  # SwiGLU (gate, up, down) rather than a plain activation (up, down)
    bias: bool = False
    qk_norm: bool = False
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm
    untied: bool = True
    learned_positions: int = 0  # rows of a learned position embedding (0: RoPE or none)
    rope: bool = True
    sequence_parallel: bool = False
    # STEM
    stem_layers: Tuple[int, ...] = ()
    stem_variant: str = "up"
    # StructMoE (every layer)
    smoe_ffn: int = 0  # D'_ff
    smoe_stored_ffn: int = 0  # D'_ff as stored (--structmoe-ffn-pad-to); 0: smoe_ffn
    smoe_experts: int = 0
    smoe_rank: int = 0
    smoe_topk: int = 0
    # Sigma (every layer MoE): Megatron's experts
    experts: int = 0
    expert_ffn: int = 0
    topks: Tuple[int, ...] = ()  # per layer, in effect now
    target_topks: Tuple[int, ...] = ()
    hybrid_layer_pattern: str = ""

    def __post_init__(self) -> None:
        if self.hybrid_layer_pattern:
            blocks = HybridLayers.parse(self.hybrid_layer_pattern).mlp_blocks
            if blocks != self.num_layers:
                raise ValueError(f"num_layers={self.num_layers}: --hybrid-layer-pattern "
                                 f"{self.hybrid_layer_pattern!r} has {blocks} MLP blocks")
        for name in ("num_layers", "hidden", "ffn", "heads", "vocab", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.family not in registered_families():
            raise ValueError(f"family={self.family!r}: allowed "
                             f"{', '.join(registered_families())}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; "
                                 "give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.query_groups is None:
            object.__setattr__(self, "query_groups", self.heads)
        if self.heads % self.query_groups:
            raise ValueError(f"query_groups={self.query_groups} must divide heads={self.heads}")
        object.__setattr__(self, "stem_layers", tuple(sorted(self.stem_layers)))
        bad = [i for i in self.stem_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.stem_layers)) != len(self.stem_layers):
            raise ValueError(f"stem_layers={list(self.stem_layers)}: indices must be distinct "
                             f"and in 0..{self.num_layers - 1}")
        if self.stem_variant not in VARIANTS:
            raise ValueError(f"stem_variant={self.stem_variant!r}: allowed {', '.join(VARIANTS)}")

    @classmethod
    def from_args(cls, args) -> ModelShape:
        """The model ``launch/pretrain.py`` builds from Megatron's parsed and validated arguments
        (``padded_vocab_size`` set); the family's own numbers from its terms and config."""
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        pattern = getattr(args, "hybrid_layer_pattern", None) or ""
        blocks = HybridLayers.parse(pattern).mlp_blocks if pattern else args.num_layers
        fields = dict(
            family=args.model_family, num_layers=blocks, hybrid_layer_pattern=pattern,
            hidden=args.hidden_size,
            ffn=args.ffn_hidden_size, heads=args.num_attention_heads,
            vocab=args.padded_vocab_size, seq_length=args.seq_length, query_groups=groups,
            head_dim=args.kv_channels, gated=bool(args.swiglu), bias=bool(args.add_bias_linear),
            qk_norm=bool(getattr(args, "qk_layernorm", False)),
            layernorm=args.normalization == "LayerNorm",
            untied=bool(args.untie_embeddings_and_output_weights),
            learned_positions=(args.max_position_embeddings
                               if args.position_embedding_type == "learned_absolute" else 0),
            rope=args.position_embedding_type == "rope",
            sequence_parallel=bool(args.sequence_parallel))
        fields.update(family_terms(args.model_family).spec_fields(args, family_config(args)))
        return cls(**fields)

    @classmethod
    def from_flags(cls, argv: Sequence[str], vocab: int) -> ModelShape:
        """The shape a command line of Megatron flags gives (a preset expanded, then the user's
        flags), read without Megatron's parser: the scaling harness checks its layouts with it
        before it launches anything. An absent flag takes Megatron's default; ``vocab`` is the
        tokenizer's vocabulary, padded as Megatron pads it for one tensor-parallel rank.

        What only the family's parsed config knows (STEM's layers, StructMoE's ``D'_ff``, Sigma's
        top-k schedule) keeps its default: the shape serves the layout rules, not the counts.
        """
        def number(flag: str) -> Optional[int]:
            value = flag_value(argv, flag)
            return int(value) if value is not None else None

        def required(flag: str) -> int:
            value = number(flag)
            if value is None:
                raise ValueError(f"{flag} is not given (Megatron needs it)")
            return value

        hidden, gated = required("--hidden-size"), has_flag(argv, "--swiglu")
        ffn = number("--ffn-hidden-size")
        if ffn is None:  # Megatron's default (validate_args)
            ffn = int((4 * hidden * 2 / 3) / 64) * 64 if gated else 4 * hidden
        seq_length = required("--seq-length")
        position = flag_value(argv, "--position-embedding-type") or "learned_absolute"
        groups = number("--num-query-groups") or 1
        # The hybrid path: Megatron derives --num-layers from the pattern (every symbol).
        pattern = flag_value(argv, "--hybrid-layer-pattern") or ""
        blocks = (HybridLayers.parse(pattern).mlp_blocks if pattern
                  else required("--num-layers"))
        return cls(
            family=flag_value(argv, "--model-family") or "gpt",
            num_layers=blocks, hybrid_layer_pattern=pattern, hidden=hidden, ffn=ffn,
            heads=required("--num-attention-heads"),
            vocab=padded_vocab_size(vocab, number("--make-vocab-size-divisible-by") or 128),
            seq_length=seq_length,
            query_groups=groups if has_flag(argv, "--group-query-attention") else None,
            head_dim=number("--kv-channels"), gated=gated,
            bias=not has_flag(argv, "--disable-bias-linear"),
            qk_norm=has_flag(argv, "--qk-layernorm"),
            layernorm=(flag_value(argv, "--normalization") or "LayerNorm") == "LayerNorm",
            untied=has_flag(argv, "--untie-embeddings-and-output-weights"),
            learned_positions=((number("--max-position-embeddings") or seq_length)
                               if position == "learned_absolute" else 0),
            rope=position == "rope", sequence_parallel=has_flag(argv, "--sequence-parallel"),
            experts=number("--num-experts") or 0,
            expert_ffn=number("--moe-ffn-hidden-size") or ffn)

    @property
    def terms(self) -> MLPTerms:
        return family_terms(self.family)

    @property
    def hybrid(self) -> Optional[HybridLayers]:
        """The hybrid decoder (None on the GPT path)."""
        return HybridLayers.parse(self.hybrid_layer_pattern) if self.hybrid_layer_pattern \
            else None

    @property
    def attention_layers(self) -> int:
        """Attention blocks: the pattern's ``*`` on the hybrid path, else one per layer."""
        hybrid = self.hybrid
        return hybrid.attention_layers if hybrid is not None else self.num_layers

    @property
    def m(self) -> int:
        """Base matrices of a dense MLP: gate, up, down (SwiGLU) or up, down."""
        return 3 if self.gated else 2

    @property
    def norm(self) -> int:
        return 2 * self.hidden if self.layernorm else self.hidden

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.query_groups * self.head_dim

    @property
    def num_experts(self) -> Optional[int]:
        """Megatron's ``--num-experts`` (None: a model without Megatron experts)."""
        return self.experts or None

    def is_stem(self, layer: int) -> bool:
        return layer in self.stem_layers  # empty but for STEM

    def stem_replaces_matrix(self) -> bool:
        return self.stem_variant in ("up", "gate")


# ---------------------------------------------------------------------------------------------
# parameters


@dataclass
class Parts:
    """Parameter counts by part (whole model, or one rank's shards)."""

    embedding: int = 0  # word and learned position embeddings
    attention: int = 0
    norms: int = 0
    mlp: int = 0  # dense MLP weights (StructMoE: base + LoREs + router)
    routers: int = 0  # Sigma routers
    experts: int = 0  # Sigma experts
    stem_tables: int = 0  # STEM tables that are model parameters (not managed)
    output_layer: int = 0  # 0 when tied to the embedding (on its first stage)

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def add(self, other: Parts) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def attention_weights(shape: ModelShape) -> int:
    """The attention projections' weights: QKV ``h x (q + 2kv)`` and the output ``q x h``."""
    h = shape.hidden
    return h * (shape.q + 2 * shape.kv) + shape.q * h


def attention_params(shape: ModelShape, tp: int = 1) -> int:
    n = attention_weights(shape) // tp
    if shape.bias:
        n += (shape.q + 2 * shape.kv) // tp + shape.hidden  # the row-parallel bias is not split
    if shape.qk_norm:
        n += 2 * shape.head_dim * (2 if shape.layernorm else 1)
    return n


def mlp_params(shape: ModelShape, layer: int, tp: int = 1) -> int:
    """Dense MLP weights of one layer (StructMoE: all of its MLP), tables and Sigma excluded."""
    return shape.terms.mlp_params(shape, layer, tp)


def attention_block_parts(shape: ModelShape, tp: int = 1) -> Parts:
    """One attention block: its input norm and the attention."""
    return Parts(attention=attention_params(shape, tp), norms=shape.norm)


def mlp_block_parts(shape: ModelShape, layer: int, tp: int = 1, ep: int = 1, etp: int = 1,
                    managed_tables: bool = False) -> Parts:
    """MLP block ``layer``: its pre-MLP norm and the family's MLP (tables, routers, experts)."""
    p = Parts(norms=shape.norm, mlp=mlp_params(shape, layer, tp))
    shape.terms.add_layer_parts(shape, layer, p, tp, ep, etp, managed_tables)
    return p


def layer_parts(shape: ModelShape, layer: int, tp: int = 1, ep: int = 1, etp: int = 1,
                managed_tables: bool = False) -> Parts:
    """A GPT-path transformer layer: one attention and one MLP block."""
    p = attention_block_parts(shape, tp)
    p.add(mlp_block_parts(shape, layer, tp, ep, etp, managed_tables))
    return p


def model_parts(shape: ModelShape, managed_tables: bool = False) -> Parts:
    """The whole model, each parameter once."""
    h = shape.hidden
    total = Parts(embedding=shape.vocab * h + shape.learned_positions * h, norms=shape.norm,
                  output_layer=shape.vocab * h if shape.untied else 0)
    for _ in range(shape.attention_layers):
        total.add(attention_block_parts(shape))
    for layer in range(shape.num_layers):
        total.add(mlp_block_parts(shape, layer, managed_tables=managed_tables))
    return total


def stem_table_params(shape: ModelShape) -> int:
    return shape.terms.table_params(shape)


def active_params(shape: ModelShape, topks: Optional[Sequence[int]] = None) -> int:
    """Parameters one token uses in a forward pass: every dense weight and norm (biases too),
    one embedding row, one row of each STEM table, the selected experts, the output layer."""
    topks = shape.topks if topks is None else topks
    h = shape.hidden
    n = h + (h if shape.learned_positions else 0) + shape.norm + shape.vocab * h
    n += shape.attention_layers * (attention_params(shape) + shape.norm)
    for layer in range(shape.num_layers):
        n += shape.norm + mlp_params(shape, layer)
        n += shape.terms.active_extra(shape, layer, topks)
    return n


def paper_active_params(shape: ModelShape, topks: Optional[Sequence[int]] = None) -> int:
    """The STEM paper's Table 3 convention: the whole input embedding counts as active."""
    return active_params(shape, topks) - shape.hidden + shape.vocab * shape.hidden


@dataclass(frozen=True)
class ParameterCounts:
    """A whole model's parameters, each once and by part, and those one token uses."""

    parts: Parts
    active_per_token: int

    @property
    def total(self) -> int:
        return self.parts.total

    @property
    def stem_tables(self) -> int:
        return self.parts.stem_tables

    @property
    def dense(self) -> int:
        """Everything but the STEM tables."""
        return self.total - self.stem_tables


def parameter_counts(shape: ModelShape, topks: Optional[Sequence[int]] = None) -> ParameterCounts:
    return ParameterCounts(model_parts(shape), active_params(shape, topks))


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

    def as_dict(self) -> Dict[str, float]:
        """The parts and their ``total`` (the estimate's JSON)."""
        return dict(asdict(self), total=self.total)


def _attention_core_flops(shape: ModelShape, causal: bool) -> float:
    """Training FLOPs per token of one layer's ``Q K^T`` and ``softmax(.) V``."""
    return 12.0 * shape.seq_length * shape.q * (0.5 if causal else 1.0)


def layer_training_flops(shape: ModelShape, layer: int, causal: bool = False,
                         topks: Optional[Sequence[int]] = None) -> float:
    """Training FLOPs per token of one GPT-path decoder layer (attention + MLP block
    ``layer``)."""
    topks = shape.topks if topks is None else topks
    return (6 * attention_weights(shape) + _attention_core_flops(shape, causal)
            + shape.terms.mlp_flops(shape, layer, topks))


def training_flops_per_token(shape: ModelShape, topks: Optional[Sequence[int]] = None,
                             causal: bool = False) -> FlopCounts:
    """Training FLOPs per token of the whole model (``topks``: Sigma's experts per token of each
    layer, those in effect now by default)."""
    topks = shape.topks if topks is None else topks
    layers = range(shape.num_layers)  # MLP blocks
    return FlopCounts(
        attention_linear=6.0 * shape.attention_layers * attention_weights(shape),
        attention_core=shape.attention_layers * _attention_core_flops(shape, causal),
        mlp=sum(shape.terms.mlp_flops(shape, layer, topks) for layer in layers),
        output_layer=6.0 * shape.hidden * shape.vocab,
    )


def dense_baseline(shape: ModelShape) -> ModelShape:
    """The dense SwiGLU model with the same shape (no STEM layers)."""
    return replace(shape, stem_layers=())


def stem_flop_saving_per_token(shape: ModelShape, causal: bool = False) -> float:
    """Training FLOPs per token the STEM layers save against the dense model of the same shape
    (``6 h f`` per ``up``/``gate`` layer, nothing for ``dagger``)."""
    return (training_flops_per_token(dense_baseline(shape), causal=causal).total
            - training_flops_per_token(shape, causal=causal).total)


def flop_ratio(shape: ModelShape, baseline: ModelShape, causal: bool = False) -> float:
    """Training FLOPs per token of ``shape`` over those of ``baseline`` (same token budget)."""
    return (training_flops_per_token(shape, causal=causal).total
            / training_flops_per_token(baseline, causal=causal).total)


# ---------------------------------------------------------------------------------------------
# training ROI (Sec. 4 of the STEM paper)


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


def summary(shape: ModelShape, causal: bool = False) -> Dict[str, object]:
    """Headline numbers of one model (plain dict, for JSON)."""
    params = parameter_counts(shape)
    flops = training_flops_per_token(shape, causal=causal)
    return {
        "total_params": params.total,
        "dense_params": params.dense,
        "stem_table_params": params.stem_tables,
        "active_params_per_token": params.active_per_token,
        "train_flops_per_token": flops.total,
        "forward_flops_per_token": flops.forward,
        "stem_layers": list(shape.stem_layers),
    }
