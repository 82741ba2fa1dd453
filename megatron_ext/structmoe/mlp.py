"""The StructMoE MLP (Eqs. 5-6 of the StructMoE paper) as a Megatron-Core MLP submodule.

Layout (extends ``megatron.core.transformer.mlp.MLP``)::

    linear_fc1  W1'  H -> D'   (SwiGLU: [W_gate'; W_up'] -> 2 D')   column-parallel
    router      W_R  [L, H]                                          replicated, fp32 compute
    lore_a      A    [L, H, r]                                       replicated
    lore_b      B    [L, r, D'/tp]                                   column-parallel (split along D')
    linear_fc2  W2'  D' -> H                                         row-parallel

Routed update ``R(x) = sum_{l in topk} s_l(x) x A_l B_l`` (Eq. 5) joins the base:

    additive, plain activation   y = W2'( act(x W1' + R) )                      (Eqs. 5-6)
    additive, SwiGLU             y = W2'( silu(x W_gate' + R) * x W_up' )      (before the activation)
    glu,      plain activation   y = W2'( act(x W1') * (1 + R) )
    glu,      SwiGLU             y = W2'( silu(x W_gate') * x W_up' * (1 + R) )

The GLU mode (Sec. 3.2: "the routed path modulates the activated base multiplicatively") is read as
``1 + R`` so that a small routed path starts near the dense MLP.

Stored width (``--structmoe-ffn-pad-to N``): ``W1'``, ``B`` and ``W2'`` may be stored ``S`` wide,
``D'`` rounded up to a multiple of ``N``, the columns ``D' .. S`` (of each half of a gated
``W1'``) zeros. A zero column of ``W1'`` and ``B`` gives a zero pre-activation, ``act(0) = 0``
(checked at construction) a zero input of ``W2'``'s zero column, so every gradient of the padding
is exactly zero and AdamW (decay included) keeps it zero: the model is the ``D'`` model, whose
GEMMs run at widths cuBLAS's aligned bf16 kernels take (``D' = 6618`` is not a multiple of 8). The
padding sits at the global end of ``D'`` (under TP, on the last ranks), so the stored tensors do
not depend on the TP size, and the real columns are drawn as the unpadded model draws them.

Tensor parallelism: the routed codes ``s_l(x) x A_l`` are computed on the full (replicated or
sequence-gathered) input on every TP rank, then pass Megatron's
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) before this rank's
shard of B, so A, the router and x get complete gradients on every rank. Under sequence
parallelism the routed input is gathered with ``tensor_parallel_output_grad=False`` (its gradient
is already complete; backward takes this rank's chunk).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.compiled import compile_region
from megatron_ext.models.sharding import mlp_sharded_state_dict
from megatron_ext.structmoe.balance import attach_and_record, lbl_statistics
from megatron_ext.structmoe.config import StructMoEConfig, layer_budget
from megatron_ext.structmoe.routed import expand_into_stage, resolve_backend, route_codes_stages


def small_init(fan_in: int):
    """SmallInit (Sec. 3.6): N(0, 2 / (5 d)) for input dimension d."""
    std = math.sqrt(2.0 / (5.0 * fan_in))
    return lambda t: torch.nn.init.normal_(t, mean=0.0, std=std)


def deepnorm_init(fan_in: int, num_layers: int):
    """DeepNorm-style output init (Sec. 3.6): N(0, (2 / (N_layers sqrt(d)))^2)."""
    std = 2.0 / (num_layers * math.sqrt(fan_in))
    return lambda t: torch.nn.init.normal_(t, mean=0.0, std=std)


def check_padding_activation(act) -> None:
    """The padding stays zero only if ``act(0) = 0`` (module docstring)."""
    if float(act(torch.zeros(1))[0]) != 0.0:
        raise ValueError(f"--structmoe-ffn-pad-to: the activation {getattr(act, '__name__', act)}"
                         " is not 0 at 0, so zero columns of D'_ff would not stay zero; use "
                         "--structmoe-ffn-pad-to 1")


def padded_init(init, real: int, stored: int, dim: int, halves: int):
    """``init`` for a weight whose axis ``dim`` holds ``halves`` blocks ``stored`` wide (fc1's
    ``[gate; up]``: 2). Given the whole weight (Megatron's CPU initialization draws it whole
    before splitting it across TP ranks; any initialization at TP=1), it draws the unpadded
    weight as the unpadded model would and places each block's ``real`` columns, zeros after
    them; given one rank's partition (GPU initialization under TP), it draws the partition as it
    is and the padding is zeroed after construction (``zero_padding``)."""
    def run(t: torch.Tensor):
        if t.shape[dim] != halves * stored:
            return init(t)
        shape = list(t.shape)
        shape[dim] = halves * real
        src = torch.empty(shape, dtype=t.dtype, device=t.device)
        init(src)
        with torch.no_grad():
            t.zero_()
            for h in range(halves):
                t.narrow(dim, h * stored, real).copy_(src.narrow(dim, h * real, real))
        return t
    return run


def zero_padding(weight: torch.Tensor, real: int, offset: int, dim: int, halves: int) -> None:
    """Zero this rank's columns of the stored D'_ff past ``real``: axis ``dim`` of ``weight``
    holds ``halves`` blocks, each this rank's slice of D'_ff starting at global column
    ``offset``."""
    width = weight.shape[dim] // halves
    keep = max(0, min(width, real - offset))
    if keep == width:
        return
    for h in range(halves):
        weight.narrow(dim, h * width + keep, width - keep).zero_()


class StructMoEMLP(MegatronModule):
    """``mlp_block`` (1-based) and ``num_mlp_blocks``: which MLP block of the model this is and how
    many there are, for the DeepNorm depth and the per-block router metrics. Not given (the GPT
    path), every transformer layer is one block: ``config.num_layers`` of them, the block number
    being the layer number ``TransformerLayer`` sets. The hybrid path gives both (its spec counts
    the ``-`` symbols), since there ``config.num_layers`` and the layer number count every symbol of
    ``--hybrid-layer-pattern`` (8 layers and positions 2, 4, 6, 8 for ``*-*-*-*-``)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules,
                 structmoe: StructMoEConfig, tp_group=None, name: Optional[str] = None,
                 mlp_block: Optional[int] = None, num_mlp_blocks: Optional[int] = None):
        super().__init__(config=config)
        self.smoe = structmoe
        self.num_mlp_blocks = num_mlp_blocks if num_mlp_blocks is not None else config.num_layers
        if mlp_block is not None and not 1 <= mlp_block <= self.num_mlp_blocks:
            raise ValueError(f"StructMoE MLP block {mlp_block}: out of 1..{self.num_mlp_blocks}")
        self.gated = bool(config.gated_linear_unit)
        self.budget = layer_budget(structmoe, config.hidden_size, config.ffn_hidden_size,
                                   self.gated)
        ffn, stored = self.budget.ffn, self.budget.storage_ffn
        self.tp_group = tp_group
        self.tp_size = tp_group.size() if tp_group is not None else 1
        self.tp_rank = tp_group.rank() if tp_group is not None else 0
        if stored % self.tp_size:
            what = f"D'_ff={ffn}" + (f" stored as {stored}" if stored != ffn else "")
            raise ValueError(f"StructMoE {what} is not divisible by "
                             f"--tensor-model-parallel-size={self.tp_size}; choose "
                             "--structmoe-ffn-hidden-size or --structmoe-ffn-pad-to")
        if stored != ffn:
            check_padding_activation(config.activation_func)
        self.ffn_per_partition = stored // self.tp_size
        hidden, n_exp, rank = config.hidden_size, structmoe.num_experts, structmoe.rank
        small = structmoe.init == "small"
        fc1_init = small_init(hidden) if small else config.init_method
        # DeepNorm's N is the number of MLP blocks (Sec. 3.6), not the hybrid path's symbols;
        # its fan-in is the model's D'_ff, not the stored width.
        fc2_init = (deepnorm_init(ffn, self.num_mlp_blocks) if small
                    else config.output_layer_init_method)
        halves = 2 if self.gated else 1
        if stored != ffn:
            fc1_init = padded_init(fc1_init, ffn, stored, 0, halves)
            fc2_init = padded_init(fc2_init, ffn, stored, 1, 1)

        self.linear_fc1 = submodules.linear_fc1(
            hidden, 2 * stored if self.gated else stored, config=config, init_method=fc1_init,
            gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="fc1", tp_group=tp_group, stride=2 if self.gated else 1,
            name=(name + ".linear_fc1") if name is not None else None)
        self.activation_func = config.activation_func
        self.linear_fc2 = submodules.linear_fc2(
            stored, hidden, config=config, init_method=fc2_init, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="fc2", tp_group=tp_group,
            name=(name + ".linear_fc2") if name is not None else None)

        # Replicated parameters are drawn identically on every TP rank (same CPU seed); B is drawn
        # whole and sliced along D', so values do not depend on the TP size.
        gen_init = small_init if small else (lambda _: config.init_method)
        self.router = torch.nn.Parameter(self._draw((n_exp, hidden), gen_init(hidden)))
        self.lore_a = torch.nn.Parameter(self._draw((n_exp, hidden, rank), gen_init(hidden)))
        full_b = self._draw((n_exp, rank, ffn), gen_init(rank))
        if stored != ffn:
            full_b = torch.nn.functional.pad(full_b, (0, stored - ffn))
        shard = slice(self.tp_rank * self.ffn_per_partition,
                      (self.tp_rank + 1) * self.ffn_per_partition)
        self.lore_b = torch.nn.Parameter(full_b[..., shard].contiguous())
        for p, parallel in ((self.router, False), (self.lore_a, False), (self.lore_b, True)):
            setattr(p, "tensor_model_parallel", parallel)
            setattr(p, "partition_dim", 2 if parallel else -1)
            setattr(p, "partition_stride", 1)
        if stored != ffn:
            # Whatever drew them (a rank's own partition under GPU initialization, Transformer
            # Engine's linears, no initialization before a load), the padding starts at zero.
            with torch.no_grad():
                zero_padding(self.linear_fc1.weight, ffn, self.tp_rank * self.ffn_per_partition,
                             0, halves)
                zero_padding(self.linear_fc2.weight, ffn, self.tp_rank * self.ffn_per_partition,
                             1, 1)
        self.backend = resolve_backend(structmoe.backend)
        # A fused backend (triton) computes the routing with the codes; the others run route().
        self.route_codes_fn, self.expand_fn = route_codes_stages(self.backend, structmoe.compile)
        # --structmoe-compile routed: the load-balancing statistics compiled too (balance.py).
        self.lbl_statistics_fn = (compile_region(lbl_statistics) if structmoe.compile == "routed"
                                  else None)
        self.expand_into_fn = expand_into_stage(self.backend)
        # The MLP block (1-based, global) under which the router metrics are recorded.
        self.mlp_block = mlp_block
        self.layer_number = mlp_block

    def set_layer_number(self, layer_number: int) -> None:
        """Called by ``TransformerLayer`` as for upstream's MoE layer: on the GPT path the layer is
        the MLP block; a block number given at construction (the hybrid path, where the layer
        number is a pattern position) stays."""
        if self.mlp_block is None:
            self.layer_number = layer_number

    def _draw(self, shape, init) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        if self.config.perform_initialization:
            init(t)
        return t.to(self.config.params_dtype)

    @classmethod
    def as_mlp_submodule(cls, submodules: MLPSubmodules, structmoe: StructMoEConfig,
                         config: TransformerConfig, pg_collection, is_mtp_layer: bool = False,
                         name: Optional[str] = None, mlp_block: Optional[int] = None,
                         num_mlp_blocks: Optional[int] = None) -> "StructMoEMLP":
        """Builder matching megatron-core 0.18+'s ``submodules.mlp(config=, pg_collection=, ...)``."""
        return cls(config=config, submodules=submodules, structmoe=structmoe,
                   tp_group=pg_collection.tp, name=name, mlp_block=mlp_block,
                   num_mlp_blocks=num_mlp_blocks)

    def routed_update(self, hidden_states: torch.Tensor,
                      into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``R(x)`` for this rank's D' shard, laid out like ``linear_fc1``'s output; with
        ``into`` (that output), ``into + R(x)``, added in place by the expand GEMM where the
        backend can (dense-masked, triton)."""
        x = hidden_states
        if self.config.sequence_parallel and self.tp_size > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                     group=self.tp_group)
        s, b, h = x.shape
        x2d = x.reshape(s * b, h)
        routing, codes = self.route_codes_fn(x2d, self.router, self.lore_a, self.smoe.topk)
        if self.tp_size > 1:
            codes = copy_to_tensor_model_parallel_region(codes, group=self.tp_group)
        if into is None:
            update = self.expand_fn(codes, self.lore_b, routing).view(s, b, -1)
        else:
            update = self.expand_into_fn(into, codes, self.lore_b, routing)
        return attach_and_record(update, routing, self.smoe.aux_loss_coeff, self.layer_number,
                                 self.num_mlp_blocks, self.lbl_statistics_fn) \
            if self.training else update

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        base, _ = self.linear_fc1(hidden_states)
        act = self.activation_func
        if not self.gated and self.smoe.fusion == "additive":
            # Eq. 6's x W1' + R(x) in one pass: the update is added into fc1's output (no
            # [tokens, D'] update tensor, no separate add).
            return self.linear_fc2(act(self.routed_update(hidden_states, into=base)))
        update = self.routed_update(hidden_states).to(base.dtype)
        if self.gated:
            gate, up = torch.chunk(base, 2, dim=-1)
            if self.smoe.fusion == "additive":
                inner = act(gate + update) * up
            else:
                inner = act(gate) * up * (1.0 + update)
        else:
            inner = act(base) * (1.0 + update)
        return self.linear_fc2(inner)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """fc1/fc2 as in Megatron's MLP; B split along D' (axis 2); router and A replicated."""
        return mlp_sharded_state_dict(
            self, prefix, sharded_offsets, metadata,
            {"router": None, "lore_a": None, "lore_b": 2}, gated_fc1=self.gated)
