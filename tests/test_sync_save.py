"""A synchronous ``torch_dist`` save starts no process: its write results stay in a queue of the
process (``megatron_ext/compat/sync_save.py``), where megatron-core 0.19.2 spawned a
``multiprocessing.Manager`` on every process's first save. The checkpoint loads back the same,
and a failed write still fails the save naming the worker's error. One rank, in-process."""

from __future__ import annotations

import errno
import multiprocessing.managers
import os

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.compat import seam, sync_save


@pytest.fixture
def fixed():
    """The rows in place for the test (they may be already: the process's upstream fixes)."""
    done = seam.install(sync_save.ROWS)
    yield
    seam.restore(done)


@pytest.fixture
def managers(monkeypatch):
    """The ``multiprocessing`` Manager servers started (their start counted, and refused: the
    upstream path would spawn one, ~2 s)."""
    started = []

    def start(self, *args, **kwargs):
        started.append(self)
        raise AssertionError("a Manager process was started")

    monkeypatch.setattr(multiprocessing.managers.BaseManager, "start", start)
    # A queue upstream made earlier in this process would hide a new start.
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    return started


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 3, generator=g)),
            "b": ShardedTensor.from_rank_offsets("b", torch.randn(5, generator=g))}


def test_a_synchronous_save_starts_no_process_and_loads_back(mcore_single_rank, fixed, managers,
                                                              tmp_path):
    dist_checkpointing.save(_state(0), str(tmp_path))
    assert managers == []
    loaded = dist_checkpointing.load(_state(1), str(tmp_path))
    expected = _state(0)
    for key in ("w", "b"):
        assert torch.equal(loaded[key], expected[key].data)


def test_a_failed_write_still_fails_the_save(mcore_single_rank, fixed, managers, tmp_path,
                                             monkeypatch):
    def full(file, mode="r", *args, **kwargs):
        if mode == "wb" and str(file).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(filesystem_async, "open", full, raising=False)  # the writer's open
    with pytest.raises(CheckpointException) as failed:
        dist_checkpointing.save(_state(0), str(tmp_path))
    error = failed.value.failures[0][0]  # rank 0's, as torch's checkpointer wraps it
    assert str(error) == ("Worker failure: An error is caught while starting worker 0, error: "
                          "<class 'OSError'>")  # upstream's words, as through its Manager
    assert managers == []
