"""Moving STEM table rows between data-parallel ranks: fetch rows from their owners, send row
gradients back to them. Collectives over one process group (the data-parallel group); every rank
of the group calls them in the same order with its own ids.

``VocabExchange`` (``--stem-table-sharding vocab``): each rank owns the rows a ``RowOwnership``
gives it. A fetch sends the batch's *deduplicated* ids to their owners (``all_to_all``), the owners
gather those rows from their shards, and the rows come back the same way: per rank and step this
moves ``uniq(ids) x width`` values, the STEM paper's Table 1 accounting. Pushing gradients is the
same route backwards; an owner sums the gradients of a row that several ranks send: this *is* the
data-parallel reduction of the tables (Megatron's DDP never sees them).

``ReplicatedExchange`` (``replicated``): every rank holds every row; fetches are local and a push
gathers all ranks' (id, gradient) pairs and sums them, so every rank steps the same rows alike.

Device: the collectives run where the group's backend wants tensors (CUDA for NCCL, CPU for gloo);
rows gathered from host shards for a GPU are written straight into a reusable pinned buffer
(``PinnedStaging``) and moved by one asynchronous copy. Rows may travel in the model's 16-bit
dtype (``wire_dtype``): the layers cast them to it anyway, so the values they compute with are the
same, and the bytes moved are halved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_ext.stem.ownership import RowOwnership
from megatron_ext.stem.tiers import TieredShard


def comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PinnedStaging:
    """A reusable page-locked host buffer for copies between host shards and the GPU (pinned
    memory is what lets the copy engine move it while kernels run; allocating it is slow, so it
    is allocated once and grows when a larger batch of rows comes). A view handed out is valid
    until the next ``view()``, which first waits for the copy that ``record()`` marked."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._event = None

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        need = numel * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None
            self._buffer = torch.empty(need + need // 4 + 4096, dtype=torch.uint8,
                                       pin_memory=True)
        return self._buffer[:need].view(dtype)

    def record(self) -> None:
        """Mark the end of the copy that reads/writes the last view (on the current stream)."""
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream())

    def take_event(self):
        """The marked copy's event (None if none), handed to whoever will wait for it; the next
        ``view()`` no longer waits for it: the taker must be done with the buffer first."""
        event, self._event = self._event, None
        return event


def host_gather(shard: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                chunk: int = 1024) -> None:
    """``out[:] = shard[index]`` cast to ``out``'s dtype, for fp32 host shards: the compiled
    gather (``kernels/row_adam_cpu.py``) when it builds, else torch ops in chunks of rows."""
    from megatron_ext_kernels import row_adam_cpu

    kernel = row_adam_cpu.load()
    if kernel is not None and shard.is_contiguous() and shard.dtype == torch.float32:
        kernel.gather_rows_(shard, index, out)
        return
    for start in range(0, index.numel(), chunk):
        part = index[start: start + chunk]
        rows = out[start: start + part.numel()]
        if out.dtype == shard.dtype:
            torch.index_select(shard, 0, part, out=rows)
        else:
            rows.copy_(shard[part])


def gather_rows(shards: Sequence[torch.Tensor], index: torch.Tensor, device: torch.device,
                dtype: torch.dtype, staging: PinnedStaging | None = None,
                chunk: int = 1024) -> torch.Tensor:
    """``cat([shard[index] for shard in shards], dim=1)`` as ``dtype`` on ``device``. From host
    shards to a GPU the rows are gathered (and cast) straight into ``staging``'s pinned buffer,
    one block per shard, in chunks of rows (no large temporaries), then moved in one
    asynchronous copy and laid out side by side on the GPU."""
    if shards and isinstance(shards[0], TieredShard):
        return _gather_tiered(shards, index, device, dtype, staging)
    widths = [s.shape[1] for s in shards]
    n = index.numel()
    on_host = all(s.device.type == "cpu" for s in shards)
    if not (staging is not None and on_host and device.type == "cuda") or n == 0:
        rows = torch.cat([s[index.to(s.device)] for s in shards], dim=1) if n else \
            shards[0].new_empty(0, sum(widths))
        return rows.to(device=device, dtype=dtype)
    flat = staging.view(n * sum(widths), dtype)
    index = index.to(torch.long).contiguous()
    offset = 0
    for s, w in zip(shards, widths):
        host_gather(s, index, flat[offset: offset + n * w].view(n, w), chunk)
        offset += n * w
    moved = flat.to(device, non_blocking=True)
    staging.record()
    parts, offset = [], 0
    for w in widths:
        parts.append(moved[offset: offset + n * w].view(n, w))
        offset += n * w
    return torch.cat(parts, dim=1)


def _gather_tiered(shards: Sequence[TieredShard], index: torch.Tensor, device: torch.device,
                   dtype: torch.dtype, staging: PinnedStaging | None) -> torch.Tensor:
    """``gather_rows`` of tiered shards: the GPU tier's rows are read where they are, the host
    tier's through the host-shard path (pinned staging to a GPU)."""
    widths = [s.shape[1] for s in shards]
    hot_pos, hot_rows, cold_pos, cold_rows = shards[0].split(index)
    out = torch.empty(index.numel(), sum(widths), dtype=dtype, device=device)
    if hot_pos.numel():
        hot_dev = shards[0].hot.device
        rows = torch.cat([s.hot[hot_rows.to(hot_dev)] for s in shards], dim=1)
        out[hot_pos.to(device)] = rows.to(device, dtype)
    if cold_pos.numel():
        out[cold_pos.to(device)] = gather_rows([s.cold for s in shards], cold_rows, device, dtype,
                                               staging)
    return out


@dataclass
class Route:
    """Where each of this rank's unique ids goes and what it is asked for in return."""
    order: torch.Tensor          # permutation of the unique ids into owner order
    send_counts: List[int]       # ids this rank asks of each owner
    recv_counts: List[int]       # ids each rank asks of this rank
    requested: torch.Tensor      # local shard indices asked of this rank (concatenated by asker)

    @property
    def rows_out(self) -> int:   # rows this rank serves
        return sum(self.recv_counts)

    @property
    def rows_in(self) -> int:    # rows this rank receives
        return sum(self.send_counts)


class VocabExchange:
    def __init__(self, ownership: RowOwnership, group):
        if ownership.world != dist.get_world_size(group):
            raise ValueError(f"ownership is for {ownership.world} ranks, the group has "
                             f"{dist.get_world_size(group)}")
        self.ownership = ownership
        self.group = group
        self.device = comm_device(group)

    def route(self, unique_ids: torch.Tensor) -> Route:
        """Exchange counts and ids (two small all-to-alls)."""
        ids = unique_ids.to(torch.long)
        owners = self.ownership.owner(ids)
        order = torch.argsort(owners, stable=True)
        world = self.ownership.world
        send_counts = torch.bincount(owners, minlength=world)
        dev = self.device
        recv_counts = torch.empty_like(send_counts, device=dev)
        dist.all_to_all_single(recv_counts, _to(send_counts, dev), group=self.group)
        send, recv = send_counts.tolist(), recv_counts.cpu().tolist()
        requested = torch.empty(sum(recv), dtype=torch.long, device=dev)
        dist.all_to_all_single(requested, _to(ids[order], dev), output_split_sizes=recv,
                               input_split_sizes=send, group=self.group)
        local = self.ownership.local_index(requested.cpu())
        return Route(order=order, send_counts=send, recv_counts=recv, requested=local)

    def fetch(self, route: Route, shards: Sequence[torch.Tensor], out_device: torch.device,
              wire_dtype: torch.dtype | None = None, staging: PinnedStaging | None = None
              ) -> List[torch.Tensor]:
        """Rows of ``unique_ids`` (the route's) from every shard: one all-to-all for all layers.
        Returns ``[len(unique_ids), width]`` fp32 per shard, in ``unique_ids`` order. The rows
        travel as ``wire_dtype`` (default: the shards' dtype)."""
        widths = [s.shape[1] for s in shards]
        wire = wire_dtype or shards[0].dtype
        served = gather_rows(shards, route.requested, self.device, wire, staging)
        received = torch.empty(route.rows_in, sum(widths), dtype=wire, device=self.device)
        dist.all_to_all_single(received, served.contiguous(),
                               output_split_sizes=route.send_counts,
                               input_split_sizes=route.recv_counts, group=self.group)
        rows = torch.empty_like(received)
        rows[route.order.to(received.device)] = received
        rows = _to(rows, out_device).to(shards[0].dtype)
        return list(torch.split(rows, widths, dim=1))

    def push(self, route: Route, grads: Sequence[torch.Tensor]
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Send each shard's row gradients (``[len(unique_ids), width]``, ``unique_ids`` order) to
        the owners. Returns this rank's touched local rows (unique, sorted) and, per shard, their
        gradients summed over all ranks that sent them (on the communication device)."""
        widths = [g.shape[1] for g in grads]
        outgoing = _to(torch.cat(list(grads), dim=1), self.device)[route.order.to(self.device)]
        incoming = torch.empty(route.rows_out, sum(widths), dtype=outgoing.dtype,
                               device=self.device)
        dist.all_to_all_single(incoming, outgoing.contiguous(),
                               output_split_sizes=route.recv_counts,
                               input_split_sizes=route.send_counts, group=self.group)
        rows, inverse = torch.unique(route.requested, return_inverse=True)
        summed = torch.zeros(rows.numel(), sum(widths), dtype=incoming.dtype, device=self.device)
        summed.index_add_(0, inverse.to(self.device), incoming)
        return rows, list(torch.split(summed, widths, dim=1))


class ReplicatedExchange:
    """Every rank owns every row (``RowOwnership`` with world 1 over the full vocab)."""

    def __init__(self, vocab: int, group):
        self.ownership = RowOwnership(vocab, 1, "contiguous")
        self.group = group
        self.device = comm_device(group)

    def route(self, unique_ids: torch.Tensor) -> Route:
        ids = unique_ids.to(torch.long)
        n = ids.numel()
        return Route(order=torch.arange(n), send_counts=[n], recv_counts=[n], requested=ids.cpu())

    def fetch(self, route: Route, shards: Sequence[torch.Tensor], out_device: torch.device,
              wire_dtype: torch.dtype | None = None, staging: PinnedStaging | None = None
              ) -> List[torch.Tensor]:
        widths = [s.shape[1] for s in shards]
        rows = gather_rows(shards, route.requested, out_device, wire_dtype or shards[0].dtype,
                           staging).to(shards[0].dtype)
        return list(torch.split(rows, widths, dim=1))

    def push(self, route: Route, grads: Sequence[torch.Tensor]
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        widths = [g.shape[1] for g in grads]
        world = dist.get_world_size(self.group)
        ids = _to(route.requested, self.device)
        payload = _to(torch.cat(list(grads), dim=1), self.device)
        counts = torch.tensor([ids.numel()], device=self.device)
        all_counts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts, group=self.group)
        most = max(int(c) for c in all_counts)
        padded_ids = torch.zeros(most, dtype=torch.long, device=self.device)
        padded_ids[: ids.numel()] = ids
        padded = payload.new_zeros(most, payload.shape[1])
        padded[: ids.numel()] = payload
        every_ids = [torch.empty_like(padded_ids) for _ in range(world)]
        every = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(every_ids, padded_ids, group=self.group)
        dist.all_gather(every, padded, group=self.group)
        ids_all = torch.cat([e[: int(c)] for e, c in zip(every_ids, all_counts)])
        grads_all = torch.cat([e[: int(c)] for e, c in zip(every, all_counts)])
        rows, inverse = torch.unique(ids_all, return_inverse=True)
        summed = torch.zeros(rows.numel(), payload.shape[1], dtype=payload.dtype,
                             device=self.device)
        summed.index_add_(0, inverse, grads_all)
        return rows.cpu(), list(torch.split(summed, widths, dim=1))
