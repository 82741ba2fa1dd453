"""Tiered STEM tables (``--stem-table-placement tiered``): the hottest rows in GPU memory with
their optimizer state, stepped there; the other rows in host memory, stepped on the CPU.

Both tiers are sharded by vocabulary over the data-parallel ranks with the ownership of
``--stem-row-ownership``, and rows move through their owners exactly as for host tables
(``stem/runtime/exchange.py``), so the data-parallel reduction of the tables is unchanged. What changes is
where an owner keeps a row: ``TieredOwnership`` numbers the rows a rank owns hot first (its local
indices ``[0, num_hot)`` are its GPU-tier rows, the rest its host rows), and ``TieredShard`` holds
the two halves of one layer's owned rows. ``TieredRowAdamW`` steps each half with the same
``RowAdamW`` semantics (``dense``: every owned row every iteration; ``sparse``: touched rows, the
others brought up to date when read) where it lives: the GPU tier with the torch kernel on the model's device,
the host tier with the CPU kernels. Without CUDA the GPU tier lives on the model's device, the CPU.

The hot rows are the most frequent token ids of the training data (``stem/runtime/hot_rows.py``), counted
at start-up from a sample of the training blend's indexed datasets (``data_paths.training_blend``:
whichever of Megatron's data flags names them; ``--stem-tier-count-tokens``); with mock data,
which has no counts, the lowest ids (byte-level BPE vocabularies put frequent tokens there).
Checkpoints hold the canonical ``[vocab, d_ff]`` table, so the tier may be re-chosen at resume
and a run resumes across ordinary, gpu, cpu and tiered placement.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_ext.stem.runtime.transfer import to_device


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
    model's step (``stem/runtime/optimizer.py``), so the host tier's step does not wait for the GPU; its
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


def write_back(x, whole: torch.Tensor) -> None:
    """After ``whole = full_tensor(x)`` was written in place: a tiered ``x`` takes it back into
    its two halves (a plain tensor already holds it)."""
    if isinstance(x, TieredShard):
        x.assign(whole)


def full_tensor(x):
    """A plain tensor of a shard or per-row state: ``x`` itself, or a tiered one's host copy."""
    return x.full() if isinstance(x, TieredShard) else x
