"""A synchronous ``torch_dist`` save collects its write results in the process, with no
``multiprocessing.Manager``.

Megatron-Core 0.19's synchronous save (``TorchDistSaveShardedStrategy.save``, what
``save_checkpoint`` runs without ``--async-save``) goes through its asynchronous writer
(``FileSystemWriterAsync``) and runs the write function in the training process
(``AsyncRequest.execute_sync``). The writer asks ``filesystem_async.get_write_results_queue()``
for the queue the write function puts its results in, and that starts, on a process's first
save, a ``multiprocessing.Manager`` server by ``spawn``: a fresh interpreter the first ``put``
waits for, ~2 s per rank (more on a busy machine), for results that never leave the process.
The queue exists for the asynchronous save, whose writer runs in another process.

Inside a synchronous save the writer gets a plain ``queue.Queue`` of its own: the same results
and errors (the write function's exception object itself, where the Manager passed a pickled
copy), read by the same ``retrieve_write_results``; the checkpoint's files are the same. An
asynchronous save, and any other caller, gets upstream's queue as before. Two rows of
``upstream_fixes.FIXES`` (``compat/seam.py`` assigns them): the strategy's ``save`` marks the
save synchronous for the thread that runs it, ``get_write_results_queue`` answers inside it.
"""

from __future__ import annotations

import contextvars
import functools
import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron_ext.compat.seam import Seam

# Set while a synchronous save runs in this thread (context).
_SYNCHRONOUS = contextvars.ContextVar("megatron_ext_synchronous_save", default=False)


def _marked_synchronous(original):
    """``TorchDistSaveShardedStrategy.save``: upstream's, marked synchronous while it runs."""

    @functools.wraps(original)
    def save(self, sharded_state_dict, checkpoint_dir):
        token = _SYNCHRONOUS.set(True)
        try:
            return original(self, sharded_state_dict, checkpoint_dir)
        finally:
            _SYNCHRONOUS.reset(token)

    return save


def _in_process_queue(original):
    """``get_write_results_queue``: a queue of this save's own inside a synchronous save (its
    writer and its reader are this process), upstream's Manager queue otherwise."""

    @functools.wraps(original)
    def get_write_results_queue(*args, **kwargs):
        if _SYNCHRONOUS.get():
            return queue.Queue()
        return original(*args, **kwargs)

    return get_write_results_queue


WHY = ("performance bug of megatron-core 0.19.2: a synchronous torch_dist save starts a spawned "
       "multiprocessing.Manager for results that stay in the process (~2 s per rank, every "
       "launch's first save); no option (the sync save runs the async writer)")

ROWS = (
    Seam(TorchDistSaveShardedStrategy, "save", _marked_synchronous, WHY),
    Seam(filesystem_async, "get_write_results_queue", _in_process_queue,
         WHY + "; FileSystemWriterAsync.prepare_write_data calls it by its module's name"),
)
