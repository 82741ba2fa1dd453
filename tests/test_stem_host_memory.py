"""Host memory for STEM host rows and moments: huge-page-advised mappings that hold their values,
outlive the call that made them, start on a huge-page boundary, and back the host shards of the
store and the CPU optimizer's moments (small tensors stay with torch's allocator)."""

from __future__ import annotations

import gc
import mmap
import threading

import pytest
import torch

from megatron_ext.stem.host_memory import (
    HUGE_PAGE,
    host_copy,
    host_empty,
    host_zeros_like,
    huge_page_advised,
)
from megatron_ext.stem.row_adam import RowAdamW
from megatron_ext.stem.store import TableStore

needs_advice = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or huge_page_advised(torch.zeros(1)) is None,
    reason="no MADV_HUGEPAGE or no /proc/self/smaps on this platform")

BIG = (HUGE_PAGE // 4 // 256 + 3, 256)  # fp32: a little over one huge page


@needs_advice
def test_large_tensors_are_advised_aligned_and_keep_their_values():
    def make():
        t = host_empty(BIG)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(BIG))
        return t

    t = make()
    gc.collect()  # the mapping lives as long as the tensor, not the function that made it
    assert t.shape == BIG and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert huge_page_advised(t) is True
    assert torch.equal(t.view(-1), torch.arange(t.numel(), dtype=torch.float32))
    # Views and a write from another thread (the worker's) see the same memory.
    worker = threading.Thread(target=lambda: t[5].fill_(-1.0))
    worker.start()
    worker.join()
    assert bool((t[5] == -1.0).all()) and float(t[6, 0]) == 6 * 256

    zeros = host_zeros_like(t)
    assert huge_page_advised(zeros) is True and not zeros.any() and zeros.shape == t.shape
    copy = host_copy(t)
    assert huge_page_advised(copy) is True and torch.equal(copy, t)
    copy[0, 0] = 7.0
    assert float(t[0, 0]) == 0.0  # a copy, not a view
    halves = host_empty((BIG[0] * 2, BIG[1]), torch.bfloat16, zero=True)
    assert halves.dtype == torch.bfloat16 and not halves.any()


@needs_advice
def test_small_tensors_use_torchs_allocator():
    small = host_empty((4, 8), zero=True)
    assert not small.any() and huge_page_advised(small) is False
    assert huge_page_advised(torch.empty(BIG)) is False  # madvise-mode THP: not advised


@needs_advice
@pytest.mark.parametrize("placement", ["cpu", "tiered"])
def test_store_and_optimizer_keep_host_rows_in_advised_memory(placement):
    vocab, width, num_hot = BIG[0] + 40, BIG[1], 16
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(vocab, width, generator=g)]
    owned = torch.randperm(vocab, generator=g)[: vocab - 8]
    store = TableStore(iter(tables), owned, placement, torch.device("cpu"),
                       num_hot if placement == "tiered" else None)
    shard = store.shards[0]
    host = shard.cold if placement == "tiered" else shard
    assert huge_page_advised(host) is True
    assert torch.equal(store.read(0), tables[0][owned])
    for mode in ("dense", "sparse"):
        opt = RowAdamW([host], mode=mode, kernel="torch")
        assert all(huge_page_advised(m) for m in opt.exp_avg + opt.exp_avg_sq)
