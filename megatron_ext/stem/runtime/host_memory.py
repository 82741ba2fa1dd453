"""Host memory for STEM's host-resident rows: the table shards and their Adam moments on
transparent huge pages.

The host rows are read and stepped a few at a time at scattered places (a micro-batch's rows,
``kernels/row_adam_cpu.py``), over shards of gigabytes: with 4 KiB pages almost
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
tensors ask: each tensor of 32 MiB or more is a private anonymous mapping of its own (``mmap``),
starting on a 2 MiB boundary, advised ``MADV_HUGEPAGE`` with ``madvise(2)`` as a whole before
anything touches it, so its pages are huge from their first fault, and unmapped when the tensor
is freed. Taking them from PyTorch's allocator instead (glibc's ``malloc``) does not work: a large
request is served from the heap whenever the heap has a free chunk that fits (freed smaller
tensors coalesce into one), whatever glibc's mmap threshold, and heap memory was touched
before, so the advice finds ordinary pages already there and stays on the heap after the tensor
(reproduced: ``tests/test_stem_host_memory.py``; it made a CI run fail on 2026-11-26). Smaller
tensors stay ordinary torch tensors. This needs the kernel's transparent huge pages set to
``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``); with ``never`` (or off
Linux) the advice has no effect and the tensors are ordinary, with the same values.
``--no-stem-host-huge-pages`` turns it off (each function's ``huge``; ``TableStore``'s
``huge_pages``): the mapping is advised ``MADV_NOHUGEPAGE`` instead, ordinary pages.

Kept from child processes. Every such mapping is also advised ``MADV_DONTFORK``: a process this
one forks (Megatron's data loader workers are forked after the model and its optimizer are
built) does not get it. Without that, fork shares every page of the rows and moments
copy-on-write, and the first write of each page after it, by the table step, copies the page
(and splits a huge one): on the development machine the sparse step of 512 rows x 8,192 that
took 2.0 ms took 99 ms when its rows were first written after a fork (the next step of the same
rows: 2 ms again), and on the GPU machine of 2026-11-27 the table step inside training ran about
25x slower than alone. Nothing in a child reads the tables: the data workers read the dataset,
and a checkpoint's tensors are copies (``stem/runtime/checkpoint.py``); a child that touched the mapping
would fault, not read stale rows. Smaller tensors (under ``MIN_MAPPED_BYTES``) stay ordinary torch
tensors, shared copy-on-write, a few thousand pages at most.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys
from typing import List, Optional, Sequence, Set, Tuple

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Tensors of at least this many bytes get a mapping of their own on huge pages (``empty``);
# smaller ones stay ordinary torch tensors. The gain is where page walks cost: tensors of
# hundreds of MiB to GiB, whose page tables do not stay in the caches. The main job's 7 MiB host
# tiers, on huge pages, trained slower in each of three pairs of runs (562 vs 547 ms per step,
# medians; the huge-page run went first in each pair, so the order may explain it:
# docs/benchmarks.md, "Huge pages, adopted").
MIN_MAPPED_BYTES = 32 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_CAN_MAP = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
_CAN_KEEP_FROM_CHILDREN = _CAN_MAP and hasattr(mmap, "MADV_DONTFORK")


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


def _address(buf: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the buffer export


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32,
          huge: bool = True) -> torch.Tensor:
    """An uninitialised host tensor; of at least ``MIN_MAPPED_BYTES``, in a mapping of its own
    on a 2 MiB boundary, kept from child processes (``MADV_DONTFORK``) and, with ``huge``, advised
    onto huge pages as a whole (fill it before reading it; without ``huge``, advised off them).
    The mapping lives as long as the tensor (``torch.frombuffer`` holds it)."""
    shape = tuple(shape)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not _CAN_MAP or nbytes < MIN_MAPPED_BYTES:
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -_address(buf) % HUGE_PAGE  # mmap gives whole 4 KiB pages: a page multiple
    # A kernel without transparent huge pages refuses the page-size advice: ordinary pages.
    _advise(buf, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", offset, size)
    if _CAN_KEEP_FROM_CHILDREN:
        _advise(buf, "MADV_DONTFORK")
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)


def _advise(buf: mmap.mmap, name: str, *span: int) -> None:
    """``madvise(2)`` the mapping ``buf`` (``span``: offset and length, else all of it) with
    the advice ``name`` where this Python knows it; a refusal is logged, not raised."""
    advice = getattr(mmap, name, None)
    if advice is None:
        return
    try:
        buf.madvise(advice, *span)
    except OSError as e:
        logger.debug("madvise(%s) refused (%s)", name, e)


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
    mappings = _mappings(tensors)
    if mappings is None:
        return None
    return (sum(overlap for overlap, _, flags in mappings if "hg" in flags),
            sum(huge for _, huge, _ in mappings))


def flagged_bytes(tensors: Sequence[torch.Tensor], flag: str) -> Optional[int]:
    """Bytes of the storages of host ``tensors`` that lie in mappings with ``flag`` among
    their smaps ``VmFlags`` (``dc``: kept from child processes, ``MADV_DONTFORK``; ``hg``,
    ``nh``: advised onto, off huge pages); None where ``/proc/self/smaps`` cannot be read."""
    mappings = _mappings(tensors)
    if mappings is None:
        return None
    return sum(overlap for overlap, _, flags in mappings if flag in flags)


def _mappings(tensors: Sequence[torch.Tensor]) -> Optional[List[Tuple[int, int, Set[str]]]]:
    """Per mapping of ``/proc/self/smaps`` that holds part of the storages of host ``tensors``:
    ``(bytes of them in it, its AnonHugePages bytes, its VmFlags)``; None where it cannot be
    read."""
    spans = sorted({(t.untyped_storage().data_ptr(),
                     t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                    for t in tensors if t.device.type == "cpu"})
    out = []
    try:
        with open("/proc/self/smaps") as f:
            overlap = huge = 0
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    overlap = sum(max(0, min(hi, end) - max(lo, start)) for start, end in spans)
                    huge = 0
                elif overlap and line.startswith("AnonHugePages:"):
                    huge = int(line.split()[1]) * 1024
                elif overlap and line.startswith("VmFlags:"):  # a mapping's last field
                    out.append((overlap, huge, set(line.split()[1:])))
    except (OSError, ValueError):
        return None
    return out


def huge_bytes(tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """Bytes of ``tensors``' mappings on huge pages (``page_stats``), or None."""
    stats = page_stats(tensors)
    return None if stats is None else stats[1]


# ---------------------------------------------------------------------------------------------
# room for the host rows, checked before they are allocated

_MEMINFO = "/proc/meminfo"
_CGROUP = "/sys/fs/cgroup"


def available_bytes(meminfo: str = _MEMINFO, cgroup: str = _CGROUP) -> Optional[int]:
    """Memory this process can still take without the kernel killing it: ``MemAvailable`` plus
    ``SwapFree`` of ``/proc/meminfo``, or less where the cgroup's limit leaves less (v2
    ``memory.max`` less ``memory.current``; v1 ``memory/memory.limit_in_bytes`` less
    ``memory/memory.usage_in_bytes``), the cgroup's page cache counted as free (``memory.stat``
    ``file``, v1 ``total_cache``): the kernel reclaims it before it kills, and a long-lived
    container's usage is mostly cache. None where ``/proc/meminfo`` cannot be read."""
    fields = {}
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024
    except OSError:
        return None
    if "MemAvailable" not in fields:
        return None
    room = fields["MemAvailable"] + fields.get("SwapFree", 0)
    for limit, usage, stat, cache in (
            ("memory.max", "memory.current", "memory.stat", "file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_cache")):
        try:
            with open(f"{cgroup}/{limit}") as f:
                cap = f.read().strip()
            with open(f"{cgroup}/{usage}") as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 2**60:  # "max" / a huge number: no limit
            room = min(room, max(int(cap) - used + _stat_field(f"{cgroup}/{stat}", cache), 0))
    return room


def _stat_field(path: str, name: str) -> int:
    """Field ``name`` of a cgroup ``memory.stat`` file (bytes), 0 where absent."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def check_room(need: int, released: int = 0, ranks_on_node: int = 1,
               available: Optional[int] = None) -> None:
    """Refuse, before anything is allocated, host rows that cannot fit: ``need`` bytes for this
    rank (its host rows and their Adam moments) against the memory available (``available``, by
    default ``available_bytes()``) plus ``released`` (what this rank holds now and frees while
    it allocates: the drawn initial rows). A need that fits this rank but not the
    ``ranks_on_node`` ranks of the node together (each as large) is a warning: they may differ
    (pipeline stages), and the others may not have allocated yet. Unknown availability: no
    check."""
    if available is None:
        available = available_bytes()
    if available is None or need <= 0:
        return
    room = available + released
    advice = ("shard the rows over more data-parallel ranks (--stem-table-sharding vocab), keep "
              "more of them in the GPU tier (--stem-table-placement tiered, --stem-gpu-tier), "
              "or use fewer STEM layers (--stem-ratio, --stem-layers)")
    if need > room:
        raise ValueError(
            f"STEM tables: this rank's host-resident rows and their Adam moments need "
            f"{_size(need)} of host memory, and {_size(room)} is available (MemAvailable + "
            f"SwapFree, within the cgroup's limit); {advice}")
    if need * ranks_on_node > available + released * ranks_on_node:
        logger.warning("STEM tables: this rank's host rows and their Adam moments need %s of "
                       "host memory; %d ranks on this node need about %s together, and %s is "
                       "available: the node may run out of memory; %s", _size(need),
                       ranks_on_node, _size(need * ranks_on_node),
                       _size(available + released * ranks_on_node), advice)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
