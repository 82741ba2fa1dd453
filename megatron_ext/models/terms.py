"""A family's terms in the parameter and FLOPs counts (``planning/model_shape.py``), the layout
rules (``planning/layout.py``) and the memory estimate (``planning/estimate.py``).

``MLPTerms`` is the dense SwiGLU (or plain) MLP of the baseline; a family whose MLP differs
subclasses it in its folder and hands an instance to its ``Family`` (``estimate_terms``). The
tools call these methods for each layer and never ask which family it is. ``spec`` is a
``ModelShape``, ``layout`` a ``Layout``, ``parts`` a ``Parts`` (parameter counts by part) being
filled.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple


class MLPTerms:
    def check(self, spec) -> None:
        """Refuse a spec this family cannot have (ValueError)."""

    def spec_fields(self, args, cfg) -> Dict[str, object]:
        """The family's ``ModelShape`` fields from Megatron's parsed args and the family's
        config."""
        return {}

    def layout_fields(self, args, cfg) -> Dict[str, object]:
        """The family's ``Layout`` fields (expert-TP size, managed tables)."""
        return {}

    def mlp_params(self, spec, layer: int, tp: int = 1) -> int:
        """The MLP's dense weights of one layer on one TP rank (tables and experts aside)."""
        h, f, m = spec.hidden, spec.ffn, spec.m
        n = m * h * f // tp
        if spec.bias:
            n += (m - 1) * f // tp + h
        return n

    def add_layer_parts(self, spec, layer: int, parts, tp: int, ep: int, etp: int,
                        managed_tables: bool) -> None:
        """Parameters of one layer beyond attention, norms and ``mlp_params`` (tables, routers,
        experts)."""

    def active_extra(self, spec, layer: int, topks: Sequence[int]) -> int:
        """Parameters one token uses in the layer beyond ``mlp_params`` (the selected experts,
        a table row; negative for weights it skips)."""
        return 0

    def mlp_flops(self, spec, layer: int, topks: Sequence[int]) -> float:
        """Training (forward + backward) FLOPs per token of the layer's MLP."""
        return 6.0 * spec.m * spec.hidden * spec.ffn

    def mlp_activation_bytes(self, spec, layout, layer: int, topks: Sequence[int], s: int,
                             b: int, sp: int) -> float:
        """Bytes autograd keeps for the layer's MLP, one micro-batch (``s`` local sequence,
        ``b`` micro-batch, ``sp`` the sequence-parallel divisor)."""
        return layout.act_bytes * s * b * (spec.ffn / layout.tp) * (5 if spec.gated else 2)

    def table_params(self, spec) -> int:
        """Parameters of token-indexed tables (the whole model)."""
        return 0

    def stage_memory(self, spec, layout, layers: Sequence[int], s: int, b: int,
                     gpu: Dict[str, float], host: Dict[str, float]) -> None:
        """Memory of one pipeline stage that is not parameters or activations (managed
        tables)."""

    def widths(self, spec) -> List[Tuple[str, int]]:
        """Widths the tensor-parallel size must divide, beside the common ones."""
        return []

    def check_layout(self, spec, layout) -> None:
        """Refuse a layout the model provider would refuse (ValueError)."""

    def topks_at(self, args, cfg, completed_iterations: int):
        """Experts per token of each layer in the step after ``completed_iterations``, for a
        family whose FLOPs per token change during training (None: they do not)."""
        return None
