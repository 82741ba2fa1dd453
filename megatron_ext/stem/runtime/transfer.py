"""Copies between host and GPU that block neither the thread that queues them nor the GPU's
other work: the small tensors the tables move (indices, positions, factors) to the GPU, and the
host tier's row gradients from it.

A plain ``.to("cuda")`` of a pageable host tensor synchronises the stream: the training thread
would wait for the GPU, the worker thread for the GPU tier's earlier kernels on its side stream.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU through pinned memory without blocking
    the host (PyTorch's pinned-memory allocator keeps the staging block until the copy ends)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Arrival:
    """When the gradients that ``stage_to_host`` copies are on the host: all of them
    (``synchronize``, ``query``), or the leading rows of each that it copied first
    (``synchronize_first``: what the next step's first micro-batch reads)."""

    def __init__(self, first, done):
        self._first, self._done = first, done

    def synchronize(self) -> None:
        self._done.synchronize()

    def query(self) -> bool:
        return self._done.query()

    def synchronize_first(self) -> None:
        (self._first if self._first is not None else self._done).synchronize()


def stage_to_host(grads: Sequence[torch.Tensor], staging, stream,
                  first: Optional[Sequence[int]] = None) -> Tuple[List[torch.Tensor], Arrival]:
    """GPU ``grads`` copied as fp32 into views of ``staging``'s pinned buffer (a
    ``store.PinnedStaging``) on the CUDA stream ``stream``, after what the current stream has
    queued so far (which made them); returns the views and their ``Arrival``. With ``first``
    (a row count per gradient), those leading rows of every gradient are copied before the
    others, and ``Arrival.synchronize_first`` waits for them alone: the table step of the rows
    the next step's first micro-batch reads needs those, and the copy of all of them takes the
    copy engine several milliseconds at the 1B shape (below) while that micro-batch waits.

    Nothing waits: not the host, and not the current stream's later work. Queued on the current
    stream, the copies would hold back the model's optimizer step and the next step's first
    micro-batch behind them for as long as the copy engine takes (at the 1B shape about 0.3 GB of
    host-tier gradients per step: about 10 ms at 25-50 GB/s); on their own stream they run beside
    that work. The gradients' memory is not reused before the copies have read it
    (``record_stream``)."""
    firsts = [min(int(n), g.shape[0]) for n, g in zip(first, grads)] if first is not None \
        else [0] * len(grads)
    flat = staging.view(sum(g.numel() for g in grads), torch.float32)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream())
    views, offset = [], 0
    early = None
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for g in grads:
            views.append(flat[offset: offset + g.numel()].view(g.shape))
            offset += g.numel()
        if any(firsts):
            for g, view, n in zip(grads, views, firsts):
                if n:
                    view[:n].copy_(g[:n], non_blocking=True)
            early = torch.cuda.Event()
            early.record(stream)
        for g, view, n in zip(grads, views, firsts):
            if n < g.shape[0]:
                view[n:].copy_(g[n:], non_blocking=True)
            g.record_stream(stream)
        staging.record()  # on ``stream``: the copies' end
    return views, Arrival(early, staging.take_event())
