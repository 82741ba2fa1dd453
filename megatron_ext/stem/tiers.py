"""Tiered STEM tables (``--stem-table-placement tiered``): the hottest rows in GPU memory with
their optimizer state, stepped there; the other rows in host memory, stepped on the CPU.

Both tiers are sharded by vocabulary over the data-parallel ranks with the ownership of
``--stem-row-ownership``, and rows move through their owners exactly as for host tables
(``stem/exchange.py``), so the data-parallel reduction of the tables is unchanged. What changes is
where an owner keeps a row: ``TieredOwnership`` numbers the rows a rank owns hot first (its local
indices ``[0, num_hot)`` are its GPU-tier rows, the rest its host rows), and ``TieredShard`` holds
the two halves of one layer's owned rows. ``TieredRowAdamW`` steps each half with the same
``RowAdamW`` semantics (``dense``: every owned row every iteration; ``sparse``: touched rows, the
others brought up to date when read) where it lives: the GPU tier with the torch kernel on the model's device,
the host tier with the CPU kernels. Without CUDA the GPU tier lives on the model's device, the CPU.

The hot rows are the most frequent token ids of the training data (``stem/hot_rows.py``), counted
at start-up from a sample of the training blend's indexed datasets (``data_paths.training_blend``:
whichever of Megatron's data flags names them; ``--stem-tier-count-tokens``); with mock data,
which has no counts, the lowest ids (byte-level BPE vocabularies put frequent tokens there).
Checkpoints hold the canonical ``[vocab, d_ff]`` table, so the tier may be re-chosen at resume
and a run resumes across ordinary, gpu, cpu and tiered placement.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from megatron.core.datasets.object_storage_utils import is_object_storage_path

from megatron_ext.data_paths import training_blend
from megatron_ext.stem import hot_rows
from megatron_ext.stem.config import DEFAULT_TIER_COUNT_TOKENS
from megatron_ext.stem.ownership import RowOwnership
from megatron_ext.stem.row_adam import (
    AdamHyper,
    LazyRows,
    LazyView,
    RowAdamW,
    StepPlan,
)
from megatron_ext.stem.transfer import to_device


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


class TieredShard:
    """One layer's owned rows (or a per-row state of them): ``hot`` ``[num_hot, ...]`` on the
    model's device, ``cold`` ``[owned - num_hot, ...]`` in host memory;
    local row ``r`` is ``hot[r]`` for ``r < num_hot``, else ``cold[r - num_hot]``."""

    def __init__(self, hot: torch.Tensor, cold: torch.Tensor):
        self.hot, self.cold = hot, cold

    @property
    def num_hot(self) -> int:
        return self.hot.shape[0]

    @property
    def shape(self):
        return (self.hot.shape[0] + self.cold.shape[0],) + tuple(self.hot.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.cold.dtype

    @property
    def device(self) -> torch.device:
        """Where the step's row indices go (the host; each half's gradients move where it is)."""
        return self.cold.device

    def host_bytes(self) -> int:
        return self.cold.numel() * self.cold.element_size()

    def hot_bytes(self) -> int:
        return self.hot.numel() * self.hot.element_size()

    def full(self) -> torch.Tensor:
        """A host copy of all owned rows in local order (checkpoints, dumps)."""
        return torch.cat([self.hot.detach().cpu(), self.cold.detach().cpu()])

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """``full()`` as ``dtype`` (what checkpoint reads of a shard take)."""
        return self.full().to(dtype)

    def assign(self, full: torch.Tensor) -> None:
        """Write all owned rows back from ``full`` (local order; checkpoint loads)."""
        full = full.reshape(self.shape)
        self.hot.copy_(full[: self.num_hot].to(self.hot.device, self.hot.dtype))
        self.cold.copy_(full[self.num_hot:].to(self.cold.device, self.cold.dtype))

    def fill_(self, value) -> "TieredShard":
        self.hot.fill_(value)
        self.cold.fill_(value)
        return self

    def split(self, rows: torch.Tensor):
        """``(hot positions, hot rows, cold positions, cold rows)`` of local ``rows``."""
        rows = rows.cpu()
        is_hot = rows < self.num_hot
        hot_pos = torch.nonzero(is_hot).squeeze(1)
        cold_pos = torch.nonzero(~is_hot).squeeze(1)
        return hot_pos, rows[hot_pos], cold_pos, rows[cold_pos] - self.num_hot


class TierGrads:
    """The gradients of a tiered shard's rows, split by tier (``split_grads``): the rows they go
    with are local indices, hot first; ``hot`` holds the first ``num_hot`` rows' gradients (on the
    GPU tier's device), ``cold`` the others'. The optimizer moves ``cold`` to the host before the
    model's step (``table_optimizer``), so the host tier's step does not wait for the GPU; its
    first ``cold_first`` rows (those the next step's first micro-batch reads) go first
    (``transfer.stage_to_host``)."""

    def __init__(self, hot: torch.Tensor, cold: torch.Tensor, cold_first: int = 0):
        self.hot, self.cold, self.cold_first = hot, cold, cold_first

    @property
    def num_hot(self) -> int:
        return self.hot.shape[0]

    def tensors(self) -> tuple:
        return self.hot, self.cold

    def within_first(self, positions: torch.Tensor) -> bool:
        """Whether the rows at ``positions`` (of the rows these gradients go with) need no host
        gradient beyond the first ``cold_first``."""
        cold = positions[positions >= self.num_hot]
        return cold.numel() == 0 or int(cold.max()) - self.num_hot < self.cold_first

    def take(self, rows: torch.Tensor, keep: torch.Tensor) -> tuple:
        """``(rows[keep], their TierGrads)``, in ascending position (hot first still; the order
        the rows of one step take does not matter: each is stepped once)."""
        keep = torch.sort(keep.cpu()).values
        split = int(torch.searchsorted(keep, self.num_hot))
        hot, cold = keep[:split], keep[split:] - self.num_hot
        return rows[keep], TierGrads(select_rows(self.hot, hot), select_rows(self.cold, cold))


def split_grads(shard: "TieredShard", rows: torch.Tensor, grad: torch.Tensor,
                first: Optional[torch.Tensor] = None) -> tuple:
    """``(rows, TierGrads)``: local ``rows`` hot first, and ``grad``'s rows split alike (both
    parts where ``grad`` is). The host rows that are also in ``first`` (local indices: the rows
    the next step's first micro-batch reads of this rank) come first among the host rows, and
    their count is the ``TierGrads``' ``cold_first``."""
    hot_pos, hot_rows, cold_pos, cold_rows = shard.split(rows)
    cold_first = 0
    if first is not None and cold_rows.numel():
        needed = torch.isin(cold_rows + shard.num_hot, first.cpu())
        order = torch.cat([torch.nonzero(needed).squeeze(1), torch.nonzero(~needed).squeeze(1)])
        cold_pos, cold_rows = cold_pos[order], cold_rows[order]
        cold_first = int(needed.sum())
    rows = torch.cat([hot_rows, cold_rows + shard.num_hot])
    return rows, TierGrads(grad.index_select(0, to_device(hot_pos, grad.device)),
                           grad.index_select(0, to_device(cold_pos, grad.device)), cold_first)


def take_rows(rows: torch.Tensor, grad, keep: torch.Tensor) -> tuple:
    """``rows[keep]`` and their gradients (a tensor, or a tiered shard's ``TierGrads``)."""
    if isinstance(grad, TierGrads):
        return grad.take(rows, keep)
    return rows[keep], select_rows(grad, keep)


def select_rows(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, positions)``, the same values; a view of ``t`` when ``positions``
    (host) are a run of consecutive rows. The table step takes its gradients in chunks of
    consecutive positions until a read has stepped rows out of the middle: a view spares each
    chunk a copy into fresh memory (16 MiB at the 1B shape, about 3 ms of page faults and copying
    on the worker on the GPU machine of 2026-11-27)."""
    n = positions.numel()
    if n and positions.device.type == "cpu":
        first, last = int(positions[0]), int(positions[-1])
        if last - first + 1 == n and (n == 1 or bool((positions.diff() == 1).all())):
            return t[first: last + 1]
    return t.index_select(0, to_device(positions, t.device))


def grad_tensors(grad) -> tuple:
    """The tensors of a gradient (a tensor or ``TierGrads``)."""
    return grad.tensors() if isinstance(grad, TierGrads) else (grad,)


class TieredLazyRows(LazyRows):
    """``LazyRows`` of tiered shards: one clock, the last and touched steps of all owned rows
    (host, local order), viewed as those of each tier (``hot``, ``cold``: what each tier's optimizer uses); each
    tier's moments live with its rows."""

    def __init__(self, shards: Sequence[TieredShard], huge_pages: bool = True):
        super().__init__(shards, huge_pages=huge_pages)
        self.hot = LazyRows([s.hot for s in self.shards], self.clock,
                            [m[: s.num_hot] for m, s in zip(self.last, self.shards)],
                            [m[: s.num_hot] for m, s in zip(self.touched, self.shards)],
                            huge_pages)
        self.cold = LazyRows([s.cold for s in self.shards], self.clock,
                             [m[s.num_hot:] for m, s in zip(self.last, self.shards)],
                             [m[s.num_hot:] for m, s in zip(self.touched, self.shards)],
                             huge_pages)

    def bind_moments(self):
        raise TypeError("a tiered store's moments are bound per tier (hot, cold)")

    def settle(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        """Each tier settles its own rows of ``rows`` (local indices)."""
        if (self.clock.step if upto is None else upto) == self.clock.base or rows.numel() == 0:
            return
        _, hot_rows, _, cold_rows = self.shards[i].split(rows)
        self.hot.settle(i, hot_rows, upto)
        self.cold.settle(i, cold_rows, upto)


class TieredRowAdamW(LazyView):
    """``RowAdamW``'s interface over tiered shards: one ``RowAdamW`` for the GPU tier (torch
    kernel, on the model's device) and one for the host tier (CPU kernels), advanced together
    (one iteration clock, the same learning rate), each stepping its own rows.
    ``lazy`` (sparse): the shards' ``TieredLazyRows`` (default: a private one)."""

    def __init__(self, shards: Sequence[TieredShard], mode: str = "dense",
                 lazy: Optional[TieredLazyRows] = None, huge_pages: bool = True):
        self.shards = list(shards)
        self.mode = mode
        self.lazy = lazy if lazy is not None else TieredLazyRows(self.shards, huge_pages)
        sparse = mode == "sparse"
        self.hot = RowAdamW([s.hot for s in self.shards], mode=mode,
                            lazy=self.lazy.hot if sparse else None, huge_pages=huge_pages)
        self.cold = RowAdamW([s.cold for s in self.shards], mode=mode,
                             lazy=self.lazy.cold if sparse else None, huge_pages=huge_pages)

    @property
    def kernel(self) -> str:
        return self.cold.kernel

    @property
    def step_count(self) -> int:
        return self.hot.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.hot.step_count = self.cold.step_count = value

    def _pair(self, name: str) -> List[TieredShard]:
        return [TieredShard(h, c) for h, c in zip(getattr(self.hot, name),
                                                  getattr(self.cold, name))]

    @property
    def exp_avg(self) -> List[TieredShard]:
        return self._pair("exp_avg")

    @property
    def exp_avg_sq(self) -> List[TieredShard]:
        return self._pair("exp_avg_sq")

    def begin_step(self, hyper: AdamHyper) -> StepPlan:
        plan = self.hot.begin_step(hyper)  # moves the shared clock once
        self.cold.step_count = plan.step
        return plan

    def step_rows(self, i: int, rows: torch.Tensor, rows_grad, plan: StepPlan) -> None:
        """Shard ``i``'s rows (local indices) step in the tier that holds them; dense: each tier
        steps all its rows (the others with a zero gradient). ``rows_grad``: a tensor, or the
        ``TierGrads`` of ``split_grads`` (the rows hot first)."""
        shard = self.shards[i]
        if not isinstance(rows_grad, TierGrads):
            rows, rows_grad = split_grads(shard, rows, rows_grad)
        rows, n = rows.cpu().to(torch.long), rows_grad.num_hot
        for opt, local, grad, tier in ((self.hot, rows[:n], rows_grad.hot, shard.hot),
                                       (self.cold, rows[n:] - shard.num_hot, rows_grad.cold,
                                        shard.cold)):
            if tier.shape[0] and (local.numel() or self.mode == "dense"):
                # Dense zero-fills a tier-sized gradient on the tier's device and writes the rows
                # there (their indices go along); sparse keeps its per-row last steps on the host
                # and takes host indices.
                if self.mode == "dense":
                    local = to_device(local, tier.device)
                opt.step_rows(i, local, grad.to(tier.device), plan)

    def catch_up(self, i: int, rows: torch.Tensor, upto: Optional[int] = None) -> None:
        if self.mode == "sparse":
            self.lazy.settle(i, rows, upto)

    def materialize(self) -> None:
        if self.mode == "sparse":
            self.lazy.settle_all()


def write_back(x, whole: torch.Tensor) -> None:
    """After ``whole = full_tensor(x)`` was written in place: a tiered ``x`` takes it back into
    its two halves (a plain tensor already holds it)."""
    if isinstance(x, TieredShard):
        x.assign(whole)


def full_tensor(x):
    """A plain tensor of a shard or per-row state: ``x`` itself, or a tiered one's host copy."""
    return x.full() if isinstance(x, TieredShard) else x


# ---------------------------------------------------------------------------------------------
# choosing the GPU tier

def choose_hot_mask(args, vocab: int, tier_spec: str,
                    count_tokens: int = DEFAULT_TIER_COUNT_TOKENS,
                    counted: Optional[dict] = None) -> tuple:
    """``(boolean [vocab] mask of the GPU tier, how it was chosen)``: the most frequent ids of
    the training blend, from a count of at most ``count_tokens`` of its tokens (0: all).
    ``counted``: the counts made so far in this training ((blend, vocab, budget) ->
    (``hot_rows.Frequencies``, seconds); ``StemRun`` keeps it), so that the model chunks of a
    rank count the blend once."""
    counted = {} if counted is None else counted
    rows = hot_rows.parse_tier_size(tier_spec, vocab)

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
        freq = hot_rows.training_frequencies(prefixes, weights, vocab, count_tokens)
        counted[key] = freq, time.perf_counter() - start
    freq, seconds = counted[key]
    mask = hot_rows.hot_mask(freq.share, rows, vocab)
    share = float(freq.share[mask].sum())
    sample = ("every token" if freq.counted == freq.total else
              f"windows of {hot_rows.COUNT_WINDOW:,} tokens spread over each dataset, "
              f"--stem-tier-count-tokens {count_tokens:,}")
    how = (f"the {rows} most frequent ids of {len(prefixes)} indexed dataset(s)"
           f"{' (blend weights applied)' if freq.weighted else ''}, {100 * share:.1f}% of "
           f"the training tokens; {freq.counted:,} of {freq.total:,} tokens counted "
           f"({sample}) in {seconds:.1f} s")
    return mask, how
