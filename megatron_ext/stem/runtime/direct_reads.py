"""The direct reads of host rows still queued on the GPU (``--stem-host-read direct``), and the
wait that every CPU write of those rows makes first.

The hazard. With the direct read (``stem/runtime/store.py``, ``kernels/host_rows.py``) a GPU
kernel reads rows straight from the page-locked host shards when the GPU gets to it, after the
gather that queued it has returned. A CPU write of the same host rows in the meantime (the table
step, a catch-up settled in place, a checkpoint load into the shard) would let the kernel read
the new values, or a row half written. The staged read has no such window: the CPU copies the
rows into its staging buffer before the gather returns.

So each direct read records an event on the stream it was queued on (the worker's side stream
or the current stream: two reads on two streams finish in either order, so a later read's event
says nothing of an earlier one's) and stamps the rows it read with its number; a write of rows
first waits for every read still pending up to the last one that read any of them (an earlier
read of one of them may have been stamped over by a later one: every pending read up to that
number is waited for). A write of rows that no pending read reads waits for nothing: the table
step's chunks that run while the next micro-batch's read is queued write only rows that read
does not read (``schedule.OwedStep``: a read steps its own rows first). Finished reads are
dropped at the next read (``Event.query``), so what is kept is the reads the GPU has not run yet.

On the CPU the read runs at once (Triton's interpreter): no event, nothing pending, nothing to
wait for."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def new_event():
    """The end of a direct read queued now, an event of the current stream when recorded; None
    without CUDA, where the read has run already. (Tests replace it with an event of their own.)"""
    return torch.cuda.Event() if torch.cuda.is_available() else None


class DirectReads:
    """The direct reads still queued on the GPU of a set of host shards of ``num_rows`` rows each
    (a store's host shards, read together, in their local row order), and the wait before a CPU
    write of their rows. Used on the thread that reads and writes the rows (the worker; the
    training thread for checkpoints once the worker is idle)."""

    def __init__(self, num_rows: int):
        self._count = 0  # reads recorded
        # The number of the last read of each row (0: none): one int64 per host row.
        self._last_read = torch.zeros(num_rows, dtype=torch.int64)
        self._pending: List[Tuple[int, object]] = []  # (number, event), in the order queued

    @property
    def pending(self) -> int:
        """How many reads are kept (recorded and not yet found finished)."""
        return len(self._pending)

    def record(self, rows: torch.Tensor) -> None:
        """A direct read of ``rows`` (host local indices) was queued on the current stream."""
        event = new_event()
        if event is None:  # no GPU: the read has run
            return
        event.record()
        # Drop the reads that have finished (in any order: their streams differ).
        self._pending = [(n, e) for n, e in self._pending if not e.query()]
        self._count += 1
        # index_fill_, not an indexed assignment: 30 us against 210 us for 3420 rows on 2 busy
        # cores (the assignment's index_put wakes the intra-op threads)
        self._last_read.index_fill_(0, rows.to(torch.long), self._count)
        self._pending.append((self._count, event))

    def before_write(self, rows: Optional[torch.Tensor] = None) -> None:
        """Wait for the reads still queued that read ``rows`` (host local indices; None: any row),
        before the CPU writes them."""
        if not self._pending:
            return
        if rows is None:
            upto = self._count
        elif rows.numel() == 0:
            return
        else:
            upto = int(self._last_read[rows].max())
        if upto < self._pending[0][0]:  # none of the rows is read by a read still kept
            return
        keep = []
        for number, event in self._pending:
            if number <= upto:
                event.synchronize()
            else:
                keep.append((number, event))
        self._pending = keep

    def wait_all(self) -> None:
        """Wait for every read still queued (before a write of the shards whole)."""
        self.before_write(None)
