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


# scripts/test.sh runs the files on two pytest-xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a file's tests stay on one worker, in order, so its module fixture
# (one shared launch of its trainings) runs once, and the files are handed out in collection
# order. Collected longest first (seconds per file on the 2-core machine, `--durations=0` summed;
# a file not listed is short), the longest start at once and short ones fill in at the end
# instead of one long file running alone last.
FILE_SECONDS = {
    "test_parallel_stem_tables.py": 365, "test_convert_to_hf.py": 145, "test_parallel_stem.py": 111,
    "test_gpu_plan_smoke.py": 110, "test_parallel_sigma.py": 101, "test_parallel_structmoe.py": 96,
    "test_cli_errors.py": 90,
    "test_parallel_hybrid.py": 86, "test_estimate.py": 81, "test_parallel_hybrid_sigma.py": 80,
    "test_parallel_stem_tp_padding.py": 75, "test_convert_to_hf_hybrid.py": 71,
    "test_convert_from_hf.py": 60, "test_parallel_hybrid_structmoe.py": 45,
    "test_parallel_sigma_lbl.py": 45, "test_scaling_harness.py": 45, "test_compat.py": 40,
    "test_launch_scripts.py": 40, "test_gpu_evidence.py": 40, "test_stem_exchange.py": 30,
    "test_family_plugin.py": 25, "test_parallel_stem_tables_fp16.py": 25,
    "test_kernel_structmoe.py": 25, "test_convert_plan.py": 20, "test_suite_launch.py": 20,
}


def pytest_collection_modifyitems(session, config, items):
    def seconds(item):
        return FILE_SECONDS.get(os.path.basename(str(item.path)), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: a file's own order is kept
