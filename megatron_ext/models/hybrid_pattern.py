"""What a ``--hybrid-layer-pattern`` says about the model's blocks, for the tools that count or
convert it without building it (``tools/model_shape.py``, ``tools/estimate.py``, ``to-hf``,
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
from typing import List, Optional, Tuple

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


def hybrid_layers(args) -> Optional[HybridLayers]:
    """The hybrid decoder of Megatron's arguments, None on the GPT path."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    return HybridLayers.parse(pattern) if pattern else None


def mlp_blocks(args) -> int:
    """MLP blocks of the model: ``-``/``E`` symbols on the hybrid path, the transformer layers on
    the GPT path (where ``--num-layers`` counts blocks)."""
    layers = hybrid_layers(args)
    return layers.mlp_blocks if layers is not None else args.num_layers
