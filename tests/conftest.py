"""Shared fixtures: a one-rank Megatron parallel state (gloo) for in-process unit tests."""

from __future__ import annotations

import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mcore_single_rank():
    """torch.distributed (gloo, world size 1) + Megatron model parallel state with TP=PP=1."""
    import torch

    from megatron_ext.compat import cpu

    cpu.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield parallel_state
