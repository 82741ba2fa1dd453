"""The schedule of the managed tables' steps on the host worker: ``TableSteps`` runs each
iteration's row steps (``stem/runtime/worker.py``), overlapping the next training step: first the
rows the next step's first micro-batch reads, then that micro-batch's read is released
(``StemTables.release``), then the other rows (``OwedStep``: the sparse step left with the store,
run in chunks, every read settling the rows it needs first). Every later read of the rows is
queued behind the step, so it sees it. The optimizer (``stem/runtime/optimizer.py``) hands it
each iteration's final row gradients.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.profiler import record_function

from megatron_ext.stem.runtime.tiers import TierGrads, grad_tensors, take_layers


class OwedStep:
    """The part of a sparse table step not run yet, kept by the store (``TableStore.owed_step``).

    ``step(positions)`` steps the rows at ``positions`` (one index tensor per shard) of the step's
    gradients. A read of the store first steps the rows it reads (``settle``); the worker runs
    the rest in chunks of about ``CHUNK_ELEMENTS`` row elements (``run_chunk``), so a read
    queued meanwhile waits for one chunk, not for the whole step. Every row is stepped once,
    whichever comes first: rows step independently (each is brought up to date from its own last
    step), so the numbers are those of one step of every row. Used on the worker thread only."""

    CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 rows: a few milliseconds of CPU AdamW
    # The GPU tier's rows per chunk (``queued``): 128 MiB of fp32 rows, each of the step's ten or
    # so temporaries on the GPU that size.
    QUEUED_ELEMENTS = 1 << 25

    def __init__(self, step: Callable, rows: Sequence[torch.Tensor], widths: Sequence[int],
                 queued: Optional[Sequence[int]] = None):
        self._step = step
        self.rows = list(rows)
        self.widths = list(widths)
        # The leading positions of each shard whose step the host only queues (the GPU tier's
        # rows: their step is a few kernel launches whatever their number): the first chunk takes
        # them all, outside the budget, so the GPU tier steps in one go, not once per chunk.
        self.queued = list(queued) if queued is not None else [0] * len(self.rows)
        # The layers of a chunk step the same rows (the same tokens touch them): those share one
        # tensor of rows and of positions left, so a read looks its rows up once, not per layer
        # (``_per_rows``; ``tiers.split_layers`` gives them one tensor already).
        for i in range(1, len(self.rows)):
            r, first = self.rows[i], self.rows[0]
            if r is not first and r.shape == first.shape and \
                    r.device.type == first.device.type == "cpu" and torch.equal(r, first):
                self.rows[i] = first
        left = {}
        for r in self.rows:
            if id(r) not in left:
                left[id(r)] = torch.arange(r.numel())
        self.left = [left[id(r)] for r in self.rows]
        self.seconds = 0.0            # every part's step time
        self.seconds_in_reads = 0.0   # the parts reads waited for (on a read's path)
        self.store = None             # the store that keeps it, until it is done

    def _run(self, positions) -> float:
        if not any(p.numel() for p in positions):
            return 0.0
        took = self._step(positions)
        self.seconds += took
        return took

    def settle(self, local_rows: torch.Tensor) -> None:
        """Step the rows of ``local_rows`` not stepped yet."""
        def split(rows, left):
            if left.numel() == 0:
                return left, left
            hit = torch.isin(rows[left], local_rows)
            return left[hit], left[~hit]

        positions, self.left = self._per_rows(split)
        self.seconds_in_reads += self._run(positions)

    def _per_rows(self, split: Callable) -> Tuple[list, list]:
        """``split(rows, left) -> (positions to step, positions left)`` per shard, called once
        for shards that share their rows and positions left (the outputs shared alike)."""
        done, positions, left = {}, [], []
        for rows, remaining in zip(self.rows, self.left):
            key = (id(rows), id(remaining))
            if key not in done:
                done[key] = split(rows, remaining)
            positions.append(done[key][0])
            left.append(done[key][1])
        return positions, left

    def run_chunk(self) -> bool:
        """Step the next chunk of rows; True once every row is stepped."""
        # Shards that share their rows and positions left take the same positions (their
        # widths summed against the budget), so they keep sharing them.
        widths, queued = {}, {}
        for rows, left, width, q in zip(self.rows, self.left, self.widths, self.queued):
            key = (id(rows), id(left))
            widths[key] = widths.get(key, 0) + width
            queued[key] = min(queued.get(key, q), q)  # shards sharing positions take the same
        budget, taken = self.CHUNK_ELEMENTS, False

        def split(rows, left):
            nonlocal budget, taken
            key = (id(rows), id(left))
            width = widths[key]
            # Positions left ascend (a read's settle keeps their order): the queued ones lead,
            # within their own budget (the GPU memory of the step's temporaries).
            free = int(torch.searchsorted(left, queued[key])) if queued[key] else 0
            if free:
                n = min(free, max(self.QUEUED_ELEMENTS // max(width, 1), 1))
                if n < free:
                    taken = True
                    return left[:n], left[n:]
            n = free + min(left.numel() - free, max(budget // max(width, 1), 0))
            if n == 0 and left.numel() and not taken:
                n = 1  # progress whatever the width
            taken = taken or n > 0
            budget -= n * width
            return left[:n], left[n:]

        positions, self.left = self._per_rows(split)
        self._run(positions)
        if self.done and self.store is not None and self.store.owed_step is self:
            self.store.owed_step = None
        return self.done

    @property
    def done(self) -> bool:
        return not any(left.numel() for left in self.left)

    def finish(self) -> None:
        while not self.run_chunk():
            pass

    def result(self) -> Tuple[float, float]:
        """(seconds of the whole step, seconds of it that reads waited for), as the table
        step's tasks report them."""
        return self.seconds, self.seconds_in_reads


def _groups(keys: Sequence) -> List[List[int]]:
    """The indices of ``keys`` grouped by equal key, in order of first appearance."""
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _within_first(grads: Sequence, positions: torch.Tensor) -> bool:
    """Whether the rows at ``positions`` of every one of ``grads`` need no host gradient beyond
    those copied first (``TierGrads.within_first``), asked once where they all split alike."""
    if not all(isinstance(g, TierGrads) for g in grads):
        return False
    if all(g.num_hot == grads[0].num_hot and g.cold_first == grads[0].cold_first for g in grads):
        return grads[0].within_first(positions)
    return all(g.within_first(positions) for g in grads)


class TableSteps:
    """The row steps of each iteration's tables as they run, and the wait for them: what
    ``StemTablesOptimizer`` does with an iteration's row gradients once they are final (its
    ``step_with_ready_grads``), apart from Megatron's optimizer, so that it runs alone as well
    (``benchmarks/stem_worker_schedule.py``, tests). ``mode``: ``--stem-optimizer``."""

    def __init__(self, mode: str, worker):
        self.mode = mode
        self.worker = worker  # the training's host worker (stem/runtime/worker.py)
        # (table, future of (seconds, seconds before its read), the step's gradient waits), not
        # waited for yet
        self.tasks = []

    def drain(self, tables: Sequence) -> None:
        """Wait for the tables' host work (the last step's rows, reads queued behind it). The
        waited time counts as exposed optimizer time (once, on the first of ``tables``); the
        background steps' own times are counted now, with the iteration they overlapped."""
        waited = self.worker.wait()
        if tables:  # one wait for every chunk: counted once
            tables[0].stats["optimizer_seconds_exposed"] += waited
        for t, done, grad_wait in self.tasks:
            took, before_read = done.result()
            t.stats["optimizer_seconds"] += took
            t.stats["optimizer_seconds_before_fetch"] += before_read
            t.stats["optimizer_seconds_grad_wait"] += grad_wait[0]
        self.tasks.clear()

    def step_table(self, t, adam, plan, grads, arrived, made=None) -> None:
        """Step one chunk's rows. Without a deferred read (no overlap), here and now. With one,
        on the worker. Dense steps every row in one pass, so its whole step precedes the read.
        Sparse leaves the step with the store (``OwedStep``) and runs it in the background in
        chunks; the deferred read, and every later read of this step, runs before the rest of it
        and steps the rows it needs first. ``made``: the event after which the GPU holds what
        they read (``worker.mark``), so their GPU work and copies overlap the model's step."""

        grad_wait = [0.0]  # seconds the step waited for its host gradients' copy (in its time)

        def step(positions=None):
            """Step the rows at ``positions`` (per shard; None: all) of ``grads``."""
            start = time.perf_counter()
            with record_function("stem/table-step"):
                if positions is not None:  # layers whose rows and positions are the same
                    groups = _groups([(id(r), id(p)) for (r, _), p in zip(grads, positions)])
                else:
                    groups = _groups([id(r) for r, _ in grads])
                if arrived is not None:  # the gradients are read only after their copy landed
                    # (those of the rows the next step's first micro-batch reads land first)
                    # (asked once for layers that split alike: the same positions, same answer)
                    first = positions is not None and all(
                        _within_first([grads[i][1] for i in group], positions[group[0]])
                        for group in groups)
                    with record_function("stem/wait-grads"):
                        (arrived.synchronize_first if first else arrived.synchronize)()
                    grad_wait[0] += time.perf_counter() - start
                items = []
                for layers in groups:
                    rows = grads[layers[0]][0]
                    layer_grads = [grads[i][1] for i in layers]
                    if positions is not None:  # layers sharing rows and positions: looked up
                        # once, each tier's gradients taken together (tiers.take_layers)
                        rows, layer_grads = take_layers(rows, layer_grads, positions[layers[0]])
                    if rows.numel() or self.mode != "sparse":
                        items.extend((i, rows, g) for i, g in zip(layers, layer_grads))
                items.sort(key=lambda item: item[0])
                step_shards = getattr(adam, "step_shards", None)
                if step_shards is not None:  # the layers together where it can (row_adam)
                    step_shards(items, plan)
                else:  # an optimizer of one shard at a time
                    for item in items:
                        adam.step_rows(*item, plan)
            return time.perf_counter() - start

        fetch = t.deferred
        if fetch is None:
            t.stats["optimizer_seconds_exposed"] += self.worker.wait()
            took = step()
            t.stats["optimizer_seconds"] += took
            t.stats["optimizer_seconds_exposed"] += took
            t.stats["optimizer_seconds_grad_wait"] += grad_wait[0]
            return
        # Read on the worker's side stream.
        self.worker.hand_over(x for _, g in grads for x in grad_tensors(g))
        if self.mode != "sparse":
            def whole():
                took = step()
                return took, took

            self.tasks.append((t, self.worker.submit(whole, after=made), grad_wait))
            t.release(fetch, after=made)
            return
        # The GPU tier's rows lead each tiered gradient's; on a GPU their step is only queued.
        queued = [g.num_hot if isinstance(g, TierGrads) and g.hot.device.type != "cpu" else 0
                  for _, g in grads]
        owed = OwedStep(step, [rows for rows, _ in grads], t.store.widths, queued)
        # The worker is idle for this store: the step drained it.
        owed.store, t.store.owed_step = t.store, owed
        t.release(fetch, after=made)
        self.tasks.append((t, self.worker.submit_background(owed, after=made), grad_wait))
