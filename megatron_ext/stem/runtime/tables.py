"""Managed STEM tables of one model chunk (``--stem-table-placement cpu|tiered`` and/or
``--stem-table-sharding vocab``): the rows a rank holds of every STEM layer of the chunk, outside
Megatron's parameters, and the way a micro-batch's rows travel.

One direction through the modules:

* rows: ``store`` (``stem/runtime/store.py``: the owned rows, read by host work) -> ``exchange``
  (``stem/runtime/exchange.py``: ids routed to their owners, rows sent back; collectives) -> the layers
  (``stem/runtime/binding.py``: leaves in a ``FetchedRows``, which the forward step passes to the model
  and the model to its layers in the block context);
* gradients: the layers (``binding.collect``) -> ``exchange.push`` (summed at the owners: the
  data-parallel reduction of the tables) -> the optimizer (``stem/runtime/optimizer.py``) -> the
  store (rows stepped in place).

A fetch has three parts: ``start_fetch`` (training thread: deduplicate the micro-batch's ids once
for all layers of the chunk, route them: a collective), the owners' read of the rows asked of
them (host work on the worker thread, ``stem/runtime/worker.py``, queued after every table step submitted
before it, so it sees them), and ``finish_fetch`` (training thread: wait for that read, send the
rows back: a collective, and return them as leaves). Every collective is issued by the training thread in
program order, the same on every rank; the worker never issues one.

The data read-ahead (``stem/runtime/read_ahead.py``, the family's ``take_batch`` the forward step
calls): with ``--stem-prefetch`` it reads micro-batch ``m + 1`` while ``m`` computes and starts
its fetch, so the owners' reads run in the background. Read-ahead never crosses an optimizer step except for the next step's first
micro-batch, whose rows are read only after its table step (``deferred``: the optimizer releases
the read after stepping the rows it reads, then steps the rest while the next step computes). So
a row updated at step ``i`` is read with that update at step ``i + 1``, and the numbers are those
of a synchronous fetch and step.

Table values are drawn exactly as for an ordinary STEM parameter (same initialiser, same RNG
stream: the full ``[vocab, F/tp]`` table of this TP rank), then the owned rows are kept, so every
placement and sharding starts from the same numbers.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_ext.models.token_ids import FetchedRows
from megatron_ext.stem.runtime import checkpoint
from megatron_ext.stem.runtime.binding import RowBinding
from megatron_ext.stem.runtime.exchange import ReplicatedExchange, Route, VocabExchange
from megatron_ext.stem.runtime.ownership import RowOwnership, TieredOwnership
from megatron_ext.stem.runtime.read_ahead import TableReadAhead
from megatron_ext.stem.runtime.store import TableStore
from megatron_ext.stem.runtime.transfer import to_device
from megatron_ext.stem.runtime.worker import HostWorker


@dataclass
class LayerTable:
    """What the runtime knows of one STEM layer's table: the layer (its global 1-based number,
    the key of its rows in ``FetchedRows``), the drawn values of this rank's rows, the model's
    dtype, and the table's global rows and tensor-parallel split (its checkpoint blocks)."""
    layer_number: int
    initial: object  # the drawn rows (stem/initial_rows.py InitialRows) or a whole table
    dtype: torch.dtype
    vocab_size: int
    tp_rank: int = 0
    tp_size: int = 1


@dataclass
class Fetch:
    """One micro-batch's fetch between ``start_fetch`` and ``finish_fetch``."""
    unique: torch.Tensor           # the micro-batch's unique ids, on the host
    inverse: torch.Tensor          # [s, b] index of each token into ``unique``
    route: Route
    ahead: bool                    # started while another micro-batch computes (prefetch)
    served: Optional[Future] = None  # the owners' read: (rows, event, seconds), once submitted


class StemTables:
    """The managed tables of one model chunk. ``stem``: the table options (``placement``,
    ``sharding``, ``ownership``, ``prefetch``, ``host_huge_pages``, ``host_read``: the fields of
    the model side's ``StemConfig``, read here without importing it); ``worker``: the
    training's host worker (``StemRun``)."""

    def __init__(self, layers: Sequence[LayerTable], stem, vocab_size: int,
                 dp_group, worker: HostWorker, device: Optional[torch.device] = None,
                 hot_mask: Optional[torch.Tensor] = None, host_group=None):
        self.layers = list(layers)
        self.vocab_size = vocab_size
        self.worker = worker  # the training's host worker (``StemRun``), shared by its chunks
        self.dp_rank = dist.get_rank(dp_group)
        self.dp_size = dist.get_world_size(dp_group)
        cuda = torch.cuda.is_available()
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if cuda
                                 else torch.device("cpu"))
        self.prefetch = stem.prefetch
        self.tiered = stem.placement == "tiered"  # always vocab-sharded (StemConfig checks)
        num_hot = None
        if stem.sharding == "vocab":
            self.ownership = RowOwnership(vocab_size, self.dp_size, stem.ownership)
            if self.tiered:  # the same owners; each rank numbers its hot rows first
                if hot_mask is None:
                    raise ValueError("--stem-table-placement tiered needs the GPU tier's rows")
                self.ownership = TieredOwnership(self.ownership, hot_mask, self.dp_rank)
                num_hot = self.ownership.num_hot
            self.exchange = VocabExchange(self.ownership, dp_group, host_group)
            self.owned_ids = self.ownership.owned_ids(self.dp_rank)
        else:
            self.ownership = None
            self.exchange = ReplicatedExchange(vocab_size, dp_group)
            self.owned_ids = torch.arange(vocab_size)
        self.store = TableStore([layer.initial for layer in self.layers],
                                self.owned_ids, stem.placement, self.device, num_hot,
                                huge_pages=stem.host_huge_pages,
                                host_read=getattr(stem, "host_read", "staged"))
        for layer in self.layers:
            layer.initial = None  # the store holds the values now
        self.binding = RowBinding([layer.layer_number for layer in self.layers])
        # Rows travel in the model's 16-bit dtype when it has one (the layers cast them to it,
        # so what they compute is the same).
        dtype = self.layers[0].dtype if self.layers else torch.float32
        self.wire_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        # Host rows (the host tier of tiered ones) step on the CPU: with prefetch, that step
        # overlaps the next step (the forward step reads that step's first micro-batch ahead).
        self.overlap = stem.prefetch and self.store.on_host
        self.deferred: Optional[Fetch] = None  # started; its read waits for the table step
        self._open = 0  # fetches started and not finished
        self._step_routes: List[Route] = []  # of the fetches whose gradients the step pushes
        # Checkpoints: each layer's row blocks as the model's sharded state dict last gave them
        # (the optimizer state reuses their keys and offsets), and the state-dict key of each
        # layer's blocks (``take_loaded``).
        self.checkpoint_blocks: List[Optional[Dict[int, object]]] = [None] * len(self.layers)
        self._block_keys: Dict[str, int] = {}
        # The forward step's read-ahead of this chunk's micro-batches (the family's take_batch).
        self.read_ahead = TableReadAhead(self)
        self.stats = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        """Counters since the last reset (per iteration: the training-log hook resets them)."""
        self.stats = {"unique_rows": 0, "fetch_rows_in": 0, "fetch_rows_out": 0,
                      "fetch_rows_host": 0, "grad_rows_out": 0, "grad_rows_in": 0,
                      "grad_rows_host": 0, "fetch_seconds": 0.0,
                      "fetch_seconds_hidden": 0.0, "optimizer_seconds": 0.0,
                      "optimizer_seconds_exposed": 0.0, "optimizer_seconds_before_fetch": 0.0,
                      "optimizer_seconds_grad_wait": 0.0}

    @property
    def shards(self) -> List:
        return self.store.shards

    @property
    def widths(self) -> List[int]:
        return self.store.widths

    @property
    def row_bytes(self) -> int:
        """Bytes of one fetched row of every layer (they travel together)."""
        return sum(self.widths) * self.wire_dtype.itemsize

    @property
    def grad_row_bytes(self) -> int:
        return sum(self.widths) * 4  # gradients travel in fp32

    def host_bytes(self) -> int:
        return self.store.host_bytes()

    # -- rows: store -> exchange -> layers ------------------------------------------------------
    def start_fetch(self, token_ids: torch.Tensor, ahead: bool = False,
                    after_step: bool = False) -> Fetch:
        """Deduplicate ``token_ids`` ([b, s], as the batch has them) and route the unique ids to
        their owners (collective over the data-parallel group), then queue the owners' read of
        the rows on the worker, unless ``after_step``: the read waits for the next table step,
        which releases it (``release``)."""
        start = time.perf_counter()
        with record_function("stem/start-fetch"):  # profiler traces: the tables' own ranges
            # Host ids (the batch's host copy, ``training/batch.py``): deduplicating them on the
            # GPU and reading the result back would wait for every kernel queued before.
            ids = token_ids.cpu() if token_ids.is_cuda else token_ids
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            inverse = to_device(inverse.view(ids.shape).t().contiguous(), self.device)
            fetch = Fetch(unique, inverse, self.exchange.route(unique), ahead)
        self._open += 1
        if after_step:
            if self.deferred is not None:
                raise RuntimeError("a STEM fetch already waits for the table step")
            self.deferred = fetch
        else:
            self.release(fetch)
        self.stats["fetch_seconds"] += time.perf_counter() - start
        return fetch

    def release(self, fetch: Fetch, after=None) -> None:
        """Queue the owners' read of ``fetch``'s rows on the worker (after what is queued; on a
        GPU, its copies after ``after``, an event of the current stream, when given)."""
        if self.deferred is fetch:
            self.deferred = None
        route, store = fetch.route, self.store
        device = self.exchange.serve_device(self.device)
        dtype = self.wire_dtype

        def read():
            start = time.perf_counter()
            with record_function("stem/read-rows"):
                served = store.gather(route.requested, device, dtype)
                event = None
                if served.is_cuda:  # queued on the worker's side stream
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream())
            return served, event, time.perf_counter() - start

        fetch.served = self.worker.submit(read, after=after)

    def finish_fetch(self, fetch: Fetch) -> FetchedRows:
        """Wait for the owners' read, send the rows to the ranks that asked (collective over the
        data-parallel group); returns them for the layers."""
        start = time.perf_counter()
        if fetch.served is None:  # deferred, and the table step did not run (skipped): read now
            self.release(fetch)
        with record_function("stem/wait-read"):  # the training thread waits for the worker
            served, event, took = fetch.served.result()
        waited = time.perf_counter() - start
        with record_function("stem/finish-fetch"):
            if event is not None:
                current = torch.cuda.current_stream()
                current.wait_event(event)
                served.record_stream(current)
            rows = self.exchange.send_rows(fetch.route, served, self.widths, self.device)
            fetched, kept = self.binding.bind(fetch.unique, rows, fetch.inverse)
            if kept:  # their gradients: a push
                self._step_routes.append(fetch.route)
        self._open -= 1
        self.stats["unique_rows"] += fetch.unique.numel()
        self.stats["fetch_rows_in"] += fetch.route.rows_in
        self.stats["fetch_rows_out"] += fetch.route.rows_out
        self.stats["fetch_rows_host"] += self.store.host_rows(fetch.route.requested)
        self.stats["fetch_seconds"] += time.perf_counter() - start
        if fetch.ahead:  # the part of the read the training thread did not wait for
            self.stats["fetch_seconds_hidden"] += max(took - waited, 0.0)
        return fetched

    def fetch_now(self, token_ids: torch.Tensor) -> FetchedRows:
        """Fetch synchronously (evaluation, a step's first micro-batch without read-ahead,
        ``--no-stem-prefetch``, conversions). Collective over the data-parallel group."""
        return self.finish_fetch(self.start_fetch(token_ids))

    # -- checkpoints (the model's sharded_state_dict / load_state_dict, stem/runtime/checkpoint.py) -----
    def sharded_blocks(self, layer_number: int, key: str, sharded_offsets: tuple,
                       dtype: torch.dtype) -> dict:
        """The row blocks of layer ``layer_number``'s table this rank writes, as ShardedTensors
        under the model's ``key`` (``<prefix>table``) and offsets, in ``dtype``: what the layer's
        ``sharded_state_dict`` returns (``{key.block<b>: tensor}``). Collective over the
        data-parallel group."""
        index = self._index_of(layer_number)
        layer = self.layers[index]
        blocks = {}
        for block, rows in checkpoint.table_blocks(self, index):
            blocks[block] = checkpoint.block_sharded_tensor(
                key, rows.to(dtype), block, layer.vocab_size, sharded_offsets, layer.tp_rank,
                layer.tp_size)
        self.checkpoint_blocks[index] = blocks
        self._block_keys[f"{key}.block"] = index
        return {f"{key}.block{block}": tensor for block, tensor in blocks.items()}

    def take_loaded(self, state_dict: dict) -> dict:
        """Write the loaded row blocks of every layer (keys given by ``sharded_blocks``) into the
        owners' stores, in layer order (collective over the data-parallel group); returns the
        rest of ``state_dict``."""
        rest = dict(state_dict)
        by_layer: Dict[int, Dict[int, torch.Tensor]] = {}
        for marker, index in self._block_keys.items():
            keys = [k for k in rest if k.startswith(marker) and k[len(marker):].isdigit()]
            if keys:
                by_layer[index] = {int(k[len(marker):]): rest.pop(k) for k in keys}
        for index in sorted(by_layer):
            checkpoint.load_table(self, index, by_layer[index])
        return rest

    def _index_of(self, layer_number: int) -> int:
        for index, layer in enumerate(self.layers):
            if layer.layer_number == layer_number:
                return index
        raise KeyError(f"layer {layer_number} has no managed STEM table here "
                       f"(layers {[layer.layer_number for layer in self.layers]})")

    # -- gradients: layers -> exchange -> optimizer ---------------------------------------------
    def collect_grads(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Sum the row gradients of this step's micro-batches per id, send them to the owners.
        Returns the owned rows (local indices) with gradients and, per layer, those gradients
        summed over every rank and micro-batch. Collective over the data-parallel group."""
        if self._open != (self.deferred is not None):  # only the next step's first may be open
            raise RuntimeError("a STEM micro-batch read ahead was never used: read-ahead must "
                               "not cross an optimizer step")
        unique, summed = self.binding.collect(self.widths, self.device)
        # The union of the step's fetches: both sides of its route are known (no collective).
        route = self.exchange.union_route(unique, self._step_routes)
        self._step_routes = []
        self.stats["grad_rows_out"] += route.rows_in
        self.stats["grad_rows_in"] += route.rows_out
        rows, grads = self.exchange.push(route, summed)
        self.stats["grad_rows_host"] += self.store.host_rows(rows)
        return rows, grads
