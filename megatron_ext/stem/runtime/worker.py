"""The worker thread of a training's managed STEM tables: host work only.

What runs here reads or writes the tables' rows and optimizer state in host memory (and, on a GPU,
queues copies and the GPU tier's row updates on a side stream): gathering the rows a micro-batch
needs into a pinned buffer, the table step (``RowAdamW``). It never issues a collective: every
``torch.distributed`` call of the tables (routing ids, sending rows, pushing gradients) is made by
the training thread, in the same program order on every rank, so the tables' collectives and
Megatron's never interleave differently on two ranks (``tests/test_parallel_stem_tables.py`` checks it).

Two lanes, one thread. ``submit`` tasks run one at a time in submission order, which is the
training thread's program order: a row read submitted after a table step sees the step.
``submit_background`` jobs (the part of a sparse table step that no read waits for) run in
chunks whenever no submitted task waits, so a row read submitted later runs before the rest of
the job instead of behind all of it; the store it reads settles the rows that read needs first
(``stem/runtime/store.py``, ``owed_step``), so it still sees the step. One worker serves every model
chunk of a training (an interleaved pipeline gives a rank several chunks with tables): the
training's ``StemRun`` (``stem/run.py``) owns it and closes it when the training ends.

The GIL. The worker's host work is mostly compiled code that releases the GIL (the row kernels,
PyTorch's ops), but each return into Python must take the GIL back, and a thread that holds it
running Python (the training thread on a GPU, launching the model's kernels) hands it over only
when it blocks or after Python's switch interval, 5 ms by default. A sparse table step of one
chunk takes it back a few times, so beside a Python-bound thread its 2 ms became 9 and a clock
window of about 20 small ops became 99 ms (probes on the development machine); the chunked
schedule with a training thread running Python took 1.29x its compute against 1.11x with the
worker's interval (``benchmarks/stem_worker_schedule.py --training-thread python``). So when the
worker starts it lowers the process's switch interval
to its own (``--stem-gil-switch-ms``; 0 leaves Python's own): the training thread
then yields within that time when the worker waits, and nothing changes while it does not.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, List, Optional

import torch

logger = logging.getLogger(__name__)

# The switch interval the worker sets when it starts (seconds; 0: Python's own). 0.2 ms: see the
# module's docstring and docs/benchmarks.md (stem_worker_schedule, --training-thread python).
DEFAULT_SWITCH_INTERVAL_S = 2e-4


def check_switch_interval(seconds: float) -> float:
    """``seconds`` as a GIL switch interval for the worker (``--stem-gil-switch-ms`` / 1e3);
    0 leaves Python's own."""
    if not seconds >= 0.0:
        raise ValueError(f"the GIL switch interval must be >= 0 seconds (0: Python's own), got "
                         f"{seconds}")
    return float(seconds)


class HostWorker:
    """One training's host worker (``StemRun`` makes it; ``close`` ends its thread)."""

    def __init__(self, switch_interval_s: float = DEFAULT_SWITCH_INTERVAL_S):
        self.switch_interval_s = check_switch_interval(switch_interval_s)
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self.stream = None
        self._cond = threading.Condition()
        self._tasks: collections.deque = collections.deque()       # (future, fn)
        self._background: collections.deque = collections.deque()  # (future, job, ready)
        self._pending: List[Future] = []  # futures not yet waited for

    def _side_stream(self):
        """The worker's CUDA side stream (made on first use), or None without CUDA."""
        if torch.cuda.is_available() and self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def set_switch_interval(self, seconds: float) -> None:
        """The GIL switch interval this worker sets when it starts; applied at once if it
        runs."""
        self.switch_interval_s = check_switch_interval(seconds)
        if self.running:
            self._apply_switch_interval()

    def _apply_switch_interval(self) -> None:
        """Lower the process's GIL switch interval to the worker's (never raise it: whoever set a
        shorter one keeps it)."""
        target = self.switch_interval_s
        if target > 0.0 and sys.getswitchinterval() > target:
            logger.info("STEM host worker: GIL switch interval %.3g ms -> %.3g ms",
                        1e3 * sys.getswitchinterval(), 1e3 * target)
            sys.setswitchinterval(target)

    def _start(self) -> None:
        if self._closing:
            raise RuntimeError("the STEM host worker of a finished training got new work")
        if not self.running:
            self._side_stream()
            self._apply_switch_interval()
            self._thread = threading.Thread(target=self._run, name="stem-worker", daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def close(self) -> None:
        """Wait for the queued work (raising the first failure, as ``wait``), then end the
        thread. A closed worker takes no more work."""
        try:
            self.wait()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify()
            if self._thread is not None:
                self._thread.join()
            _LIVE.discard(self)

    def _keep(self, future: Future, name: str) -> Future:
        # Kept until waited for: finished tasks only if they failed (their error is re-raised).
        future.task_name = name  # named in the report of a failure (wait)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(future)
        return future

    def submit(self, fn: Callable, after=None) -> Future:
        """Queue ``fn()``, after every task queued before it and before the rest of any
        background job. On a GPU it runs on the side stream, after the work queued so far on the
        current stream (which produced what it may read: the step's gradients), or only after
        ``after``, an event of it recorded earlier, when what it reads was made by then."""
        future: Future = Future()
        with self._cond:
            self._start()
            task = fn if self.stream is None else _on_stream(fn, self.stream, after)
            self._tasks.append((future, task))
            self._cond.notify()
        return self._keep(future, _task_name(fn))

    def submit_background(self, job, after=None) -> Future:
        """Queue ``job``: ``job.run_chunk()`` is called, when no task waits, until it returns
        True; the future then holds ``job.result()``. Jobs run one after the other, in order.
        On a GPU its chunks run on the side stream after ``after`` as ``submit``'s tasks do."""
        future: Future = Future()
        with self._cond:
            self._start()
            ready = None
            if self.stream is not None:
                ready = after if after is not None else mark()
            self._background.append((future, job, ready))
            self._cond.notify()
        return self._keep(future, f"{type(job).__name__} (background)")

    def _run(self) -> None:
        _name_os_thread(b"stem-worker")
        while True:
            with self._cond:
                while not self._tasks and not self._background:
                    if self._closing:
                        return
                    self._cond.wait()
                if self._tasks:
                    future, task = self._tasks.popleft()
                    job = None
                else:
                    future, job, ready = self._background[0]
            if job is None:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(task())
                    except BaseException as exc:
                        future.set_exception(exc)
                continue
            try:
                if self.stream is None:
                    finished = job.run_chunk()
                else:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        finished = job.run_chunk()
                result = job.result() if finished else None
            except BaseException as exc:
                finished, result = True, exc
            if finished:
                with self._cond:
                    self._background.popleft()
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def hand_over(self, tensors) -> None:
        """``tensors``, made on the current stream, are read by work submitted next, on the side
        stream: their memory is not reused before that work has run on the GPU (the caching
        allocator frees a block for its own stream only; ``Tensor.record_stream``)."""
        stream = self._side_stream()
        if stream is None:
            return
        for x in tensors:
            if x.is_cuda:
                x.record_stream(stream)

    def wait(self) -> float:
        """Wait for every task and job submitted so far, failed ones or not. On a GPU, the
        current stream's later work also waits for what they queued on the side stream (a read
        of the GPU tier after ``wait`` sees its last step). Returns the seconds waited. If tasks
        failed, raises the first one's error, with a note naming each of the others (which are
        also logged, with their tracebacks): none is dropped."""
        start = time.perf_counter()
        pending, self._pending = self._pending, []
        failed = [(future, future.exception()) for future in pending]  # waits for each
        failed = [(future, error) for future, error in failed if error is not None]
        if failed:
            first = failed[0][1]
            others = failed[1:]
            for future, error in others:
                logger.error("STEM host worker: task %s failed too: %s: %s",
                             future.task_name, type(error).__name__, error, exc_info=error)
            if others:
                first.add_note(f"{len(others)} more STEM host task(s) failed: " + "; ".join(
                    f"{future.task_name}: {type(error).__name__}: {error}"
                    for future, error in others))
            raise first
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        return time.perf_counter() - start


def _task_name(fn: Callable) -> str:
    """What a failure report calls a submitted function (its qualified name)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread ``name`` (at most 15 bytes) where the OS keeps thread names
    (Linux): profilers (PyTorch's traces name host threads by it), ``top -H`` and debuggers then
    tell the worker from the training thread. Python's own thread name stays in Python."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def mark():
    """An event recorded on the current CUDA stream now (None without CUDA): what a later
    ``submit(..., after=)`` needs to have run first."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def _on_stream(fn: Callable, stream, after=None) -> Callable:
    """``fn`` run on ``stream``, after ``after`` or the work queued so far on the current
    stream."""
    ready = after if after is not None else mark()

    def task():
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            return fn()

    return task


# The workers whose thread runs. Module-level because the exit hook below must reach a training's
# worker that was not closed (its thread is a daemon): a run that ends without its session's
# close still has its queued host work finished, or its failure logged.
_LIVE: "weakref.WeakSet[HostWorker]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    """Let queued host work end before the interpreter does (the thread is a daemon). A task
    that failed after the last wait has nobody left to raise its error to: it is logged here
    (every failure, ``HostWorker.wait``), not dropped."""
    for worker in list(_LIVE):
        try:
            worker.wait()
        except BaseException as exc:
            logger.error("STEM host worker: a task failed after the training's last wait: "
                         "%s: %s", type(exc).__name__, exc, exc_info=exc)


atexit.register(_finish_at_exit)
