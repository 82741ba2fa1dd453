"""Every ``torch.distributed`` collective wrapped: a call from any thread but the training (main)
thread is reported (``THREAD GUARD: <op> from thread <name>``) and raises, and each rank reports
how many calls of each operation it saw (``THREAD GUARD CALLS rank R {...}``), so a test can tell a
clean run from one that made no calls.

``tests/dist/multi_config.py`` installs it for a launch whose plan has an item with
``"thread_guard": true`` (every training of that launch is then guarded) and reports each such
item's calls in its log. It must be installed before Megatron imports, so such launches are
exec'd, not forked from the preloaded server (``tests/multirank.py``, ``tests/rank_server.py``)."""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading

import torch.distributed as dist

# Every collective and point-to-point operation of torch.distributed that a training step, the
# tables, checkpoints or logging may issue.
OPS = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
       "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
       "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
       "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
       "monitored_barrier", "_all_gather_base", "_reduce_scatter_base"]

CALLS = collections.Counter()
MAIN = threading.main_thread()
_INSTALLED = False


def wrap(name, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        thread = threading.current_thread()
        if thread is not MAIN:
            print(f"THREAD GUARD: torch.distributed.{name} from thread {thread.name}",
                  file=sys.stderr, flush=True)
            raise RuntimeError(f"torch.distributed.{name} called from thread {thread.name}, "
                               "not the training thread")
        CALLS[name] += 1
        return fn(*args, **kwargs)

    return guarded


def install() -> None:
    """Wrap the operations (once per process). Before anything imports them by name."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed import distributed_c10d

    for op in OPS:
        if hasattr(dist, op):
            original = getattr(dist, op)
            guarded = wrap(op, original)
            setattr(dist, op, guarded)
            # P2POp accepts only c10d's own isend/irecv (a batched pipeline send passes
            # torch.distributed.isend), and batch_isend_irecv calls the op it was given.
            if getattr(distributed_c10d, op, None) is original:
                setattr(distributed_c10d, op, guarded)
    _INSTALLED = True


def report() -> None:
    """This rank's counts since the last report (each of a launch's trainings has its own)."""
    print(f"THREAD GUARD CALLS rank {os.environ.get('RANK', '0')} "
          f"{json.dumps(dict(sorted(CALLS.items())))}", flush=True)
    CALLS.clear()

