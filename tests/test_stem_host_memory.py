"""Host-resident STEM rows on transparent huge pages (megatron_ext/stem/runtime/host_memory.py): the
store's host shards and their Adam moments are advised before they are filled, the values are
those of plain torch, and ``huge_pages=False`` (``--no-stem-host-huge-pages``) leaves ordinary
pages. Either way they are kept from child processes (``MADV_DONTFORK``): a forked child has no
mapping of them, so the parent's writes after a fork copy no pages."""

import ctypes
import mmap
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_ext.stem.runtime import host_memory
from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.report import host_row_tensors
from megatron_ext.stem.runtime.row_adam import TieredRowAdamW

MODE = host_memory.thp_setting()
needs_thp = pytest.mark.skipif(
    MODE not in ("madvise", "always") or host_memory.page_stats([torch.empty(0)]) is None,
    reason=f"transparent huge pages unavailable here ({MODE})")

ROWS, WIDTH = 2560, 4096  # 40 MiB per tensor: above host_memory.MIN_MAPPED_BYTES


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
    big = torch.randn(ROWS, WIDTH, generator=g)  # above MIN_MAPPED_BYTES: a mapping of its own
    mapped = host_memory.index_select(big, torch.arange(ROWS - 1, -1, -1))
    assert mapped.data_ptr() % host_memory.HUGE_PAGE == 0 and torch.equal(mapped, big.flip(0))
    assert torch.equal(host_memory.copy(big, torch.float64), big.double())
    assert host_memory.empty((5, 0)).shape == (5, 0)


def _advised_mappings():
    """``(start, end, is_heap)`` of each mapping of this process advised onto huge pages (smaps'
    ``hg`` flag). Other libraries advise memory too: NumPy advises each array of 4 MiB or more,
    on the heap as well once glibc's mmap threshold has risen, and the heap's mapping then splits
    into advised and ordinary parts that later allocations reuse."""
    out, head = set(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(x, 16) for x in first.split("-"))
                head = (lo, hi, line.rstrip().endswith("[heap]"))
            elif line.startswith("VmFlags:") and " hg" in line:
                out.add(head)
    return out


@needs_thp
def test_large_tensors_get_a_mapping_of_their_own_when_the_heap_has_room():
    """With 48 MiB of freed heap chunks that fit the request (what glibc's ``malloc`` then
    serves a 40 MiB tensor from, touched memory), the host rows still get a fresh mapping of
    their own, advised whole before their first touch, and the heap is not advised. Small
    tensors stay ordinary ones."""
    pieces = [torch.empty(1 << 18).fill_(1.0) for _ in range(49)]  # 1 MiB each, on the heap
    fence = pieces.pop()  # the last one keeps the freed pieces off the heap's top (no trim)
    del pieces
    before, advised = _thp_fallbacks(), _advised_mappings()
    t = host_memory.empty((ROWS, WIDTH)).fill_(1.0)
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    _advised_and_granted([t], before)
    added = _advised_mappings() - advised
    start = t.untyped_storage().data_ptr()
    assert [(lo <= start < hi, heap) for lo, hi, heap in added] == [(True, False)], added
    _small_tensors_are_ordinary()
    del fence


def _small_tensors_are_ordinary():
    """A tensor below ``MIN_MAPPED_BYTES`` is an ordinary torch tensor: ``empty`` maps and
    advises nothing for it, and it is not kept from children (every mapping ``empty`` makes
    is). Where its memory lies is the allocator's choice: it may be heap that another library
    advised (``_advised_mappings``)."""
    advised = _advised_mappings()
    small = host_memory.empty((host_memory.MIN_MAPPED_BYTES // 4 - 1,)).fill_(1.0)
    assert _advised_mappings() == advised
    assert host_memory.flagged_bytes([small], "dc") == 0
    assert host_memory.flagged_bytes([small], "nh") == 0


_NUMPY_ADVISES_THE_HEAP = """
import numpy as np, torch
from megatron_ext.stem.runtime import host_memory
raise_threshold = torch.empty((32 << 20) - 8192, dtype=torch.uint8)
del raise_threshold  # a freed mmapped chunk: glibc now serves up to 32 MiB from the heap
arrays = [np.ones(20 << 20, dtype=np.uint8) for _ in range(2)]  # on the heap, advised by NumPy
fence = torch.empty(1000)  # keeps their freed chunks off the heap's top (no trim)
del arrays
small = host_memory.empty((host_memory.MIN_MAPPED_BYTES // 4 - 1,)).fill_(1.0)
print(host_memory.page_stats([small])[0], host_memory.flagged_bytes([small], "dc"))
"""


@needs_thp
def test_small_tensors_are_ordinary_where_numpy_advised_the_heap():
    """NumPy advises its arrays of 4 MiB or more onto huge pages, heap ones too (once freeing an
    mmapped chunk of 32 MiB has raised glibc's mmap threshold). A small tensor served from that
    freed heap memory then lies in advised memory that ``host_memory`` did not advise: the
    cause of a failure of the test above on 2026-11-28, which asserted the memory's advice.
    In a fresh process, where the heap's history is this script's alone."""
    pytest.importorskip("numpy")
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:
        pytest.skip("this NumPy does not say whether it advises huge pages")
    if not _get_madvise_hugepage():
        pytest.skip("NumPy does not advise huge pages here")
    out = subprocess.run([sys.executable, "-c", _NUMPY_ADVISES_THE_HEAP], capture_output=True,
                         text=True, check=True).stdout.split()
    advised, kept_from_children = (int(x) for x in out)
    assert advised > 0  # the memory is advised: by NumPy
    assert kept_from_children == 0  # ... and the tensor is an ordinary one: not by host_memory


def test_thp_setting_reads_the_bracketed_mode(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_memory.thp_setting(str(f)) == "madvise"
    assert host_memory.thp_setting(str(tmp_path / "absent")) is None


def _thp_fallbacks():
    """``/proc/vmstat``'s huge-page faults so far that fell back to ordinary pages."""
    counts = {}
    with open("/proc/vmstat") as f:
        for line in f:
            name, value = line.split()
            counts[name] = int(value)
    return counts.get("thp_fault_fallback", 0) + counts.get("thp_fault_fallback_charge", 0)


def _advised_and_granted(tensors, fallbacks_before):
    """All of ``tensors`` is advised, and the kernel acted on the advice when they were filled
    (after ``fallbacks_before``, ``_thp_fallbacks``): it granted huge pages to some of them, or,
    where no 2 MiB of contiguous memory was free (a busy, fragmented machine), it tried and
    recorded the fall back to ordinary pages. Memory that is not advised takes neither path
    (``madvise`` mode)."""
    advised, huge = host_memory.page_stats(tensors)
    total = sum(_nbytes(t) for t in tensors)
    assert advised == total
    fell_back = _thp_fallbacks() - fallbacks_before
    assert huge > 0 or (MODE == "madvise" and fell_back > 0), (huge, fell_back)


@needs_thp
def test_advised_tensors_are_on_huge_pages():
    before = _thp_fallbacks()
    t = host_memory.empty((ROWS, WIDTH)).fill_(1.0)
    _advised_and_granted([t], before)
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
        before = _thp_fallbacks()
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
            _advised_and_granted(tensors, before)
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


# -- room for the host rows ---------------------------------------------------------------------


def _meminfo(path, available_kib, swap_kib=0):
    path.write_text(f"MemTotal:       24000000 kB\nMemFree:         1000 kB\n"
                    f"MemAvailable:   {available_kib} kB\nSwapFree:       {swap_kib} kB\n")
    return str(path)


def test_available_memory_is_meminfo_within_the_cgroups_limit(tmp_path):
    meminfo = _meminfo(tmp_path / "meminfo", 1000, swap_kib=24)
    none = tmp_path / "no-cgroup"
    assert host_memory.available_bytes(meminfo, str(none)) == 1024 * 1024
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("600000\n")
    (v2 / "memory.current").write_text("100000\n")
    assert host_memory.available_bytes(meminfo, str(v2)) == 500000
    # Page cache the cgroup holds is reclaimed before anything is killed: counted as free.
    (v2 / "memory.stat").write_text("anon 60000\nfile 80000\nfile_mapped 10\n")
    assert host_memory.available_bytes(meminfo, str(v2)) == 580000
    (v2 / "memory.max").write_text("max\n")  # no limit
    assert host_memory.available_bytes(meminfo, str(v2)) == 1024 * 1024
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("300000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("400000\n")  # over its limit
    assert host_memory.available_bytes(meminfo, str(v1)) == 0
    (v1 / "memory" / "memory.stat").write_text("cache 1\ntotal_cache 250000\nrss 150000\n")
    assert host_memory.available_bytes(meminfo, str(v1)) == 150000
    assert host_memory.available_bytes(str(tmp_path / "missing"), str(none)) is None
    (tmp_path / "old").write_text("MemTotal: 1 kB\n")  # kernels before 3.14: no MemAvailable
    assert host_memory.available_bytes(str(tmp_path / "old"), str(none)) is None
    assert host_memory.available_bytes() is None or host_memory.available_bytes() > 0


def test_rows_that_cannot_fit_are_refused_before_they_are_allocated(caplog):
    gib = 2**30
    with pytest.raises(ValueError, match=r"need 3\.00 GiB of host memory, and 2\.50 GiB is "
                                         r"available.*--stem-gpu-tier"):
        host_memory.check_room(3 * gib, released=gib // 2, available=2 * gib)
    with caplog.at_level("WARNING"):
        host_memory.check_room(2 * gib, released=gib // 2, available=2 * gib)  # fits exactly
        assert not caplog.records
        # Fits this rank, not its 4 ranks of the node together: a warning.
        host_memory.check_room(2 * gib, released=0, ranks_on_node=4, available=3 * gib)
    assert "4 ranks on this node need about 8.00 GiB together" in caplog.text


def test_unknown_availability_is_no_check(monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    host_memory.check_room(2**50)  # nothing known: nothing refused


def test_planned_host_bytes_count_rows_and_both_moments():
    from megatron_ext.stem.runtime.store import planned_host_bytes

    cuda = torch.cuda.is_available()
    assert planned_host_bytes("cpu", 10, None, [8, 4]) == 3 * 4 * 10 * 12
    assert planned_host_bytes("tiered", 10, 3, [8]) == 3 * 4 * (7 if cuda else 10) * 8
    assert planned_host_bytes("gpu", 10, None, [8]) == (0 if cuda else 3 * 4 * 10 * 8)


def test_tables_too_large_for_the_host_are_refused_at_set_up(mcore_single_rank, monkeypatch):
    """The store checks the room before it allocates a row: here 100 rows of widths 8 and 4
    with their moments (14,400 bytes) against 1,000 bytes available plus the 4,800 bytes of
    drawn rows it will let go; with 9,600 available they fit and the tables are built."""
    from megatron.core import parallel_state

    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.runtime.tables import LayerTable, StemTables
    from megatron_ext.stem.runtime.worker import HostWorker

    def Layer(table):  # noqa: N802 (a STEM layer as the tables know it)
        return LayerTable(1, table, table.dtype, table.shape[0])

    allocated = []
    index_select = host_memory.index_select

    def recording(*args, **kwargs):
        allocated.append(1)
        return index_select(*args, **kwargs)

    monkeypatch.setattr(host_memory, "index_select", recording)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1000)
    layers = [Layer(torch.zeros(100, 8)), Layer(torch.zeros(100, 4))]
    with pytest.raises(ValueError, match=r"moments need 0\.0 MiB of host memory, and 0\.0 MiB "
                                         r"is available.*--stem-table-sharding vocab"):
        StemTables(layers, StemConfig(placement="cpu", sharding="vocab"), 100,
                   parallel_state.get_data_parallel_group(), HostWorker())
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 9599)  # one byte short
    with pytest.raises(ValueError, match="moments need"):
        StemTables(layers, StemConfig(placement="cpu", sharding="vocab"), 100,
                   parallel_state.get_data_parallel_group(), HostWorker())
    assert not allocated
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 9600)  # 9,600 + 4,800: fits
    tables = StemTables([Layer(torch.zeros(100, 8)), Layer(torch.zeros(100, 4))],
                        StemConfig(placement="cpu", sharding="vocab", host_huge_pages=False),
                        100, parallel_state.get_data_parallel_group(), HostWorker())
    assert allocated == [1, 1] and [s.shape for s in tables.store.shards] == [(100, 8), (100, 4)]


# -- kept from child processes (MADV_DONTFORK) --------------------------------------------------
needs_linux_maps = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTFORK"),
    reason="Linux mappings")


@needs_linux_maps
@pytest.mark.parametrize("huge", [True, False])
def test_large_host_tensors_are_kept_from_children(huge):
    """Every host tensor of at least MIN_MAPPED_BYTES, on huge pages or not, is a mapping that
    fork does not copy (smaps ``dc``); without huge pages it is advised off them (``nh``)."""
    t = host_memory.empty((ROWS, WIDTH), huge=huge).fill_(1.0)
    nbytes = _nbytes(t)
    assert nbytes >= host_memory.MIN_MAPPED_BYTES
    assert host_memory.flagged_bytes([t], "dc") == nbytes
    assert host_memory.flagged_bytes([t], "nh") == (0 if huge else nbytes)
    small = host_memory.empty((4, WIDTH), huge=huge).fill_(1.0)  # an ordinary torch tensor
    assert host_memory.flagged_bytes([small], "dc") == 0


def _read_in_child(t: torch.Tensor) -> int:
    """Fork; the child reads ``t``'s first element by its address and exits 0. Returns the
    child's wait status."""
    address = t.data_ptr()
    pid = os.fork()
    if pid == 0:  # the child: no torch, no threads, one read
        try:
            ctypes.c_float.from_address(address).value
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


@needs_linux_maps
def test_a_forked_child_does_not_get_the_rows():
    """What a data loader worker forked after the tables were built gets: no mapping for the
    host rows (reading them faults), so the parent's later writes copy nothing; an ordinary
    tensor is there, shared copy-on-write."""
    mapped = host_memory.empty((ROWS, WIDTH)).fill_(2.0)
    ordinary = torch.full((ROWS, WIDTH), 2.0)
    status = _read_in_child(ordinary)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    status = _read_in_child(mapped)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
    assert float(mapped[0, 0]) == 2.0  # the parent's rows are untouched


@needs_linux_maps
@pytest.mark.parametrize("placement", ["cpu", "tiered"])
def test_store_and_optimizer_keep_host_rows_from_children(placement):
    """The host shard (a tiered shard's host tier) and both moments, as the sparse table
    optimizer binds them, with and without huge pages."""
    vocab = ROWS + 64
    table = torch.randn(vocab, WIDTH)
    owned = torch.randperm(vocab)
    for huge in (True, False):
        store = TableStore(iter([table]), owned, placement, torch.device("cpu"),
                           64 if placement == "tiered" else None, huge_pages=huge)
        host = store.shards[0].cold if placement == "tiered" else store.shards[0]
        lazy = store.lazy.cold if placement == "tiered" else store.lazy
        optimizer = RowAdamW([host], mode="sparse", lazy=lazy, huge_pages=huge)
        tensors = [host, *optimizer.exp_avg, *optimizer.exp_avg_sq]
        assert host_memory.flagged_bytes(tensors, "dc") == sum(_nbytes(t) for t in tensors)


@needs_linux_maps
def test_fork_benchmark_runs_and_reports_what_is_kept_from_children(tmp_path):
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "fork.json"
    p = subprocess.run([sys.executable, "benchmarks/stem_fork_cow.py", "--rows", "8192",
                        "--width", "1024", "--batch-rows", "256", "--reps", "2", "--json",
                        str(out)], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["store"]["kept_from_children_bytes"] == 3 * 8192 * 1024 * 4  # rows, two moments
    assert s["huge pages, shared"]["kept_from_children_bytes"] == 0
    assert s["plain torch"]["kept_from_children_bytes"] == 0
    assert set(s["ratio_after_fork"]) == {"plain torch", "huge pages, shared", "store"}
