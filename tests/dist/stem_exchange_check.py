"""Run under torchrun (gloo): row fetch and gradient push of STEM tables against a global
reference computed on every rank. Exits non-zero with a message on the first mismatch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_ext.stem.exchange import ReplicatedExchange, VocabExchange
from megatron_ext.stem.ownership import SCHEMES, RowOwnership
from megatron_ext.stem.store import gather_rows

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
    dist.barrier()
    if rank == 0:
        print(f"exchange ok on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
