"""Which STEM table rows are hot: token counts of the training data and the GPU tier they choose.

Token traffic is Zipfian: a small share of the vocabulary carries most tokens. A tiered table keeps
the rows of the most frequent token ids in GPU memory and the rest in host memory; this module
counts the ids of a Megatron indexed dataset (``.bin`` + ``.idx``, the format ``--data-path``
names) and picks the hottest ones. It reads the ``.bin`` file as one memory map in chunks and
keeps ``vocab`` int64 counters.

At start-up every rank counts, so the count reads a sample (``training_frequencies``,
``--stem-tier-count-tokens``): windows of ``COUNT_WINDOW`` consecutive tokens spread evenly over
each dataset, the budget shared among the datasets of the blend by their share of the training
stream. A whole pass costs about 4.3 s per billion tokens here (232 M tokens/s from the page
cache, one core), so an hour per rank for a trillion-token corpus; which rows are hot changes the
speed of a tiered table, never its numbers, so an estimate of the frequencies is enough.

``parse_tier_size`` reads the tier's size as given on the command line: a number of rows
(``50000``), a fraction of the vocabulary (``0.1``) or a percentage (``10%``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.object_storage_utils import is_object_storage_path

from megatron_ext.data_paths import training_blend

CHUNK_TOKENS = 1 << 24  # tokens read at once
COUNT_WINDOW = 1 << 16  # consecutive tokens of one window of a sampled count


@dataclass
class Counted:
    """One dataset's token counts: ``counts`` int64 ``[vocab]`` over ``counted`` of its
    ``total`` tokens."""
    counts: torch.Tensor
    counted: int
    total: int


def _ids(prefix: str) -> np.memmap:
    """The token ids of the indexed dataset ``prefix`` (its ``.bin``, as a memory map)."""
    return np.memmap(prefix + ".bin", dtype=IndexedDataset(prefix).index.dtype, mode="r")


def count_windows(total: int, max_tokens: int) -> List[Tuple[int, int]]:
    """The ``[start, stop)`` token ranges a count of at most ``max_tokens`` of ``total`` tokens
    reads: all of them when ``max_tokens`` is 0 or at least ``total``; else
    ``ceil(max_tokens / COUNT_WINDOW)`` windows of equal length (``max_tokens`` in all, rounded
    down), the first at the start, the last at the end, evenly spaced and disjoint."""
    if max_tokens < 0:
        raise ValueError(f"a token budget of {max_tokens}: give 0 (every token) or more")
    if max_tokens == 0 or max_tokens >= total:
        return [(0, total)] if total else []
    k = -(-max_tokens // COUNT_WINDOW)
    width = max_tokens // k
    if k == 1:
        return [(0, width)]
    return [(i * (total - width) // (k - 1), i * (total - width) // (k - 1) + width)
            for i in range(k)]


def count_dataset(prefix: str, vocab: int, max_tokens: int = 0, data=None) -> Counted:
    """Occurrences of every id ``< vocab`` in the ``count_windows`` of the indexed dataset
    ``prefix`` (``data``: its ids, if the caller has them mapped already). An id at or above
    ``vocab`` is refused: the data and the tables disagree."""
    data = _ids(prefix) if data is None else data
    total = int(data.shape[0])
    counts = np.zeros(vocab, dtype=np.int64)
    counted = 0
    for begin, end in count_windows(total, max_tokens):
        for start in range(begin, end, CHUNK_TOKENS):
            chunk = np.asarray(data[start: min(start + CHUNK_TOKENS, end)])
            if chunk.size and int(chunk.max()) >= vocab:
                raise ValueError(f"{prefix}.bin holds token id {int(chunk.max())}, beyond the "
                                 f"{vocab}-row STEM tables")
            counts += np.bincount(chunk, minlength=vocab)[:vocab]
            counted += int(chunk.size)
    return Counted(torch.from_numpy(counts), counted, total)


def token_counts(prefixes: Iterable[str], vocab: int) -> torch.Tensor:
    """Occurrences of every id ``< vocab`` in the indexed datasets ``prefixes``, every token
    counted (int64 ``[vocab]``)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for prefix in prefixes:
        counts += count_dataset(prefix, vocab).counts
    return counts


@dataclass
class Frequencies:
    """Each id's estimated share of the training stream's tokens (float64 ``[vocab]``, sum 1
    unless nothing was counted), from ``counted`` of the blend's ``total`` tokens."""
    share: torch.Tensor
    counted: int
    total: int
    weighted: bool


def training_frequencies(prefixes: Sequence[str], weights: Optional[Sequence[float]],
                         vocab: int, max_tokens: int) -> Frequencies:
    """Each id's share of the tokens Megatron's blend of ``prefixes`` trains on
    (``BlendedMegatronDatasetBuilder``: dataset ``i`` gives a share ``weights[i] / sum(weights)``
    of the samples, or, without weights, a share in proportion to its size): the sum over the
    datasets of their share times each id's frequency in the dataset. ``max_tokens`` (0: every
    token) is divided among the datasets by their share, at least one window each; a dataset
    with no share is not read."""
    ids = [_ids(p) for p in prefixes]  # each dataset mapped once: its size, then its counts
    totals = [int(d.shape[0]) for d in ids]
    if weights is not None:
        if len(weights) != len(prefixes) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"blend weights {list(weights)} for {len(prefixes)} dataset(s): "
                             "one non-negative weight each, not all zero")
        shares = [w / sum(weights) for w in weights]
    else:
        shares = [t / sum(totals) if sum(totals) else 0.0 for t in totals]
    share = torch.zeros(vocab, dtype=torch.float64)
    counted = 0
    for prefix, data, part in zip(prefixes, ids, shares):
        if part <= 0.0:
            continue
        budget = 0 if max_tokens == 0 else max(COUNT_WINDOW, round(max_tokens * part))
        c = count_dataset(prefix, vocab, budget, data)
        if c.counted:
            share += part * c.counts.to(torch.float64) / c.counted
        counted += c.counted
    return Frequencies(share, counted, sum(totals), weights is not None)


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
    """The ``rows`` most frequent ids (by counts or shares), most frequent first; equal counts
    in id order (so the choice is the same on every rank and every run)."""
    if rows <= 0:
        return torch.empty(0, dtype=torch.long)
    # Stable sort on -count keeps id order among equal counts; the sort's indices are the ids.
    # Counts (int64) or shares (float64): float64 holds counts below 2^53 exactly.
    return torch.sort(-counts.to(torch.float64), stable=True).indices[:rows]


def hot_mask(counts: torch.Tensor, rows: int, vocab: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[vocab]``: True for the ``rows`` hottest ids."""
    vocab = counts.numel() if vocab is None else vocab
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[hottest(counts, rows)] = True
    return mask


def choose_hot_mask(args, vocab: int, tier_spec: str,
                    count_tokens: int,
                    counted: Optional[dict] = None) -> tuple:
    """``(boolean [vocab] mask of the GPU tier, how it was chosen)``: the most frequent ids of
    the training blend, from a count of at most ``count_tokens`` of its tokens (0: all).
    ``counted``: the counts made so far in this training ((blend, vocab, budget) ->
    (``Frequencies``, seconds); ``StemRun`` keeps it), so that the model chunks of a
    rank count the blend once."""
    counted = {} if counted is None else counted
    rows = parse_tier_size(tier_spec, vocab)

    def lowest_ids(why: str) -> tuple:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[:rows] = True
        return mask, f"ids 0..{rows - 1} (no token counts: {why})"

    blend = training_blend(args)
    if blend is None:
        return lowest_ids("mock data, or no data flag")
    prefixes, weights = blend
    remote = [p for p in prefixes if is_object_storage_path(p)]
    if remote:  # read through Megatron's object-storage cache, not counted here
        return lowest_ids(f"{remote[0]} is in object storage; the tier is chosen from local "
                          "indexed datasets only")
    key = (tuple(prefixes), None if weights is None else tuple(weights), vocab, count_tokens)
    if key not in counted:
        start = time.perf_counter()
        freq = training_frequencies(prefixes, weights, vocab, count_tokens)
        counted[key] = freq, time.perf_counter() - start
    freq, seconds = counted[key]
    mask = hot_mask(freq.share, rows, vocab)
    share = float(freq.share[mask].sum())
    sample = ("every token" if freq.counted == freq.total else
              f"windows of {COUNT_WINDOW:,} tokens spread over each dataset, "
              f"--stem-tier-count-tokens {count_tokens:,}")
    how = (f"the {rows} most frequent ids of {len(prefixes)} indexed dataset(s)"
           f"{' (blend weights applied)' if freq.weighted else ''}, {100 * share:.1f}% of "
           f"the training tokens; {freq.counted:,} of {freq.total:,} tokens counted "
           f"({sample}) in {seconds:.1f} s")
    return mask, how
