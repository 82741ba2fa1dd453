"""Megatron's parallel state for one process (tests, benchmarks, conversion tools)."""

from __future__ import annotations

import socket

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ext.compat import cpu


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank(seed: int = 1234):
    """torch.distributed with world size 1 and TP=PP=1 model parallel state; idempotent.

    Installs the CPU backend first when there is no GPU. Uses NCCL when CUDA is available.
    """
    cpu.install()

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(
            backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(seed)
    return parallel_state
