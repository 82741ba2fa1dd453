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

from typing import Optional, Sequence

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
    hot_pos, cold_pos, rows, cold_first = _tier_positions(shard, rows, first)
    return rows, TierGrads(grad.index_select(0, to_device(hot_pos, grad.device)),
                           grad.index_select(0, to_device(cold_pos, grad.device)), cold_first)


def _tier_positions(shard: "TieredShard", rows: torch.Tensor,
                    first: Optional[torch.Tensor]) -> tuple:
    """``(hot_pos, cold_pos, rows, cold_first)``: the positions in ``rows`` of the GPU tier's
    and of the host tier's rows, the local rows hot first, and how many host rows lead because
    ``first`` reads them (in their order; the others after them, in theirs)."""
    hot_pos, hot_rows, cold_pos, cold_rows = shard.split(rows)
    cold_first = 0
    if first is not None and cold_rows.numel():
        needed = torch.isin(cold_rows + shard.num_hot, first.cpu())
        cold_first = int(needed.sum())
        if 0 < cold_first < needed.numel():  # the rows ``first`` reads lead the host rows
            order = torch.argsort(~needed, stable=True)
            cold_pos, cold_rows = cold_pos[order], cold_rows[order]
    return hot_pos, cold_pos, torch.cat([hot_rows, cold_rows + shard.num_hot]), cold_first


def split_layers(shards: Sequence["TieredShard"], rows: torch.Tensor,
                 grads: Sequence[torch.Tensor], first: Optional[torch.Tensor] = None) -> list:
    """``[split_grads(shard, rows, grad, first) for ...]`` over the layers of one chunk, the same
    bits, in one pass where the layers split alike (one store's shards: the same GPU-tier rows)
    and their gradients are one tensor's layers (``layer_stack``: each layer's column block of
    the ``[rows, layers * width]`` gradient that ``exchange.push`` sums): the positions of the
    tiers' rows are found once on the host (every layer has the same ``rows``), and each tier's
    gradients of every layer are taken with one op on the gradients' device, layer first, or
    viewed where the positions are a run (the GPU tier's rows of sorted ``rows``: a prefix); no
    op waits for the device. The layers share one tensor of rows (the table step looks a read's
    rows up once for all of them, ``schedule.OwedStep``)."""
    stack = layer_stack(grads)
    if stack is None or len({s.num_hot for s in shards}) != 1:
        return [split_grads(s, rows, g, first) for s, g in zip(shards, grads)]
    hot_pos, cold_pos, rows, cold_first = _tier_positions(shards[0], rows, first)
    hot = select_rows(stack, hot_pos, dim=1).unbind(0)
    # The host tier's are copied, each layer's rows contiguous: what the copy to the host
    # (``transfer.stage_to_host``: one contiguous copy per part) and the row kernel take.
    cold = (stack.index_select(1, to_device(cold_pos, stack.device)) if cold_pos.numel()
            else stack.narrow(1, 0, 0)).unbind(0)
    return [(rows, TierGrads(h, c, cold_first)) for h, c in zip(hot, cold)]


def layer_stack(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A view ``T`` of ``tensors``' memory with ``T[k]`` the values of ``tensors[k]``, where they
    are two or more equal-shaped views of one tensor at evenly spaced offsets (each layer's
    column block of one gradient, the layers of a stack that ``unbind`` split); else None. For
    reading: unlike ``row_adam.stacked``, the layers may interleave (column blocks do)."""
    if len(tensors) < 2 or any(not isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tensors[0]
    base = first._base
    if base is None:
        return None
    step = tensors[1].storage_offset() - first.storage_offset()
    if step <= 0:
        return None
    for k, t in enumerate(tensors):
        if t._base is not base or t.shape != first.shape or t.stride() != first.stride() or \
                t.dtype != first.dtype or t.storage_offset() != first.storage_offset() + k * step:
            return None
    return first.as_strided((len(tensors),) + tuple(first.shape), (step,) + first.stride(),
                            first.storage_offset())


def take_layers(rows: torch.Tensor, grads: Sequence, keep: torch.Tensor) -> tuple:
    """``take_rows(rows, grad, keep)`` for layers that share ``rows`` and ``keep``:
    ``(rows[keep], [each layer's gradients of them])``, the same values; the positions looked up
    once, and each tier's gradients of every layer taken with one op (or viewed) where they are
    one tensor's layers (``split_layers``' and the host staging's are)."""
    if len(grads) < 2 or not all(isinstance(g, TierGrads) for g in grads) or \
            len({g.num_hot for g in grads}) != 1:
        return rows[keep], [take_rows(rows, g, keep)[1] for g in grads]
    keep = torch.sort(keep.cpu()).values
    split = int(torch.searchsorted(keep, grads[0].num_hot))
    hot, cold = keep[:split], keep[split:] - grads[0].num_hot
    return rows[keep], [TierGrads(h, c) for h, c in zip(
        _select_layers([g.hot for g in grads], hot), _select_layers([g.cold for g in grads], cold))]


def _select_layers(tensors: Sequence[torch.Tensor], positions: torch.Tensor) -> list:
    stack = layer_stack(tensors)
    if stack is None:
        return [select_rows(t, positions) for t in tensors]
    return list(select_rows(stack, positions, dim=1).unbind(0))


def take_rows(rows: torch.Tensor, grad, keep: torch.Tensor) -> tuple:
    """``rows[keep]`` and their gradients (a tensor, or a tiered shard's ``TierGrads``)."""
    if isinstance(grad, TierGrads):
        return grad.take(rows, keep)
    return rows[keep], select_rows(grad, keep)


def select_rows(t: torch.Tensor, positions: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``t.index_select(dim, positions)``, the same values; a view of ``t`` when ``positions``
    (host) are a run of consecutive rows, or none. The table step takes its gradients in chunks
    of consecutive positions until a read has stepped rows out of the middle: a view spares each
    chunk a copy into fresh memory (16 MiB at the 1B shape, about 3 ms of page faults and copying
    on the worker on the GPU machine of 2026-11-27)."""
    n = positions.numel()
    if n == 0:  # no copy of positions to the device for nothing
        return t.narrow(dim, 0, 0)
    if positions.device.type == "cpu":
        first, last = int(positions[0]), int(positions[-1])
        if last - first + 1 == n and (n == 1 or bool((positions.diff() == 1).all())):
            return t.narrow(dim, first, n)
    return t.index_select(dim, to_device(positions, t.device))


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
