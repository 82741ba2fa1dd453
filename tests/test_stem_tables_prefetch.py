"""Managed STEM tables in one process: a fetch started ahead (its rows read on the worker thread)
binds the same rows as a synchronous one, and the bound rows and index reproduce ``table[ids]``;
the overlapped table step (the forward step's read-ahead of the next step's first micro-batch,
whose read the optimizer releases after stepping the rows it needs) lets every micro-batch read
rows with every earlier step applied. On a GPU the rows come from pinned host memory over a side
stream (the path CI cannot run); on the CPU the thread path."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.config import StemConfig

VOCAB = 100


class FakeLayer:
    """The calls StemTables makes on a StemMLP."""

    def __init__(self, table):
        self.table, self.bound = table, None

    def release_initial_table(self):
        return self.table

    def bind_rows(self, rows, inverse):
        self.bound = (rows, inverse)

    def release_rows(self):
        self.bound = None


def host_tables(g: torch.Generator):
    """Two tables (widths 8 and 4) drawn from ``g``, managed in host shards with prefetch: (the
    drawn tables, the fake layers, StemTables, the device rows go to)."""
    from megatron.core import parallel_state

    from megatron_ext.stem.tables import StemTables

    full = [torch.randn(VOCAB, 8, generator=g), torch.randn(VOCAB, 4, generator=g)]
    layers = [FakeLayer(t.clone()) for t in full]
    tables = StemTables(layers, StemConfig(placement="cpu", sharding="vocab"), VOCAB,
                        parallel_state.get_data_parallel_group())
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return full, layers, tables, device


def test_prefetch_binds_what_a_synchronous_fetch_binds(mcore_single_rank):
    g = torch.Generator().manual_seed(0)
    full, layers, tables, device = host_tables(g)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g).to(device)  # [b, s] as batches come
    with torch.no_grad():
        tables.fetch_now(ids)
        sync = [(r.clone(), i.clone()) for r, i in (l.bound for l in layers)]
        tables.finish_fetch(tables.start_fetch(ids, ahead=True))
    for layer, table, (rows, inverse) in zip(layers, full, sync):
        got_rows, got_inverse = layer.bound
        assert got_rows.device.type == device.type
        assert torch.equal(got_rows, rows) and torch.equal(got_inverse, inverse)
        # [s, b] lookups equal the table rows of the transposed ids.
        torch.testing.assert_close(got_rows[got_inverse].cpu(), table[ids.t().cpu()])
    assert tables.stats["fetch_seconds_hidden"] >= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_through_pinned_staging(dtype):
    """Rows of several shards, side by side, in the wire dtype: through the reusable pinned buffer
    on a GPU (twice, so the buffer is reused and grown), directly on the CPU."""
    from megatron_ext.stem.store import PinnedStaging, gather_rows

    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(50, 8, generator=g), torch.randn(50, 3, generator=g)]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    staging = PinnedStaging() if cuda else None
    for n in (7, 40):
        index = torch.randint(0, 50, (n,), generator=g)
        got = gather_rows(shards, index, device, dtype, staging, chunk=5)
        want = torch.cat([s[index] for s in shards], dim=1).to(dtype)
        assert got.device.type == device.type and got.dtype == dtype
        assert torch.equal(got.cpu(), want)


def test_overlapped_step_reads_rows_with_the_step_applied(mcore_single_rank):
    """Two steps of three micro-batches with host shards and prefetch, through the forward step's
    read-ahead and the table optimizer's step split (the rows the next step's first micro-batch
    reads, its read, the rest), with plain SGD as the row rule: every bound row equals a plain
    table updated by the same rule after every step, and the shards end equal to it."""
    from megatron_ext.stem.table_optimizer import StemTablesOptimizer
    from megatron_ext.stem.worker import WORKER
    from megatron_ext.training.forward_step import TableReadAhead

    g = torch.Generator().manual_seed(2)
    full, layers, tables, device = host_tables(g)
    assert tables.overlap
    # Skewed ids (many repeats across micro-batches, some rows read by one only).
    batches = [(torch.multinomial(torch.arange(VOCAB, 0, -1).float() ** 2, 32, replacement=True,
                                  generator=g).view(2, 16).to(device),) for _ in range(7)]
    weights = [torch.randn(16, 2, t.shape[1], generator=g).to(device) for t in full]
    reader = iter(batches)
    expected = [t.clone() for t in full]
    lr = 0.5

    class SGD:  # the row rule, in RowAdamW's step interface
        mode = "sparse"

        def begin_step(self, hyper):
            return None

        def step_rows(self, i, rows, grad, plan):
            tables.store.shards[i].index_add_(0, rows, grad.to(torch.float32), alpha=-lr)

    optimizer = StemTablesOptimizer.__new__(StemTablesOptimizer)  # only its table step
    optimizer.mode, optimizer._step_tasks = "sparse", []
    read_ahead = TableReadAhead(tables)
    for step in range(2):
        for m in range(3):
            batch = read_ahead.take(lambda: next(reader), 3, next_step=step == 0)
            loss = 0.0
            for layer, want, w in zip(layers, expected, weights):
                rows, inverse = layer.bound
                looked_up = rows[inverse]  # [s, b, F]
                assert torch.equal(looked_up.detach().cpu(), want[batch[0].t().cpu()]), (step, m)
                loss = loss + (looked_up * w).sum()
            loss.backward()
        local, grads = tables.collect_grads()
        grads = [x.cpu() for x in grads]
        for want, x in zip(expected, grads):  # the plain rule: SGD on the touched rows
            want.index_add_(0, tables.owned_ids[local], x, alpha=-lr)
        # After the first step the next step's first micro-batch waits for this step.
        assert (tables.deferred is not None) == (step == 0)
        optimizer._step_table(tables, SGD(), None, [(local, x) for x in grads], None)
        assert tables.deferred is None
    WORKER.wait()
    assert sum(done.result()[0] for _, done in optimizer._step_tasks) > 0
    assert next(reader) is batches[6]  # read ahead exactly one micro-batch: the step's first
    for shard, want in zip(tables.shards, expected):
        assert torch.equal(shard, want[tables.owned_ids])
