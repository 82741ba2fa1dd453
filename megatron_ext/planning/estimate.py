"""Memory per rank of any family and parallel layout, from numbers alone, beside the model's
parameters and FLOPs per token: the estimate ``--dry-run`` prints (``training/dry_run.py``) and the
run report takes its FLOPs per token from.

Nothing is allocated: the model is a :class:`~megatron_ext.planning.model_shape.ModelShape`
(whose module counts its parameters and FLOPs, and says how), the layout a
:class:`~megatron_ext.planning.layout.Layout` (checked by ``planning/layout.py``'s rules), both
read from Megatron's parsed arguments by :func:`estimate_from_args`.

**Memory per rank** (the busiest pipeline stage, tensor-parallel rank 0):

* weights in the parameter dtype; gradients in Megatron's DDP buffer (fp32 with bf16/fp16, which
  Megatron's ``--accumulate-allreduce-grads-in-fp32`` makes the default); Adam's state: fp32
  master weights (16-bit training only) and two fp32 moments, divided by the data-parallel size
  (the expert-data-parallel size for Sigma's experts) with ``--use-distributed-optimizer``;
* STEM tables that ``--stem-table-placement cpu|tiered`` or ``--stem-table-sharding vocab`` manage are
  not parameters: each rank holds its owned rows (``ceil(V / dp)`` with vocab sharding) of every
  STEM layer, fp32, with two fp32 moments and, for ``--stem-optimizer dense``, an fp32 gradient
  buffer: on the host with ``cpu`` placement, on the GPU with ``gpu``; with ``tiered``, the
  rank's GPU-tier rows on the GPU (``ceil(tier / dp)`` with interleaved ownership; with contiguous
  ownership the whole tier, as the busiest rank may own every frequent id) and its other rows on
  the host; plus two buffers of fetched rows on the GPU (at most ``min(V, s b)`` rows each);
* activations of one micro-batch: per layer the tensors autograd keeps
  (:func:`layer_activation_bytes`; the attention's by the core attention that will run,
  ``Layout.core_attention``, the model's own rule for ``--ext-core-attention``), the causal mask
  of the unfused attention, the token ids, and on the last stage the final
  norm and what the loss keeps (upstream's fp32 softmax, ``4 s b V / t`` bytes; with
  ``--ext-cross-entropy fused`` the logits in the model's dtype and a log-sum-exp per token,
  :func:`loss_bytes`); 1F1B pipelining keeps
  ``min(pp - stage, micro-batches)`` micro-batches in flight on a stage; full recomputation keeps
  each layer's input only, plus one layer's activations while it is recomputed.

On the hybrid path (``--hybrid-layer-pattern``) a stage holds the pattern's layers of its
segments (``|``; an even split of the symbols without one, as upstream's
``select_pipeline_segment``): its attention blocks (``*``) and MLP blocks (``-``/``E``), each with
the norm before it; full recomputation keeps the input of every pattern layer. ``*-`` repeated is
then the GPT path's model, counted alike but for full recomputation (two layer inputs per block
instead of one).

Not counted: CUDA context, NCCL and allocator fragmentation (budget 2-5 GiB per GPU), Megatron's
distributed-optimizer communication buckets, and temporary buffers of fused kernels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_ext.planning.layout import Layout, validate_layout
from megatron_ext.planning.model_shape import (
    ModelShape,
    Parts,
    active_params,
    attention_block_parts,
    mlp_block_parts,
    model_parts,
    paper_active_params,
    stem_table_params,
    training_flops_per_token,
)


# How a report names each part of the memory per rank (the keys of ``Estimate.gpu_bytes`` and
# ``host_bytes``): the dry run's and the start-up memory check's messages.
LABELS = {
    "weights": "weights", "gradients": "gradients (DDP buffer)",
    "optimizer": "optimizer states", "activations": "activations",
    "stem_tables": "STEM tables (fp32)", "stem_adam_moments": "STEM Adam moments",
    "stem_table_gradients": "STEM row gradients (dense optimizer)",
    "stem_fetched_rows": "STEM fetched-row buffers",
}


# ---------------------------------------------------------------------------------------------
# activations


def norm_activation_bytes(layout: Layout, hs: float, rows: float) -> float:
    """A norm followed by a linear: what both keep. The local backend's norm (``models/norm.py``,
    fp32 math) keeps its input and the normalised input in fp32, the fp32 ``rstd`` per row and the
    16-bit output the linear reads; Transformer Engine's fused norm keeps the input and ``rstd``."""
    B = layout.act_bytes
    if layout.transformer_engine:
        return 2 * B * hs + 4 * rows
    return 8 * hs + 4 * rows + B * hs


def layer_activation_bytes(spec: ModelShape, layout: Layout, layer: int,
                           topks: Sequence[int]) -> float:
    """Bytes autograd keeps for one GPT-path layer (attention block and MLP block ``layer``) and
    one micro-batch on one rank: :func:`attention_activation_bytes` plus
    :func:`mlp_activation_bytes`.

    ``s`` the local sequence, ``b`` the micro batch, ``t`` the TP size, ``B`` bytes per element of
    the training dtype; ``hs = s b h`` (divided by ``t`` with sequence parallelism). Checked
    against the tensors the local backend really saves (``tests/test_estimate.py``):

    * two norms, each with the linear after it (:func:`norm_activation_bytes`);
    * QK-norm (local backend): the fp32 input and normalised Q and K and their ``rstd``;
    * attention: the fused QKV output ``s b (a + 2g) d / t`` (V is a view of it), with RoPE new Q
      and K ``s b (a + g) d / t`` and the cos/sin tables ``4 s d``; what the core attention that
      runs keeps (:func:`core_attention_bytes`: upstream's unfused one the softmax probabilities
      ``a s^2 b / t``, the fused ones the fp32 log-sum-exp ``a s b / t``); the
      context, the output projection's input ``s b a d / t``; a 1-byte dropout mask of ``hs``
      with hidden dropout (twice per layer);
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
    return (attention_activation_bytes(spec, layout)
            + mlp_activation_bytes(spec, layout, layer, topks))


def _local(spec: ModelShape, layout: Layout):
    """(local sequence, micro batch, sequence-parallel divisor, ``s b h`` per rank, rows)."""
    s = spec.seq_length // layout.cp
    b = layout.micro_batch
    sp = layout.tp if spec.sequence_parallel else 1
    return s, b, sp, s * b * spec.hidden / sp, s * b / sp


def attention_activation_bytes(spec: ModelShape, layout: Layout) -> float:
    """An attention block (its norm, attention, hidden dropout) and one micro-batch."""
    t, B = layout.tp, layout.act_bytes
    s, b, sp, hs, rows = _local(spec, layout)
    n = norm_activation_bytes(layout, hs, rows)
    n += B * s * b * ((spec.q + 2 * spec.kv) + spec.q) / t
    if spec.rope:
        n += B * s * b * (spec.q + spec.kv) / t + 4 * s * spec.head_dim * B
    if spec.qk_norm and not layout.transformer_engine:  # fp32 math of the local norm, Q and K
        n += 4 * s * b * (2 * (spec.q + spec.kv) + spec.heads + spec.query_groups) / t
    n += core_attention_bytes(spec, layout)
    if layout.hidden_dropout:
        n += hs
    return n


def loss_bytes(layout: Layout, s: int, b: int, vocab: int) -> float:
    """What the loss keeps for its backward on the last stage: upstream's cross entropy its fp32
    softmax (``4 s b V / t``); the fused one (``--ext-cross-entropy fused``) the logits in the
    model's dtype and an fp32 log-sum-exp per token."""
    if layout.fused_cross_entropy:
        return layout.param_bytes * s * b * vocab / layout.tp + 4 * s * b
    return 4 * s * b * vocab / layout.tp


def core_attention_bytes(spec: ModelShape, layout: Layout) -> float:
    """What the core attention itself keeps for backward beyond its inputs (one layer, one
    micro-batch), by the core attention that runs (``layout.core_attention``):

    * ``unfused`` (upstream's ``DotProductAttention``): the softmax probabilities
      ``a s^2 b / t`` in the training dtype (the dropout output and a 1-byte mask on top with
      attention dropout) -- the score tensors;
    * ``sdpa`` (PyTorch's fused kernels): the fp32 log-sum-exp ``a s b / t``; the output it
      keeps is the output projection's input (the kernel writes it in the query's layout, so
      ``sdpa_attention.py``'s reshape back is a view), counted with the attention. With the
      batch's mask (``models/sdpa_attention.py`` hands it to the kernel) also the mask PyTorch
      makes additive in the training dtype, ``[b, 1, s, s]`` per layer, and with GQA K and V
      expanded to the heads (``2 s b a d / t``), which then keep neither RoPE's K nor the fused
      QKV output (V's storage) alive. Measured on the CPU (PyTorch's CPU flash kernel,
      ``tests/test_estimate.py``); on a GPU a masked batch takes the memory-efficient kernel,
      whose own output (``s b a d / t`` more) is not counted;
    * ``te`` (Transformer Engine's fused attention): its output and the fp32 log-sum-exp (not
      measured here: no Transformer Engine on these machines);
    * nothing with selective recomputation of ``core_attn`` (upstream checkpoints any core
      attention; its inputs are kept anyway)."""
    t, B = layout.tp, layout.act_bytes
    s, b = spec.seq_length // layout.cp, layout.micro_batch
    if layout.recompute == "selective" and "core_attn" in layout.recompute_modules:
        return 0.0
    if layout.core_attention == "unfused":
        scores = spec.heads * s * s * b / t
        return B * scores + ((B * scores + scores) if layout.attention_dropout else 0.0)
    n = 4 * spec.heads * s * b / t
    if layout.core_attention == "te":
        n += B * s * b * spec.q / t
    if layout.core_attention == "sdpa" and layout.attention_mask:
        n += B * s * s * b
        if spec.query_groups < spec.heads:  # upstream's repeat_interleave before the kernel
            n += 2 * B * s * b * spec.q / t
            if spec.rope and not spec.qk_norm:  # Q is RoPE's own tensor: nothing views QKV
                n -= B * s * b * ((spec.q + 2 * spec.kv) + spec.kv) / t
    return n


def mlp_activation_bytes(spec: ModelShape, layout: Layout, layer: int,
                         topks: Sequence[int]) -> float:
    """MLP block ``layer`` (its norm, the family's MLP, hidden dropout) and one micro-batch."""
    s, b, sp, hs, rows = _local(spec, layout)
    n = norm_activation_bytes(layout, hs, rows)
    if layout.hidden_dropout:
        n += hs
    return n + spec.terms.mlp_activation_bytes(spec, layout, layer, topks, s, b, sp)


# ---------------------------------------------------------------------------------------------
# the estimate


@dataclass
class Estimate:
    model: ModelShape
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
        layout = {k: v for k, v in asdict(self.layout).items() if k != "name"}
        out["layout"] = dict(layout, dp=self.layout.dp,
                             expert_dp=self.layout.expert_dp,
                             microbatches=self.layout.microbatches)
        out["train_flops_per_token"] = self.train_flops_per_token
        out["gpu_total_bytes"] = sum(self.gpu_bytes.values())
        out["host_total_bytes"] = sum(self.host_bytes.values())
        return out


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Megatron's even split of the decoder layers over pipeline stages (the layout rules refuse
    an uneven one)."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


@dataclass(frozen=True)
class StageBlocks:
    """What one pipeline stage holds: its attention blocks, the indices of its MLP blocks (the
    family's layer index) and the layers whose input full recomputation keeps."""

    attention: int
    mlp: List[int]
    layers: int


def stage_blocks(spec: ModelShape, layout: Layout, stage: int) -> StageBlocks:
    """The blocks of pipeline stage ``stage``: Megatron's even split of the transformer layers
    (GPT path), or the pattern's segments the stage builds (hybrid path; upstream's
    ``select_pipeline_segment``: segment ``k`` on stage ``k % pp``, all virtual chunks)."""
    hybrid = spec.hybrid
    if hybrid is None:
        layers = list(stage_layers(spec.num_layers, layout.pp, stage))
        return StageBlocks(len(layers), layers, len(layers))
    if len(hybrid.segments) == 1:  # no '|': an even split of the symbols
        per = len(hybrid.symbols) // layout.pp
        positions = list(range(stage * per, (stage + 1) * per))
    else:
        positions, start = [], 0
        for k, segment in enumerate(hybrid.segments):
            if k % layout.pp == stage:
                positions += range(start, start + len(segment))
            start += len(segment)
    block = {p: k for k, p in enumerate(hybrid.mlp_positions)}
    return StageBlocks(sum(hybrid.symbols[p] == "*" for p in positions),
                       [block[p] for p in positions if p in block], len(positions))


def rank_parts(spec: ModelShape, layout: Layout, stage: int) -> Parts:
    """Parameters on tensor-parallel rank 0 of pipeline stage ``stage``."""
    tp, pp = layout.tp, layout.pp
    p = Parts()
    blocks = stage_blocks(spec, layout, stage)
    for _ in range(blocks.attention):
        p.add(attention_block_parts(spec, tp))
    for layer in blocks.mlp:
        p.add(mlp_block_parts(spec, layer, tp, layout.ep, layout.expert_tp, layout.stem_managed))
    if stage == 0:
        p.embedding += spec.vocab * spec.hidden // tp + spec.learned_positions * spec.hidden
    if stage == pp - 1:
        p.norms += spec.norm
        if spec.untied:
            p.output_layer += spec.vocab * spec.hidden // tp
        elif pp > 1:  # the last stage keeps a copy of the tied embedding for the output layer
            p.output_layer += spec.vocab * spec.hidden // tp
    return p


def _stage_memory(spec: ModelShape, layout: Layout, stage: int, topks: Sequence[int]):
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
    blocks = stage_blocks(spec, layout, stage)
    layers = blocks.mlp
    B = layout.act_bytes
    s = spec.seq_length // layout.cp
    b = layout.micro_batch
    hs = s * b * spec.hidden / (layout.tp if spec.sequence_parallel else 1)
    attention = attention_activation_bytes(spec, layout)
    mlp = [mlp_activation_bytes(spec, layout, i, topks) for i in layers]
    if spec.hybrid is None:  # a recomputed GPT layer is one attention and one MLP block
        full = [attention + m for m in mlp]
    else:  # a recomputed hybrid layer is one block
        full = [attention] * min(blocks.attention, 1) + mlp
    if layout.recompute == "full":
        one_microbatch = blocks.layers * hs * B + (max(full) if full else 0)
    else:
        one_microbatch = blocks.attention * attention + sum(mlp)
    if layout.core_attention == "unfused" and layout.recompute is None:
        one_microbatch += s * s * b  # the causal mask (bool), shared by the layers
    rows = s * b / (layout.tp if spec.sequence_parallel else 1)
    if stage == layout.pp - 1:  # final norm + output layer input, what the loss keeps
        one_microbatch += norm_activation_bytes(layout, hs, rows) + loss_bytes(layout, s, b,
                                                                               spec.vocab)
    if stage == 0:
        one_microbatch += 8 * s * b  # token ids
    if layout.pp > 1:
        in_flight = min(layout.pp - stage, layout.microbatches)
        if layout.virtual_pp:
            factor = 1 + (layout.pp - 1) / (layout.pp * layout.virtual_pp)
            in_flight = min(math.ceil(layout.pp * factor) - stage, layout.microbatches)
    else:
        in_flight = 1
    gpu["activations"] = in_flight * one_microbatch
    host["_one_microbatch_activations"] = one_microbatch  # popped by the callers
    spec.terms.stage_memory(spec, layout, layers, s, b, gpu, host)  # e.g. managed tables
    return parts, gpu, host


def table_memory(spec: ModelShape, layout: Layout, stage: int
                 ) -> Tuple[Dict[str, float], Dict[str, float]]:
    """The family's memory beyond parameters and activations (STEM's managed tables, their Adam
    moments and fetched-row buffers) on a rank of pipeline stage ``stage``: (GPU bytes, host
    bytes) by part, the terms :func:`estimate` adds; what the start-up check
    (``training/preflight.py``) weighs against the memory available."""
    gpu: Dict[str, float] = {}
    host: Dict[str, float] = {}
    spec.terms.stage_memory(spec, layout, stage_blocks(spec, layout, stage).mlp,
                            spec.seq_length // layout.cp, layout.micro_batch, gpu, host)
    return gpu, host


def rank_estimate(spec: ModelShape, layout: Layout, stage: int) -> Dict[str, float]:
    """The numbers of one rank of pipeline stage ``stage`` (``tests/dist/estimate_check.py``
    compares them with what that rank really holds)."""
    _check(spec, layout)
    parts, gpu, host = _stage_memory(spec, layout, stage, spec.topks)
    one = host.pop("_one_microbatch_activations")
    return {"params": parts.total, "expert_params": parts.experts,
            "weight_bytes": gpu["weights"], "grad_bytes": gpu["gradients"],
            "optimizer_bytes": gpu["optimizer"], "activation_bytes_one_microbatch": one,
            "train_flops_per_token": training_flops_per_token(spec).total}


def _check(spec: ModelShape, layout: Layout) -> None:
    """What the model provider (or Megatron, at its first step) would refuse, refused before
    anything is counted."""
    spec.terms.check(spec)
    validate_layout(layout, spec)


def estimate(spec: ModelShape, layout: Layout) -> Estimate:
    _check(spec, layout)
    topks = spec.topks
    target = spec.target_topks or topks
    whole = model_parts(spec, managed_tables=False)
    flops = training_flops_per_token(spec, topks).as_dict()
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
    if layout.core_attention == "unfused":
        notes.append("attention scores are materialised (--ext-core-attention unfused, "
                     "Megatron's DotProductAttention); sdpa or Transformer Engine removes the "
                     "a s^2 b term")
    emb = spec.vocab * spec.hidden
    return Estimate(
        model=spec, layout=layout, total_params=whole.total,
        stem_table_params=stem_table_params(spec), active_params=active,
        active_params_target=active_params(spec, target),
        active_params_without_embeddings=(active - spec.hidden - emb
                                          - (spec.hidden if spec.learned_positions else 0)),
        paper_active_params=paper_active_params(spec, topks),
        paper_gflops_per_token=2 * paper_active_params(spec, topks) / 1e9,
        flops=flops, flops_target=training_flops_per_token(spec, target).as_dict(),
        rank_params=asdict(parts), rank_expert_params=parts.experts,
        gpu_bytes=gpu, host_bytes=host, busiest_stage=stage, notes=notes)


# ---------------------------------------------------------------------------------------------
# from Megatron's arguments


def estimate_from_args(args, world_size: Optional[int] = None) -> Estimate:
    """The estimate for Megatron's parsed and validated arguments (``padded_vocab_size`` set)."""
    return estimate(ModelShape.from_args(args), Layout.from_args(args, world_size))
