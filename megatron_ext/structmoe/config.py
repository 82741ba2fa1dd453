"""StructMoE options (CLI flags map 1:1 onto these fields) and the parameter/FLOP budget (Sec. 3.3).

Notation of the StructMoE paper: hidden size H, dense MLP width D_ff, L low-rank experts ("LoREs")
of rank r, top-k routing, reduced base width D'_ff.

For a plain activation (GELU, the paper's Eq. 3) the dense MLP has two matrices::

    P_dense = 2 H D_ff                                          (Sec. 3.3)
    P       = 2 H D' + L r (H + D') + H L                       (Eq. 7)
    D'      = (2 H D_ff - H L (r + 1)) / (2 H + L r)            (Eq. 8)
    F       = 4 H D' + 2 H L + 2 k r (H + D')  FLOPs per token  (Eq. 9; dense: 4 H D_ff)

For SwiGLU (three matrices, the routed update joins the up-projection) the same derivation with
``m = 3`` base matrices gives ``D' = (3 H D_ff - H L (r + 1)) / (3 H + L r)`` and
``F = 6 H D' + 2 H L + 2 k r (H + D')``. D' is rounded down (the paper's Table 1: H=2048,
D_ff=7168, L=16, r=16 gives 6618).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

FUSIONS = ("additive", "glu")
BACKENDS = ("auto", "reference", "grouped", "dense-masked", "triton")
INITS = ("small", "megatron")
# --structmoe-compile: none (eager), routed (the small ops between the GEMMs compiled; routed.py).
COMPILE_CHOICES = ("none", "routed")


@dataclass
class StructMoEConfig:
    """Options of the StructMoE family (``--structmoe-*``)."""

    num_experts: int = 16
    rank: int = 16
    topk: int = 1
    fusion: str = "additive"
    param_matched: bool = True
    ffn_hidden_size: Optional[int] = None  # explicit D'_ff; wins over param_matched
    # D'_ff stored as a multiple of this (zero columns past D'_ff that stay zero): 1 = as is.
    ffn_pad_to: int = 1
    aux_loss_coeff: float = 0.01
    init: str = "small"
    backend: str = "auto"
    compile: str = "none"

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"--structmoe-num-experts={self.num_experts}: must be >= 1")
        if self.rank < 1:
            raise ValueError(f"--structmoe-rank={self.rank}: must be >= 1")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--structmoe-topk={self.topk}: must be in 1..{self.num_experts} "
                             f"(--structmoe-num-experts)")
        if self.fusion not in FUSIONS:
            raise ValueError(f"--structmoe-fusion={self.fusion!r}: allowed {', '.join(FUSIONS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--structmoe-backend={self.backend!r}: allowed {', '.join(BACKENDS)}")
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"--structmoe-compile={self.compile!r}: allowed "
                             f"{', '.join(COMPILE_CHOICES)}")
        if self.init not in INITS:
            raise ValueError(f"--structmoe-init={self.init!r}: allowed {', '.join(INITS)}")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"--structmoe-aux-loss-coeff={self.aux_loss_coeff}: must be >= 0")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"--structmoe-ffn-hidden-size={self.ffn_hidden_size}: must be >= 1")
        if self.ffn_pad_to < 1:
            raise ValueError(f"--structmoe-ffn-pad-to={self.ffn_pad_to}: must be >= 1 (1: D'_ff "
                             "stored as it is)")


@dataclass(frozen=True)
class LayerBudget:
    """Per-layer parameters and forward FLOPs per token of a StructMoE MLP and its dense twin."""

    hidden: int
    dense_ffn: int
    ffn: int  # D'_ff
    num_experts: int
    rank: int
    topk: int
    base_matrices: int  # 2 for a plain activation, 3 for SwiGLU
    # D'_ff as stored (--structmoe-ffn-pad-to): the GEMMs' width; the columns past ``ffn`` are
    # zeros. Parameters and FLOPs above count the model's D'_ff.
    storage_ffn: int

    @property
    def dense_params(self) -> int:
        return self.base_matrices * self.hidden * self.dense_ffn

    @property
    def params(self) -> int:  # Eq. 7 (m = base_matrices)
        h, d, n, r = self.hidden, self.ffn, self.num_experts, self.rank
        return self.base_matrices * h * d + n * r * (h + d) + h * n

    @property
    def dense_flops(self) -> int:
        return 2 * self.dense_params

    @property
    def flops(self) -> int:  # Eq. 9
        h, d, r = self.hidden, self.ffn, self.rank
        return (2 * self.base_matrices * h * d + 2 * h * self.num_experts
                + 2 * self.topk * r * (h + d))

    def describe(self) -> str:
        stored = (f", stored as {self.storage_ffn} (--structmoe-ffn-pad-to)"
                  if self.storage_ffn != self.ffn else "")
        return (f"StructMoE MLP: D'_ff={self.ffn}{stored} (dense D_ff={self.dense_ffn}), "
                f"L={self.num_experts}"
                f" r={self.rank} k={self.topk} | params {self.params:,} vs dense "
                f"{self.dense_params:,} ({self.params / self.dense_params - 1:+.3%}) | forward "
                f"FLOPs/token {self.flops:,} vs dense {self.dense_flops:,} "
                f"(ratio {self.flops / self.dense_flops:.4f})")


def param_matched_ffn(hidden: int, dense_ffn: int, num_experts: int, rank: int,
                      base_matrices: int = 2) -> int:
    """Eq. 8 (with ``base_matrices`` = 2, or 3 for SwiGLU), rounded down."""
    m, h, n, r = base_matrices, hidden, num_experts, rank
    numerator = m * h * dense_ffn - h * n * (r + 1)
    if numerator <= 0:
        raise ValueError(
            f"--structmoe-num-experts={n} --structmoe-rank={r}: the router and experts alone "
            f"exceed the dense MLP's {m * h * dense_ffn:,} parameters; use fewer or smaller "
            "experts, or --structmoe-ffn-hidden-size")
    return math.floor(numerator / (m * h + n * r))


def layer_budget(cfg: StructMoEConfig, hidden: int, dense_ffn: int, gated: bool) -> LayerBudget:
    m = 3 if gated else 2
    if cfg.ffn_hidden_size is not None:
        ffn = cfg.ffn_hidden_size
    elif cfg.param_matched:
        ffn = param_matched_ffn(hidden, dense_ffn, cfg.num_experts, cfg.rank, m)
    else:
        ffn = dense_ffn
    return LayerBudget(hidden, dense_ffn, ffn, cfg.num_experts, cfg.rank, cfg.topk, m,
                       -(-ffn // cfg.ffn_pad_to) * cfg.ffn_pad_to)
