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
into a reusable pinned buffer (``PinnedStaging``) and moved by one asynchronous copy.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch
from torch.profiler import record_function

from megatron_ext.stem.runtime import host_memory
from megatron_ext.stem.runtime.row_adam import LazyRows
from megatron_ext.stem.runtime.row_adam import TieredLazyRows, stacked
from megatron_ext.stem.runtime.tiers import TieredShard, full_tensor, write_back
from megatron_ext.stem.runtime.transfer import to_device
from megatron_ext_kernels import row_adam_cpu


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
    (``host_memory.py``, ``--stem-host-huge-pages``)."""

    def __init__(self, tables, owned_ids: torch.Tensor, placement: str, device: torch.device,
                 num_hot: Optional[int] = None, huge_pages: bool = True):
        cuda = torch.cuda.is_available()
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
            del values
            self.shards.append(shard)
            layer_number += 1
        self.placement = placement
        self.lazy = TieredLazyRows(self.shards, huge_pages) if placement == "tiered" else \
            LazyRows(self.shards, huge_pages=huge_pages)
        self.staging = PinnedStaging() if cuda and placement in ("cpu", "tiered") else None
        # The part of a sparse table step still to run (``schedule.OwedStep``): rows a
        # read needs are stepped first. Set and cleared by the optimizer; used on the worker.
        self.owed_step = None

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
        return gather_rows(self.shards, local_rows, device, dtype, self.staging, lazy=self.lazy)

    def read(self, i: int) -> torch.Tensor:
        """Layer ``i``'s owned rows, settled, as one tensor in local order: the shard itself, or a
        host copy of a tiered one's two halves."""
        if self.owed_step is not None:
            self.owed_step.finish()
        self.lazy.settle_all()
        return full_tensor(self.shards[i])

    def write(self, i: int, whole: torch.Tensor) -> None:
        """After ``whole = read(i)`` was written in place: a tiered shard takes it back."""
        write_back(self.shards[i], whole)


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
                chunk: int = 1024, lazy: Optional[LazyRows] = None) -> torch.Tensor:
    """``cat([shard[index] for shard in shards], dim=1)`` as ``dtype`` on ``device``. From host
    shards to a GPU the rows are gathered (and cast) straight into ``staging``'s pinned buffer,
    one block per shard, in chunks of rows (no large temporaries), then moved in one
    asynchronous copy and laid out side by side on the GPU. ``lazy``: the shards' ``LazyRows``
    (the sparse optimizer's state): the rows are read as of its clock's iteration."""
    if shards and isinstance(shards[0], TieredShard):
        return _gather_tiered(shards, index, device, dtype, staging, lazy)
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


def _gather_tiered(shards: Sequence[TieredShard], index: torch.Tensor, device: torch.device,
                   dtype: torch.dtype, staging: PinnedStaging | None,
                   lazy: Optional[TieredLazyRows] = None) -> torch.Tensor:
    """``gather_rows`` of tiered shards: the GPU tier's rows are read where they are, the host
    tier's through the host-shard path (pinned staging to a GPU); ``lazy``: the shards'
    ``TieredLazyRows``, each tier reading its own rows."""
    widths = [s.shape[1] for s in shards]
    hot_pos, hot_rows, cold_pos, cold_rows = shards[0].split(index)
    for pos, rows, tier, tier_lazy, tier_staging in (
            (hot_pos, hot_rows, "hot", lazy.hot if lazy is not None else None, None),
            (cold_pos, cold_rows, "cold", lazy.cold if lazy is not None else None, staging)):
        if pos.numel() == index.numel():  # every row in one tier: read in place of ``out``
            return gather_rows([getattr(s, tier) for s in shards], rows, device, dtype,
                               tier_staging, lazy=tier_lazy)
    out = torch.empty(index.numel(), sum(widths), dtype=dtype, device=device)
    if hot_pos.numel():
        out[to_device(hot_pos, device)] = gather_rows(
            [s.hot for s in shards], hot_rows, device, dtype,
            lazy=lazy.hot if lazy is not None else None)
    if cold_pos.numel():
        out[to_device(cold_pos, device)] = gather_rows(
            [s.cold for s in shards], cold_rows, device, dtype, staging,
            lazy=lazy.cold if lazy is not None else None)
    return out
