"""The dataset prefixes Megatron's data flags name (``--data-path`` with or without blend
weights, ``--train-data-path`` ...): used by the start-up checks (``training/preflight.py``) and
by the GPU tier's token counts (``stem/tiers.py``)."""

from __future__ import annotations

from typing import List


def dataset_prefixes(paths) -> List[str]:
    """The dataset prefixes of one data flag's values (blend weights left out)."""
    out = []
    for entry in paths or []:
        for part in str(entry).split():
            try:
                float(part)  # a blend weight
            except ValueError:
                out.append(part)
    return out
