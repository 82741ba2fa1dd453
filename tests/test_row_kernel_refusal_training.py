"""A training run whose CPU row kernel refuses a table step (``RowKernelError`` on the tables'
worker thread, rank 1 only: ``tests/dist/row_kernel_refusal.py`` corrupts a row's state there)
stops: the rank that hit it prints one line naming the kernel, the row and why, no traceback,
and the launch ends non-zero instead of hanging; the other rank, stopped in a collective with it,
adds at most one line saying so."""

from __future__ import annotations

import os
import re

import pytest

from multirank import TINY_GPT, torchrun

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist",
                       "row_kernel_refusal.py")


def test_a_refused_table_step_stops_the_run_with_one_line(tmp_path):
    from megatron_ext_kernels import row_adam_cpu

    if row_adam_cpu.load() is None:
        pytest.skip("no C++ compiler for the row kernels")
    flags = TINY_GPT + ["--model-family", "stem", "--stem-layers", "1,3", "--train-iters", "6",
                        "--stem-table-placement", "cpu", "--stem-table-sharding", "vocab",
                        "--stem-optimizer", "sparse"]
    run = torchrun("refused", str(tmp_path), flags, nproc=2, timeout=600, entry=WRAPPER)
    assert run.returncode != 0, run.log[-3000:]
    lines = [line for line in run.log.splitlines() if line.startswith("megatron-ext: ")
             and "no CUDA" not in line]
    # Rank 1's line; rank 0, stopped in a collective with it (gloo: "Connection closed by
    # peer"), says only that, if the launcher has not ended it first.
    assert re.fullmatch(r"megatron-ext: the CPU row kernel refused a STEM table step or read "
                        r"\(nothing was written\): sparse_adamw_: row \d+ was last brought up to "
                        r"date at iteration 10\d\d, outside the clock's 0\.\.\d", lines[-1]), lines
    assert lines[:-1] in ([], ["megatron-ext: another rank ended during training (its own "
                               "message, or torchrun's summary, says why); this rank stopped in a "
                               "collective with it"]), lines
    assert "Traceback" not in run.log, run.log[-3000:]
