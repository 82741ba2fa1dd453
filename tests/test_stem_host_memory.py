"""Host-resident STEM rows on transparent huge pages (megatron_ext/stem/host_memory.py): the
store's host shards and their Adam moments are advised before they are filled, the values are
those of plain torch, and ``huge_pages=False`` (``--no-stem-host-huge-pages``) leaves ordinary
pages."""

import pytest
import torch

from megatron_ext.stem import host_memory
from megatron_ext.stem.row_adam import AdamHyper, RowAdamW
from megatron_ext.stem.store import TableStore
from megatron_ext.stem.table_optimizer import host_row_tensors
from megatron_ext.stem.tiers import TieredRowAdamW

MODE = host_memory.thp_setting()
needs_thp = pytest.mark.skipif(
    MODE not in ("madvise", "always") or host_memory.page_stats([torch.empty(0)]) is None,
    reason=f"transparent huge pages unavailable here ({MODE})")

# 40 MiB per tensor: above glibc's largest mmap threshold (32 MiB), so each tensor is a mapping
# of its own; smaller ones are not advised (host_memory.MIN_ADVISED_BYTES).
ROWS, WIDTH = 2560, 4096


def _nbytes(t):
    return t.numel() * t.element_size()


def test_helpers_give_plain_torch_values():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(300, 40, generator=g)
    index = torch.tensor([5, 0, 299, 17, 5])
    for huge in (True, False):
        assert torch.equal(host_memory.index_select(src, index, huge=huge), src[index])
        assert torch.equal(host_memory.index_select(src.double(), index, torch.float32, huge),
                           src.double()[index].float())
        assert torch.equal(host_memory.copy(src[100:], huge=huge), src[100:])
        z = host_memory.zeros_like(src, huge)
        assert z.is_contiguous() and z.shape == src.shape and not z.any()
    assert host_memory.advise_huge_pages(torch.empty(10)) == 0  # at or below MIN_ADVISED_BYTES


@needs_thp
def test_tensors_that_may_come_from_the_heap_are_not_advised():
    """At most 34 MiB: possibly heap memory, where advice would outlive the tensor."""
    small = host_memory.empty((host_memory.MIN_ADVISED_BYTES // 4,)).fill_(1.0)
    assert host_memory.advise_huge_pages(small) == 0
    assert host_memory.page_stats([small])[0] == 0
    large = torch.empty(host_memory.MIN_ADVISED_BYTES // 4 + 1)
    assert host_memory.advise_huge_pages(large) > 0


def test_thp_setting_reads_the_bracketed_mode(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_memory.thp_setting(str(f)) == "madvise"
    assert host_memory.thp_setting(str(tmp_path / "absent")) is None


def _thp_fault_counts():
    """``/proc/vmstat``'s huge-page faults so far: (granted, fell back to ordinary pages)."""
    counts = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            counts[name] = int(value)
    return (counts.get("thp_fault_alloc", 0),
            counts.get("thp_fault_fallback", 0) + counts.get("thp_fault_fallback_charge", 0))


def _advised_and_granted(tensors, partial_pages, faults_before):
    """All of ``tensors`` but their partial 2 MiB pages at the ends is advised, and the kernel
    acted on the advice when they were filled (after ``faults_before``, ``_thp_fault_counts``):
    it granted huge pages to some of them, or, where no 2 MiB of contiguous memory was free (a
    busy, fragmented machine), it tried and recorded the fall back to ordinary pages. Memory that
    is not advised takes neither path (``madvise`` mode)."""
    advised, huge = host_memory.page_stats(tensors)
    total = sum(_nbytes(t) for t in tensors)
    assert total - partial_pages * host_memory.HUGE_PAGE <= advised <= total
    fell_back = _thp_fault_counts()[1] - faults_before[1]
    assert huge > 0 or (MODE == "madvise" and fell_back > 0), (huge, fell_back)


@needs_thp
def test_advised_tensors_are_on_huge_pages():
    before = _thp_fault_counts()
    t = host_memory.empty((ROWS, WIDTH)).fill_(1.0)
    _advised_and_granted([t], 2, before)
    plain = host_memory.empty((ROWS, WIDTH), huge=False).fill_(1.0)
    assert host_memory.page_stats([plain])[0] == 0


@needs_thp
@pytest.mark.parametrize("placement", ["cpu", "tiered"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_store_and_optimizer_put_host_rows_on_huge_pages(placement, mode):
    """The host shard (a tiered shard's host tier) and its moments, as the table optimizer binds
    them; with huge_pages=False none of them."""
    vocab = ROWS + 64
    table = torch.randn(vocab, WIDTH)
    owned = torch.randperm(vocab)
    num_hot = 64 if placement == "tiered" else None
    for huge in (True, False):
        before = _thp_fault_counts()
        store = TableStore(iter([table]), owned, placement, torch.device("cpu"), num_hot,
                           huge_pages=huge)
        host = store.shards[0].cold if placement == "tiered" else store.shards[0]
        assert torch.equal(store.read(0), table[owned])
        lazy = store.lazy.cold if placement == "tiered" else store.lazy
        optimizer = RowAdamW([host], mode=mode, lazy=lazy if mode == "sparse" else None,
                             huge_pages=huge)  # as the table optimizer builds it
        rows = torch.tensor([0, 7, ROWS - 1])
        optimizer.step([(rows, torch.randn(3, WIDTH))], AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1))
        tensors = [host, *optimizer.exp_avg, *optimizer.exp_avg_sq]
        if huge:
            _advised_and_granted(tensors, 6, before)
        else:
            assert host_memory.page_stats(tensors)[0] == 0


def test_report_lists_the_host_row_tensors():
    """What the start-up line counts: host shards (a tiered shard's host tier) and moments."""

    class Holder:
        pass

    store = TableStore(iter([torch.randn(20, 4)]), torch.arange(20), "tiered",
                       torch.device("cpu"), 5)

    holder = Holder()
    holder.row_adams = [TieredRowAdamW(store.shards, mode="sparse", lazy=store.lazy)]
    tensors = host_row_tensors(holder)
    cold = store.shards[0].cold
    assert len(tensors) == 3 and tensors[0] is cold
    assert all(t.shape == cold.shape for t in tensors)
