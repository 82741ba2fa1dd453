"""Peak GPU memory of each side of a step benchmark (``structmoe_step.py``, ``sigma_step.py``).

Every side's model stays on the device while the others are timed, so a side's peak is what the
whole run needs at that side's step: every model's weights and gradient buffers (``resident``,
allocated when its timing starts) plus that step's activations, logits and loss. Measured, it
checks a count made without a GPU (docs/gpu_session.md: about 40-50 GB at 4 x 4096 tokens).
Without CUDA nothing is measured: the JSON's fields are null.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, TypeVar

import torch

T = TypeVar("T")
GIB = 2 ** 30


class PeakMemory:
    """Per side, the highest ``torch.cuda.max_memory_allocated()`` over its timings (GiB), the
    counter reset when each timing starts, and what was allocated then."""

    def __init__(self):
        self.peak_gib: Dict[str, float] = {}
        self.resident_gib: Dict[str, float] = {}

    def track(self, measure: Dict[str, Callable[[], T]]) -> Dict[str, Callable[[], T]]:
        """``measure`` (a side's timing, as ``common.alternate_timed`` takes them) with each
        side's peak recorded; without CUDA, as it is."""
        if not torch.cuda.is_available():
            return dict(measure)

        def tracked(name: str, fn: Callable[[], T]) -> Callable[[], T]:
            def run() -> T:
                # The peak of this side's steps alone, not of an earlier side's or the build's.
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resident = torch.cuda.memory_allocated() / GIB
                out = fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / GIB
                if peak >= self.peak_gib.get(name, -1.0):
                    self.peak_gib[name], self.resident_gib[name] = peak, resident
                return out
            return run

        return {name: tracked(name, fn) for name, fn in measure.items()}

    def summary(self) -> Dict[str, Optional[Dict[str, float]]]:
        """The JSON's fields: ``peak_gpu_gib`` and ``resident_gpu_gib`` per side, or null
        where nothing was measured (no CUDA)."""
        return {"peak_gpu_gib": dict(self.peak_gib) or None,
                "resident_gpu_gib": dict(self.resident_gib) or None}

    def line(self, name: str) -> str:
        """``"  peak GPU 41.3 GiB (18.0 resident)"`` for the side's printed line; empty without
        a measurement."""
        if name not in self.peak_gib:
            return ""
        return (f"  peak GPU {self.peak_gib[name]:.1f} GiB "
                f"({self.resident_gib[name]:.1f} resident)")
