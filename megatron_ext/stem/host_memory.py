"""Host memory for STEM's host-resident rows: the table shards and their Adam moments on
transparent huge pages.

The host rows are read and stepped a few at a time at scattered places (a micro-batch's rows,
``megatron_ext_kernels/row_adam_cpu.py``), over shards of gigabytes: with 4 KiB pages almost
every row of every tensor (parameters, first and second moment) costs TLB misses, whose page
walks through gigabytes of page tables miss the caches (in a virtual machine each walk is two
dimensional, guest and host). 2 MiB pages cut the page-table entries 512-fold. Measured on the
development machine (docs/benchmarks.md, "Huge pages, adopted"): the sparse step of ~3,400 Zipf
rows of a 50,304 x 5,632 shard 1.15-1.69x faster (``benchmarks/stem_optimizer.py``, the two page
sizes in alternate processes), the dense step over the whole shard 5-11%, the row gathers of a
fetch up to 1.18x (``benchmarks/stem_host_gather.py``). Where page walks are cheap the gain is
small (earlier probes on other machines of the same kind: 0-14%).

PyTorch's CPU allocator asks for huge pages only when ``THP_MEM_ALLOC_ENABLE=1`` is set before
its first large allocation, and then for every tensor of the process. Here only the host rows'
tensors ask: each is allocated empty (a fresh, untouched mapping: glibc maps every allocation
above its mmap threshold, at most 32 MiB, on its own), its whole 2 MiB-aligned interior is
advised ``MADV_HUGEPAGE`` with ``madvise(2)``, and only then is it filled, so its pages are huge
from their first fault. Tensors of 34 MiB or less stay on ordinary pages (``MIN_ADVISED_BYTES``:
they may come from the heap, where advice would outlive them and reach later allocations).
This needs the kernel's transparent huge pages set to ``madvise`` or ``always``
(``/sys/kernel/mm/transparent_hugepage/enabled``); with ``never`` (or off Linux) the advice has
no effect and the tensors are ordinary, with the same values. ``--no-stem-host-huge-pages`` turns
the advice off (each function's ``huge``; ``TableStore``'s ``huge_pages``).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB on 64-bit) from
# a mapping of its own. Smaller tensors may come from the heap, and advice given there outlives
# the tensor: later heap allocations (a CPU run's activations) would get huge pages that the
# heap's trimming then splits. So only tensors above this size, always mappings of their own,
# are advised (a precaution: one run of the main job's mode, 7 MiB host tiers, was slower with
# heap advice, 603 against 560 ms per step, but not in a way that isolated the cause;
# docs/benchmarks.md).
MIN_ADVISED_BYTES = (32 << 20) + HUGE_PAGE
MADV_HUGEPAGE = 14  # linux/mman.h
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_libc = None


def thp_setting(path: str = _THP_SETTING) -> Optional[str]:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None
    where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _madvise(address: int, length: int, advice: int) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno()


def advise_huge_pages(t: torch.Tensor) -> int:
    """Advise the 2 MiB pages wholly inside ``t``'s storage onto huge pages; the bytes advised
    (0: not on the CPU, at most ``MIN_ADVISED_BYTES`` (possibly heap memory), or refused by the
    kernel). Pages already touched keep their size until the kernel's background collapse, so
    call it before filling ``t``."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or \
            storage.nbytes() <= MIN_ADVISED_BYTES:
        return 0
    start = storage.data_ptr()
    end = start + storage.nbytes()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE  # above MIN_ADVISED_BYTES, whole 2 MiB pages lie inside
    err = _madvise(lo, hi - lo, MADV_HUGEPAGE)
    if err:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): ordinary pages", err)
        return 0
    return hi - lo


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          huge: bool = True) -> torch.Tensor:
    """An uninitialised host tensor, advised onto huge pages if ``huge`` (fill it before
    reading it)."""
    t = torch.empty(tuple(shape), dtype=dtype)
    if huge:
        advise_huge_pages(t)
    return t


def zeros_like(t: torch.Tensor, huge: bool = True) -> torch.Tensor:
    """``torch.zeros_like(t)`` (contiguous); on huge pages if ``huge`` and ``t`` is a host
    tensor."""
    if t.device.type != "cpu":
        return torch.zeros_like(t)
    return empty(t.shape, t.dtype, huge).zero_()


def copy(src: torch.Tensor, dtype: Optional[torch.dtype] = None,
         huge: bool = True) -> torch.Tensor:
    """A contiguous host copy of ``src`` (cast to ``dtype``), on huge pages if ``huge``."""
    out = empty(src.shape, dtype or src.dtype, huge)
    out.copy_(src)
    return out


def index_select(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype = torch.float32,
                 huge: bool = True) -> torch.Tensor:
    """``src[index]`` as a contiguous ``dtype`` host tensor (rows of ``src``), on huge pages
    if ``huge``."""
    out = empty((index.numel(),) + tuple(src.shape[1:]), dtype, huge)
    if src.dtype == dtype and src.device.type == "cpu":
        torch.index_select(src, 0, index.to(src.device), out=out)
    else:
        out.copy_(src[index.to(src.device)])
    return out


def page_stats(tensors: Sequence[torch.Tensor]) -> Optional[Tuple[int, int]]:
    """``(advised, huge)``: bytes of the storages of host ``tensors`` that lie in mappings
    advised ``MADV_HUGEPAGE`` (smaps' ``hg`` flag: what this module asked for) and bytes of those
    mappings that the kernel holds on huge pages (``AnonHugePages``: what it granted; it may
    fall back to ordinary pages where no 2 MiB of contiguous memory is free). From
    ``/proc/self/smaps``, one read; None where that cannot be read. The large tensors this
    module allocates each have mappings of their own."""
    spans = sorted({(t.untyped_storage().data_ptr(),
                     t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                    for t in tensors if t.device.type == "cpu"})
    advised = huge = 0
    try:
        with open("/proc/self/smaps") as f:
            overlap = 0
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    overlap = sum(max(0, min(hi, end) - max(lo, start)) for start, end in spans)
                elif overlap and line.startswith("AnonHugePages:"):
                    huge += int(line.split()[1]) * 1024
                elif overlap and line.startswith("VmFlags:") and " hg" in line:
                    advised += overlap
    except (OSError, ValueError):
        return None
    return advised, huge


def huge_bytes(tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """Bytes of ``tensors``' mappings on huge pages (``page_stats``), or None."""
    stats = page_stats(tensors)
    return None if stats is None else stats[1]
