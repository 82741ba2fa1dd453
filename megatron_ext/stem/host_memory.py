"""Host memory for the tables' host rows and their Adam moments: anonymous mappings advised for
transparent huge pages (``madvise(MADV_HUGEPAGE)``).

Why: the sparse optimizer, the catch-up and the fetch walk rows scattered over shards of
gigabytes. With 4 KiB pages, one row of a 5632-wide fp32 shard spans six pages of each of the
row, its two moments: a TLB miss each, and under a hypervisor's nested paging each miss is a
two-level page walk. With 2 MiB pages the 3.4 GB of a 50,304-row shard and its moments need about
1,700 TLB entries, which the second-level TLB holds. Measured on the 2-core development machine
(``benchmarks/stem_optimizer.py`` prints the step on both kinds of memory): see
``docs/benchmarks.md``. Contiguous passes (DeepSpeed's dense Adam) gain nothing from it.

Pinned (page-locked) memory is not needed for the shards: every copy between them and a GPU goes
through a pinned staging buffer (``store.PinnedStaging``, the optimizer's gradient staging), and
``cudaHostAlloc``'s pinned pages are small ones.

A fresh anonymous mapping reads as zeros and takes physical memory only where it is written, so
the moments of rows no gradient has reached yet cost nothing. Where the mapping or the advice is
not available (not Linux, an allocation under 2 MiB), memory comes from torch's allocator.
"""

from __future__ import annotations

import mmap
from typing import Optional, Sequence

import torch

HUGE_PAGE = 2 << 20  # x86-64 and most aarch64 kernels' transparent huge page size
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def host_empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
               zero: bool = False) -> torch.Tensor:
    """A contiguous host tensor of ``shape``, in huge-page-advised memory when it is at least one
    huge page; ``zero``: filled with zeros (free for a fresh mapping)."""
    shape = tuple(int(s) for s in shape)
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if _ADVICE is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype) if zero else torch.empty(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a huge-page boundary (the
    # kernel backs only aligned 2 MiB ranges with huge pages); the unused head is never touched.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_ADVICE)
    except OSError:  # THP compiled out: the memory is still good, in small pages
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps ``region`` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    return raw[start: start + nbytes].view(dtype).view(shape)


def host_zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(t)``; in huge-page-advised memory for a host tensor."""
    if t.device.type != "cpu":
        return torch.zeros_like(t)
    return host_empty(t.shape, t.dtype, zero=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t`` in huge-page-advised memory."""
    out = host_empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def huge_page_advised(t: torch.Tensor) -> Optional[bool]:
    """Whether ``t``'s memory lies in a mapping advised for huge pages (``hg`` in its
    ``/proc/self/smaps`` VmFlags); None where that file cannot be read."""
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("VmFlags:"):
                    return "hg" in line.split()[1:]
    except OSError:
        return None
    return False


def thp_mode() -> Optional[str]:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None if
    unknown: with ``never`` the advice does nothing."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1: end] if 0 <= start < end else None
