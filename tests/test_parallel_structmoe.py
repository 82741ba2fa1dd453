"""StructMoE under TP (with and without SP) and DP, and checkpoint resume and resharding: the layout
must not change the numbers. All runs of one activation start from one checkpoint (``--finetune``);
fp32, CPU, gloo. The Switch load-balancing loss is on (its default coefficient), so DP=1 with
twice the micro-batches also checks that its gradient is scaled like the LM loss under gradient
accumulation."""

from __future__ import annotations

import math

import pytest

from multirank import (TINY_GPT, Launches, assert_close_curves, assert_close_scalars,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

# k = 2 of 4 experts of rank 4; D'_ff from Eq. 8 (112 for this shape: divisible by TP=2).
SMOE = TINY_GPT + ["--model-family", "structmoe", "--structmoe-num-experts", "4",
                   "--structmoe-rank", "4", "--structmoe-topk", "2"]
# GELU (Eq. 3's plain activation) with the GLU fusion.
GELU_GLU = [f for f in SMOE if f != "--swiglu"] + ["--structmoe-fusion", "glu"]
ITERS = ["--train-iters", "6"]
TP2 = ["--tensor-model-parallel-size", "2"]
FIRST5 = [1, 2, 3, 4, 5]
# The Triton backend's run stops after step 3 (``--exit-interval``; ``--train-iters`` and so the
# learning-rate schedule stay the reference's): under Triton's interpreter each step costs it
# several seconds on 2 cores, and steps 1-3 already hold what the comparison checks: step 1's
# loss the fused router and codes' forward, steps 2 and 3 two updates from their gradients
# (router, codes, experts), Adam's moments included. Steps 4-6 run the same kernels again. Its
# gradient norm is compared too (a wrong gradient shows in it at the step it is made; 2e-7 apart
# unbroken, measured 2026-11-28).
TRITON_STEPS = [1, 2, 3]
LAYERS, EXPERTS = 4, 4
# D'_ff = 112 stored as 128: under TP=2 rank 0 holds columns 0-63, rank 1 64-111 and the
# padding 112-127.
PAD = ["--structmoe-ffn-pad-to", "128"]


def init_flags(path):
    """One step of training saved as the common start (``--save path``)."""
    return ["--train-iters", "1", "--lr-warmup-iters", "0", "--save", path, "--save-interval", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structmoe_parallel")
    ck_tp2, ck_init, ck_gelu, ck_pad, ck_pad_end = (
        str(tmp / n) for n in ("ck_tp2", "init", "gelu_init", "pad_init", "pad_end"))
    start, gelu_start = (["--load", ck, "--finetune"] for ck in (ck_init, ck_gelu))
    resume = ["--load", ck_tp2, "--ckpt-step", "3"]
    # In order; those of 2 ranks in one launch (tests/multirank.py, Launches).
    launches = Launches(str(tmp))
    launches.add("init", SMOE + init_flags(ck_init))
    launches.add("ref", SMOE + ITERS + start)  # TP=1 x DP=2, 2 micro-batches
    launches.add("tp2", SMOE + ITERS + start + TP2 + ["--save", ck_tp2, "--save-interval", "3"])
    launches.add("tp2_sp", SMOE + ITERS + start + TP2 + ["--sequence-parallel"])
    launches.add("resume_tp2", SMOE + ITERS + TP2 + resume)
    launches.add("resume_tp2_as_tp1", SMOE + ITERS + resume)
    launches.add("gelu_init", GELU_GLU + init_flags(ck_gelu))
    launches.add("gelu_ref", GELU_GLU + ITERS + gelu_start + ["--structmoe-backend", "grouped"])
    launches.add("gelu_tp2_sp", GELU_GLU + ITERS + gelu_start + TP2 +
                 ["--sequence-parallel", "--structmoe-backend", "dense-masked"])
    # The fused router + codes kernel (Triton's interpreter on the CPU: tests/conftest.py sets
    # TRITON_INTERPRET for the suite's processes, the ranks included, so it shares the launch)
    # under TP=2 + SP; steps 1-3 only (TRITON_STEPS).
    launches.add("tp2_sp_triton", SMOE + ITERS + start + TP2 +
                 ["--sequence-parallel", "--structmoe-backend", "triton", "--exit-interval", "3"])
    launches.add("dp1", SMOE + ITERS + start, nproc=1)  # 4 micro-batches
    # D'_ff stored padded: its own first step from scratch (the unpadded init's draws), saved at
    # TP=1 and continued at TP=2 + SP, where rank 1 holds the padding; saved at the end.
    launches.add("pad_init", SMOE + PAD + init_flags(ck_pad))
    launches.add("pad_tp2_sp", SMOE + PAD + ITERS + ["--load", ck_pad, "--finetune"] + TP2 +
                 ["--sequence-parallel", "--save", ck_pad_end, "--save-interval", "6"])
    r = launches.run()
    require_ok(r["init"])
    require_ok(r.pop("gelu_init"))
    r["pad_end"] = ck_pad_end
    return r


def test_build_prints_the_budget(runs):
    lines = [l for l in require_ok(runs["init"]).log.splitlines() if "Eqs. 7-9" in l]
    assert lines and "D'_ff=112 (dense D_ff=128)" in lines[0]
    assert "params 24,576 vs dense 24,576" in lines[0]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_sp_triton", "dp1"])
def test_layout_does_not_change_losses(runs, layout):
    ref = require_ok(runs["ref"])
    assert ref.losses[6] < ref.losses[1]
    run = require_ok(runs[layout])
    steps = TRITON_STEPS if layout == "tp2_sp_triton" else FIRST5
    assert sorted(run.losses) == (steps if layout == "tp2_sp_triton" else sorted(ref.losses))
    assert_close_curves(run, ref, steps)
    if layout == "tp2_sp_triton":
        assert_close_scalars(run, ref, "grad-norm", TRITON_STEPS)


def test_gelu_glu_tp2_sp_matches_tp1(runs):
    """Plain activation, GLU fusion; also the grouped (TP=1) vs dense-masked (TP=2) backends."""
    ref = require_ok(runs["gelu_ref"])
    assert ref.losses[6] < ref.losses[1]
    assert_close_curves(require_ok(runs["gelu_tp2_sp"]), ref, FIRST5)


@pytest.mark.parametrize("resumed,original", [("resume_tp2", "tp2"),
                                              ("resume_tp2_as_tp1", "tp2")])
def test_checkpoint_resumes(runs, resumed, original):
    run = require_ok(runs[resumed])
    assert sorted(run.losses) == [4, 5, 6]
    assert_close_curves(run, require_ok(runs[original]), [4, 5, 6])


@pytest.mark.parametrize("name", ["ref", "tp2_sp"])
def test_router_metrics_logged(runs, name):
    """Per-layer routing fractions (Fig. 4) sum to 1 in every layer and step; the load-balancing
    loss is logged each step, on the console too, and does not depend on the layout."""
    run = require_ok(runs[name])
    lbl = dict(run.scalars["load_balancing_loss"])
    assert sorted(lbl) == [1, 2, 3, 4, 5, 6]
    assert all(0.9 < v < EXPERTS for v in lbl.values())  # 1 when perfectly balanced
    assert "load_balancing_loss:" in run.log
    for layer in range(LAYERS):
        tags = [f"moe/structmoe_routing_fraction_expert_{e}_layer_{layer}" for e in range(EXPERTS)]
        per_step = [dict(run.scalars[t]) for t in tags]
        for step in range(1, 7):
            fractions = [series[step] for series in per_step]
            assert math.isclose(sum(fractions), 1.0, abs_tol=1e-5), (layer, step, fractions)
            assert max(fractions) < 1.0  # not collapsed onto one expert
    ref_lbl = dict(require_ok(runs["ref"]).scalars["load_balancing_loss"])
    for step in FIRST5:
        assert math.isclose(lbl[step], ref_lbl[step], rel_tol=1e-5)


def test_padded_storage_trains_the_unpadded_model(runs):
    """``--structmoe-ffn-pad-to 128``: the first step from scratch is the unpadded model's, and
    the TP=2 + SP continuation from it gives the unpadded TP=1 run's losses and gradient norms."""
    init, pad_init = require_ok(runs["init"]), require_ok(runs["pad_init"])
    assert "D'_ff=112, stored as 128 (--structmoe-ffn-pad-to)" in pad_init.log
    assert_close_curves(pad_init, init, [1], tol=1e-6)
    ref, run = require_ok(runs["ref"]), require_ok(runs["pad_tp2_sp"])
    assert sorted(run.losses) == sorted(ref.losses)
    assert_close_curves(run, ref, sorted(ref.losses))
    assert_close_scalars(run, ref, "grad-norm", sorted(ref.losses))


def test_padding_stays_zero_in_weights_and_adam_moments(runs):
    """After 6 steps at TP=2 (weight decay on), the saved padding columns of W1' (both SwiGLU
    halves), B and W2', and Adam's moments of them, are exactly zero; the real columns are not."""
    from megatron_ext.checkpoint_reader import MegatronCheckpoint

    ckpt = MegatronCheckpoint(runs["pad_end"], 6)
    checked = []
    for key in ckpt.metadata.state_dict_metadata:
        if not key.endswith(("mlp.linear_fc1.weight", "mlp.lore_b", "mlp.linear_fc2.weight")):
            continue
        t = ckpt.read(key)
        dim = {"weight": 1, "lore_b": 3}[key.rsplit(".", 1)[-1]]  # axis 0: the layers
        if key.endswith("linear_fc2.weight"):
            dim = 2
        halves = t.chunk(2, dim) if key.endswith("linear_fc1.weight") else (t,)
        for half in halves:
            assert half.shape[dim] == 128, (key, t.shape)
            assert bool((half.narrow(dim, 112, 16) == 0).all()), key
            if "exp_avg" not in key:  # Adam's second moment of a column can be tiny, not 0
                assert bool((half.narrow(dim, 0, 112).abs().amax() > 0)), key
        checked.append(key)
    kinds = {k.split("decoder.layers.")[0] for k in checked}
    assert len(checked) >= 9 and len(kinds) >= 3, checked  # the weights and both moments


def test_teardown_frees_every_training(runs):
    """The launches' StructMoE trainings (TP=2, TP=2 + SP, DP=2) are each freed at their teardown
    with their process groups."""
    assert_teardown_left_only_the_default_group(runs)
