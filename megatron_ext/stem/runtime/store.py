"""The rows of managed STEM tables that a rank holds (``--stem-table-placement cpu|gpu|tiered``,
``--stem-table-sharding``): one shard per STEM layer of a model chunk, and every read of them.

A ``TableStore`` keeps its chunk's shards where the placement puts them (host memory; the
model's device; or a ``TieredShard``'s two halves), in the local row order of the
rank's ownership (``stem/runtime/ownership.py``, ``stem/runtime/tiers.py``), and what its rows still owe under the
sparse optimizer (``row_adam.LazyRows``: the optimizer binds the moments, moves the clock and steps
rows in place; every read here sees the rows it reads brought up to date). It knows nothing of other
ranks: the exchange (``stem/runtime/exchange.py``) says which rows to read and moves them, the optimizer
(``stem/runtime/optimizer.py``) writes them, and leaves here the part of a sparse step it has not
run yet (``owed_step``): a read steps the rows it needs of it first, then reads them as of now
(host rows without writing them: their next step brings them up to date in its own pass).
Reads and writes of the shards are host work: they run on the process's worker thread
(``stem/runtime/worker.py``) or, for checkpoints and dumps, on the training thread once the worker is
idle.

Reading rows (``gather_rows``): from host shards to a GPU the rows are gathered and cast straight
into a reusable pinned buffer (``PinnedStaging``) and moved by one asynchronous copy (the staged
read, ``--stem-host-read staged``); or, with ``--stem-host-read direct``, a GPU kernel reads them
from the host shards themselves, made page-locked in place for it (``kernels/host_rows.py``),
when the GPU gets to it: every CPU write of host rows first waits for the reads of them still
queued (``stem/runtime/direct_reads.py``).
"""

from __future__ import annotations

import mmap
import os
from typing import List, Optional, Sequence

import torch
from torch.profiler import record_function

from megatron_ext.stem.runtime import host_memory
from megatron_ext.stem.runtime.direct_reads import DirectReads
from megatron_ext.stem.runtime.row_adam import LazyRows
from megatron_ext.stem.runtime.row_adam import TieredLazyRows, stacked
from megatron_ext.stem.runtime.tiers import TieredShard, full_tensor, write_back
from megatron_ext.stem.runtime.transfer import to_device
from megatron_ext_kernels import host_rows, row_adam_cpu
from megatron_ext_kernels._triton_runtime import interpreted

HOST_READS = ("staged", "direct")


class WholeTable:
    """Every row of a table drawn (``[vocab, F/tp]``), in the interface of the model's drawn
    rows (``stem/initial_rows.py`` ``InitialRows``: ``values`` and ``rows(ids)``, the positions
    of global rows in ``values``), which the store reads without importing the model side."""

    def __init__(self, values: torch.Tensor):
        self.values = values

    def rows(self, wanted: torch.Tensor) -> torch.Tensor:
        return wanted.to(torch.long)


class TableStore:
    """The owned rows (``owned_ids``, local order) of each of a chunk's STEM layers.

    ``tables``: the drawn values of each layer, a ``[vocab, F/tp]`` tensor or the rows kept of
    it (``initial_rows.InitialRows``, holding at least ``owned_ids``; every placement starts
    from the same numbers); ``placement``: ``gpu`` keeps the shards on ``device``, ``cpu`` in
    host memory, ``tiered`` the first ``num_hot`` local rows on ``device`` and the rest in host
    memory.
    ``huge_pages``: host shards and their moments on transparent huge pages
    (``host_memory.py``, ``--stem-host-huge-pages``). ``host_read``: how host rows reach the
    GPU, ``staged`` (gathered on the CPU into pinned staging, then copied) or ``direct`` (read
    by a GPU kernel from the shards, which are made page-locked for it; without CUDA only
    under Triton's interpreter, the CPU twin of the tests)."""

    def __init__(self, tables, owned_ids: torch.Tensor, placement: str, device: torch.device,
                 num_hot: Optional[int] = None, huge_pages: bool = True,
                 host_read: str = "staged"):
        cuda = torch.cuda.is_available()
        check_host_read(host_read, placement, cuda)
        self.host_read = host_read
        # direct: the finalizers that unregister the host shards registered for the GPU's
        # reads (cudaHostRegister), run when the store is collected.
        self._registered: list = []
        self.shards: List = []
        self.huge_pages = huge_pages
        # Host shards are ordinary (pageable) memory, on huge pages: only the CPU reads and
        # writes them (the row gather, the CPU optimizer), a row at a time at scattered places;
        # rows and gradients cross to and from the GPU through the reusable pinned buffers
        # (``PinnedStaging``). Pinning the shards themselves would lock up to twice their
        # size: PyTorch's pinned allocator rounds each allocation up to a power of two (a 4.2 GB
        # table shard: 8 GiB locked).
        drawn = [d if hasattr(d, "rows") else WholeTable(d) for d in tables]
        # Room for the host rows and their moments, checked before any is allocated; the drawn
        # rows are let go one layer at a time as they are copied.
        host_memory.check_room(
            planned_host_bytes(placement, owned_ids.numel(), num_hot,
                               [d.values.shape[1] for d in drawn]),
            released=sum(d.values.numel() * d.values.element_size() for d in drawn
                         if d.values.device.type == "cpu"),
            ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        # The device rows of every layer (the GPU tier; gpu placement) in one tensor, layer
        # first, where the layers have one width: the torch path then steps, settles and reads
        # every layer's rows with one op per tensor (row_adam.stacked), not one per layer.
        widths = {d.values.shape[1] for d in drawn}
        on_device = num_hot if placement == "tiered" else \
            owned_ids.numel() if placement == "gpu" and cuda else None
        stack = torch.empty(len(drawn), on_device, widths.pop(), dtype=torch.float32,
                            device=device) if on_device and len(drawn) > 1 and \
            len(widths) == 1 else None
        layer_number = 0
        while drawn:
            layer = drawn.pop(0)
            rows, values = layer.rows(owned_ids), layer.values
            del layer
            if placement == "tiered":  # the first num_hot owned rows are the GPU tier
                hot = self._device_rows(values[rows[:num_hot]], stack, layer_number, device)
                cold = host_memory.index_select(values, rows[num_hot:], torch.float32,
                                                huge_pages)
                shard = TieredShard(hot, cold)
            elif placement == "gpu" and cuda:
                shard = self._device_rows(values[rows], stack, layer_number, device)
            else:  # host memory (cpu placement; gpu placement without CUDA)
                shard = host_memory.index_select(values, rows, torch.float32, huge_pages)
            if host_read == "direct" and cuda:  # before the optimizer state binds the shards
                if isinstance(shard, TieredShard):
                    shard.cold = self._addressable(shard.cold)
                else:
                    shard = self._addressable(shard)
            del values
            self.shards.append(shard)
            layer_number += 1
        self.placement = placement
        self.lazy = TieredLazyRows(self.shards, huge_pages) if placement == "tiered" else \
            LazyRows(self.shards, huge_pages=huge_pages)
        # direct: a GPU kernel reads the host rows after ``gather`` returns, so every CPU write
        # of them (the table step, catch-ups settled in place, ``write``, loads) first waits for
        # the reads of them still queued. Kept with the host rows' lazy state, which the
        # optimizer writing them shares (``direct_reads.py``).
        self.reads = None
        if host_read == "direct":
            host_lazy = self.lazy.cold if placement == "tiered" else self.lazy
            num_host = self.shards[0].cold.shape[0] if placement == "tiered" and self.shards \
                else owned_ids.numel()
            self.reads = host_lazy.reads = DirectReads(num_host)
        self.staging = PinnedStaging() if cuda and placement in ("cpu", "tiered") else None
        # The part of a sparse table step still to run (``schedule.OwedStep``): rows a
        # read needs are stepped first. Set and cleared by the optimizer; used on the worker.
        self.owed_step = None

    def _addressable(self, t: torch.Tensor) -> torch.Tensor:
        """Host rows ``t`` where a GPU kernel can read them: a mapping of their own
        (``host_memory.empty``: page-aligned, whole pages) registered in place for as long as the
        store lives, kept on huge pages; a smaller tensor, which may share pages with other heap
        memory (registering a page twice fails), copied into pinned memory (at most
        ``MIN_MAPPED_BYTES``, where the pinned allocator's rounding to a power of two costs
        little)."""
        if t.numel() == 0:
            return t
        if t.data_ptr() % mmap.PAGESIZE == 0 and \
                t.numel() * t.element_size() >= host_memory.MIN_MAPPED_BYTES:
            handle = host_rows.register(t, self)
            if handle is not None:
                self._registered.append(handle)
            return t
        return t.pin_memory()

    @staticmethod
    def _device_rows(rows: torch.Tensor, stack: Optional[torch.Tensor], k: int,
                     device: torch.device) -> torch.Tensor:
        """A layer's device rows as fp32: layer ``k`` of ``stack``, or a tensor of their own."""
        if stack is None:
            return rows.to(device=device, dtype=torch.float32).contiguous()
        stack[k].copy_(rows)
        return stack[k]

    @property
    def widths(self) -> List[int]:
        return [s.shape[1] for s in self.shards]

    @property
    def on_host(self) -> bool:
        """Whether the rows step on the CPU (a tiered store's host tier does)."""
        return all(s.device.type == "cpu" for s in self.shards)

    def host_rows(self, local_rows: torch.Tensor) -> int:
        """How many of ``local_rows`` (local indices, duplicates counted) the placement keeps in
        host memory: every row (``cpu``), none (``gpu``), those past the GPU tier (``tiered``).
        What a fetch of them copies from host memory to the model's device, and what of their
        gradients steps on the CPU."""
        if self.placement == "cpu":
            return local_rows.numel()
        if self.placement == "tiered":
            return int((local_rows >= self.shards[0].num_hot).sum()) if self.shards else 0
        return 0

    def host_bytes(self) -> int:
        return sum(s.host_bytes() if isinstance(s, TieredShard) else
                   s.numel() * s.element_size() for s in self.shards if s.device.type == "cpu")

    def gather(self, local_rows: torch.Tensor, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
        """The rows ``local_rows`` of every shard, side by side, as ``dtype`` on ``device``, as
        of the clock's iteration (what they owe is settled, in place on a GPU; host rows are
        read brought forward and left as they are: ``LazyRows.read_into``). On a GPU, what is
        copied from host memory is queued on the current stream (the worker's side stream when
        the worker runs it)."""
        if self.owed_step is not None:  # first: the step brings its rows up to date itself
            with record_function("stem/step-rows-read"):
                self.owed_step.settle(local_rows)
        rows = gather_rows(self.shards, local_rows, device, dtype, self.staging, lazy=self.lazy,
                           read=self.host_read)
        # direct: the kernel reads the host rows when the GPU runs it, after this returns; the
        # read is recorded (``_gather_direct``) and every CPU write of its rows waits for it.
        return rows

    def read(self, i: int) -> torch.Tensor:
        """Layer ``i``'s owned rows, settled, as one tensor in local order: the shard itself, or a
        host copy of a tiered one's two halves."""
        self.wait_reads()  # the rows are settled in place and may be written whole
        if self.owed_step is not None:
            self.owed_step.finish()
        self.lazy.settle_all()
        return full_tensor(self.shards[i])

    def write(self, i: int, whole: torch.Tensor) -> None:
        """After ``whole = read(i)`` was written in place: a tiered shard takes it back."""
        self.wait_reads()  # a direct read queued since ``read`` reads the old rows
        write_back(self.shards[i], whole)

    def wait_reads(self) -> None:
        """Wait for every direct read of the host rows still queued on the GPU, before the CPU
        writes them past the store's own writers (``read``, ``write``, a checkpoint's load)."""
        if self.reads is not None:
            self.reads.wait_all()


def check_host_read(host_read: str, placement: str, cuda: bool) -> None:
    """Refuse a host read that cannot work here (``--stem-host-read``), in one line."""
    if host_read not in HOST_READS:
        raise ValueError(f"--stem-host-read={host_read!r}: allowed values are "
                         f"{', '.join(HOST_READS)}")
    if host_read != "direct":
        return
    if placement == "gpu":
        raise ValueError("--stem-host-read direct reads host rows, and --stem-table-placement "
                         "gpu keeps none: use --stem-table-placement cpu or tiered, or "
                         "--stem-host-read staged")
    if not cuda and not interpreted():
        raise ValueError("--stem-host-read direct needs a CUDA device (a GPU kernel reads the "
                         "host rows); use --stem-host-read staged")


def planned_host_bytes(placement: str, num_owned: int, num_hot: Optional[int],
                       widths: Sequence[int]) -> int:
    """Host memory a ``TableStore`` of this layout holds with its optimizer's two Adam moments
    (fp32 rows and moments, dense or sparse optimizer alike): the host tier of ``tiered``, every
    owned row of ``cpu``, none of ``gpu``; every row without CUDA, where the device is the CPU.
    What ``host_memory.check_room`` weighs before the store allocates them."""
    if not torch.cuda.is_available() or placement == "cpu":
        rows = num_owned
    elif placement == "tiered":
        rows = num_owned - (num_hot or 0)
    else:
        rows = 0
    return 3 * 4 * rows * sum(widths)


class PinnedStaging:
    """A reusable page-locked host buffer for copies between host shards and the GPU (pinned
    memory is what lets the copy engine move it while kernels run; allocating it is slow, so it
    is allocated once and grows when a larger batch of rows comes). A view handed out is valid
    until the next ``view()``, which first waits for the copy that ``record()`` marked."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._event = None

    def view(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        need = numel * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None
            self._buffer = torch.empty(need + need // 4 + 4096, dtype=torch.uint8,
                                       pin_memory=True)
        return self._buffer[:need].view(dtype)

    def record(self) -> None:
        """Mark the end of the copy that reads/writes the last view (on the current stream)."""
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream())

    def take_event(self):
        """The marked copy's event (None if none), handed to whoever will wait for it; the next
        ``view()`` no longer waits for it: the taker must be done with the buffer first."""
        event, self._event = self._event, None
        return event


def host_gather(shard: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                chunk: int = 1024, lazy: Optional[LazyRows] = None, i: int = 0) -> None:
    """``out[:] = shard[index]`` cast to ``out``'s dtype, for fp32 host shards: the compiled
    gather (``kernels/row_adam_cpu.py``) when it builds, else torch ops in chunks
    of rows. ``lazy`` (the shard is its ``i``-th): the rows as of the clock's iteration, read
    without writing them where the kernel can (``LazyRows.read_into``), else settled first."""
    if lazy is not None:
        if lazy.read_into(i, index, out):
            return
        lazy.settle(i, index)
    kernel = row_adam_cpu.load()
    if kernel is not None and shard.is_contiguous() and shard.dtype == torch.float32:
        kernel.gather_rows_(shard, index, out)
        return
    for start in range(0, index.numel(), chunk):
        part = index[start: start + chunk]
        rows = out[start: start + part.numel()]
        if out.dtype == shard.dtype:
            torch.index_select(shard, 0, part, out=rows)
        else:
            rows.copy_(shard[part])


def gather_rows(shards: Sequence[torch.Tensor], index: torch.Tensor, device: torch.device,
                dtype: torch.dtype, staging: PinnedStaging | None = None,
                chunk: int = 1024, lazy: Optional[LazyRows] = None,
                read: str = "staged") -> torch.Tensor:
    """``cat([shard[index] for shard in shards], dim=1)`` as ``dtype`` on ``device``. From host
    shards to a GPU the rows are gathered (and cast) straight into ``staging``'s pinned buffer,
    one block per shard, in chunks of rows (no large temporaries), then moved in one
    asynchronous copy and laid out side by side on the GPU; with ``read`` ``direct`` a GPU
    kernel reads them from the shards (``_gather_direct``). ``lazy``: the shards' ``LazyRows``
    (the sparse optimizer's state): the rows are read as of its clock's iteration."""
    if shards and isinstance(shards[0], TieredShard):
        return _gather_tiered(shards, index, device, dtype, staging, lazy, read)
    widths = [s.shape[1] for s in shards]
    n = index.numel()
    on_host = all(s.device.type == "cpu" for s in shards)
    if n == 0:
        return shards[0].new_empty(0, sum(widths)).to(device=device, dtype=dtype)
    index = index.to(torch.long).contiguous()
    if not on_host:  # device shards: settled in place, read by indexing
        if lazy is not None:
            lazy.settle_shards(index)
        stack = stacked(shards)
        if stack is not None:  # every layer's rows in one gather, laid side by side and cast
            rows = torch.empty(n, len(shards), widths[0], dtype=dtype, device=device)
            rows.copy_(stack.index_select(1, to_device(index, stack.device)).transpose(0, 1))
            return rows.view(n, -1)
        return torch.cat([s[to_device(index, s.device)] for s in shards], dim=1).to(
            device=device, dtype=dtype)
    if read == "direct":
        return _gather_direct(shards, index, device, dtype, lazy, staging)
    if staging is None or device.type != "cuda":  # host rows to host memory
        parts = [torch.empty(n, w, dtype=dtype) for w in widths]
        for i, (s, part) in enumerate(zip(shards, parts)):
            host_gather(s, index, part, chunk, lazy, i)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return rows.to(device)
    flat = staging.view(n * sum(widths), dtype)
    offset = 0
    for i, (s, w) in enumerate(zip(shards, widths)):
        host_gather(s, index, flat[offset: offset + n * w].view(n, w), chunk, lazy, i)
        offset += n * w
    moved = flat.to(device, non_blocking=True)
    staging.record()
    parts, offset = [], 0
    for w in widths:
        parts.append(moved[offset: offset + n * w].view(n, w))
        offset += n * w
    return torch.cat(parts, dim=1)


def _gather_direct(shards: Sequence[torch.Tensor], index: torch.Tensor, device: torch.device,
                   dtype: torch.dtype, lazy: Optional[LazyRows] = None,
                   staging: PinnedStaging | None = None, out: Optional[torch.Tensor] = None,
                   positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gather_rows`` of host shards read by a GPU kernel (``kernels/host_rows.py``; on the
    CPU, under Triton's interpreter), into each shard's column block of the result, queued on
    the current stream. Rows current at the clock's iteration are read from the shard itself.
    Rows that owe the sparse optimizer's catch-up are read as the staged read reads them, as of
    now without writing them (``LazyRows.read_into``), into ``staging``'s pinned buffer, which
    the kernel then reads: settling them in place instead would give the same read but not the
    same table afterwards (a catch-up over iterations a..c then c..d rounds otherwise than one
    over a..d), and costs the CPU three row writes where the staged read makes one. Without the
    compiled read (``read_into`` declines) they are settled in place first, as the staged read
    then does. So the result and the tables are the staged read's, bit for bit.
    ``out``/``positions`` (host): write row ``j`` to ``out[positions[j]]`` (the host tier's rows
    of a tiered read) instead of a new tensor."""
    widths = [s.shape[1] for s in shards]
    index = index.to(torch.long).contiguous()
    n = index.numel()
    if out is None:
        out = torch.empty(n, sum(widths), dtype=dtype, device=device)
    where = torch.arange(n) if positions is None else positions.to(torch.long)
    owing = [_owing(lazy, i, index) for i in range(len(shards))]
    late = [int(o.sum()) if o is not None else 0 for o in owing]
    flat = None
    if sum(late):
        total = sum(k * w for k, w in zip(late, widths))
        flat = staging.view(total, dtype) if staging is not None and device.type == "cuda" \
            else torch.empty(total, dtype=dtype)
    moved = {}  # (rows, positions) on the device per mask: layers mostly owe the same rows

    def on_device(mask: Optional[torch.Tensor]):
        key = None if mask is None else mask.numpy().tobytes()
        if key not in moved:
            rows, pos = (index, where) if mask is None else (index[mask], where[mask])
            moved[key] = (to_device(rows, device), to_device(pos, device))
        return moved[key]

    offset = column = 0
    for i, (s, w, o, k) in enumerate(zip(shards, widths, owing, late)):
        block = out[:, column: column + w]
        if k:
            part = flat[offset: offset + k * w].view(k, w)
            if lazy.read_into(i, index[o], part):
                _, pos = on_device(o)
                host_rows.gather_host_rows(part, to_device(torch.arange(k), device), block,
                                           positions=pos)
                offset += k * w
                o = ~o
            else:  # no compiled read: settled in place, as host_gather does
                lazy.settle(i, index[o])
                o = None
        rows, pos = on_device(o)
        if rows.numel():
            host_rows.gather_host_rows(s, rows, block, positions=pos)
        column += w
    if flat is not None and staging is not None and device.type == "cuda":
        staging.record()  # the kernel has read the buffer when this event is reached
    if lazy is not None and lazy.reads is not None:  # the shards' rows until the kernel ran
        lazy.reads.record(index)
    return out


def _owing(lazy: Optional[LazyRows], i: int, index: torch.Tensor) -> Optional[torch.Tensor]:
    """Which of ``index`` (host) shard ``i`` of ``lazy`` holds as of an earlier iteration than
    its clock's (a host bool mask), or None where no row can owe."""
    if lazy is None or lazy.exp_avg is None or lazy.clock.step == lazy.clock.base:
        return None
    late = lazy.last[i][index] < lazy.clock.step
    return late if bool(late.any()) else None


def _gather_tiered(shards: Sequence[TieredShard], index: torch.Tensor, device: torch.device,
                   dtype: torch.dtype, staging: PinnedStaging | None,
                   lazy: Optional[TieredLazyRows] = None, read: str = "staged") -> torch.Tensor:
    """``gather_rows`` of tiered shards: the GPU tier's rows are read where they are, the host
    tier's through the host-shard path (pinned staging to a GPU, or the direct read, which
    writes them into their places of the result itself); ``lazy``: the shards'
    ``TieredLazyRows``, each tier reading its own rows."""
    widths = [s.shape[1] for s in shards]
    hot_pos, hot_rows, cold_pos, cold_rows = shards[0].split(index)
    for pos, rows, tier, tier_lazy, tier_staging in (
            (hot_pos, hot_rows, "hot", lazy.hot if lazy is not None else None, None),
            (cold_pos, cold_rows, "cold", lazy.cold if lazy is not None else None, staging)):
        if pos.numel() == index.numel():  # every row in one tier: read in place of ``out``
            return gather_rows([getattr(s, tier) for s in shards], rows, device, dtype,
                               tier_staging, lazy=tier_lazy, read=read)
    out = torch.empty(index.numel(), sum(widths), dtype=dtype, device=device)
    if hot_pos.numel():
        out[to_device(hot_pos, device)] = gather_rows(
            [s.hot for s in shards], hot_rows, device, dtype,
            lazy=lazy.hot if lazy is not None else None)
    if cold_pos.numel() and read == "direct":
        _gather_direct([s.cold for s in shards], cold_rows, device, dtype,
                       lazy.cold if lazy is not None else None, staging, out, cold_pos)
    elif cold_pos.numel():
        out[to_device(cold_pos, device)] = gather_rows(
            [s.cold for s in shards], cold_rows, device, dtype, staging,
            lazy=lazy.cold if lazy is not None else None)
    return out
