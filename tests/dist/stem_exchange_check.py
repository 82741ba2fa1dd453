"""Run under torchrun (gloo): row fetch and gradient push of STEM tables against a global
reference computed on every rank. Exits non-zero with a message on the first mismatch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_ext.stem.runtime import exchange
from megatron_ext.stem.runtime.exchange import ReplicatedExchange, VocabExchange
from megatron_ext.stem.runtime.ownership import SCHEMES, RowOwnership
from megatron_ext.stem.runtime.store import gather_rows

VOCAB, WIDTHS = 37, (5, 3)


def batch_ids(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 0 if (rank == 1 and step == 2) else 11 + rank  # rank 1 sends nothing at step 2
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    return torch.cat([ids, ids[:3]])  # duplicates: fetched and pushed once


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = [torch.randn(VOCAB, w, generator=torch.Generator().manual_seed(7 + w))
              for w in WIDTHS]
    # Routes in one all-to-all of padded blocks (the default at this size), then in two.
    for one_shot_bytes in (exchange.ONE_SHOT_ROUTE_BYTES, 0):
        exchange.ONE_SHOT_ROUTE_BYTES = one_shot_bytes
        check_fetch_and_push(rank, world, tables)
        check_groups(rank, world, tables, one_shot=bool(one_shot_bytes))
    check_union_route(rank, world)
    dist.barrier()
    if rank == 0:
        print(f"exchange ok on {world} ranks")
    dist.destroy_process_group()


def check_fetch_and_push(rank: int, world: int, tables) -> None:
    for scheme in SCHEMES + ("replicated",):
        for step in range(3):
            if scheme == "replicated":
                ex = ReplicatedExchange(VOCAB, dist.group.WORLD)
                shards = tables
                owned = torch.arange(VOCAB)
            else:
                own = RowOwnership(VOCAB, world, scheme)
                ex = VocabExchange(own, dist.group.WORLD)
                owned = own.owned_ids(rank)
                shards = [t[owned].clone() for t in tables]
            unique = torch.unique(batch_ids(rank, step))
            route = ex.route(unique)
            cpu = torch.device("cpu")
            served = gather_rows(shards, route.requested, ex.serve_device(cpu), torch.float32)
            rows = ex.send_rows(route, served, WIDTHS, cpu)
            for t, r in zip(tables, rows):
                if not torch.equal(r, t[unique]):
                    sys.exit(f"{scheme} step {step} rank {rank}: fetched rows differ")
            grads = [torch.randn(unique.numel(), w, generator=torch.Generator().manual_seed(
                100 * rank + w + step)) for w in WIDTHS]
            local_rows, summed = ex.push(route, grads)
            # Reference: every rank's (unique ids, grads), summed into the global table.
            for wi, w in enumerate(WIDTHS):
                ref = torch.zeros(VOCAB, w, dtype=torch.float64)
                touched = torch.zeros(VOCAB, dtype=torch.bool)
                for r in range(world):
                    u = torch.unique(batch_ids(r, step))
                    g = torch.randn(u.numel(), w, generator=torch.Generator().manual_seed(
                        100 * r + w + step))
                    ref.index_add_(0, u, g.double())
                    touched[u] = True
                got_ids = owned[local_rows]
                expect_ids = owned[touched[owned]]
                if not torch.equal(got_ids, expect_ids):
                    sys.exit(f"{scheme} step {step} rank {rank}: touched rows {got_ids.tolist()} "
                             f"!= {expect_ids.tolist()}")
                if not torch.allclose(summed[wi].double(), ref[got_ids], atol=1e-6):
                    sys.exit(f"{scheme} step {step} rank {rank}: summed gradients differ")


class CallLog:
    """Records the group of every ``all_to_all_single`` while installed."""

    def __init__(self):
        self.groups = []
        self._real = dist.all_to_all_single

    def __enter__(self):
        def recorded(*args, group=None, **kwargs):
            self.groups.append(group)
            return self._real(*args, group=group, **kwargs)
        dist.all_to_all_single = recorded
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._real


def check_union_route(rank: int, world: int) -> None:
    """The push's route of a step's fetches, made without a collective (``union_route``), is
    the route that exchanging the union of their ids gives (``route``), field by field: every
    rank knows both of its sides. Micro-batches of different sizes, one of them empty on rank 1;
    also no fetch at all, and one rank in the group."""
    alone = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    for scheme in SCHEMES:
        for group, size in ((dist.group.WORLD, world), (alone, 1)):
            ex = VocabExchange(RowOwnership(VOCAB, size, scheme), group)
            for steps in ((0, 1, 2), (2,), ()):
                fetched = [torch.unique(batch_ids(rank, s)) for s in steps]
                routes = [ex.route(u) for u in fetched]
                union = torch.unique(torch.cat(fetched)) if fetched else \
                    torch.empty(0, dtype=torch.long)
                with CallLog() as made:
                    got = ex.union_route(union, routes)
                if made.groups:
                    sys.exit(f"{scheme}: union_route issued a collective")
                want = ex.route(union)
                for field in ("order", "send_counts", "recv_counts", "requested",
                              "requested_ids"):
                    a, b = getattr(got, field), getattr(want, field)
                    same = torch.equal(a, b) if torch.is_tensor(a) else a == b
                    if not same:
                        sys.exit(f"{scheme} (group of {size}) steps {steps} rank {rank}: "
                                 f"union_route's {field} {a} != route's {b}")


def check_groups(rank: int, world: int, tables, one_shot: bool) -> None:
    """Routing runs on the host group (one all-to-all with ``one_shot``, else two), rows and
    gradients on the exchange's group; with one rank in the group nothing is exchanged, and both
    give the reference's rows and sums."""
    device_group = dist.new_group(list(range(world)), backend="gloo")
    host_group = dist.new_group(list(range(world)), backend="gloo")
    alone = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    cpu = torch.device("cpu")
    for scheme in SCHEMES:
        for group, host, size in ((device_group, host_group, world), (alone, None, 1)):
            own = RowOwnership(VOCAB, size, scheme)
            ex = VocabExchange(own, group, host)
            owned = own.owned_ids(0 if size == 1 else rank)
            shards = [t[owned].clone() for t in tables]
            unique = torch.unique(batch_ids(rank, 0))
            with CallLog() as routed:
                route = ex.route(unique)
            with CallLog() as moved:
                served = gather_rows(shards, route.requested, ex.serve_device(cpu),
                                     torch.float32)
                rows = ex.send_rows(route, served, WIDTHS, cpu)
                grads = [torch.randn(unique.numel(), w) for w in WIDTHS]
                local_rows, summed = ex.push(route, grads)
            if size == 1:
                if routed.groups or moved.groups:
                    sys.exit(f"{scheme}: a one-rank exchange issued collectives")
                for w, g in zip(WIDTHS, summed):
                    ref = torch.zeros(VOCAB, w)
                    ref.index_add_(0, unique, grads[WIDTHS.index(w)])
                    if not torch.allclose(g, ref[owned[local_rows]]):
                        sys.exit(f"{scheme}: one-rank push differs")
            else:
                if not routed.groups or any(g is not host for g in routed.groups):
                    sys.exit(f"{scheme}: route used {routed.groups}, not only the host group")
                if ex.one_shot != one_shot or len(routed.groups) != 2 - one_shot:
                    sys.exit(f"{scheme}: one_shot {ex.one_shot}, {len(routed.groups)} "
                             f"all-to-alls to route")
                if not moved.groups or any(g is not group for g in moved.groups):
                    sys.exit(f"{scheme}: rows/gradients used {moved.groups}, not the group")
            for t, r in zip(tables, rows):
                if not torch.equal(r, t[unique]):
                    sys.exit(f"{scheme} (group of {size}) rank {rank}: fetched rows differ")


if __name__ == "__main__":
    main()
