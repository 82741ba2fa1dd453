"""The rows a micro-batch's STEM layers read, and their gradients taken back after backward.

Each layer reads a leaf tensor ``rows [n_unique, F/tp]`` (requires grad while training) with the
inverse index ``[s, b]`` (``models/token_ids.py`` ``FetchedRows``, which reaches the layers as an
argument in the block context); its lookup is ``rows[inverse]``, so autograd leaves the row
gradients, already deduplicated per micro-batch, in ``rows.grad``. ``collect`` sums them per id
over the step's micro-batches: what the exchange pushes to the owners (``stem/runtime/exchange.py``).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from megatron_ext.models.token_ids import FetchedRows
from megatron_ext.stem.runtime.transfer import to_device


class RowBinding:
    """The leaves of the step's micro-batches of one model chunk's tables."""

    def __init__(self, layer_numbers: Sequence[int]):
        self.layer_numbers = list(layer_numbers)
        self._pending: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []

    def bind(self, unique_ids: torch.Tensor, rows: Sequence[torch.Tensor],
             inverse: torch.Tensor) -> Tuple[FetchedRows, bool]:
        """The rows (``unique_ids`` order) as leaves for the layers, with the index of each token
        into them; while training, the leaves are kept for ``collect``. Returns them and whether
        they were kept."""
        grad = torch.is_grad_enabled()
        leaves = [r.detach().requires_grad_(grad) for r in rows]
        if grad:
            self._pending.append((unique_ids, leaves))
        return FetchedRows(inverse, dict(zip(self.layer_numbers, leaves))), grad

    def collect(self, widths: Sequence[int], device: torch.device
                ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The ids the step's micro-batches read (unique, on the host) and, per layer, their row
        gradients summed over the micro-batches (fp32; zeros where a layer got none); the leaves
        are let go."""
        if self._pending:
            ids = torch.cat([u for u, _ in self._pending])
            grads = []
            for i, width in enumerate(widths):
                parts = [leaves[i].grad if leaves[i].grad is not None
                         else torch.zeros(u.numel(), width, device=device)
                         for u, leaves in self._pending]
                grads.append(torch.cat(parts).float())
            unique, inverse = torch.unique(ids, return_inverse=True)
            inverse = to_device(inverse, grads[0].device)  # pageable .to() would sync
            summed = [torch.zeros(unique.numel(), g.shape[1], device=g.device).index_add_(
                0, inverse, g) for g in grads]
        else:
            unique = torch.empty(0, dtype=torch.long)
            summed = [torch.zeros(0, w, device=device) for w in widths]
        self._pending.clear()
        return unique, summed
