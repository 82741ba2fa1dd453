"""Shared fixtures: a one-rank Megatron parallel state for in-process unit tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The project's Triton kernels run under Triton's interpreter on a machine without CUDA
# (tests/test_kernel_*.py). It must be switched on before anything imports Triton (transformers
# does, in test_hf_modeling.py): ``@triton.jit`` picks compiled or interpreted when it decorates,
# Triton's own library functions included, and compiled ones cannot be called by the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session")
def mcore_single_rank():
    """torch.distributed (world size 1) + Megatron model parallel state with TP=PP=1."""
    from megatron_ext.compat.standalone import init_single_rank

    yield init_single_rank()


@pytest.fixture(autouse=True)
def fresh_aux_loss_scale():
    """Megatron keeps the aux-loss gradient scale in a class attribute whose shape is fixed by the
    first ``set_loss_scale`` of the process; every test starts and ends without one."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
