"""Helpers shared by the benchmarks: device sync, Megatron DDP wrapping, a timing loop."""

from __future__ import annotations

import time
from typing import Callable, List

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wrap_ddp(module):
    """Megatron's ``DistributedDataParallel`` around ``module`` as in training (gradients land
    in ``main_grad`` buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)


def timed(step: Callable[[], None], reset: Callable[[], None], reps: int,
          warmup: int) -> List[float]:
    """Seconds of ``reps`` calls of ``step`` after ``warmup`` untimed ones; ``reset`` runs before
    each call, outside the timing (e.g. zeroing the grad buffer, done once per global batch in
    training)."""
    times = []
    for i in range(warmup + reps):
        reset()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times
