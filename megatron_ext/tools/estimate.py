"""Parameters, FLOPs and memory per rank of any family and parallel layout, from numbers alone.

``--dry-run`` prints these (``tools/dry_run.py``); the scaling harness takes the FLOPs per token
from here. Nothing is allocated: the model is described by :class:`ModelSpec` and the layout by
:class:`Layout`, both read from Megatron's parsed arguments by :func:`estimate_from_args`.

**Parameters** are counted as the model provider builds them (``tests/test_estimate.py`` checks
every family against built models under TP=2 x PP=2, and EP=2 for Sigma):

* attention: QKV ``h (a + 2g) d`` and output ``a d h`` (``a`` heads, ``g`` query groups, ``d``
  head dim), biases ``(a + 2g) d + h`` with ``--add-bias-linear``, QK-norm ``2d`` (RMSNorm;
  LayerNorm ``4d``); two norms of ``h`` per layer (LayerNorm ``2h``) and a final one;
* MLP: ``m h f`` with ``m = 3`` for SwiGLU, 2 otherwise; STEM ``up``/``gate`` layers ``(m - 1) h f``
  plus a ``V x f`` table (``dagger``: ``m h f`` plus the table); StructMoE Eq. 7 of its paper
  (``m h D' + L r (h + D') + h L``); Sigma a router ``E h`` plus ``E`` SwiGLU experts ``3 h F``;
* word embedding ``V h`` (``V`` Megatron's padded vocabulary), learned positions, and the output
  layer ``V h`` when untied.

*Active* parameters per token count one STEM table row (``f``), the selected ``k`` StructMoE
experts (``k r (h + D')``) and Sigma experts (``k_l`` in layer ``l``), one embedding row and the
whole output layer. The STEM paper's Table 3 counts the whole input embedding as active and its
``#GFLOPs`` column, the denominator of its ROI, is ``2 x`` those active parameters: reported as
``paper_active_params`` and ``paper_gflops_per_token``.

**Training FLOPs per token** (forward + backward) follow ``tools/flops.py``: ``6`` per weight a
token multiplies (attention, the MLP's active matmuls, routers, the output layer) plus the
attention core ``12 s a d`` (the full ``s x s`` scores, as Megatron's local attention computes
them). Table lookups and element-wise work are not counted.

**Memory per rank** (the busiest pipeline stage, tensor-parallel rank 0):

* weights in the parameter dtype; gradients in Megatron's DDP buffer (fp32 with bf16/fp16, which
  Megatron's ``--accumulate-allreduce-grads-in-fp32`` makes the default); Adam's state: fp32
  master weights (16-bit training only) and two fp32 moments, divided by the data-parallel size
  (the expert-data-parallel size for Sigma's experts) with ``--use-distributed-optimizer``;
* STEM tables that ``--stem-table-placement cpu`` or ``--stem-table-sharding vocab`` manage are
  not parameters: each rank holds its owned rows (``ceil(V / dp)`` with vocab sharding) of every
  STEM layer, fp32, with two fp32 moments and, for ``--stem-optimizer dense``, an fp32 gradient
  buffer: on the host with ``cpu`` placement, on the GPU otherwise; plus two buffers of fetched
  rows on the GPU (at most ``min(V, s b)`` rows each);
* activations of one micro-batch: per layer the tensors autograd keeps
  (:func:`layer_activation_bytes`), the causal mask, the token ids, and on the last stage the final
  norm and the fp32 logits of the loss (``4 s b V / t`` bytes); 1F1B pipelining keeps
  ``min(pp - stage, micro-batches)`` micro-batches in flight on a stage; full recomputation keeps
  each layer's input only, plus one layer's activations while it is recomputed.

Not counted: CUDA context, NCCL and allocator fragmentation (budget 2-5 GiB per GPU), Megatron's
distributed-optimizer communication buckets, and temporary buffers of fused kernels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple



def family_terms(family: str):
    """The family's estimate terms (``models/terms.py``; the dense MLP's by default)."""
    from megatron_ext.models.registry import get_family
    from megatron_ext.models.terms import MLPTerms

    return get_family(family).estimate_terms or MLPTerms()


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    head_dim: int
    vocab: int  # Megatron's padded vocabulary
    seq_length: int
    gated: bool = True
    bias: bool = False
    qk_norm: bool = False
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm
    untied: bool = True
    learned_positions: int = 0  # rows of a learned position embedding (0: RoPE or none)
    rope: bool = True
    # STEM
    stem_layers: Tuple[int, ...] = ()
    stem_variant: str = "up"
    # StructMoE (every layer)
    smoe_ffn: int = 0  # D'_ff
    smoe_experts: int = 0
    smoe_rank: int = 0
    smoe_topk: int = 0
    # Sigma (every layer MoE)
    experts: int = 0
    expert_ffn: int = 0
    topks: Tuple[int, ...] = ()  # per layer, in effect now
    target_topks: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from megatron_ext.models.registry import registered_families

        if self.family not in registered_families():
            raise ValueError(f"family={self.family!r}: allowed "
                             f"{', '.join(registered_families())}")
        self.terms.check(self)

    @property
    def terms(self):
        return family_terms(self.family)

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

    def is_stem(self, layer: int) -> bool:
        return layer in self.stem_layers  # empty but for STEM

    def stem_replaces_matrix(self) -> bool:
        return self.stem_variant in ("up", "gate")


@dataclass(frozen=True)
class Layout:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int = 1
    distributed_optimizer: bool = False
    recompute: Optional[str] = None  # None, "selective", "full"
    recompute_modules: Tuple[str, ...] = ("core_attn",)
    virtual_pp: Optional[int] = None
    param_bytes: int = 2
    grad_bytes: int = 4
    master_weights: bool = True  # fp32 main params (16-bit training)
    attention_dropout: bool = False
    hidden_dropout: bool = False
    flash_attention: bool = False  # scores are not materialised (TE / flash attention)
    # STEM managed tables
    stem_managed: bool = False
    stem_placement: str = "gpu"
    stem_sharding: str = "replicated"
    stem_optimizer: str = "dense"

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp", "micro_batch", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(f"world size {self.world_size} is not divisible by TP x PP x CP = "
                             f"{self.tp} x {self.pp} x {self.cp}")
        if (self.world_size // self.pp) % (self.ep * self.etp):
            raise ValueError(f"EP x expert-TP = {self.ep} x {self.etp} does not divide the "
                             f"{self.world_size // self.pp} ranks of a pipeline stage")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not divisible by micro batch "
                             f"{self.micro_batch} x data-parallel size {self.dp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def act_bytes(self) -> int:
        return self.param_bytes


# ---------------------------------------------------------------------------------------------
# parameters


@dataclass
class Parts:
    """Parameter counts by part (whole model, or one rank's shards)."""

    embedding: int = 0
    attention: int = 0
    norms: int = 0
    mlp: int = 0  # dense MLP weights (StructMoE: base + LoREs + router)
    routers: int = 0  # Sigma routers
    experts: int = 0  # Sigma experts
    stem_tables: int = 0  # STEM tables that are model parameters (not managed)
    output_layer: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def add(self, other: "Parts") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def attention_params(spec: ModelSpec, tp: int = 1) -> int:
    h = spec.hidden
    n = (h * (spec.q + 2 * spec.kv) + spec.q * h) // tp
    if spec.bias:
        n += (spec.q + 2 * spec.kv) // tp + h  # the row-parallel bias is not split
    if spec.qk_norm:
        n += 2 * spec.head_dim * (2 if spec.layernorm else 1)
    return n


def mlp_params(spec: ModelSpec, layer: int, tp: int = 1) -> int:
    """Dense MLP weights of one layer (StructMoE: all of its MLP), tables and Sigma excluded."""
    return spec.terms.mlp_params(spec, layer, tp)


def layer_parts(spec: ModelSpec, layer: int, tp: int = 1, ep: int = 1, etp: int = 1,
                managed_tables: bool = False) -> Parts:
    p = Parts(attention=attention_params(spec, tp), norms=2 * spec.norm,
              mlp=mlp_params(spec, layer, tp))
    spec.terms.add_layer_parts(spec, layer, p, tp, ep, etp, managed_tables)
    return p


def model_parts(spec: ModelSpec, managed_tables: bool = False) -> Parts:
    """The whole model, each parameter once."""
    total = Parts(embedding=spec.vocab * spec.hidden + spec.learned_positions * spec.hidden,
                  norms=spec.norm, output_layer=spec.vocab * spec.hidden if spec.untied else 0)
    for layer in range(spec.num_layers):
        total.add(layer_parts(spec, layer, managed_tables=managed_tables))
    return total


def stem_table_params(spec: ModelSpec) -> int:
    return spec.terms.table_params(spec)


def active_params(spec: ModelSpec, topks: Optional[Sequence[int]] = None) -> int:
    """Parameters one token uses in a forward pass: every dense weight and norm (biases too),
    one embedding row, one row of each STEM table, the selected experts, the output layer."""
    topks = spec.topks if topks is None else topks
    h = spec.hidden
    n = h + (h if spec.learned_positions else 0) + spec.norm + spec.vocab * h
    for layer in range(spec.num_layers):
        n += attention_params(spec) + 2 * spec.norm + mlp_params(spec, layer)
        n += spec.terms.active_extra(spec, layer, topks)
    return n


def paper_active_params(spec: ModelSpec, topks: Optional[Sequence[int]] = None) -> int:
    """The STEM paper's Table 3 convention: the whole input embedding counts as active."""
    return active_params(spec, topks) - spec.hidden + spec.vocab * spec.hidden


# ---------------------------------------------------------------------------------------------
# FLOPs


def training_flops_per_token(spec: ModelSpec, topks: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """Training (forward + backward) FLOPs per token by part."""
    topks = spec.topks if topks is None else topks
    h = spec.hidden
    attn_w = h * (spec.q + 2 * spec.kv) + spec.q * h
    mlp = 0.0
    for layer in range(spec.num_layers):
        mlp += spec.terms.mlp_flops(spec, layer, topks)
    parts = {
        "attention_linear": 6.0 * spec.num_layers * attn_w,
        "attention_core": 12.0 * spec.num_layers * spec.seq_length * spec.q,
        "mlp": mlp,
        "output_layer": 6.0 * h * spec.vocab,
    }
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------
# activations


def norm_activation_bytes(layout: Layout, hs: float, rows: float) -> float:
    """A norm followed by a linear: what both keep. The local backend's norm (``models/norm.py``,
    fp32 math) keeps its input and the normalised input in fp32, the fp32 ``rstd`` per row and the
    16-bit output the linear reads; Transformer Engine's fused norm keeps the input and ``rstd``."""
    B = layout.act_bytes
    if layout.flash_attention:  # Transformer Engine
        return 2 * B * hs + 4 * rows
    return 8 * hs + 4 * rows + B * hs


def layer_activation_bytes(spec: ModelSpec, layout: Layout, layer: int,
                           topks: Sequence[int]) -> float:
    """Bytes autograd keeps for one layer and one micro-batch on one rank.

    ``s`` the local sequence, ``b`` the micro batch, ``t`` the TP size, ``B`` bytes per element of
    the training dtype; ``hs = s b h`` (divided by ``t`` with sequence parallelism). Checked
    against the tensors the local backend really saves (``tests/test_estimate.py``):

    * two norms, each with the linear after it (:func:`norm_activation_bytes`);
    * QK-norm (local backend): the fp32 input and normalised Q and K and their ``rstd``;
    * attention: the fused QKV output ``s b (a + 2g) d / t`` (V is a view of it), with RoPE new Q
      and K ``s b (a + g) d / t`` and the cos/sin tables ``4 s d``; the softmax probabilities
      ``a s^2 b / t`` (local backend without selective recomputation of the core; the fp16/bf16
      dropout output and a 1-byte mask on top with attention dropout); Transformer Engine's flash
      attention keeps the output and the fp32 log-sum-exp ``a s b / t`` instead; the context, the
      output projection's input ``s b a d / t``; a 1-byte dropout mask of ``hs`` with hidden
      dropout (twice per layer);
    * MLP: SwiGLU ``5 s b f / t`` (fc1's output, ``2f`` wide, and three ``f``-wide tensors of the
      unfused SwiGLU: the SiLU output, the product and the fc2 input), a plain activation
      ``2 s b f / t``; STEM layers the gate output, the gathered rows, the SiLU output and the
      product (``4 s b f / t``) and the int64 ids; StructMoE the dense terms of ``D'`` plus the
      routed update ``s b D' / t`` and the fp32 router probabilities ``s b L``; Sigma the fp32
      router logits and probabilities ``2 s b E``, the tokens permuted to and from the experts
      ``2 k s b h`` and each routed copy's ``5 F / etp`` SwiGLU terms.

    Measured on the local backend (CPU, ``tests/test_estimate.py``): dense and STEM layers within
    1% of the bytes really saved; StructMoE and Sigma, whose routing keeps index and gather
    tensors this model does not itemise, within 15% (the estimate is lower).
    """
    t = layout.tp
    s = spec.seq_length // layout.cp
    b = layout.micro_batch
    B = layout.act_bytes
    sp = t if layout.sequence_parallel else 1
    hs = s * b * spec.hidden / sp
    rows = s * b / sp
    n = 2 * norm_activation_bytes(layout, hs, rows)
    # attention block
    n += B * s * b * ((spec.q + 2 * spec.kv) + spec.q) / t
    if spec.rope:
        n += B * s * b * (spec.q + spec.kv) / t + 4 * s * spec.head_dim * B
    if spec.qk_norm and not layout.flash_attention:  # fp32 math of the local norm, Q and K
        n += 4 * s * b * (2 * (spec.q + spec.kv) + spec.heads + spec.query_groups) / t
    core_recomputed = layout.recompute == "selective" and "core_attn" in layout.recompute_modules
    if layout.flash_attention:
        n += B * s * b * spec.q / t + 4 * spec.heads * s * b / t
    elif not core_recomputed:
        scores = spec.heads * s * s * b / t
        n += B * scores
        if layout.attention_dropout:
            n += B * scores + scores
    if layout.hidden_dropout:
        n += 2 * hs
    # MLP block
    n += spec.terms.mlp_activation_bytes(spec, layout, layer, topks, s, b, sp)
    return n


# ---------------------------------------------------------------------------------------------
# the estimate


@dataclass
class Estimate:
    model: ModelSpec
    layout: Layout
    total_params: int
    stem_table_params: int
    active_params: int
    active_params_target: int  # Sigma: after the sparsification switch
    active_params_without_embeddings: int
    paper_active_params: int
    paper_gflops_per_token: float
    flops: Dict[str, float]
    flops_target: Dict[str, float]
    rank_params: Dict[str, int]  # the busiest rank, by part
    rank_expert_params: int
    gpu_bytes: Dict[str, float] = field(default_factory=dict)
    host_bytes: Dict[str, float] = field(default_factory=dict)
    busiest_stage: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def train_flops_per_token(self) -> float:
        return self.flops["total"]

    @property
    def forward_flops_per_token(self) -> float:
        return self.flops["total"] / 3.0

    def as_dict(self) -> Dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if k not in ("model", "layout")}
        out["model"] = asdict(self.model)
        out["layout"] = dict(asdict(self.layout), dp=self.layout.dp,
                             expert_dp=self.layout.expert_dp,
                             microbatches=self.layout.microbatches)
        out["train_flops_per_token"] = self.train_flops_per_token
        out["gpu_total_bytes"] = sum(self.gpu_bytes.values())
        out["host_total_bytes"] = sum(self.host_bytes.values())
        return out


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Megatron's even split of the decoder layers over pipeline stages."""
    if num_layers % pp:
        raise ValueError(f"--num-layers={num_layers} is not divisible by the pipeline size {pp} "
                         "(the estimate assumes Megatron's even split)")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def rank_parts(spec: ModelSpec, layout: Layout, stage: int) -> Parts:
    """Parameters on tensor-parallel rank 0 of pipeline stage ``stage``."""
    tp, pp = layout.tp, layout.pp
    p = Parts()
    for layer in stage_layers(spec.num_layers, pp, stage):
        p.add(layer_parts(spec, layer, tp, layout.ep, layout.etp, layout.stem_managed))
    if stage == 0:
        p.embedding += spec.vocab * spec.hidden // tp + spec.learned_positions * spec.hidden
    if stage == pp - 1:
        p.norms += spec.norm
        if spec.untied:
            p.output_layer += spec.vocab * spec.hidden // tp
        elif pp > 1:  # the last stage keeps a copy of the tied embedding for the output layer
            p.output_layer += spec.vocab * spec.hidden // tp
    return p


def _stage_memory(spec: ModelSpec, layout: Layout, stage: int, topks: Sequence[int]):
    parts = rank_parts(spec, layout, stage)
    n = parts.total
    experts = parts.experts
    dense = n - experts
    gpu: Dict[str, float] = {}
    host: Dict[str, float] = {}
    gpu["weights"] = n * layout.param_bytes
    gpu["gradients"] = n * layout.grad_bytes
    state = (4 if layout.master_weights else 0) + 8
    if layout.distributed_optimizer:
        gpu["optimizer"] = state * (dense / layout.dp + experts / layout.expert_dp)
    else:
        gpu["optimizer"] = state * n
    # activations
    layers = list(stage_layers(spec.num_layers, layout.pp, stage))
    B = layout.act_bytes
    s = spec.seq_length // layout.cp
    b = layout.micro_batch
    hs = s * b * spec.hidden / (layout.tp if layout.sequence_parallel else 1)
    full = [layer_activation_bytes(spec, layout, i, topks) for i in layers]
    if layout.recompute == "full":
        one_microbatch = len(layers) * hs * B + (max(full) if full else 0)
    else:
        one_microbatch = sum(full)
    if not layout.flash_attention and layout.recompute is None:
        one_microbatch += s * s * b  # the causal mask (bool), shared by the layers
    rows = s * b / (layout.tp if layout.sequence_parallel else 1)
    if stage == layout.pp - 1:  # final norm + output layer input, fp32 logits of the loss
        one_microbatch += norm_activation_bytes(layout, hs, rows) + 4 * s * b * spec.vocab / layout.tp
    if stage == 0:
        one_microbatch += 8 * s * b  # token ids
    if layout.pp > 1:
        in_flight = min(layout.pp - stage, layout.microbatches)
        if layout.virtual_pp:
            in_flight = min(math.ceil(layout.pp * (1 + (layout.pp - 1) / (layout.pp * layout.virtual_pp)))
                            - stage, layout.microbatches)
    else:
        in_flight = 1
    gpu["activations"] = in_flight * one_microbatch
    host["_one_microbatch_activations"] = one_microbatch  # popped by the callers
    spec.terms.stage_memory(spec, layout, layers, s, b, gpu, host)  # e.g. managed tables
    return parts, gpu, host


def rank_estimate(spec: ModelSpec, layout: Layout, stage: int) -> Dict[str, float]:
    """The numbers of one rank of pipeline stage ``stage`` (``tests/dist/estimate_check.py``
    compares them with what that rank really holds)."""
    parts, gpu, host = _stage_memory(spec, layout, stage, spec.topks)
    one = host.pop("_one_microbatch_activations")
    return {"params": parts.total, "expert_params": parts.experts,
            "weight_bytes": gpu["weights"], "grad_bytes": gpu["gradients"],
            "optimizer_bytes": gpu["optimizer"], "activation_bytes_one_microbatch": one,
            "train_flops_per_token": training_flops_per_token(spec)["total"]}


def check_divisibility(spec: ModelSpec, layout: Layout) -> None:
    """What the model provider would refuse for this layout, refused before building."""
    t = layout.tp
    widths = [("--ffn-hidden-size", spec.ffn), ("--num-attention-heads", spec.heads),
              ("query groups", spec.query_groups)]
    widths += spec.terms.widths(spec)
    for name, value in widths:
        if value % t:
            raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {t}")
    spec.terms.check_layout(spec, layout)
    stage_layers(spec.num_layers, layout.pp, 0)


def estimate(spec: ModelSpec, layout: Layout) -> Estimate:
    check_divisibility(spec, layout)
    topks = spec.topks
    target = spec.target_topks or topks
    whole = model_parts(spec, managed_tables=False)
    flops = training_flops_per_token(spec, topks)
    best = None
    for stage in range(layout.pp):
        parts, gpu, host = _stage_memory(spec, layout, stage, topks)
        host.pop("_one_microbatch_activations")
        key = sum(gpu.values())
        if best is None or key > best[0]:
            best = (key, stage, parts, gpu, host)
    _, stage, parts, gpu, host = best
    active = active_params(spec, topks)
    notes = []
    if layout.virtual_pp:
        notes.append("interleaved pipeline: activations use the (1 + (p-1)/(p v)) in-flight "
                     "factor of the 1F1B-interleaved schedule")
    if not layout.flash_attention:
        notes.append("attention scores are materialised (local backend); TE/flash attention "
                     "removes the a s^2 b term")
    emb = spec.vocab * spec.hidden
    return Estimate(
        model=spec, layout=layout, total_params=whole.total,
        stem_table_params=stem_table_params(spec), active_params=active,
        active_params_target=active_params(spec, target),
        active_params_without_embeddings=(active - spec.hidden - emb
                                          - (spec.hidden if spec.learned_positions else 0)),
        paper_active_params=paper_active_params(spec, topks),
        paper_gflops_per_token=2 * paper_active_params(spec, topks) / 1e9,
        flops=flops, flops_target=training_flops_per_token(spec, target),
        rank_params=asdict(parts), rank_expert_params=parts.experts,
        gpu_bytes=gpu, host_bytes=host, busiest_stage=stage, notes=notes)


# ---------------------------------------------------------------------------------------------
# from Megatron's arguments


def spec_from_args(args) -> ModelSpec:
    from megatron_ext.models.registry import family_config

    family = args.model_family
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    heads = args.num_attention_heads
    head_dim = args.kv_channels or args.hidden_size // heads
    kw = dict(
        family=family, num_layers=args.num_layers, hidden=args.hidden_size,
        ffn=args.ffn_hidden_size, heads=heads, query_groups=groups or heads, head_dim=head_dim,
        vocab=args.padded_vocab_size, seq_length=args.seq_length, gated=bool(args.swiglu),
        bias=bool(args.add_bias_linear), qk_norm=bool(getattr(args, "qk_layernorm", False)),
        layernorm=args.normalization == "LayerNorm",
        untied=bool(args.untie_embeddings_and_output_weights),
        learned_positions=(args.max_position_embeddings
                           if args.position_embedding_type == "learned_absolute" else 0),
        rope=args.position_embedding_type == "rope")
    kw.update(family_terms(family).spec_fields(args, family_config(args)))
    return ModelSpec(**kw)


def layout_from_args(args, world_size: Optional[int] = None) -> Layout:
    from megatron_ext.models.registry import family_config

    sixteen = bool(args.bf16 or args.fp16)
    modules = tuple(getattr(args, "recompute_modules", None) or ("core_attn",))
    flash = (args.transformer_impl == "transformer_engine"
             or bool(getattr(args, "use_flash_attn", False)))
    return Layout(
        world_size=world_size or args.world_size, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        sequence_parallel=bool(args.sequence_parallel), micro_batch=args.micro_batch_size,
        global_batch=args.global_batch_size,
        distributed_optimizer=bool(args.use_distributed_optimizer),
        recompute=args.recompute_granularity, recompute_modules=modules,
        virtual_pp=getattr(args, "virtual_pipeline_model_parallel_size", None),
        param_bytes=2 if sixteen else 4,
        grad_bytes=4 if (args.accumulate_allreduce_grads_in_fp32 or not sixteen) else 2,
        master_weights=sixteen, attention_dropout=args.attention_dropout > 0,
        hidden_dropout=args.hidden_dropout > 0, flash_attention=flash,
        **family_terms(args.model_family).layout_fields(args, family_config(args)))


def estimate_from_args(args, world_size: Optional[int] = None) -> Estimate:
    """The estimate for Megatron's parsed and validated arguments (``padded_vocab_size`` set)."""
    return estimate(spec_from_args(args), layout_from_args(args, world_size))
