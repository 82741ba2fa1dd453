"""Which STEM table rows are hot: token counts of the training data and the GPU tier they choose.

Token traffic is Zipfian: a small share of the vocabulary carries most tokens. A tiered table keeps
the rows of the most frequent token ids in GPU memory and the rest in host memory; this module
counts the ids of a Megatron indexed dataset (``.bin`` + ``.idx``, the format ``--data-path``
names) and picks the hottest ones. It reads the ``.bin`` file as one memory map in chunks, so
counting a corpus costs one sequential pass over it and ``vocab`` int64 counters.

``parse_tier_size`` reads the tier's size as given on the command line: a number of rows
(``50000``), a fraction of the vocabulary (``0.1``) or a percentage (``10%``).
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

CHUNK_TOKENS = 1 << 24


def token_counts(prefixes: Iterable[str], vocab: int) -> torch.Tensor:
    """Occurrences of every id ``< vocab`` in the indexed datasets ``prefixes`` (int64
    ``[vocab]``). An id at or above ``vocab`` is refused: the data and the tables disagree."""
    counts = np.zeros(vocab, dtype=np.int64)
    for prefix in prefixes:
        dtype = IndexedDataset(prefix).index.dtype
        data = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        for start in range(0, data.shape[0], CHUNK_TOKENS):
            chunk = np.asarray(data[start: start + CHUNK_TOKENS])
            if chunk.size and int(chunk.max()) >= vocab:
                raise ValueError(f"{prefix}.bin holds token id {int(chunk.max())}, beyond the "
                                 f"{vocab}-row STEM tables")
            counts += np.bincount(chunk, minlength=vocab)[:vocab]
        del data
    return torch.from_numpy(counts)


def parse_tier_size(spec: Union[str, float, int], vocab: int) -> int:
    """Rows of the GPU tier: ``"10%"``, a fraction in ``[0, 1)`` (``"0.1"``) or a row count
    (``"50000"``); at most ``vocab``."""
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            rows = round(float(text[:-1]) / 100.0 * vocab)
        elif any(c in text for c in ".eE"):
            value = float(text)
            if not 0.0 <= value <= 1.0:
                raise ValueError
            rows = round(value * vocab)
        else:
            rows = int(text)
    except ValueError:
        raise ValueError(f"GPU tier size {spec!r}: give rows (50000), a fraction of the "
                         "vocabulary (0.1) or a percentage (10%)") from None
    if not 0 <= rows <= vocab:
        raise ValueError(f"GPU tier size {spec!r} is {rows} rows, outside 0..{vocab}")
    return rows


def hottest(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``rows`` most frequent ids, most frequent first; equal counts in id order (so the
    choice is the same on every rank and every run)."""
    if rows <= 0:
        return torch.empty(0, dtype=torch.long)
    # Stable sort on -count keeps id order among equal counts; the sort's indices are the ids.
    return torch.sort(-counts.to(torch.long), stable=True).indices[:rows]


def hot_mask(counts: torch.Tensor, rows: int, vocab: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[vocab]``: True for the ``rows`` hottest ids."""
    vocab = counts.numel() if vocab is None else vocab
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[hottest(counts, rows)] = True
    return mask
