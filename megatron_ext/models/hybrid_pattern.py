"""What a ``--hybrid-layer-pattern`` says about the model's blocks, for the tools that count or
convert it without building it (``planning/model_shape.py``, ``planning/estimate.py``, ``to-hf``,
STEM's checkpoint check).

On the hybrid path Megatron sets ``--num-layers`` to the number of pattern symbols (``*-*-`` is
4), while the parameter and FLOPs counts, the families' layer flags (``--stem-layers``) and the
Hugging Face export count *blocks*: attention layers (``*``) and MLP blocks (``-``: dense, STEM,
StructMoE; ``E``: MoE). The i-th MLP block is the i-th ``-``/``E`` of the pattern, whatever stands
between them (``models/hybrid_specs.py`` builds the ``-`` layers so). Upstream's symbols:
``megatron.core.models.hybrid.hybrid_layer_allocation.Symbols``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

MLP_SYMBOLS = (Symbols.MLP, Symbols.MOE)
COUNTED = (Symbols.ATTENTION,) + MLP_SYMBOLS


@dataclass(frozen=True)
class HybridLayers:
    """The decoder of a hybrid pattern: ``symbols`` one per layer (pipes dropped), ``segments``
    the pipeline segments (split at ``|``; one when the pattern has none)."""

    pattern: str
    symbols: str
    segments: Tuple[str, ...]

    @classmethod
    def parse(cls, pattern: str) -> HybridLayers:
        """Refuses (ValueError naming the flag) a pattern with layers megatron-ext does not count
        (Mamba ``M``, gated delta net ``G``, DSA ``D``, MLA ``+``) or MTP depths."""
        try:
            parsed = parse_hybrid_pattern(pattern)
        except ValueError as exc:
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: {exc}") from None
        if parsed.mtp_num_depths:
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: multi-token prediction "
                             f"depths ('/{parsed.mtp_pattern}') are not supported")
        main = parsed.main_pattern or ""
        others = sorted({s for s in main if s not in COUNTED + (Symbols.PIPE,)})
        if others:
            raise ValueError(
                f"--hybrid-layer-pattern {pattern!r}: layers {', '.join(others)} are not "
                "supported here; megatron-ext models are attention ('*') and MLP ('-', 'E') "
                "layers")
        symbols = main.replace(Symbols.PIPE, "")
        if not symbols:
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: no decoder layers")
        return cls(pattern, symbols, tuple(main.split(Symbols.PIPE)))

    @property
    def attention_positions(self) -> List[int]:
        """Pattern position (global layer index) of each ``*``, in order."""
        return [i for i, s in enumerate(self.symbols) if s == Symbols.ATTENTION]

    @property
    def mlp_positions(self) -> List[int]:
        """Pattern position of each MLP block (``-`` or ``E``), in order."""
        return [i for i, s in enumerate(self.symbols) if s in MLP_SYMBOLS]

    @property
    def attention_layers(self) -> int:
        return len(self.attention_positions)

    @property
    def mlp_blocks(self) -> int:
        return len(self.mlp_positions)


def main_pattern(pattern: str) -> str:
    """The decoder's layer symbols, pipeline boundaries (``|``) and MTP depths dropped."""
    return (parse_hybrid_pattern(pattern).main_pattern or "").replace(Symbols.PIPE, "")


def mlp_layer_indices(pattern: str) -> List[int]:
    """Global layer index of each ``-`` of the pattern, in order."""
    return [i for i, s in enumerate(main_pattern(pattern)) if s == Symbols.MLP]


def moe_layer_indices(pattern: str) -> List[int]:
    """Global layer index of each ``E`` of the pattern, in order."""
    return [i for i, s in enumerate(main_pattern(pattern)) if s == Symbols.MOE]


def mlp_block_count(args) -> int:
    """The model's MLP blocks (FFN blocks: dense, STEM, StructMoE or MoE), which the families'
    layer flags (``--stem-layers``, ``--sigma-topk-schedule``), logs and exports count: the ``-``
    and ``E`` symbols on the hybrid path, the transformer layers on the GPT path (where
    ``--num-layers`` counts blocks). A family builds one kind of MLP block (``Family.
    hybrid_symbols``), so its ``k``-th block is the ``k``-th ``-`` (``mlp_layer_indices``) or the
    ``k``-th ``E`` (``moe_layer_indices``)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return args.num_layers
    return sum(s in MLP_SYMBOLS for s in main_pattern(pattern))


def check_family_symbols(pattern: str, family: str, allowed: str) -> None:
    """Refuse (ValueError naming the flag) a pattern with layers the family does not build:
    ``allowed`` its symbols (``Family.hybrid_symbols``), pipes aside."""
    extra = sorted(set(main_pattern(pattern)) - set(allowed))
    if extra:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: --model-family {family} builds "
            f"{', '.join(repr(s) for s in allowed)} layers only, not {', '.join(map(repr, extra))}")
