#!/usr/bin/env bash
# The whole test suite: unit tests and multi-rank (torchrun + gloo) tests. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
