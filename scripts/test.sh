#!/usr/bin/env bash
# The whole test suite: unit tests and multi-rank (torchrun + gloo) tests. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests at the end of every run, to see where the suite's time goes.
exec .venv/bin/python -m pytest tests --durations=30 "$@"
