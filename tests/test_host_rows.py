"""The direct read of host rows (``kernels/host_rows.py``, ``--stem-host-read direct``) against
its reference and against the staged read of the store.

On the CPU the Triton kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``) on CPU tensors: the same kernel, reading host memory as the GPU would
through unified addressing. It must give ``src[index].to(dtype)`` bit for bit. The store's read
with ``direct`` must give the staged read's bits over sparse-optimizer iterations whose reads
owe catch-ups and owed steps (the direct read settles them in place first, the staged one reads
them as of now without writing), for host and tiered shards. On a GPU the ``gpu`` tests read
a registered huge-page shard and refuse a pageable one.
"""

from __future__ import annotations


import pytest
import torch

from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.runtime import host_memory, store as store_mod
from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW, TieredRowAdamW
from megatron_ext.stem.runtime.schedule import OwedStep, TableSteps
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.tiers import split_grads
from megatron_ext_kernels import host_rows
from stem_fakes import CallerRunsWorker, StoreTable

pytestmark = pytest.mark.skipif(not host_rows.available(), reason="Triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HYPER = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _host(src: torch.Tensor) -> torch.Tensor:
    """``src`` where the kernel can read it: pinned on a GPU machine, as it is on the CPU."""
    return src.pin_memory() if torch.cuda.is_available() else src


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_gives_the_reference_bits(src_dtype, dtype):
    """Widths that are not a multiple of the column block (a ragged last block), repeated ids,
    the first and last row, one row, a single column block, an empty index."""
    g = torch.Generator().manual_seed(0)
    src = _host((torch.randn(53, 37, generator=g) * 3).to(src_dtype))
    src[5, 3] = float("nan")  # carried through the bf16 rounding as a NaN
    for ids, block_c in (([3, 3, 0, 52, 7, 3, 18], 16), ([52], 16), ([1, 2, 3, 2], None),
                         ([], 16)):
        index = torch.tensor(ids, dtype=torch.int64, device=DEVICE)
        out = host_rows.gather_host_rows(src, index, dtype=dtype, block_c=block_c)
        want = host_rows.host_rows_reference(src, index, dtype)
        assert out.shape == (len(ids), 37) and out.dtype == dtype and out.device == DEVICE
        assert torch.equal(_bits(out), _bits(want)), (ids, block_c)
    index = torch.tensor([5], device=DEVICE)
    assert torch.isnan(host_rows.gather_host_rows(src, index, dtype=dtype)[0, 3])


def test_kernel_writes_a_column_block_at_given_positions():
    """Into a column block of a wider tensor, each row at its position (a tiered read's host
    rows into their places): the other columns and rows stay as they were."""
    g = torch.Generator().manual_seed(1)
    src = _host(torch.randn(40, 21, generator=g))
    out = torch.full((9, 50), -1.0, dtype=torch.bfloat16, device=DEVICE)
    index = torch.tensor([4, 39, 4, 0, 11], device=DEVICE)
    positions = torch.tensor([8, 0, 3, 5, 1], device=DEVICE)
    host_rows.gather_host_rows(src, index, out[:, 10:31], positions=positions, block_c=8)
    want = torch.full((9, 50), -1.0, dtype=torch.bfloat16, device=DEVICE)
    want[positions, 10:31] = host_rows.host_rows_reference(src, index, torch.bfloat16)
    assert torch.equal(_bits(out), _bits(want))


def test_kernel_refuses_what_it_cannot_read(monkeypatch):
    src = torch.randn(8, 4)
    with pytest.raises(ValueError, match="2-D host tensor"):
        host_rows.gather_host_rows(src.to(torch.float64), torch.tensor([1]))
    with pytest.raises(ValueError, match="does not take 3 rows"):
        host_rows.gather_host_rows(src, torch.tensor([1, 2, 3]), out=torch.empty(2, 4))
    if not torch.cuda.is_available():  # the CPU runs it only under the interpreter
        monkeypatch.setattr(host_rows, "interpreted", lambda: False)
        with pytest.raises(ValueError, match="use the staged read"):
            host_rows.gather_host_rows(src, torch.tensor([1]))


# -- the store: direct against staged ----------------------------------------------------------

ROWS, WIDTH, HOT = 48, 24, 18


class _Run:
    """A store of two layers with its sparse optimizer, stepped as ``TableSteps`` steps it (the
    part the next reads do not need left owed, run in chunks between reads)."""

    def __init__(self, placement: str, read: str):
        g = torch.Generator().manual_seed(0)
        tables = [torch.randn(ROWS, WIDTH, generator=g) for _ in range(2)]
        self.store = TableStore(tables, torch.arange(ROWS), placement, DEVICE,
                                num_hot=HOT if placement == "tiered" else None, host_read=read)
        adam = TieredRowAdamW if placement == "tiered" else RowAdamW
        self.adam = adam(self.store.shards, mode="sparse", lazy=self.store.lazy)
        self.steps = TableSteps("sparse", CallerRunsWorker())
        self.table = StoreTable(self.store)

    def owe(self, rows, grads, first):
        if self.store.placement == "tiered":
            items = [split_grads(s, rows, g.to(DEVICE), first)
                     for s, g in zip(self.store.shards, grads)]
        else:
            items = [(rows, g) for g in grads]
        self.steps.step_table(self.table, self.adam, self.adam.begin_step(HYPER), items, None)

    def state(self):
        self.adam.materialize()
        return [self.store.read(i).cpu() for i in range(len(self.store.shards))]


@pytest.mark.parametrize("placement", ["cpu", "tiered"])
def test_store_direct_read_gives_the_staged_bits(placement, monkeypatch):
    """Over three iterations of the sparse optimizer, each leaving part of its step owed and
    followed by two micro-batches' reads (rows owing catch-ups, owed steps, repeats, rows of
    both tiers), the direct read returns the staged read's bits in bf16 and fp32, through the
    kernel (counted), and the tables end identical."""
    monkeypatch.setattr(OwedStep, "CHUNK_ELEMENTS", 8 * WIDTH)  # chunks of a few rows
    calls = []
    kernel = host_rows.gather_host_rows

    def counted(src, index, *args, **kwargs):
        calls.append(index.numel())
        return kernel(src, index, *args, **kwargs)

    monkeypatch.setattr(host_rows, "gather_host_rows", counted)
    staged, direct = _Run(placement, "staged"), _Run(placement, "direct")
    g = torch.Generator().manual_seed(1)
    for it in range(3):
        touched = torch.randperm(ROWS, generator=g)[:14].sort().values
        grads = [torch.randn(touched.numel(), WIDTH, generator=g) for _ in range(2)]
        read = torch.randperm(ROWS, generator=g)[:12]
        for run in (staged, direct):
            run.owe(touched, grads, read)
        later = torch.cat([torch.randperm(ROWS, generator=g)[:9], read[:2]])  # repeats
        for want, dtype in ((read, torch.bfloat16), (later, torch.float32)):
            before = len(calls)
            a = staged.store.gather(want, DEVICE, dtype)
            assert len(calls) == before  # the staged read never calls the kernel
            b = direct.store.gather(want, DEVICE, dtype)
            assert len(calls) > before
            assert torch.equal(_bits(a), _bits(b)), (it, dtype)
            for run in (staged, direct):  # a chunk of the owed step between the reads
                if run.store.owed_step is not None:
                    run.store.owed_step.run_chunk()
        for run in (staged, direct):
            if run.store.owed_step is not None:
                run.store.owed_step.finish()
    for a, b in zip(staged.state(), direct.state()):
        assert torch.equal(a, b)


def test_host_read_refusals(monkeypatch):
    """One line each, naming the flag: a placement without host rows, an unknown read, no CUDA
    (outside the interpreter's CPU twin)."""
    with pytest.raises(ValueError, match="--stem-host-read direct reads host rows.*placement gpu"):
        StemConfig(placement="gpu", host_read="direct")
    with pytest.raises(ValueError, match="--stem-host-read='copy'"):
        StemConfig(placement="cpu", host_read="copy")
    StemConfig(placement="tiered", sharding="vocab", host_read="direct")
    with pytest.raises(ValueError, match="placement gpu keeps none"):
        store_mod.check_host_read("direct", "gpu", True)
    monkeypatch.setattr(store_mod, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="--stem-host-read direct needs a CUDA device"):
        store_mod.check_host_read("direct", "cpu", False)
    store_mod.check_host_read("direct", "cpu", True)
    store_mod.check_host_read("staged", "cpu", False)


# -- GPU only ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_reads_a_registered_huge_page_shard_and_refuses_a_pageable_one():
    """A host shard as the store allocates it (a mapping of its own on huge pages), registered
    in place (not copied), read by the kernel over the bus; a pageable tensor is refused in one
    line before the launch; unregistered when its owner goes."""
    rows = host_memory.MIN_MAPPED_BYTES // (4 * 1024) + 8
    shard = host_memory.empty((rows, 1024)).normal_()
    assert not shard.is_pinned()
    index = torch.randint(0, rows, (3000,), device="cuda")
    with pytest.raises(ValueError, match="pageable: pin or register it"):
        host_rows.gather_host_rows(shard, index)

    class Owner:
        pass

    owner = Owner()
    handle = host_rows.register(shard, owner)
    assert handle is not None and shard.is_pinned()
    for dtype in (torch.float32, torch.bfloat16):
        out = host_rows.gather_host_rows(shard, index, dtype=dtype)
        assert torch.equal(out, host_rows.host_rows_reference(shard, index, dtype))
    del owner
    assert not handle.alive and not shard.is_pinned()


@pytest.mark.gpu
@gpu
def test_gpu_store_registers_its_host_shards():
    """A tiered store with ``direct`` reads its host tier through the kernel from the shard it
    registered in place (huge pages kept) and gives the staged read's bits."""
    rows = 2 * (host_memory.MIN_MAPPED_BYTES // (4 * 512))
    tables = [torch.randn(rows, 512)]
    stores = {read: TableStore(tables, torch.arange(rows), "tiered", DEVICE, num_hot=1000,
                               host_read=read) for read in ("staged", "direct")}
    cold = stores["direct"].shards[0].cold
    assert cold.is_pinned() and cold.data_ptr() % host_memory.HUGE_PAGE == 0
    want = torch.randint(0, rows, (4000,))
    a, b = (stores[r].gather(want, DEVICE, torch.bfloat16) for r in ("staged", "direct"))
    assert torch.equal(a, b)


def test_flag_reaches_the_config():
    """``--stem-host-read`` parses onto ``StemConfig.host_read`` (default staged)."""
    import argparse

    from megatron_ext.stem import family

    parser = argparse.ArgumentParser()
    family.add_args(parser)
    tiered = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab"]
    assert family.config_from_args(parser.parse_args(tiered)).host_read == "staged"
    args = parser.parse_args(tiered + ["--stem-host-read", "direct"])
    assert family.config_from_args(args).host_read == "direct"
