"""Moving STEM table rows between data-parallel ranks: route ids to their owners, send the rows the
owners read back to the askers, send row gradients to the owners. Collectives over one process
group (the data-parallel group); every rank of the group calls them in the same order with its
own ids, from the training thread (the rows themselves are read from and written to the store,
``stem/runtime/store.py``, by host work that issues no collective).

``VocabExchange`` (``--stem-table-sharding vocab``): each rank owns the rows a ``RowOwnership``
gives it. A fetch sends the batch's *deduplicated* ids to their owners (``route``: one small
``all_to_all`` of padded blocks while they are small, else two: counts, then ids), the owners
read those rows from their store, and the rows come back the same way (``send_rows``: one
``all_to_all`` for every layer of the chunk): per rank and step this
moves ``uniq(ids) x width`` values, the STEM paper's Table 1 accounting. Pushing gradients is the
same route backwards, for the union of the step's fetches (``union_route``: every rank knows what
it asked and what it was asked in those fetches, so that route costs no collective; one
``all_to_all`` moves the gradients); an owner sums the gradients of a row that several ranks send:
this *is* the data-parallel reduction of the tables (Megatron's DDP never sees them). Every
collective is a point where the ranks wait for each other: on a busy host each costs the wake-ups
of both ranks' communication threads, so the tables make as few as they can.

``ReplicatedExchange`` (``replicated``): every rank holds every row; fetches are local and a push
gathers all ranks' (id, gradient) pairs and sums them, so every rank steps the same rows alike.

Device: the collectives run where the group's backend wants tensors (CUDA for NCCL, CPU for gloo:
``serve_device``, where the owners' rows must be put for ``send_rows``). Rows may travel in the model's 16-bit
dtype (``wire_dtype``): the layers cast them to it anyway, so the values they compute with are the
same, and the bytes moved are halved.

No wait for the GPU on the training thread: ids are host data, so ``route`` exchanges them over a
host group (``host_group``: Megatron's gloo copy of the data-parallel group,
``parallel_state.get_data_parallel_group_gloo``) when there is one; routing over NCCL instead needs
the counts on the host, and reading them waits for every kernel queued before (the previous
micro-batch's backward), so the host stops running ahead of the GPU at every micro-batch. With
one rank in the group nothing is exchanged at all. Host tensors go to the GPU from pinned memory
without blocking (``to_device``): a plain ``.to("cuda")`` of a host tensor synchronises the
stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_ext.stem.runtime.ownership import RowOwnership
from megatron_ext.stem.runtime.transfer import to_device

ONE_SHOT_ROUTE_BYTES = 256 * 1024


def comm_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


@dataclass
class Route:
    """Where each of this rank's unique ids goes and what it is asked for in return."""
    order: torch.Tensor          # permutation of the unique ids into owner order (host)
    send_counts: List[int]       # ids this rank asks of each owner
    recv_counts: List[int]       # ids each rank asks of this rank
    requested: torch.Tensor      # local shard indices asked of this rank (concatenated by asker)
    requested_ids: torch.Tensor  # the same rows' global ids (host)

    @property
    def rows_out(self) -> int:   # rows this rank serves
        return sum(self.recv_counts)

    @property
    def rows_in(self) -> int:    # rows this rank receives
        return sum(self.send_counts)


class VocabExchange:
    """``host_group``: a host (gloo) group of the same ranks as ``group``, for ``route``'s ids
    (``group`` itself when it is a host group; None: route over ``group``)."""

    def __init__(self, ownership: RowOwnership, group, host_group=None):
        if ownership.world != dist.get_world_size(group):
            raise ValueError(f"ownership is for {ownership.world} ranks, the group has "
                             f"{dist.get_world_size(group)}")
        if host_group is not None and (
                dist.get_world_size(host_group) != ownership.world
                or dist.get_rank(host_group) != dist.get_rank(group)):
            raise ValueError("the host group of a STEM exchange must hold the same ranks, in "
                             "the same order, as its group")
        self.ownership = ownership
        self.group = group
        self.device = comm_device(group)
        if host_group is None and self.device.type == "cpu":
            host_group = group
        self.host_group = host_group
        self.single = ownership.world == 1  # nothing to exchange
        # One all-to-all for a route's counts and ids when every rank's ids for one owner fit a
        # block that all ranks size alike without asking: the count, then at most as many ids
        # as the owner owns, padded (int32). Used on the host group while a rank sends at most
        # ``ONE_SHOT_ROUTE_BYTES`` (2 ranks of an 8,192-id vocabulary: 32 KiB); past that, two
        # all-to-alls (counts, then only the ids).
        self.block = 1 + max(ownership.num_owned(r) for r in range(ownership.world))
        self.one_shot = (self.host_group is not None and not self.single
                         and ownership.vocab < 2**31
                         and ownership.world * self.block * 4 <= ONE_SHOT_ROUTE_BYTES)

    def route(self, unique_ids: torch.Tensor) -> Route:
        """Exchange counts and ids (one all-to-all of padded blocks when ``one_shot``, else two
        small all-to-alls; on the host group when there is
        one; none with one rank)."""
        ids, owners, order, send_counts = self._send_side(unique_ids)
        send = send_counts.tolist()
        if self.single:
            recv, requested = send, ids[order]
        elif self.one_shot:
            recv, requested = self._route_one_shot(ids[order], owners[order], send_counts)
        elif self.host_group is not None:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.host_group)
            recv = recv_counts.tolist()
            requested = torch.empty(sum(recv), dtype=torch.long)
            dist.all_to_all_single(requested, ids[order].contiguous(), output_split_sizes=recv,
                                   input_split_sizes=send, group=self.host_group)
        else:  # NCCL only (no gloo copy of the group): the counts' read waits for the GPU
            dev = self.device
            recv_counts = torch.empty_like(send_counts, device=dev)
            dist.all_to_all_single(recv_counts, to_device(send_counts, dev), group=self.group)
            recv = recv_counts.cpu().tolist()
            requested = torch.empty(sum(recv), dtype=torch.long, device=dev)
            dist.all_to_all_single(requested, to_device(ids[order], dev),
                                   output_split_sizes=recv, input_split_sizes=send,
                                   group=self.group)
            requested = requested.cpu()
        local = self.ownership.local_index(requested)
        return Route(order=order, send_counts=send, recv_counts=recv, requested=local,
                     requested_ids=requested)

    def _send_side(self, unique_ids: torch.Tensor):
        """What this rank asks of each owner: the ids (host, long), their owners, the
        permutation into owner order (stable: ids in their order within an owner) and the count
        per owner."""
        ids = unique_ids.to(torch.long)
        if ids.is_cuda:  # callers pass host ids; a GPU tensor costs a wait for the GPU here
            ids = ids.cpu()
        owners = self.ownership.owner(ids)
        order = torch.argsort(owners, stable=True)
        return ids, owners, order, torch.bincount(owners, minlength=self.ownership.world)

    def _route_one_shot(self, ids: torch.Tensor, owners: torch.Tensor,
                        counts: torch.Tensor) -> Tuple[List[int], torch.Tensor]:
        """``route``'s exchange in one all-to-all of fixed blocks (``one_shot``): ``ids`` in
        owner order, ``owners`` theirs, ``counts`` per owner. Returns what each rank asks of this
        one: the counts and the ids, concatenated by asker."""
        world, block = self.ownership.world, self.block
        out = torch.zeros(world, block, dtype=torch.int32)
        out[:, 0] = counts
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(ids.numel()) - starts[owners]
        out[owners, 1 + position] = ids.to(torch.int32)
        back = torch.empty_like(out)
        dist.all_to_all_single(back, out, group=self.host_group)
        recv = back[:, 0].tolist()
        if any(not 0 <= c < block for c in recv):
            raise RuntimeError(f"STEM route: a rank asked for {recv} rows of at most "
                               f"{block - 1} (ranks disagree on the table's ownership)")
        filled = torch.arange(block - 1)[None, :] < back[:, :1]
        return recv, back[:, 1:][filled].to(torch.long)

    def union_route(self, unique_ids: torch.Tensor, routes: Sequence[Route]) -> Route:
        """The route of ``unique_ids``, the sorted union of the unique ids of the fetches whose
        routes are ``routes`` (the step's gradient push), made without a collective: what this
        rank asks of each owner is its share of ``unique_ids`` (``route``'s send side), and what
        each rank asks of this one is the union of what it asked in ``routes``, sorted by id,
        the order in which that rank's share of its sorted ids reaches this owner. Every rank
        must pass the routes of the same fetches (their unions are each other's receive
        sides)."""
        ids, _, order, send_counts = self._send_side(unique_ids)
        send = send_counts.tolist()
        if self.single:
            recv, requested = send, ids[order]
        else:
            by_asker = [torch.split(r.requested_ids, r.recv_counts) for r in routes]
            parts = [torch.unique(torch.cat([asked[a] for asked in by_asker])) if routes else
                     torch.empty(0, dtype=torch.long) for a in range(self.ownership.world)]
            recv = [p.numel() for p in parts]
            requested = torch.cat(parts)
        local = self.ownership.local_index(requested)
        return Route(order=order, send_counts=send, recv_counts=recv, requested=local,
                     requested_ids=requested)

    def serve_device(self, out_device: torch.device) -> torch.device:
        """Where the rows an owner serves must be for ``send_rows``: the group's device."""
        return self.device

    def send_rows(self, route: Route, served: torch.Tensor, widths: Sequence[int],
                  out_device: torch.device, dtype: torch.dtype = torch.float32
                  ) -> List[torch.Tensor]:
        """The rows this rank serves (``served [rows_out, sum(widths)]``: the route's
        ``requested`` rows of every shard, side by side, on ``serve_device``) go to the ranks that
        asked; the rows this rank asked for come back (one all-to-all for all layers). Returns
        ``[len(unique_ids), width]`` per shard, in ``unique_ids`` order, as ``dtype`` on
        ``out_device``. The rows travel as ``served``'s dtype."""
        if self.single:  # one owner: the rows are served in the asker's order already
            rows = served
        else:
            received = torch.empty(route.rows_in, sum(widths), dtype=served.dtype,
                                   device=self.device)
            dist.all_to_all_single(received, served.contiguous(),
                                   output_split_sizes=route.send_counts,
                                   input_split_sizes=route.recv_counts, group=self.group)
            rows = torch.empty_like(received)
            rows[to_device(route.order, received.device)] = received
        rows = to_device(rows, out_device).to(dtype)
        return list(torch.split(rows, list(widths), dim=1))

    def push(self, route: Route, grads: Sequence[torch.Tensor]
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Send each shard's row gradients (``[len(unique_ids), width]``, ``unique_ids`` order) to
        the owners. Returns this rank's touched local rows (unique, sorted) and, per shard, their
        gradients summed over all ranks that sent them (on the communication device)."""
        widths = [g.shape[1] for g in grads]
        outgoing = to_device(torch.cat(list(grads), dim=1), self.device)
        if self.single:  # one owner, ids in owner order already
            incoming = outgoing
        else:
            outgoing = outgoing[to_device(route.order, self.device)]
            incoming = torch.empty(route.rows_out, sum(widths), dtype=outgoing.dtype,
                                   device=self.device)
            dist.all_to_all_single(incoming, outgoing.contiguous(),
                                   output_split_sizes=route.recv_counts,
                                   input_split_sizes=route.send_counts, group=self.group)
        rows, inverse = torch.unique(route.requested, return_inverse=True)
        summed = torch.zeros(rows.numel(), sum(widths), dtype=incoming.dtype, device=self.device)
        summed.index_add_(0, to_device(inverse, self.device), incoming)
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
        return Route(order=torch.arange(n), send_counts=[n], recv_counts=[n], requested=ids.cpu(),
                     requested_ids=ids.cpu())

    def union_route(self, unique_ids: torch.Tensor, routes: Sequence[Route]) -> Route:
        """Every rank holds every row: the route of ``unique_ids`` is local."""
        return self.route(unique_ids)

    def serve_device(self, out_device: torch.device) -> torch.device:
        """Every rank serves itself: its rows go straight where the layers want them."""
        return out_device

    def send_rows(self, route: Route, served: torch.Tensor, widths: Sequence[int],
                  out_device: torch.device, dtype: torch.dtype = torch.float32
                  ) -> List[torch.Tensor]:
        """``served`` are the route's (this rank's own) rows already: no collective."""
        rows = to_device(served, out_device).to(dtype)
        return list(torch.split(rows, list(widths), dim=1))

    def push(self, route: Route, grads: Sequence[torch.Tensor]
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        widths = [g.shape[1] for g in grads]
        world = dist.get_world_size(self.group)
        ids = to_device(route.requested, self.device)
        payload = to_device(torch.cat(list(grads), dim=1), self.device)
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
