"""Managed STEM tables: the rows a rank holds of every STEM layer of one model chunk, outside
Megatron's parameters (``--stem-table-placement cpu`` and/or ``--stem-table-sharding vocab``).

Per micro-batch (``prepare``, called by the forward step before the model runs, on every
data-parallel rank in the same order):

1. the micro-batch's token ids are deduplicated once for all STEM layers of the chunk;
2. the unique ids go to their owners and the rows of every layer come back in one exchange
   (``stem/exchange.py``), onto the device the model runs on;
3. each layer gets a leaf tensor ``rows [n_unique, F/tp]`` (requires grad) and the inverse index
   ``[s, b]``; its lookup is ``rows[inverse]``, so autograd leaves the row gradients, already
   deduplicated, in ``rows.grad``.

Prefetch (``--stem-prefetch``, on by default): while micro-batch ``m`` computes, the forward step
has already read micro-batch ``m + 1`` from the data iterator and a background thread fetches its
rows (on a CUDA side stream when there is a GPU, through its own copy of the data-parallel
process group so its collectives never interleave with the model's). Prefetch never crosses an
optimizer step (only ``m + 1 < num_microbatches``), so a row updated at step ``i`` is read with
that update at step ``i + 1``; the fetched values are the ones a synchronous fetch reads.

Overlapped table step (host shards with prefetch): the last micro-batch of a step also reads the
next step's first micro-batch (``carried``). At the optimizer step (``run_step``) the background
thread routes its ids to their owners, steps the rows that micro-batch reads, fetches them for it,
then steps the remaining rows while the next step computes. Reads still
see every update (the fetch of micro-batch 0 follows the step of its rows; later fetches, checkpoint
and evaluation reads wait for the whole step, ``drain``), so the numbers are those of a synchronous
step; the training thread only waits where micro-batch 0 needs its rows.

At the optimizer step (``collect_grads``) the row gradients of all micro-batches are summed per id
and pushed to their owners, where the contributions of all data-parallel ranks are summed: the
data-parallel reduction of the tables. What Megatron's DDP does for parameters (average over data
parallel ranks) is applied by ``stem/table_optimizer.py``.

One background thread per process serves every model chunk (interleaved pipeline stages have
several chunks with tables): the chunks share the prefetch group, and collectives on one group must
be issued in the same order on every rank. Its tasks run in submission order, which is the program
order of the training thread, the same on every rank of the group; the training thread issues
collectives on that group itself only when the thread is idle (``drain``).

Table values are drawn exactly as for an ordinary STEM parameter (same initialiser, same RNG
stream: the full ``[vocab, F/tp]`` table of this TP rank), then the owned rows are kept, so every
placement and sharding starts from the same numbers.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_ext.stem.config import StemConfig
from megatron_ext.stem.exchange import PinnedStaging, ReplicatedExchange, VocabExchange
from megatron_ext.stem.ownership import RowOwnership
from megatron_ext.stem.tiers import TieredOwnership, TieredShard, full_tensor


class StemTables:
    def __init__(self, layers: Sequence, stem: StemConfig, vocab_size: int, dp_group,
                 device: Optional[torch.device] = None, prefetch_group=None,
                 hot_mask: Optional[torch.Tensor] = None):
        self.layers = list(layers)
        self.vocab_size = vocab_size
        for index, layer in enumerate(self.layers):  # checkpoints reach the rows through this
            layer.managed_by = (self, index)
        self.dp_rank = dist.get_rank(dp_group)
        self.dp_size = dist.get_world_size(dp_group)
        cuda = torch.cuda.is_available()
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if cuda
                                 else torch.device("cpu"))
        self.prefetch = stem.prefetch
        group = dp_group
        if stem.prefetch:
            if prefetch_group is None or dist.get_world_size(prefetch_group) != self.dp_size:
                raise ValueError("STEM prefetch needs its own data-parallel process group")
            group = prefetch_group
        self.tiered = stem.placement == "tiered"  # always vocab-sharded (StemConfig checks)
        if stem.sharding == "vocab":
            self.ownership = RowOwnership(vocab_size, self.dp_size, stem.ownership)
            if self.tiered:  # the same owners; each rank numbers its hot rows first
                if hot_mask is None:
                    raise ValueError("--stem-table-placement tiered needs the GPU tier's rows")
                self.ownership = TieredOwnership(self.ownership, hot_mask, self.dp_rank)
            self.exchange = VocabExchange(self.ownership, group)
            self.owned_ids = self.ownership.owned_ids(self.dp_rank)
        else:
            self.ownership = None
            self.exchange = ReplicatedExchange(vocab_size, group)
            self.owned_ids = torch.arange(vocab_size)
        self._step_tasks = []   # futures of background table steps (their seconds), not drained
        self.microbatch = 0   # forward calls since the last optimizer step
        self.prefetched = None  # (batch tuple, future) of the next micro-batch
        self.carried = None   # the next step's first micro-batch, read ahead (overlapped step)
        self.shards: List[torch.Tensor] = []
        for layer in self.layers:
            full = layer.release_initial_table()
            shard = full[self.owned_ids].to(torch.float32).contiguous()
            del full
            if self.tiered:
                hot, cold = shard[: self.ownership.num_hot], shard[self.ownership.num_hot:]
                shard = TieredShard(hot.to(self.device).contiguous(),
                                    cold.pin_memory() if cuda else cold.contiguous())
            elif stem.placement == "gpu" and cuda:
                shard = shard.to(self.device)
            elif cuda:
                shard = shard.pin_memory()  # host rows go to the GPU by DMA
            self.shards.append(shard)
        # Rows travel in the model's 16-bit dtype when it has one (the layers cast them to it,
        # so what they compute is the same), through a reusable pinned buffer from host shards.
        config = getattr(self.layers[0], "config", None) if self.layers else None
        dtype = getattr(config, "params_dtype", torch.float32)
        self.wire_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        self.staging = PinnedStaging() if cuda and stem.placement in ("cpu", "tiered") else None
        # Host shards (the host tier of tiered ones) step on the CPU: with prefetch, that step
        # overlaps the next step.
        self.overlap = stem.prefetch and all(s.device.type == "cpu" for s in self.shards)
        # Called with (shard index, local rows) before rows are read: lets the sparse optimizer
        # apply the weight decay a row still owes (no stale reads).
        self.read_hook: Optional[Callable[[int, torch.Tensor], None]] = None
        self._pending: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []
        self.stats = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        """Counters since the last reset (per iteration: the training-log hook resets them)."""
        self.stats = {"unique_rows": 0, "fetch_rows_in": 0, "fetch_rows_out": 0,
                      "grad_rows_out": 0, "grad_rows_in": 0, "fetch_seconds": 0.0,
                      "fetch_seconds_hidden": 0.0, "optimizer_seconds": 0.0,
                      "optimizer_seconds_exposed": 0.0, "optimizer_seconds_before_fetch": 0.0}

    @property
    def row_bytes(self) -> int:
        """Bytes of one fetched row of every layer (they travel together)."""
        return sum(self.widths) * self.wire_dtype.itemsize

    @property
    def grad_row_bytes(self) -> int:
        return sum(self.widths) * 4  # gradients travel in fp32

    @property
    def widths(self) -> List[int]:
        return [s.shape[1] for s in self.shards]

    def host_bytes(self) -> int:
        return sum(s.host_bytes() if isinstance(s, TieredShard) else
                   s.numel() * s.element_size() for s in self.shards if s.device.type == "cpu")

    def checkpoint_rows(self, i: int) -> Tuple[torch.Tensor, bool]:
        """Layer ``i``'s owned rows for a checkpoint read, and whether the read must still apply
        the decay rows owe (sparse). A tiered shard is copied whole after the background step
        and with every row's owed decay applied; any other shard is read in place."""
        if not self.tiered:
            return self.shards[i], True
        self.drain()
        if self.read_hook is not None:
            self.read_hook(i, torch.arange(self.shards[i].shape[0]))
        return self.shard_copy(i), False

    def shard_copy(self, i: int) -> torch.Tensor:
        """Layer ``i``'s owned rows as one tensor in local order (for reading them whole):
        the shard itself, or a host copy of a tiered one's two halves."""
        return full_tensor(self.shards[i])

    # ------------------------------------------------------------------------------------------
    def route_ids(self, token_ids: torch.Tensor):
        """Deduplicate ``token_ids`` and send the unique ids to their owners: ``(unique ids on the
        host, inverse index, route)``. Collective over the (prefetch) data-parallel group."""
        unique, inverse = torch.unique(token_ids.reshape(-1), return_inverse=True)
        unique_cpu = unique.cpu()
        return unique_cpu, inverse, self.exchange.route(unique_cpu)

    def fetch(self, token_ids: torch.Tensor, routed=None):
        """Route (unless ``routed``, from ``route_ids``) and fetch the rows of ``token_ids`` ([b,
        s], as the batch has them) for every STEM layer of the chunk. Collective over the
        (prefetch) data-parallel group."""
        start = time.perf_counter()
        unique_cpu, inverse, route = routed if routed is not None else self.route_ids(token_ids)
        if self.read_hook is not None and route.rows_out:
            served = torch.unique(route.requested)
            for i in range(len(self.shards)):
                self.read_hook(i, served)
        rows = self.exchange.fetch(route, self.shards, self.device, self.wire_dtype,
                                   self.staging)
        inverse = inverse.view(token_ids.shape).t().contiguous()
        event = None
        if self.device.type == "cuda":  # the stream it ran on: the side stream in the background
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        return (unique_cpu, inverse, rows, route, event, time.perf_counter() - start)

    def bind(self, fetched, waited: float) -> None:
        """Give the fetched rows to the layers (index laid out ``[s, b]``, like the ids the
        layers get through the block context); ``waited``: seconds the forward step waited."""
        unique_cpu, inverse, rows, route, event, took = fetched
        if event is not None:
            current = torch.cuda.current_stream()
            current.wait_event(event)
            for t in rows + [inverse]:
                t.record_stream(current)
        grad = torch.is_grad_enabled()
        leaves = [r.detach().requires_grad_(grad) for r in rows]
        for layer, leaf in zip(self.layers, leaves):
            layer.bind_rows(leaf, inverse)
        if grad:
            self._pending.append((unique_cpu, leaves))
        self.stats["unique_rows"] += unique_cpu.numel()
        self.stats["fetch_rows_in"] += route.rows_in
        self.stats["fetch_rows_out"] += route.rows_out
        self.stats["fetch_seconds"] += waited
        self.stats["fetch_seconds_hidden"] += max(took - waited, 0.0)

    def prepare(self, token_ids: torch.Tensor) -> None:
        """Fetch and bind synchronously (evaluation, the first micro-batch of a step, or
        ``--no-stem-prefetch``), after any background work (it may step or read the rows)."""
        start = time.perf_counter()
        self.drain()
        fetched = self.fetch(token_ids)
        self.bind(fetched, time.perf_counter() - start)

    # -- background work: one thread per process (_BACKGROUND), tasks in submission order ------
    def drain(self) -> float:
        """Wait for every background task (a table step, a fetch; of every chunk) submitted so
        far; re-raises its error. Returns the seconds waited. A prefetched micro-batch stays bound
        for its use. This chunk's background table steps' time is counted here (so an overlapped
        step is logged with the iteration it overlapped, the next one)."""
        start = time.perf_counter()
        _BACKGROUND.wait()
        waited = time.perf_counter() - start
        for done in self._step_tasks:
            took, before_fetch = done.result()
            self.stats["optimizer_seconds"] += took
            self.stats["optimizer_seconds_before_fetch"] += before_fetch
        self._step_tasks.clear()
        return waited

    def start_prefetch(self, token_ids: torch.Tensor):
        """Fetch in the background; ``bind(future.result(), ...)`` later."""
        return _BACKGROUND.submit(lambda: self.fetch(token_ids), token_ids)

    def take_batch(self, read_batch: Callable[[], tuple], num_microbatches: int,
                   read_ahead: bool = False) -> tuple:
        """The micro-batch to run now (``read_batch()``'s tuple, tokens first) with its rows bound
        to the layers. With prefetch, while training, it was read ahead by the previous call (or,
        for a step's first micro-batch, by the previous step: ``carried``) and its rows fetched in
        the background; unless this is the step's last micro-batch, the next one is read and its
        fetch started. At the last one, ``read_ahead`` (another training step follows) reads the
        next step's first micro-batch for the overlapped table step. Evaluation fetches
        synchronously and leaves what was read ahead for training. Collective over the
        data-parallel group."""
        training = torch.is_grad_enabled()
        if training and self.prefetched is not None:
            batch, future = self.prefetched
            self.prefetched = None
            start = time.perf_counter()
            fetched = future.result()
            self.bind(fetched, time.perf_counter() - start)
        else:
            if training and self.carried is not None:  # its step was skipped: fetch it now
                batch, self.carried = self.carried, None
            else:
                batch = read_batch()
            self.prepare(batch[0])
        if training:  # count this step's micro-batches (collect_grads resets the count)
            self.microbatch += 1
        if self.prefetch and training and self.microbatch < num_microbatches:
            upcoming = read_batch()
            self.prefetched = (upcoming, self.start_prefetch(upcoming[0]))
        elif self.overlap and training and read_ahead and self.microbatch == num_microbatches:
            self.carried = read_batch()
        return batch

    def run_step(self, grads: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 step_shard: Callable[[int, torch.Tensor, torch.Tensor], None],
                 ready=None, split: bool = True) -> None:
        """Step this chunk's shards: ``step_shard(i, rows, grad)`` for each shard's ``(rows,
        grad)`` (local rows). ``ready``: an event to synchronize before the gradients are read
        (their copy to the host), or None. ``split``: the rows of a shard may step in two parts
        (the sparse optimizer; the dense one steps each shard whole).

        Without a ``carried`` micro-batch the step runs here. With one, the background thread
        routes its ids, steps the rows it reads, fetches them (``prefetched``), then steps the rest
        (collective over the prefetch group, like any prefetch)."""

        def step(masks=None):
            start = time.perf_counter()
            if ready is not None:  # the gradients are read only after their copy landed
                ready.synchronize()
            for i, (rows, grad) in enumerate(grads):
                if masks is not None:
                    keep = torch.nonzero(masks[i]).squeeze(1)
                    rows, grad = rows[keep], grad.index_select(0, keep.to(grad.device))
                if rows.numel() or not split:
                    step_shard(i, rows, grad)
            return time.perf_counter() - start

        if self.carried is None:
            waited = self.drain()
            took = step()
            self.stats["optimizer_seconds"] += took
            self.stats["optimizer_seconds_exposed"] += waited + took
            return
        batch, self.carried = self.carried, None
        ids = batch[0]
        routed = {}

        def route_and_step():  # routing is a collective: it too runs on the background thread
            # Returns the step's seconds and those of the whole task: what the fetch of the next
            # micro-batch waits for (stem/optimizer-seconds-before-fetch).
            start = time.perf_counter()
            routed["ids"] = self.route_ids(ids)
            if split:
                served = torch.unique(routed["ids"][2].requested)  # rows the micro-batch reads
                routed["reads"] = [torch.isin(rows, served) for rows, _ in grads]
            took = step(routed["reads"] if split else None)
            return took, time.perf_counter() - start

        self._step_tasks.append(_BACKGROUND.submit(route_and_step, ids))
        self.prefetched = (batch, _BACKGROUND.submit(lambda: self.fetch(ids, routed["ids"])))
        if split:
            self._step_tasks.append(_BACKGROUND.submit(
                lambda: (step([~read for read in routed["reads"]]), 0.0)))

    def collect_grads(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Sum the row gradients of this step's micro-batches per id, send them to the owners.
        Returns the owned rows (local indices) with gradients and, per layer, those gradients
        summed over every rank and micro-batch. Collective over the data-parallel group."""
        if self.prefetched is not None:
            raise RuntimeError("a prefetched STEM micro-batch was never used: prefetch must not "
                               "cross an optimizer step")
        self.microbatch = 0
        widths = self.widths
        if self._pending:
            ids = torch.cat([u for u, _ in self._pending])
            grads = []
            for i, width in enumerate(widths):
                parts = [leaves[i].grad if leaves[i].grad is not None
                         else torch.zeros(u.numel(), width, device=self.device)
                         for u, leaves in self._pending]
                grads.append(torch.cat(parts).float())
            unique, inverse = torch.unique(ids, return_inverse=True)
            inverse = inverse.to(grads[0].device)
            summed = [torch.zeros(unique.numel(), g.shape[1], device=g.device).index_add_(
                0, inverse, g) for g in grads]
        else:
            unique = torch.empty(0, dtype=torch.long)
            summed = [torch.zeros(0, w, device=self.device) for w in widths]
        self._pending.clear()
        for layer in self.layers:
            layer.release_rows()
        route = self.exchange.route(unique)
        self.stats["grad_rows_out"] += route.rows_in
        self.stats["grad_rows_in"] += route.rows_out
        return self.exchange.push(route, summed)



class _Background:
    """The process's one background thread for managed tables (and, on a GPU, its side stream)."""

    def __init__(self):
        self._executor = None
        self.stream = None
        self._pending = []  # futures not yet waited for (tasks run in order)

    def submit(self, fn, token_ids: Optional[torch.Tensor] = None):
        """Queue ``fn()``; on a GPU it runs on the side stream, after the work queued so far on
        the current stream (which produced ``token_ids``, if given)."""
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stem-tables")
            if torch.cuda.is_available():
                self.stream = torch.cuda.Stream()
        task = fn
        if self.stream is not None:
            # What the task reads (the ids, the gradients) was produced on the compute stream:
            # the side stream must not read it before that work is done.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
            if token_ids is not None and token_ids.is_cuda:
                token_ids.record_stream(self.stream)
            stream = self.stream

            def task():
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    return fn()

        # Kept until waited for: finished tasks only if they failed (their error is re-raised).
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        future = self._executor.submit(task)
        self._pending.append(future)
        return future

    def wait(self) -> None:
        """Wait for every task submitted so far; re-raises the first error among them."""
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            if error is not None:
                raise error


_BACKGROUND = _Background()
_PREFETCH_GROUP = None


def prefetch_process_group():
    """A second copy of this rank's data-parallel group, for the prefetch thread's collectives.
    Collective over all ranks (every rank calls it, once; later calls return the cached group)."""
    global _PREFETCH_GROUP
    if _PREFETCH_GROUP is None:
        from megatron.core import parallel_state

        mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        groups = sorted({tuple(r) for r in everyone})
        _PREFETCH_GROUP, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return _PREFETCH_GROUP


def chunk_stem_layers(model) -> List:
    """The STEM MLPs of one model chunk with managed tables, in layer order."""
    from megatron_ext.stem.mlp import StemMLP

    return [m for m in model.modules() if isinstance(m, StemMLP) and m.managed]
