"""Short trainings of each family with its compiled regions (``--structmoe-compile routed``,
``--sigma-compile router``, ``--stem-compile gate``; ``megatron_ext/compiled.py``) against the
same training without: the losses agree within fp32 rounding (1e-5 over 3 steps: the regions'
differences are a few ulp, tests/test_compiled_regions.py, and three steps of Adam at lr 1e-3
keep them there), and so do the gradient norms (relative 1e-5; measured at most 7e-7). The
norms matter: Adam's normalized steps hide a gradient's small errors from the next losses, the
norm of every step shows them (a managed STEM region scaled by 1.001 moved the losses by
5e-6, inside their 1e-5, and the norms by 1.8e-5). Each region was compiled: Dynamo logs the
bytecode of every function it compiles under ``TORCH_LOGS=bytecode``, naming it; the compiled
trainings name their regions, the eager ones do not (upstream compiles its fused bias-dropout
either way).

Under activation recomputation the checkpointed part of a layer runs twice per micro-batch, once
without gradients (the checkpoint's forward, whose output the loss is computed from) and again
with them (the recompute in backward): STEM's and StructMoE's regions run compiled both times
(two graphs, with and without autograd), Sigma's router takes upstream's eager routing without
gradients (``SigmaRouter.routing``). Each family's compiled training with full recomputation,
and Sigma's also with upstream's selective ``--recompute-modules moe`` (the MoE layer, router
included, checkpointed), gives the losses of its compiled training without recomputation (and of
the eager one), and its gradient norms within 1e-6: the gradients come from the same compiled
graph in both (measured: the same norms to the last bit; Sigma's losses one ulp apart, from its
eager routing in the checkpoint's forward). STEM has no selective form (``--recompute-modules
mlp`` is refused for token-indexed MLPs, models/layer.py).

STEM's managed tables (``--stem-table-placement cpu`` and ``tiered``, vocab-sharded): the rows
arrive from the runtime (``stem/runtime/``) as leaves of their own rather than as a gather of a
table parameter, and the region is given the model's dtype to cast them to (``stem/mlp.py``; the
rows travel in that dtype already, ``StemTables.wire_dtype``, so the cast changes nothing
here); the compiled training gives the losses and gradient norms of the same managed-table
training without the flag.

All trainings in one launch of one rank (``tests/multirank.py``): one start-up, and Inductor's
compiles (a few seconds per region and graph on the CPU) are what the rest of the time goes to.
Vocab sharding needs no second rank (one rank owns every row).
"""

from __future__ import annotations

import re

import pytest

from multirank import TINY_GPT, assert_close_curves, require_ok, torchrun_many

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
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
# Upstream's selective recomputation of the whole MoE layer (MoELayer.moe_layer_recompute).
MOE = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
# Each compiled training under recomputation: (family, recomputation flags).
RECOMPUTED = {"structmoe_compiled_recompute": ("structmoe", FULL),
              "sigma_compiled_recompute": ("sigma", FULL),
              "sigma_compiled_recompute_moe": ("sigma", MOE),
              "stem_compiled_recompute": ("stem", FULL)}
# STEM's managed tables (tests/test_parallel_stem_tables.py runs them in every layout).
TABLES = {"stem_cpu_vocab": ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"],
          "stem_tiered": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                          "--stem-gpu-tier", "25%"]}
ENV = {"TORCH_LOGS": "bytecode"}
REGIONS = {"structmoe": ["dense_masked_route_tail", "lbl_statistics"],
           "sigma": ["compiled_routing"], "stem": ["gate_product"]}
# Each pair of an eager and a compiled training: (prefix of both names, family).
PAIRS = {**{family: family for family in FAMILIES}, **{name: "stem" for name in TABLES}}


# Relative tolerances of the gradient norms: compiled against eager, and a compiled training
# with recomputation against the same without (its gradients from the same compiled graphs).
NORM_TOL, RECOMPUTE_NORM_TOL = 1e-5, 1e-6


def compiled_functions(log: str):
    return set(re.findall(r"ORIGINAL BYTECODE (\w+) ", log))


def assert_close_norms(a, b, rel: float) -> None:
    na, nb = (dict(run.scalars["grad-norm"]) for run in (a, b))
    diffs = [abs(na[i] - nb[i]) / na[i] for i in STEPS]
    assert max(diffs) <= rel, (f"{a.name} vs {b.name} gradient norms: {[na[i] for i in STEPS]} "
                               f"vs {[nb[i] for i in STEPS]} (max relative diff "
                               f"{max(diffs):.2e})")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # Each compiled training drops Dynamo's entries of the regions first
    # (tests/dist/fresh_compile.py): in the shared process a training would otherwise run the
    # code an earlier one compiled for the same region and shapes, and its log would not name it.
    fresh = {"module": "fresh_compile"}
    items = []
    for family, (flags, compile_flags) in FAMILIES.items():
        items.append((f"{family}_eager", flags + ITERS))
        items.append((f"{family}_compiled", flags + ITERS + compile_flags, fresh))
    for name, (family, recompute) in RECOMPUTED.items():
        flags, compile_flags = FAMILIES[family]
        items.append((name, flags + ITERS + compile_flags + recompute, fresh))
    stem, stem_compile = FAMILIES["stem"]
    for name, tables in TABLES.items():
        items.append((f"{name}_eager", stem + ITERS + tables))
        items.append((f"{name}_compiled", stem + ITERS + tables + stem_compile, fresh))
    return torchrun_many(str(tmp_path_factory.mktemp("compiled_training")), items, nproc=1,
                         env=ENV)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_compiled_training_matches_eager(runs, pair):
    regions = set(REGIONS[PAIRS[pair]])
    eager, compiled = require_ok(runs[f"{pair}_eager"]), require_ok(runs[f"{pair}_compiled"])
    assert regions <= compiled_functions(compiled.log), compiled_functions(compiled.log)
    assert not regions & compiled_functions(eager.log)
    assert_close_curves(eager, compiled, STEPS)
    assert_close_norms(eager, compiled, NORM_TOL)


@pytest.mark.parametrize("name", list(RECOMPUTED))
def test_compiled_with_recomputation(runs, name):
    family = RECOMPUTED[name][0]
    recomputed = require_ok(runs[name])
    assert set(REGIONS[family]) <= compiled_functions(recomputed.log)
    compiled, eager = require_ok(runs[f"{family}_compiled"]), require_ok(runs[f"{family}_eager"])
    assert_close_curves(compiled, recomputed, STEPS)
    assert_close_norms(compiled, recomputed, RECOMPUTE_NORM_TOL)
    assert_close_curves(eager, recomputed, STEPS)
    assert_close_norms(eager, recomputed, NORM_TOL)
