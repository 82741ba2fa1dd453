"""A run's parallel layout and Megatron's rules for it, in one place: the estimate
(``planning/estimate.py``, ``--dry-run``) refuses a layout by them, the scaling harness
(``launch/scaling.py``) each of its layouts before it launches anything.

Megatron-Core's grids: ``world size = TP x PP x CP x DP`` (EP is not a factor: expert-parallel
ranks are carved out of the data-parallel x CP x TP ranks) and ``world size = expert-TP x EP x PP x
expert-DP``, so ``EP x expert-TP`` must divide the ``TP x CP x DP`` ranks of one pipeline stage.
"""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass
from typing import List, Optional, Tuple

from megatron_ext.models.registry import family_config
from megatron_ext.models.sdpa_attention import SDPAttention
from megatron_ext.models.specs import local_core_attention
from megatron_ext.planning.model_shape import ModelShape, family_terms

# The core attentions the estimate tells apart, by what they keep for backward: upstream's
# DotProductAttention (the [b, heads, s, s] probabilities), PyTorch's fused kernels
# (models/sdpa_attention.py) and Transformer Engine's (output and log-sum-exp).
CORE_ATTENTIONS = ("unfused", "sdpa", "te")


def core_attention_of(transformer_impl: str, choice: Optional[str]) -> str:
    """The core attention a run of ``--transformer-impl`` and ``--ext-core-attention``
    (``choice``; None: ``auto``) builds on this machine, by the model's own rule
    (``models/specs.py`` ``local_core_attention``: ``auto`` is ``sdpa`` on a GPU without
    Transformer Engine, ``unfused`` otherwise); Transformer Engine's layers bring their own."""
    if transformer_impl == "transformer_engine":
        return "te"
    return "sdpa" if local_core_attention(choice or "auto") is SDPAttention else "unfused"


@dataclass(frozen=True)
class Layout:
    """How a run is laid out on its ranks, with the batch and the settings the memory estimate
    reads (precision, recomputation, the attention backend, STEM's managed tables).

    ``etp`` is the expert tensor-parallel size; None (a harness name without ``etp``) leaves it to
    Megatron, which makes it TP (:attr:`expert_tp`). ``global_batch`` None: not known (a preset
    without one). ``name`` is the harness's (``tp2ep1pp1dp4``), the prefix of its messages.

    A layout that breaks a rule of :func:`validate_layout` needing neither the model nor the
    node is refused when it is built, unless ``check=False``: the harness parses its names first
    and checks each against the model and ``--gpus`` later, so that a refused one becomes a row.
    """

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = 1
    micro_batch: int = 1
    global_batch: Optional[int] = 1
    distributed_optimizer: bool = False
    recompute: Optional[str] = None  # None, "selective", "full"
    recompute_modules: Tuple[str, ...] = ("core_attn",)
    virtual_pp: Optional[int] = None
    param_bytes: int = 2
    grad_bytes: int = 4
    master_weights: bool = True  # fp32 main params (16-bit training)
    attention_dropout: bool = False
    hidden_dropout: bool = False
    transformer_engine: bool = False  # TE's layers: its fused norms and core attention
    core_attention: str = "unfused"  # one of CORE_ATTENTIONS ("te" exactly with TE's layers)
    # the batch carries Megatron's [b, 1, s, s] mask (--no-create-attention-mask-in-dataloader:
    # none, the causal kernels mask by themselves)
    attention_mask: bool = True
    # --ext-cross-entropy fused: the loss keeps the logits in their dtype and a per-row
    # log-sum-exp instead of upstream's fp32 softmax (megatron_ext_kernels/vocab_ce.py)
    fused_cross_entropy: bool = False
    # STEM managed tables
    stem_managed: bool = False
    stem_placement: str = "gpu"
    stem_sharding: str = "replicated"
    stem_optimizer: str = "dense"
    stem_ownership: str = "interleaved"
    stem_gpu_tier: str = "10%"  # tiered placement: the GPU tier's rows (--stem-gpu-tier)
    name: str = ""
    check: InitVar[bool] = True

    def __post_init__(self, check: bool) -> None:
        if check:
            validate_layout(self)

    @classmethod
    def from_args(cls, args, world_size: Optional[int] = None) -> Layout:
        """The layout of Megatron's parsed and validated arguments (``world_size`` ranks, by
        default Megatron's), with the family's own fields from its terms."""
        sixteen = bool(args.bf16 or args.fp16)
        modules = tuple(getattr(args, "recompute_modules", None) or ("core_attn",))
        te = args.transformer_impl == "transformer_engine"
        return cls(
            world_size=world_size or args.world_size, tp=args.tensor_model_parallel_size,
            pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
            ep=args.expert_model_parallel_size, micro_batch=args.micro_batch_size,
            global_batch=args.global_batch_size,
            distributed_optimizer=bool(args.use_distributed_optimizer),
            recompute=args.recompute_granularity, recompute_modules=modules,
            virtual_pp=getattr(args, "virtual_pipeline_model_parallel_size", None),
            param_bytes=2 if sixteen else 4,
            grad_bytes=4 if (args.accumulate_allreduce_grads_in_fp32 or not sixteen) else 2,
            master_weights=sixteen, attention_dropout=args.attention_dropout > 0,
            hidden_dropout=args.hidden_dropout > 0, transformer_engine=te,
            core_attention=core_attention_of(args.transformer_impl,
                                             getattr(args, "ext_core_attention", None)),
            attention_mask=bool(getattr(args, "create_attention_mask_in_dataloader", True)),
            fused_cross_entropy=getattr(args, "ext_cross_entropy", "auto") == "fused",
            **family_terms(args.model_family).layout_fields(args, family_config(args)))

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.pp * self.ep * self.expert_tp)

    @property
    def microbatches(self) -> Optional[int]:
        """Micro-batches per step per data-parallel rank (None: the global batch is not known)."""
        if self.global_batch is None:
            return None
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def act_bytes(self) -> int:
        return self.param_bytes

    def flags(self) -> List[str]:
        """The sizes as ``launch/pretrain.py`` flags (expert-TP only where it is given)."""
        out = ["--tensor-model-parallel-size", str(self.tp),
               "--pipeline-model-parallel-size", str(self.pp),
               "--expert-model-parallel-size", str(self.ep),
               "--context-parallel-size", str(self.cp)]
        if self.etp is not None:
            out += ["--expert-tensor-parallel-size", str(self.etp)]
        return out


_TOKEN = re.compile(r"(etp|tp|ep|pp|dp|cp)(\d+)")


def parse_layout(text: str) -> Layout:
    """``tp2ep1pp1dp4`` (also ``cp<n>``, ``etp<n>``; any order; a missing size is 1), not checked
    (:func:`validate_layout`)."""
    name = text.strip()
    pos, sizes = 0, {}
    for m in _TOKEN.finditer(name):
        if m.start() != pos:
            break
        key, value = m.group(1), int(m.group(2))
        if key in sizes:
            raise ValueError(f"layout {name!r}: {key} is given twice")
        if value < 1:
            raise ValueError(f"layout {name!r}: {key}{value} must be >= 1")
        sizes[key] = value
        pos = m.end()
    if not name or pos != len(name):
        raise ValueError(f"layout {name!r}: expected sizes like 'tp2ep1pp1dp4' (keys tp, ep, pp, "
                         "dp, cp, etp, each followed by a number)")
    tp, pp, cp, dp = (sizes.get(k, 1) for k in ("tp", "pp", "cp", "dp"))
    return Layout(name=name, world_size=tp * pp * cp * dp, tp=tp, pp=pp, cp=cp,
                  ep=sizes.get("ep", 1), etp=sizes.get("etp"), global_batch=None, check=False)


def parse_layouts(text: str) -> List[Layout]:
    layouts = [parse_layout(t) for t in text.split(",") if t.strip()]
    if not layouts:
        raise ValueError("--layouts: give at least one layout, e.g. 'tp1ep1pp1dp2,tp2ep1pp1dp1'")
    names = [lay.name for lay in layouts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--layouts: {', '.join(dup)} given more than once")
    return layouts


def validate_layout(layout: Layout, shape: Optional[ModelShape] = None,
                    gpus: Optional[int] = None, cpu: bool = False) -> None:
    """Megatron's rules for ``layout``, and for ``shape`` laid out so and ``gpus`` ranks (CPU
    processes with ``cpu``) where given, as a ValueError naming the size to change (prefixed
    with the layout's name)."""
    n = f"{layout.name}: " if layout.name else ""
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    for key in ("world_size", "tp", "pp", "cp", "ep", "etp", "micro_batch", "global_batch"):
        value = getattr(layout, key)
        if value is not None and value < 1:
            raise ValueError(f"{n}{key}={value}: must be >= 1")
    if layout.core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"{n}core_attention={layout.core_attention!r}: one of "
                         f"{', '.join(CORE_ATTENTIONS)}")
    if (layout.core_attention == "te") != layout.transformer_engine:
        raise ValueError(f"{n}core_attention={layout.core_attention!r} with transformer_engine="
                         f"{layout.transformer_engine}: Transformer Engine's layers bring its "
                         "attention ('te'), the local ones 'unfused' or 'sdpa'")
    if layout.world_size % (tp * pp * cp):
        raise ValueError(f"{n}world size {layout.world_size} is not divisible by TP x PP x CP = "
                         f"{tp} x {pp} x {cp}")
    dp = layout.dp
    if gpus is not None and layout.world_size != gpus:
        raise ValueError(
            f"{n}TP x PP x CP x DP = {tp} x {pp} x {cp} x {dp} = {layout.world_size} ranks, but "
            f"--gpus is {gpus} (Megatron: world size = TP x PP x CP x DP; EP lives inside the "
            "data-parallel ranks and is not a factor)")
    stage, etp = layout.world_size // pp, layout.expert_tp
    if stage % (ep * etp):
        hint = ("; expert-TP defaults to TP: add etp1 to the layout or lower ep"
                if layout.etp is None and tp > 1 else "")
        raise ValueError(f"{n}EP x expert-TP = {ep} x {etp} does not divide the {stage} ranks "
                         f"of a pipeline stage (TP x CP x DP = {tp} x {cp} x {dp}){hint}")
    if shape is not None:
        experts = shape.num_experts
        if ep > 1 and not experts:
            raise ValueError(f"{n}ep{ep} needs a model with Megatron experts (--num-experts; "
                             f"the {shape.family} preset has none): use ep1")
        if experts and experts % ep:
            raise ValueError(f"{n}--num-experts={experts} is not divisible by ep{ep}")
        if experts and tp > 1 and not shape.sequence_parallel:
            # Megatron's MoE layer raises this in its first training forward, after start-up.
            raise ValueError(f"{n}Megatron's MoE layer trains with TP only under sequence "
                             "parallelism: add --sequence-parallel (after `--` in "
                             "launch/scaling.py; Megatron turns it off by itself where TP is 1)")
        hybrid = shape.hybrid
        if hybrid is None and shape.num_layers % pp:
            raise ValueError(f"{n}--num-layers={shape.num_layers} is not divisible by pp{pp}")
        # upstream's select_pipeline_segment: the stages are the pattern's '|' segments, or an
        # even split of its layers where it has none
        if hybrid is not None and len(hybrid.segments) == 1 and len(hybrid.symbols) % pp:
            raise ValueError(f"{n}--hybrid-layer-pattern {hybrid.pattern!r}: its "
                             f"{len(hybrid.symbols)} layers are not divisible by pp{pp} (mark "
                             "the stages with '|')")
        if hybrid is not None and len(hybrid.segments) > 1 and len(hybrid.segments) % pp:
            raise ValueError(f"{n}--hybrid-layer-pattern {hybrid.pattern!r}: its "
                             f"{len(hybrid.segments)} '|'-separated segments are not divisible "
                             f"by pp{pp}")
        widths = [("--num-attention-heads", shape.heads),
                  ("--num-query-groups", shape.query_groups), ("--ffn-hidden-size", shape.ffn)]
        for flag, value in widths + shape.terms.widths(shape):
            if value % tp:
                raise ValueError(f"{n}{flag}={value} is not divisible by tp{tp}")
        shape.terms.check_layout(shape, layout)
        if cp > 1 and cpu:
            raise ValueError(f"{n}context parallelism needs a GPU (Megatron's local attention "
                             "on the CPU has no CP): use cp1")
        if cp > 1 and shape.seq_length % (2 * cp):
            raise ValueError(f"{n}--seq-length={shape.seq_length} is not divisible by "
                             f"2 x cp{cp} (causal load balancing splits it in 2 x CP)")
    if layout.global_batch is not None and layout.global_batch % (layout.micro_batch * dp):
        raise ValueError(f"{n}--global-batch-size={layout.global_batch} is not divisible by "
                         f"micro batch {layout.micro_batch} x dp{dp} (every data-parallel rank "
                         f"takes whole micro-batches of the global batch {layout.global_batch})")
