"""Global-batch and Top-1 LBL through ``pretrain`` under torchrun/gloo: the router gradient and the
LBL value of a step do not depend on the data-parallel size or on how the global batch is cut
into micro-batches (fp32, 1e-6).

Every run starts from one checkpoint and trains the same global batches of 8 sequences (Megatron's
mock data, same seed) with the learning rate at 0, so the weights stay those of the checkpoint and
each step sees the statistics of the step before as its gradient weights (``sigma/lbl.py``). ``--sigma-dump-router-grads``
writes each router's weight gradient after Megatron's gradient reduction (DP average) and the
global statistics of the step. Layouts: DP=2 with 2 micro-batches per rank, DP=1 fed both ranks'
tokens (4 micro-batches), DP=1 with 2 micro-batches of 4 and with 1 micro-batch of 8.
"""

from __future__ import annotations

import os

import pytest
import torch

from multirank import TINY_GPT, Launches, assert_teardown_left_only_the_default_group, require_ok

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

SIGMA = TINY_GPT + ["--model-family", "sigma", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
                    "--group-query-attention", "--num-query-groups", "2",
                    "--moe-token-dispatcher-type", "alltoall", "--sigma-lbl-coeff", "0.1",
                    "--train-iters", "2", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0"]
LAYERS = 4
LAYOUTS = {  # name: (ranks, micro-batch size); global batch 8
    "dp2_m2": (2, 2), "dp1_m4": (1, 2), "dp1_m2": (1, 4), "dp1_m1": (1, 8)}


def layout_flags(tmp, name, lbl, mbs, start):
    dump = str(tmp / name / "grads")
    return SIGMA + start + ["--sigma-lbl", lbl, "--micro-batch-size", str(mbs),
                            "--sigma-dump-router-grads", dump], dump


def init_flags(tmp, lbl):
    """The common start of one LBL's runs: on CPU the initial weights depend on
    --micro-batch-size (Megatron's JIT warm-up draws random tensors of that size from the CPU
    generator before the model is built), so every layout loads the same weights (--finetune).
    The checkpoint also holds the routers' statistics of its step: step 1 already has LBL
    gradient weights. Returns the training's flags and the flags to start from it."""
    path = str(tmp / f"init_{lbl}")
    return (SIGMA + ["--sigma-lbl", lbl, "--train-iters", "1", "--save", path,
                     "--save-interval", "1"], ["--load", path, "--finetune"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigma_lbl")
    plan = []  # (key, name, lbl, layout) in order; the inits first
    for lbl, layouts in (("global", list(LAYOUTS)), ("top1", ["dp2_m2", "dp1_m1"])):
        plan += [((lbl, name), f"{lbl}_{name}", lbl, name) for name in layouts]
    plan.append((("none", "dp1_m1"), "none_dp1_m1", "none", "dp1_m1"))
    # Those of one rank count in one launch (tests/multirank.py, Launches): the 2-rank runs
    # with the inits, then the 1-rank runs.
    launches = Launches(str(tmp))
    starts, dumps = {}, {}
    for lbl in ("global", "top1"):
        flags, starts[lbl] = init_flags(tmp, lbl)
        launches.add(f"init_{lbl}", flags)
    start_of = {"none": starts["global"], "global": starts["global"], "top1": starts["top1"]}
    for want in (2, 1):
        for key, name, lbl, layout in plan:
            nproc, mbs = LAYOUTS[layout]
            if nproc == want:
                flags, dumps[key] = layout_flags(tmp, name, lbl, mbs, start_of[lbl])
                launches.add(name, flags, nproc=nproc)
    done = launches.run()
    for lbl in ("global", "top1"):
        require_ok(done[f"init_{lbl}"])
    return {key: (done[name], dumps[key]) for key, name, _, _ in plan}


def dumped(runs, lbl, layout, step):
    run, dump = runs[(lbl, layout)]
    require_ok(run)
    return torch.load(os.path.join(dump, f"step_{step}.pt"))


@pytest.mark.parametrize("lbl,layout", [("global", "dp2_m2"), ("global", "dp1_m4"),
                                        ("global", "dp1_m2"), ("top1", "dp2_m2")])
@pytest.mark.parametrize("step", [1, 2])
def test_router_gradient_and_value_do_not_depend_on_layout(runs, lbl, layout, step):
    ref = dumped(runs, lbl, "dp1_m1", step)
    got = dumped(runs, lbl, layout, step)
    assert sorted(got) == list(range(LAYERS))
    for layer in range(LAYERS):
        torch.testing.assert_close(got[layer]["grad"], ref[layer]["grad"], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[layer]["f"], ref[layer]["f"], rtol=0, atol=1e-7)
        torch.testing.assert_close(got[layer]["p"], ref[layer]["p"], rtol=0, atol=1e-6)
        assert abs(got[layer]["global_lbl"] - ref[layer]["global_lbl"]) < 1e-6
        assert abs(got[layer]["top1_lbl"] - ref[layer]["top1_lbl"]) < 1e-6


def test_the_lbl_gradient_is_there_and_matters(runs):
    """Without the LBL the router gradient differs by far more than the tolerance above, so the
    comparisons test the LBL's scale (a gradient off by the DP size or the micro-batch count
    would show)."""
    none = dumped(runs, "none", "dp1_m1", 2)
    with_lbl = dumped(runs, "global", "dp1_m1", 2)
    diffs = [float((with_lbl[l]["grad"] - none[l]["grad"]).abs().max()) for l in range(LAYERS)]
    assert min(diffs) > 1e-4, diffs


def test_logged_values_equal_the_dumped_global_statistics(runs):
    """The per-layer tensorboard values are Eq. 1 of the global batch: N_E sum f_i P_i."""
    run, _ = runs[("global", "dp2_m2")]
    for step in (1, 2):
        stats = dumped(runs, "global", "dp2_m2", step)
        for layer in range(LAYERS):
            eq1 = float(4 * torch.sum(stats[layer]["f"] * stats[layer]["p"]))
            logged = dict(run.scalars[f"sigma/global_lbl_layer_{layer}"])[step]
            assert abs(logged - eq1) < 1e-6
            f_dev = dict(run.scalars[f"sigma/load_deviation_max_layer_{layer}"])[step]
            assert abs(f_dev - float(4 * stats[layer]["f"].max() - 1)) < 1e-6


def test_teardown_frees_every_training(runs):
    """The launches' Sigma LBL trainings are each freed at their teardown with their process
    groups."""
    assert_teardown_left_only_the_default_group([run for run, _ in runs.values()])
