"""The dataset prefixes Megatron's data flags name (``--data-path`` with or without blend
weights, ``--train-data-path`` ...): used by the start-up checks (``training/preflight.py``), and
the training blend, used by the GPU tier's token counts (``stem/runtime/tiers.py``)."""

from __future__ import annotations

import json
from typing import List, Optional, Sequence, Tuple

from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.msc_utils import maybe_msc


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


def data_args_list(path: str) -> List[str]:
    """The blend list a ``--data-args-path`` file holds (whitespace-separated, as Megatron's
    trainer reads it)."""
    with maybe_msc.open(path, "r") as f:
        return f.read().split()


def per_split_lists(path: str):
    """The JSON a ``--per-split-data-args-path`` file holds: split name -> its blend list, a
    string split on whitespace as Megatron's trainer splits it (anything but an object is
    returned as it is)."""
    with maybe_msc.open(path, "r") as f:
        splits = json.load(f)
    if isinstance(splits, dict):
        splits = {k: v.split() if isinstance(v, str) else v for k, v in splits.items()}
    return splits


def training_blend(args) -> Optional[Tuple[List[str], Optional[Sequence[float]]]]:
    """``(prefixes, weights or None)`` of the data the model trains on, read from Megatron's flags
    as ``megatron.training.utils.get_blend_and_blend_per_split`` reads them (``--data-path``,
    ``--data-args-path``; else the train split of ``--train-data-path`` or
    ``--per-split-data-args-path``), each list parsed by Megatron-Core's ``get_blend_from_list``;
    None for mock data or when no flag names data. The families use Megatron-Core only, so the
    two argument files are read here, as the trainer reads them (``maybe_msc``: local files, or
    the multi-storage client's with ``--enable-msc``)."""
    if getattr(args, "mock_data", False):
        return None
    if getattr(args, "data_args_path", None):
        return get_blend_from_list(data_args_list(args.data_args_path))
    if getattr(args, "data_path", None):
        return get_blend_from_list(args.data_path)
    if getattr(args, "per_split_data_args_path", None):
        return get_blend_from_list(per_split_lists(args.per_split_data_args_path)["train"])
    if getattr(args, "train_data_path", None):
        return get_blend_from_list(args.train_data_path)
    return None
