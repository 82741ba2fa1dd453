"""Progressive sparsification (report Sec. 2.2.2): the first layers route to more experts until
``--sigma-sparsify-at``, then every layer uses the target top-k.

The top-k of every layer is a function of the completed iterations only
(``SigmaConfig.topks_at``), applied before each micro-batch's forward. A run resumed from a
checkpoint on either side of the switch therefore routes exactly as the uninterrupted run; nothing
about the schedule is stored in checkpoints (parameters do not depend on top-k).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_ext.sigma.config import SigmaConfig
from megatron_ext.sigma.layer import SigmaMoELayer


def sigma_layers(model) -> List[SigmaMoELayer]:
    return [m for m in model.modules() if isinstance(m, SigmaMoELayer)]


def apply_topks(layers: Sequence[SigmaMoELayer], topks: Sequence[int]) -> None:
    for layer in layers:
        layer.set_topk(topks[layer.layer_index])


def apply_schedule(layers: Sequence[SigmaMoELayer], sigma: SigmaConfig, completed_iterations: int,
                   train_iters: Optional[int]) -> Sequence[int]:
    topks = sigma.topks_at(completed_iterations, train_iters)
    apply_topks(layers, topks)
    return topks
