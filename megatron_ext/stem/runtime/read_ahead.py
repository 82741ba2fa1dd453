"""The data read-ahead of managed STEM tables: the family's ``take_batch`` hook
(``models/family.py``), which the forward step (``training/forward_step.py``) calls for every
micro-batch. Gives the micro-batch's rows (``FetchedRows``) for the model's forward
(``token_rows``) and, with ``--stem-prefetch``, starts the next micro-batch's fetch while this one
computes."""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Tuple

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megatron_ext.models.token_ids import FetchedRows, wrapped_attr


class TableReadAhead:
    """The data read-ahead of one model chunk with managed STEM tables (``stem/runtime/tables.py``).

    While training, with ``--stem-prefetch``: when micro-batch ``m`` of a step is taken, ``m + 1``
    is read from the data iterator and its rows' fetch started, so the owners read them while
    ``m`` computes. At the step's last micro-batch, if another step follows (``next_step``) and
    the tables step on the host (``tables.overlap``), the next step's first micro-batch is read
    and routed now and its rows are read after the table step (``after_step``). Read-ahead never
    crosses an optimizer step otherwise. Evaluation fetches synchronously and leaves what was
    read ahead for training."""

    def __init__(self, tables):
        # Weakly: the tables own their read-ahead, and a reference cycle would keep the tables
        # (host memory, their process groups) alive until the cyclic collector runs after their
        # model is gone.
        self._tables = weakref.ref(tables)
        self.next: Optional[tuple] = None  # (batch, Fetch) read ahead
        self.microbatch = 0  # training micro-batches taken in this step

    def take(self, read_batch: Callable[[], tuple], num_microbatches: int,
             next_step: bool) -> Tuple[tuple, FetchedRows]:
        """The micro-batch to run now (``read_batch()``'s tuple: the five tensors and the tokens'
        host copy) and its rows. Collective over the data-parallel group."""
        tables = self._tables()
        training = torch.is_grad_enabled()
        if training and self.next is not None:
            batch, fetch = self.next
            self.next = None
            fetched = tables.finish_fetch(fetch)
        else:
            batch = read_batch()
            fetched = tables.fetch_now(_ids(batch))
        if not training:
            return batch, fetched
        self.microbatch += 1
        if self.microbatch < num_microbatches:
            if tables.prefetch:
                upcoming = read_batch()
                self.next = (upcoming, tables.start_fetch(_ids(upcoming), ahead=True))
        else:
            self.microbatch = 0
            if tables.overlap and next_step:
                upcoming = read_batch()
                self.next = (upcoming, tables.start_fetch(_ids(upcoming), ahead=True,
                                                          after_step=True))
        return batch, fetched


def _ids(batch: tuple) -> torch.Tensor:
    """The micro-batch's token ids for routing: the host copy when the batch has one."""
    return batch[5] if len(batch) > 5 and batch[5] is not None else batch[0]


def take_batch(model, read_batch: Callable[[], tuple], args) -> Tuple[tuple, dict]:
    """The micro-batch the chunk ``model`` runs now and the model's keyword arguments for it.
    With managed tables on this stage, its rows (``token_rows``; with prefetch, the next
    micro-batch read and its rows' fetch started). The
    last micro-batch of a step may read the next step's first one (the overlapped table step)
    when a next step will run here: ``curr_iteration`` is the number of steps done before this
    one."""
    tables = wrapped_attr(model, "token_tables")
    if tables is None:  # ordinary tables, or no STEM layer on this stage
        return read_batch(), {}
    upcoming = args.curr_iteration + 1
    next_step = upcoming < args.train_iters and not (
        args.exit_interval and upcoming % args.exit_interval == 0)
    batch, fetched = tables.read_ahead.take(read_batch, get_num_microbatches(), next_step)
    return batch, {"token_rows": fetched}
