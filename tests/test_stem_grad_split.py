"""The tiered tables' gradient path after backward for every layer of a chunk at once
(``tiers.split_layers``, ``tiers.take_layers``, the owed step's chunks with the GPU tier's rows
``queued``): the same gradients, rows, moments and per-row steps, bit for bit, as the path per
layer, and ops (kernel launches on a GPU, Python and dispatch on the host) that do not grow with
the layers (``benchmarks/stem_catchup_ops.py`` counts them per phase)."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_ext.stem.runtime import schedule
from megatron_ext.stem.runtime.row_adam import AdamHyper, TieredLazyRows, TieredRowAdamW
from megatron_ext.stem.runtime.schedule import OwedStep, TableSteps
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.tiers import (TieredShard, layer_stack, split_grads, split_layers,
                                             take_layers, take_rows)
from stem_fakes import CallerRunsWorker, StoreTable

ROWS, WIDTH, HOT = 48, 8, 20
HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _reference_split(num_hot, rows, grad, first):
    """One layer's split written out: hot rows in their order, then the host rows that ``first``
    holds, then the other host rows; the gradient rows alike."""
    pos = list(range(rows.numel()))
    hot = [p for p in pos if rows[p] < num_hot]
    cold = [p for p in pos if rows[p] >= num_hot]
    wanted = set(first.tolist()) if first is not None else set()
    lead = [p for p in cold if int(rows[p]) in wanted]
    cold = lead + [p for p in cold if int(rows[p]) not in wanted]
    order = torch.tensor(hot + cold, dtype=torch.long)
    return rows[order], grad[torch.tensor(hot, dtype=torch.long)], \
        grad[torch.tensor(cold, dtype=torch.long)], len(lead)


@pytest.mark.parametrize("case", ["sorted", "first", "unsorted", "all_hot", "all_cold"])
def test_split_layers_gives_each_layers_split(case):
    """``split_layers`` on column blocks of one ``[rows, layers * width]`` gradient (what
    ``exchange.push`` returns) against the split written out per layer: the same rows and
    gradients, bit for bit; the layers share one tensor of rows; each tier's gradients of every
    layer are one tensor's layers (``layer_stack``), the host tier's contiguous per layer."""
    g = torch.Generator().manual_seed(0)
    layers = 3
    rows = torch.randperm(ROWS, generator=g)[:18].sort().values
    first = None
    if case == "first":
        first = torch.randperm(ROWS, generator=g)[:20]
    elif case == "unsorted":
        rows = rows[torch.randperm(rows.numel(), generator=g)]
        first = torch.randperm(ROWS, generator=g)[:20]
    elif case == "all_hot":
        rows = torch.arange(3, 15)
    elif case == "all_cold":
        rows, first = torch.arange(HOT + 2, HOT + 14), torch.tensor([HOT + 5, HOT + 9])
    summed = torch.randn(rows.numel(), layers * WIDTH, generator=g)
    grads = list(torch.split(summed, WIDTH, dim=1))
    shards = [TieredShard(torch.zeros(HOT, WIDTH), torch.zeros(ROWS - HOT, WIDTH))
              for _ in range(layers)]
    out = split_layers(shards, rows, grads, first)
    assert all(r is out[0][0] for r, _ in out)
    for (got_rows, tg), grad in zip(out, grads):
        want_rows, hot, cold, lead = _reference_split(HOT, rows, grad, first)
        assert torch.equal(got_rows, want_rows)
        assert torch.equal(tg.hot, hot) and torch.equal(tg.cold, cold)
        assert tg.cold_first == lead and tg.cold.is_contiguous()
        # and split_grads (the per-layer path) agrees
        ref_rows, ref = split_grads(shards[0], rows, grad, first)
        assert torch.equal(ref_rows, got_rows) and torch.equal(ref.hot, tg.hot)
        assert torch.equal(ref.cold, tg.cold) and ref.cold_first == tg.cold_first
    assert layer_stack([tg.hot for _, tg in out]) is not None
    assert layer_stack([tg.cold for _, tg in out]) is not None


def test_layer_stack_reads_layers_of_one_tensor():
    summed = torch.randn(5, 3 * 4)
    cols = list(torch.split(summed, 4, dim=1))
    stack = layer_stack(cols)
    assert stack.shape == (3, 5, 4) and all(torch.equal(stack[k], cols[k]) for k in range(3))
    assert layer_stack([torch.randn(5, 4) for _ in range(3)]) is None  # tensors of their own
    assert layer_stack([cols[0], cols[2], cols[1]]) is None  # out of order
    assert layer_stack([cols[0], cols[1][:4]]) is None  # shapes differ
    assert layer_stack([cols[0]]) is None


def test_take_layers_gives_take_rows_of_each_layer():
    """A chunk's positions taken for every layer at once (``take_layers``) against
    ``take_rows`` per layer, for a run of positions (views) and scattered ones (a gather)."""
    g = torch.Generator().manual_seed(1)
    layers = 3
    rows = torch.randperm(ROWS, generator=g)[:18].sort().values
    summed = torch.randn(rows.numel(), layers * WIDTH, generator=g)
    shards = [TieredShard(torch.zeros(HOT, WIDTH), torch.zeros(ROWS - HOT, WIDTH))
              for _ in range(layers)]
    split = split_layers(shards, rows, list(torch.split(summed, WIDTH, dim=1)),
                         torch.randperm(ROWS, generator=g)[:20])
    ordered = split[0][0]
    for keep in (torch.arange(2, 11), torch.tensor([15, 1, 7, 12, 0]),
                 torch.tensor([], dtype=torch.long)):
        got_rows, got = take_layers(ordered, [tg for _, tg in split], keep)
        for (_, tg), t in zip(split, got):
            want_rows, want = take_rows(ordered, tg, keep)
            assert torch.equal(got_rows, want_rows)
            assert torch.equal(t.hot, want.hot) and torch.equal(t.cold, want.cold)


def test_owed_step_takes_queued_rows_first_within_their_budget(monkeypatch):
    """The GPU tier's rows (``queued``: the leading positions) go in the first chunks outside
    the host budget, within their own (the last of them with the host budget's rows); every
    position once, shards sharing rows sharing positions."""
    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 3 * 2 * WIDTH)  # 3 host rows per chunk
    monkeypatch.setattr(OwedStep, "QUEUED_ELEMENTS", 8 * 2 * WIDTH)  # 8 queued rows per chunk
    taken = []
    rows = torch.arange(20)
    owed = OwedStep(lambda positions: taken.append(positions) or 0.0, [rows, rows],
                    [WIDTH, WIDTH], [12, 12])
    owed.settle(torch.tensor([3, 15]))  # a read's rows first
    owed.finish()
    assert [p[0].tolist() for p in taken] == [[3, 15], [0, 1, 2, 4, 5, 6, 7, 8],
                                              [9, 10, 11, 12, 13, 14], [16, 17, 18], [19]]
    assert all(p[0] is p[1] for p in taken)


def _store(layers: int, device: str = "cpu", stacked: bool = True) -> TableStore:
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(ROWS, WIDTH, generator=g) for _ in range(layers)]
    store = TableStore(tables, torch.arange(ROWS), "tiered", torch.device(device), num_hot=HOT)
    if not stacked:  # each layer's GPU tier in a tensor of its own (the step per layer)
        store.shards = [TieredShard(s.hot.clone(), s.cold.clone()) for s in store.shards]
        store.lazy = TieredLazyRows(store.shards)
    adam = TieredRowAdamW(store.shards, mode="sparse", lazy=store.lazy)
    if device == "cpu":  # the GPU tier on its torch path, as on a GPU
        adam.hot.rowwise, store.lazy.hot._kernel = None, False
    return store, adam


def test_gradient_path_gives_the_bits_of_the_path_per_layer(monkeypatch):
    """Five iterations of the tiered sparse step from one ``[rows, layers * width]`` gradient:
    split for every layer at once and stepped through the owed step in chunks (the GPU tier's
    rows queued first, reads of rows in both tiers between the chunks) against the per-layer
    reference (``split_grads`` per layer, each layer's rows stepped in one call, layers in
    tensors of their own): the same rows, moments, per-row steps and reads, bit for bit."""
    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 3 * 3 * WIDTH)
    monkeypatch.setattr(OwedStep, "QUEUED_ELEMENTS", 5 * 3 * WIDTH)
    real = schedule.OwedStep
    monkeypatch.setattr(schedule, "OwedStep",  # on the CPU too: the GPU tier's rows queued
                        lambda step, rows, widths, queued: real(step, rows, widths, [
                            int((r < HOT).sum()) for r in rows]))
    layers = 3
    store, adam = _store(layers)
    steps, table = TableSteps("sparse", CallerRunsWorker()), StoreTable(store)
    ref_store, ref_adam = _store(layers, stacked=False)
    g = torch.Generator().manual_seed(2)
    for it in range(5):
        rows = torch.randperm(ROWS, generator=g)[:18].sort().values
        summed = torch.randn(rows.numel(), layers * WIDTH, generator=g)
        read = torch.randperm(ROWS, generator=g)[:14]
        grads = list(torch.split(summed, WIDTH, dim=1))
        split = split_layers(store.shards, rows, grads, read)
        steps.step_table(table, adam, adam.begin_step(HYPER), split, None)
        plan = ref_adam.begin_step(HYPER)
        for i, (s, grad) in enumerate(zip(ref_store.shards, grads)):
            ref_adam.step_rows(i, *split_grads(s, rows, grad.clone(), read), plan)
        for want in (read, torch.randperm(ROWS, generator=g)[:9]):
            got = store.gather(want, torch.device("cpu"), torch.float32)
            assert torch.equal(got, ref_store.gather(want, torch.device("cpu"), torch.float32))
            if store.owed_step is not None:
                store.owed_step.run_chunk()
        if store.owed_step is not None:
            store.owed_step.finish()
        for i in range(layers):
            for a, b in ((store.shards[i], ref_store.shards[i]),
                         (adam.exp_avg[i], ref_adam.exp_avg[i]),
                         (adam.exp_avg_sq[i], ref_adam.exp_avg_sq[i])):
                assert torch.equal(a.full(), b.full())
            assert torch.equal(store.lazy.last[i], ref_store.lazy.last[i])
            assert torch.equal(store.lazy.touched[i], ref_store.lazy.touched[i])


class _Ops(TorchDispatchMode):
    """Ops (views apart) on ``device`` and on the host; ops that would wait for the device."""

    SYNCING = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "masked_select"}

    def __init__(self, device):
        super().__init__()
        self.device, self.counts = device, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == self.device for t in tensors)
        name = func.overloadpacket.__name__
        if on_device and (name in self.SYNCING or (name.startswith("index") and any(
                t.dtype == torch.bool for t in tensors))):
            self.counts["sync"] += 1
        if not func.is_view:
            self.counts["device" if on_device else "host"] += 1
        return out


def _gradient_path_ops(layers: int) -> dict:
    """The ops of the split and of the whole owed step (host tier on the host), the GPU tier and
    the gradients on ``meta``."""
    store, adam = _store(layers, "meta")
    steps, table = TableSteps("sparse", CallerRunsWorker()), StoreTable(store)
    g = torch.Generator().manual_seed(3)
    rows = torch.randperm(ROWS, generator=g)[:30].sort().values
    read = torch.randperm(ROWS, generator=g)[:14]
    summed = torch.empty(rows.numel(), layers * WIDTH, device="meta")
    split_ops, step_ops = _Ops("meta"), _Ops("meta")
    with split_ops:
        split = split_layers(store.shards, rows, list(torch.split(summed, WIDTH, dim=1)), read)
    cold = torch.randn(layers, split[0][1].cold.shape[0], WIDTH, generator=g)
    for (_, tg), c in zip(split, cold.unbind(0)):  # as staged: layers of one host buffer
        tg.cold = c
    plan = adam.begin_step(HYPER)
    with step_ops:
        steps.step_table(table, adam, plan, split, None)
        store.owed_step.finish()
    return {"split": split_ops.counts, "step": step_ops.counts}


def test_gradient_path_ops_do_not_grow_with_the_layers(monkeypatch):
    """The split and the owed step (its GPU tier in one chunk: ``queued``) launch as many
    device ops for 4 layers as for 2 and run as many host ops, none that waits for the device.
    Before (the split per layer, the GPU tier's rows in the host budget's chunks, each chunk's
    gradients taken per layer): 8 -> 16 device ops for the split, 46 -> 92 host ops
    (``benchmarks/stem_catchup_ops.py`` at 30000 x 8192, 12000 rows stepped)."""
    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 4 * 4 * WIDTH)  # several host chunks
    two, four = _gradient_path_ops(2), _gradient_path_ops(4)
    for part in ("split", "step"):
        assert two[part]["sync"] == four[part]["sync"] == 0
    assert two["split"]["device"] == four["split"]["device"] <= 2, (two, four)
    assert two["split"]["host"] == four["split"]["host"], (two, four)
    assert 0 < two["step"]["device"] == four["step"]["device"], (two, four)


def _queued_path(device: str):
    """Three iterations of the tiered sparse step on ``device`` as the optimizer runs it on a
    GPU: the gradient split for every layer at once (``split_layers``), the host tier's part
    staged to pinned memory (``stage_to_host``, on a GPU), the owed step run to its end (the GPU
    tier's rows queued first); returns the store and optimizer. On a GPU the split, the staging
    and the step run under CUDA's sync debug mode "error" (a synchronisation raises) after a
    first iteration that warms up."""
    from megatron_ext.stem.runtime.store import PinnedStaging
    from megatron_ext.stem.runtime.transfer import stage_to_host

    layers = 3
    store, adam = _store(layers, device)
    if device == "cuda":
        adam.hot.rowwise = None  # as _store does on the CPU: the torch path
    steps, table = TableSteps("sparse", CallerRunsWorker()), StoreTable(store)
    g = torch.Generator().manual_seed(5)
    staging, stream = (PinnedStaging(), torch.cuda.Stream()) if device == "cuda" else (None, None)
    if staging is not None:
        staging.view(1 << 16, torch.float32)  # the pinned block, made once
    for it in range(3):
        rows = torch.randperm(ROWS, generator=g)[:18].sort().values
        summed = torch.randn(rows.numel(), layers * WIDTH, generator=g).to(device)
        read = torch.randperm(ROWS, generator=g)[:14]
        plan = adam.begin_step(HYPER)
        check = device == "cuda" and it > 0  # the first: a warm-up (pinned blocks, kernels)
        previous = torch.cuda.get_sync_debug_mode() if device == "cuda" else None
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            split = split_layers(store.shards, rows, list(torch.split(summed, WIDTH, dim=1)),
                                 read)
            if device == "cuda":
                views, arrived = stage_to_host([tg.cold for _, tg in split], staging, stream,
                                               [tg.cold_first for _, tg in split])
        finally:
            if check:
                torch.cuda.set_sync_debug_mode(previous)
        if device == "cuda":
            arrived.synchronize()  # what the worker waits for before the host tier's step
            for (_, tg), view in zip(split, views):
                tg.cold = view
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            steps.step_table(table, adam, plan, split, None)
            store.owed_step.settle(read)
            store.owed_step.finish()
        finally:
            if check:
                torch.cuda.set_sync_debug_mode(previous)
    return store, adam


def test_queued_path_on_the_cpu_is_the_reference_path():
    """The CPU run of the GPU test below (no staging, no sync check) against the per-layer
    reference: every row's bits (the GPU test compares the GPU's run with this one)."""
    store, adam = _queued_path("cpu")
    ref_store, ref_adam = _store(3, stacked=False)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        rows = torch.randperm(ROWS, generator=g)[:18].sort().values
        summed = torch.randn(rows.numel(), 3 * WIDTH, generator=g)
        read = torch.randperm(ROWS, generator=g)[:14]
        plan = ref_adam.begin_step(HYPER)
        for i, (s, grad) in enumerate(zip(ref_store.shards, torch.split(summed, WIDTH, dim=1))):
            ref_adam.step_rows(i, *split_grads(s, rows, grad, read), plan)
    for i in range(3):
        assert torch.equal(store.shards[i].full(), ref_store.shards[i].full())
        assert torch.equal(adam.exp_avg_sq[i].full(), ref_adam.exp_avg_sq[i].full())
        assert torch.equal(store.lazy.last[i], ref_store.lazy.last[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradient_path_queues_without_waiting_for_the_gpu():
    """On a GPU: the split, the staging and the owed step (reads' and chunks') run without one
    synchronisation, and give the CPU run's rows and moments (to float tolerance: the GPU's
    arithmetic) and the same per-row steps."""
    store, adam = _queued_path("cuda")
    cpu_store, cpu_adam = _queued_path("cpu")
    for i in range(3):
        torch.testing.assert_close(store.shards[i].full(), cpu_store.shards[i].full())
        torch.testing.assert_close(adam.exp_avg[i].full(), cpu_adam.exp_avg[i].full())
        torch.testing.assert_close(adam.exp_avg_sq[i].full(), cpu_adam.exp_avg_sq[i].full())
        assert torch.equal(store.lazy.last[i], cpu_store.lazy.last[i])
