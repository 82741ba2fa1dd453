"""Read back the scalars Megatron's tensorboard writer logged (loss curves, iteration times)."""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Tuple


def read_tensorboard_scalars(log_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """All scalar series under ``log_dir``: ``{tag: [(step, value), ...]}`` sorted by step.

    When a run is resumed into the same directory, a later event file's value for a step
    replaces an earlier one.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no tensorboard event files under {log_dir}")
    series: Dict[str, Dict[int, float]] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                series.setdefault(tag, {})[int(event.step)] = float(event.value)
    return {tag: sorted(values.items()) for tag, values in series.items()}
