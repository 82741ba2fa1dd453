"""Read back the scalars Megatron's tensorboard writer logged (loss curves, iteration times)."""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Tuple

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_tensorboard_scalars(log_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """All scalar series under ``log_dir``: ``{tag: [(step, value), ...]}`` sorted by step.

    Values logged twice at one step by one run are all kept (Megatron evaluates once more after
    training, at the last step). When a run is resumed into the same directory, a later event
    file's values for a step replace an earlier file's.
    """
    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no tensorboard event files under {log_dir}")
    series: Dict[str, Dict[int, List[float]]] = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            this_file: Dict[int, List[float]] = {}
            for event in acc.Scalars(tag):
                this_file.setdefault(int(event.step), []).append(float(event.value))
            series.setdefault(tag, {}).update(this_file)
    return {tag: [(step, v) for step in sorted(steps) for v in steps[step]]
            for tag, steps in series.items()}
