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

# Variables that libraries of the in-process tests set in os.environ when they are imported or
# first used, set here first to the same values: a launch whose environment differs from the rank
# server's is exec'd instead of forked (tests/rank_server.py), and the server takes the
# environment of its worker's first launch. Unset, the first lm_eval evaluation (scikit-learn's
# import) sent every later launch of its worker to exec, each rank paying its imports (about 5 s
# of CPU; CI 2026-11-28: every launch of one worker after test_convert_to_hf.py's); a file
# without lm_eval got the inductor cache's variable during its first test, after its server.
PINNED_ENV = {
    "KMP_DUPLICATE_LIB_OK": "True",  # scikit-learn's __init__
    "KMP_INIT_AT_FORK": "FALSE",  # scikit-learn's and joblib's __init__
    "HF_XET_HIGH_PERFORMANCE": "1",  # lm_eval's __init__
}
for _name, _value in PINNED_ENV.items():
    os.environ.setdefault(_name, _value)
from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: E402

cache_dir()  # sets TORCHINDUCTOR_CACHE_DIR (to its default unless given), as its first use would

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
    first ``set_loss_scale`` of the process, and the MoE metrics in one tracker per process whose
    entries keep the layer count of their first record (a later model with more layers records
    past their end); every test starts and ends without either."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_metrics_tracker().metrics.clear()
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_metrics_tracker().metrics.clear()


# scripts/test.sh runs the files on two pytest-xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a file's tests stay on one worker, in order, so its module fixture
# (one shared launch of its trainings) runs once, and the files are handed out in collection
# order. Collected longest first (seconds per file on the 2-core machine, `--durations=0` summed;
# a file not listed is short), the longest start at once and short ones fill in at the end
# instead of one long file running alone last. Measured 2026-11-28: the 4 files of the launch
# cuts (-n 0, under load) and the others' longest setups and calls of a full run; the compiled
# training and the host-read training were missing, so they ran last.
FILE_SECONDS = {
    "test_parallel_stem_tables.py": 330, "test_parallel_sigma.py": 310,
    "test_convert_to_hf.py": 280, "test_cli_errors.py": 180,
    "test_parallel_hybrid.py": 160, "test_gpu_plan_smoke.py": 160,
    "test_convert_to_hf_hybrid.py": 160, "test_estimate.py": 120, "test_parallel_stem.py": 110,
    "test_parallel_hybrid_sigma.py": 110, "test_parallel_structmoe.py": 100,
    "test_convert_from_hf.py": 100, "test_reshardable.py": 110, "test_checkpoint_safety.py": 90,
    "test_parallel_hybrid_structmoe.py": 80, "test_scaling_harness.py": 80,
    "test_parallel_stem_tp_padding.py": 70, "test_compat.py": 70,
    "test_compiled_training.py": 60, "test_host_read_training.py": 60,
    "test_family_plugin.py": 60, "test_parallel_sigma_lbl.py": 60, "test_start_refusals.py": 50,
    "test_cpu_presets_documented.py": 50, "test_parallel_stem_tables_fp16.py": 50,
    "test_gpu_evidence.py": 40, "test_launch_scripts.py": 40, "test_convert_plan.py": 40,
    "test_adam_impl.py": 35, "test_vocab_ce.py": 25,
    "test_row_kernel_refusal_training.py": 30, "test_stem_worker_gil.py": 20,
    "test_expert_parallel_resume.py": 12, "test_fsdp.py": 90,
}


def pytest_collection_modifyitems(session, config, items):
    def seconds(item):
        return FILE_SECONDS.get(os.path.basename(str(item.path)), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: a file's own order is kept
