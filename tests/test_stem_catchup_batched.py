"""The GPU tier's sparse steps and catch-ups over every layer at once (``row_adam.stacked``,
``RowAdamW.step_shards``, ``LazyRows.settle_shards``, the store's stacked device rows): the same
bits as the step and catch-up per layer, and a number of ops (kernel launches on a GPU) that does
not grow with the layers (``benchmarks/stem_catchup_ops.py`` counts them per phase)."""


import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_ext.stem.runtime.row_adam import (AdamHyper, TieredLazyRows, TieredRowAdamW,
                                                stacked)
from megatron_ext.stem.runtime.schedule import OwedStep, TableSteps
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.tiers import TieredShard, split_grads
from stem_fakes import CallerRunsWorker, StoreTable

ROWS, WIDTH, HOT = 48, 8, 20
HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _tiered_store(layers: int, device: str = "cpu", seed: int = 0) -> TableStore:
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randn(ROWS, WIDTH, generator=g) for _ in range(layers)]
    return TableStore(tables, torch.arange(ROWS), "tiered", torch.device(device), num_hot=HOT)


class _Run:
    """A tiered store with its sparse optimizer, the GPU tier on the torch path (as on a GPU)."""

    def __init__(self, store):
        self.store = store
        self.adam = TieredRowAdamW(store.shards, mode="sparse", lazy=store.lazy)
        if store.shards[0].hot.device.type == "cpu":
            self.adam.hot.rowwise, store.lazy.hot._kernel = None, False
        self.steps = TableSteps("sparse", CallerRunsWorker())
        self.table = StoreTable(store)

    def owe(self, rows, grads, first):
        split = [split_grads(s, r, g, first) for s, r, g in zip(self.store.shards, rows, grads)]
        self.steps.step_table(self.table, self.adam, self.adam.begin_step(HYPER), split, None)

    def state(self):
        a, lazy = self.adam, self.store.lazy
        return [t for i in range(len(self.store.shards)) for t in (
            self.store.shards[i].full(), a.exp_avg[i].full(), a.exp_avg_sq[i].full(),
            lazy.last[i], lazy.touched[i])]


def test_stacked_views_only_layers_of_one_tensor():
    whole = torch.randn(3, 5, 4)
    layers = list(whole.unbind(0))
    assert stacked(layers).data_ptr() == whole.data_ptr()
    assert torch.equal(stacked(layers), whole)
    per_row = torch.zeros(3, 10, dtype=torch.long)
    part = [r[:4] for r in per_row.unbind(0)]  # a tier's rows of each layer's per-row state
    part_stack = stacked(part)
    part_stack[1, 2] = 7
    assert per_row[1, 2] == 7 and part_stack.shape == (3, 4)
    assert stacked([torch.randn(5, 4) for _ in range(3)]) is None  # tensors of their own
    assert stacked([whole[0], whole[2]]) is not None  # evenly spaced
    assert stacked([whole[0], whole[2], whole[1]]) is None  # out of order
    assert stacked([whole[0], whole[0]]) is None  # the same rows twice
    assert stacked([whole[0, :3], whole[1, :4]]) is None  # shapes differ


def test_stacked_gpu_tier_gives_the_bits_of_the_step_per_layer(monkeypatch):
    """The store's GPU tier in one tensor (steps and catch-ups of all layers at once) against the
    same rows in a tensor per layer (the step and catch-up per layer, the code before the
    batching): the same rows, moments, per-row steps and reads, bit for bit, over iterations with
    reads of rows owing steps and catch-ups in both tiers, the owed step run in chunks, and an
    iteration whose layers touch different rows (a row current in one layer, late in another)."""
    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 8 * WIDTH)  # chunks of a few rows
    layers = 3
    batched = _Run(_tiered_store(layers))
    assert stacked([s.hot for s in batched.store.shards]) is not None
    per_layer_shards = [TieredShard(s.hot.clone(), s.cold.clone()) for s in batched.store.shards]
    per_layer = _Run(_tiered_store(layers))
    per_layer.store.shards = per_layer_shards
    per_layer.store.lazy = TieredLazyRows(per_layer_shards)
    per_layer.adam = TieredRowAdamW(per_layer_shards, mode="sparse", lazy=per_layer.store.lazy)
    per_layer.adam.hot.rowwise, per_layer.store.lazy.hot._kernel = None, False
    per_layer.table = StoreTable(per_layer.store)
    assert per_layer.store.lazy.hot.stacks() is None and batched.store.lazy.hot.stacks()

    g = torch.Generator().manual_seed(1)
    for it in range(5):
        touched = torch.randperm(ROWS, generator=g)[:18].sort().values
        rows = [touched] * layers
        if it == 2:  # the layers' rows differ: each layer steps its own
            rows = [touched, touched[: 12], torch.cat([touched[:6], touched[9:]])]
        grads = [torch.randn(r.numel(), WIDTH, generator=g) for r in rows]
        read = torch.randperm(ROWS, generator=g)[:14]
        for run in (batched, per_layer):
            run.owe(rows, grads, read)
        for want in (read, torch.randperm(ROWS, generator=g)[:9]):  # micro-batches 0 and 1
            out = [run.store.gather(want, torch.device("cpu"), torch.float32)
                   for run in (batched, per_layer)]
            assert torch.equal(out[0], out[1])
            for run in (batched, per_layer):  # a chunk of the owed step between the reads
                if run.store.owed_step is not None:
                    run.store.owed_step.run_chunk()
        for run in (batched, per_layer):
            if run.store.owed_step is not None:
                run.store.owed_step.finish()
        for a, b in zip(batched.state(), per_layer.state()):
            assert torch.equal(a, b)
    for run in (batched, per_layer):
        run.adam.materialize()
    for a, b in zip(batched.state(), per_layer.state()):
        assert torch.equal(a, b)


class _DeviceOps(TorchDispatchMode):
    """Ops that touch a tensor on ``device`` (kernel launches on a GPU), views apart."""

    def __init__(self, device):
        super().__init__()
        self.device, self.count = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and any(isinstance(t, torch.Tensor) and t.device.type == self.device
                                    for t in tree_flatten((args, kwargs, out))[0]):
            self.count += 1
        return out


def _read_ops(layers: int) -> int:
    """Device ops of micro-batch 0's read with a step owed, the GPU tier on ``meta`` (its torch
    path, without data)."""
    run = _Run(_tiered_store(layers, "meta"))
    g = torch.Generator().manual_seed(2)  # the same rows whatever the layers
    grad_g = torch.Generator().manual_seed(3)
    for it in range(3):
        touched = torch.randperm(ROWS, generator=g)[:18].sort().values
        read = torch.randperm(ROWS, generator=g)[:14]
        grads = []
        for s in run.store.shards:
            rows, split = split_grads(s, touched, torch.randn(18, WIDTH, generator=grad_g),
                                       read)
            split.hot = split.hot.to("meta")  # the GPU tier's gradients are on its device
            grads.append((rows, split))
        run.steps.step_table(run.table, run.adam, run.adam.begin_step(HYPER), grads, None)
        if it < 2:
            run.store.owed_step.finish()
    counter = _DeviceOps("meta")
    with counter:
        run.store.gather(read, torch.device("meta"), torch.bfloat16)
    return counter.count


def test_gpu_tier_read_ops_do_not_grow_with_the_layers():
    """A read with a step owed launches about as many GPU-tier ops for 4 layers as for 2: the
    owed step of the rows it reads, the catch-up of the others and the gather take one op per
    tensor, not per layer. What stays per layer: the gather of each layer's gradient rows
    (``TierGrads.take``: the positions' copy to the device and an ``index_select``). Before:
    about 25 ops more per layer (``benchmarks/stem_catchup_ops.py``)."""
    two, four = _read_ops(2), _read_ops(4)
    assert 0 < two and four - two <= 2 * 2, (two, four)
