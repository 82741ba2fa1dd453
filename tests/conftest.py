"""Shared fixtures: a one-rank Megatron parallel state for in-process unit tests."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session")
def mcore_single_rank():
    """torch.distributed (world size 1) + Megatron model parallel state with TP=PP=1."""
    from megatron_ext.compat.standalone import init_single_rank

    yield init_single_rank()
