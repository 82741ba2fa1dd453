"""Short trainings of each family with its compiled regions (``--structmoe-compile routed``,
``--sigma-compile router``, ``--stem-compile gate``; ``megatron_ext/compiled.py``) against the
same training without: the losses agree within fp32 rounding (1e-5 over 3 steps: the regions'
differences are a few ulp, tests/test_compiled_regions.py, and three steps of Adam at lr 1e-3
keep them there), and each region was compiled (Dynamo logs the bytecode of every function it
compiles under ``TORCH_LOGS=bytecode``, naming it: the compiled trainings name their regions,
the eager ones do not; upstream compiles its fused bias-dropout either way).
StructMoE also with full activation recomputation (the region runs once without gradients and
again with them): the losses of the run without recomputation.

All trainings in one launch of one rank (``tests/multirank.py``): one start-up, and Inductor's
compiles (a few seconds per region and graph on the CPU) are what the rest of the time goes to.
"""

from __future__ import annotations

import re

import pytest

from multirank import TINY_GPT, Launches, assert_close_curves, require_ok

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

ITERS = ["--train-iters", "3"]
STEPS = [1, 2, 3]
FAMILIES = {
    "structmoe": (TINY_GPT + ["--model-family", "structmoe", "--structmoe-num-experts", "4",
                              "--structmoe-rank", "4", "--structmoe-topk", "2",
                              "--structmoe-backend", "dense-masked"],
                  ["--structmoe-compile", "routed"]),
    "sigma": (TINY_GPT + ["--model-family", "sigma", "--num-experts", "8",
                          "--moe-ffn-hidden-size", "16", "--group-query-attention",
                          "--num-query-groups", "2", "--sigma-lbl", "top1",
                          "--sigma-lbl-coeff", "0.01"],
              ["--sigma-compile", "router"]),
    "stem": (TINY_GPT + ["--model-family", "stem", "--stem-ratio", "1/2"],
             ["--stem-compile", "gate"]),
}
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
ENV = {"TORCH_LOGS": "bytecode"}
REGIONS = {"structmoe": ["dense_masked_route_tail", "lbl_statistics"],
           "sigma": ["compiled_routing"], "stem": ["gate_product"]}


def compiled_functions(log: str):
    return set(re.findall(r"ORIGINAL BYTECODE (\w+) ", log))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = Launches(str(tmp_path_factory.mktemp("compiled_training")))
    for family, (flags, compile_flags) in FAMILIES.items():
        launches.add(f"{family}_eager", flags + ITERS, nproc=1, env=ENV)
        launches.add(f"{family}_compiled", flags + ITERS + compile_flags, nproc=1, env=ENV)
    smoe, smoe_compile = FAMILIES["structmoe"]
    launches.add("structmoe_compiled_recompute", smoe + ITERS + smoe_compile + RECOMPUTE,
                 nproc=1, env=ENV)
    return launches.run()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_training_matches_eager(runs, family):
    eager, compiled = require_ok(runs[f"{family}_eager"]), require_ok(runs[f"{family}_compiled"])
    assert set(REGIONS[family]) <= compiled_functions(compiled.log), compiled_functions(
        compiled.log)
    assert not set(REGIONS[family]) & compiled_functions(eager.log)
    assert_close_curves(eager, compiled, STEPS)


def test_structmoe_compiled_with_recomputation(runs):
    assert_close_curves(require_ok(runs["structmoe_compiled"]),
                        require_ok(runs["structmoe_compiled_recompute"]), STEPS)
