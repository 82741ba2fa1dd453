"""The process's one worker thread for managed STEM tables: host work only.

What runs here reads or writes the tables' rows and optimizer state in host memory (and, on a GPU,
queues copies and the GPU tier's row updates on a side stream): gathering the rows a micro-batch
needs into a pinned buffer, the table step (``RowAdamW``). It never issues a collective: every
``torch.distributed`` call of the tables (routing ids, sending rows, pushing gradients) is made by
the training thread, in the same program order on every rank, so the tables' collectives and
Megatron's never interleave differently on two ranks (``tests/test_parallel_stem_tables.py`` checks it).

Tasks run one at a time in submission order, which is the training thread's program order: a
row read submitted after a table step sees the step. One worker serves every model chunk of the
process (an interleaved pipeline gives a rank several chunks with tables).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

import torch


class HostWorker:
    def __init__(self):
        self._executor: Optional[ThreadPoolExecutor] = None
        self.stream = None
        self._pending: List[Future] = []  # futures not yet waited for (tasks run in order)

    def submit(self, fn: Callable) -> Future:
        """Queue ``fn()``. On a GPU it runs on the side stream, after the work queued so far on
        the current stream (which produced what it may read: the step's gradients)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stem-worker")
            if torch.cuda.is_available():
                self.stream = torch.cuda.Stream()
        task = fn if self.stream is None else _on_stream(fn, self.stream)

        # Kept until waited for: finished tasks only if they failed (their error is re-raised).
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        future = self._executor.submit(task)
        self._pending.append(future)
        return future

    def wait(self) -> float:
        """Wait for every task submitted so far; re-raises the first error among them. Returns the
        seconds waited."""
        start = time.perf_counter()
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            if error is not None:
                raise error
        return time.perf_counter() - start


def _on_stream(fn: Callable, stream) -> Callable:
    """``fn`` run on ``stream``, after the work queued so far on the current stream."""
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream())

    def task():
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            return fn()

    return task


WORKER = HostWorker()
