"""Managed STEM tables issue every collective from the training thread: a tiered, sparse run with
prefetch, the overlapped table step, two chunks of tables per rank (interleaved 1F1B), evaluation
and a checkpoint, launched with every ``torch.distributed`` collective wrapped
(``tests/dist/thread_guard.py``): any call from another thread fails the run. Worker threads do
host work only (gathering rows, the CPU AdamW)."""

from __future__ import annotations

import json
import os
import re

import pytest

from multirank import TINY_GPT, require_ok, torchrun

pytestmark = pytest.mark.multirank

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist", "thread_guard.py")
FLAGS = TINY_GPT + [
    "--model-family", "stem", "--stem-layers", "1,2,3", "--train-iters", "6",
    "--stem-table-placement", "tiered", "--stem-table-sharding", "vocab", "--stem-gpu-tier", "25%",
    "--stem-optimizer", "sparse", "--pipeline-model-parallel-size", "2",
    "--num-layers-per-virtual-pipeline-stage", "1", "--eval-interval", "3", "--eval-iters", "1",
    "--save-interval", "4"]


def test_collectives_come_from_the_training_thread_only(tmp_path):
    run = torchrun("guarded", str(tmp_path), FLAGS + ["--save", str(tmp_path / "ck")], nproc=4,
                   entry=GUARD)
    assert "THREAD GUARD:" not in run.log, run.log[-6000:]
    require_ok(run)
    calls = {int(m.group(1)): json.loads(m.group(2))
             for m in re.finditer(r"THREAD GUARD CALLS rank (\d+) (\{.*\})", run.log)}
    assert sorted(calls) == [0, 1, 2, 3]
    # The tables' exchanges ran through the wrapped functions on every rank (each stage holds a
    # chunk with STEM layers): per step and chunk, ids routed and rows sent for each of the 2
    # micro-batches (3 all-to-alls each), gradients routed and pushed (3).
    for rank, counted in calls.items():
        assert counted.get("all_to_all_single", 0) >= 6 * (2 * 3 + 3), (rank, counted)
    assert run.losses and max(run.losses) == 6
