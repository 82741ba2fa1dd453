#!/usr/bin/env bash
# The whole test suite: unit tests and multi-rank (torchrun + gloo) tests. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests at the end of every run, to see where the suite's time goes.
# -n: test files run on TEST_WORKERS pytest-xdist workers (default 2, the cores of the
# development and CI machines); each file on one worker, longest files first (tests/conftest.py).
# One file's launches leave a core idle for much of their time (rank start-up, a rank waiting on
# another), the other worker's file uses it. `bash scripts/test.sh -n 0` runs in one process.
exec .venv/bin/python -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --durations=30 "$@"
