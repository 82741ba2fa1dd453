"""Which data-parallel rank owns which rows of a vocab-sharded STEM table.

Two schemes, chosen with ``--stem-row-ownership`` (measured by ``benchmarks/stem_ownership.py``
on the real corpus, see docs/stem.md):

* ``contiguous``: rank ``j`` owns the rows ``[start_j, start_{j+1})``, ranges as equal as possible
  (the first ``vocab % world`` ranks own one more row).
* ``interleaved``: row ``r`` belongs to rank ``r % world`` at local position ``r // world``. BPE
  vocabularies put the most frequent tokens at low ids (bytes and early merges), so contiguous
  ranges overload rank 0; interleaving spreads every frequency band over all ranks.

Both are pure functions of ``(vocab, world)``; the checkpoint layout does not depend on them
(tables are saved as contiguous row ranges of the global ``[vocab, d_ff]`` table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

SCHEMES = ("contiguous", "interleaved")


@dataclass(frozen=True)
class RowOwnership:
    vocab: int
    world: int
    scheme: str = "interleaved"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"--stem-row-ownership={self.scheme!r}: allowed {', '.join(SCHEMES)}")
        if self.world < 1 or self.vocab < self.world:
            raise ValueError(f"cannot shard a {self.vocab}-row STEM table over {self.world} "
                             "data-parallel ranks")

    def _starts(self) -> torch.Tensor:
        base, extra = divmod(self.vocab, self.world)
        sizes = torch.full((self.world,), base, dtype=torch.long)
        sizes[:extra] += 1
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)])

    def num_owned(self, rank: int) -> int:
        if self.scheme == "interleaved":
            return (self.vocab - rank + self.world - 1) // self.world
        starts = self._starts()
        return int(starts[rank + 1] - starts[rank])

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        if self.scheme == "interleaved":
            return ids % self.world
        starts = self._starts().to(ids.device)
        return torch.searchsorted(starts[1:], ids, right=True)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each (global) row id in its owner's shard."""
        if self.scheme == "interleaved":
            return ids // self.world
        starts = self._starts().to(ids.device)
        return ids - starts[self.owner(ids)]

    def owned_ids(self, rank: int) -> torch.Tensor:
        """Global ids of the rows ``rank`` owns, in shard order."""
        if self.scheme == "interleaved":
            return torch.arange(rank, self.vocab, self.world)
        starts = self._starts()
        return torch.arange(int(starts[rank]), int(starts[rank + 1]))


def load_per_rank(ownership: RowOwnership, batches: torch.Tensor) -> Dict[str, object]:
    """Per-rank load of a sequence of batches of token ids (``[num_batches, tokens]``).

    ``lookups``: share of all token occurrences whose row the rank owns (rows it serves).
    ``unique_rows``: mean number of distinct owned rows per batch (rows it sends and receives
    gradients for, after deduplication): the cost that decides the step time of the exchange.
    ``imbalance``: max over ranks / mean over ranks of ``unique_rows`` (1.0 is perfect).
    """
    owners = ownership.owner(batches)
    lookups = torch.bincount(owners.reshape(-1), minlength=ownership.world).double()
    unique = torch.zeros(ownership.world, dtype=torch.float64)
    for batch in batches:
        rows = torch.unique(batch)
        unique += torch.bincount(ownership.owner(rows), minlength=ownership.world).double()
    unique /= batches.shape[0]
    return {
        "scheme": ownership.scheme, "world": ownership.world,
        "lookups": (lookups / lookups.sum()).tolist(),
        "unique_rows": unique.tolist(),
        "imbalance": float(unique.max() / unique.mean()),
        "lookup_imbalance": float(lookups.max() / lookups.mean()),
    }


class TieredOwnership:
    """``RowOwnership`` of the vocabulary, with this rank's local rows numbered hot first.

    ``owner`` is the base scheme's; ``local_index`` and ``owned_ids`` are this rank's (the only
    rank that asks: an owner turns the ids it is asked for into its local rows)."""

    def __init__(self, base: RowOwnership, hot: torch.Tensor, rank: int):
        if hot.numel() != base.vocab:
            raise ValueError(f"hot-row mask of {hot.numel()} ids for a {base.vocab}-row table")
        self.base, self.rank, self.world = base, rank, base.world
        owned = base.owned_ids(rank)
        is_hot = hot[owned]
        self.ordered = torch.cat([owned[is_hot], owned[~is_hot]])
        self.num_hot = int(is_hot.sum())
        self.position = torch.full((base.vocab,), -1, dtype=torch.long)
        self.position[self.ordered] = torch.arange(self.ordered.numel())

    @property
    def vocab(self) -> int:
        return self.base.vocab

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.owner(ids)

    def num_owned(self, rank: int) -> int:
        return self.base.num_owned(rank)

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.position[ids.cpu()]
        if bool((local < 0).any()):
            raise RuntimeError("tiered STEM table: asked for rows this rank does not own")
        return local

    def owned_ids(self, rank: int) -> torch.Tensor:
        if rank != self.rank:
            raise ValueError(f"tiered ownership of rank {self.rank} asked for rank {rank}'s rows")
        return self.ordered
