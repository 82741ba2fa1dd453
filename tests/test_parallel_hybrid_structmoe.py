"""StructMoE on the hybrid path (``--hybrid-layer-pattern``, upstream's ``HybridModel``):
``*-`` x 4 gives the GPT path's losses and router metrics (the same parameters, DeepNorm's depth
counting MLP blocks rather than pattern symbols); from one checkpoint, TP=2 + SP, PP=2 (``|`` in
the pattern) with full recompute and DP=1 with twice the micro-batches give TP=1 x DP=2's losses;
a resume is exact; a GPT-path StructMoE checkpoint continues on the hybrid path (upstream's
``gpt_checkpoint_interop``: StructMoE's layers are homogeneous, saved stacked). The Switch
load-balancing loss is on (its default coefficient). fp32, CPU, gloo."""

from __future__ import annotations

import math

import pytest

from multirank import (TINY_GPT, Launches, assert_close_curves,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

# k = 2 of 4 experts of rank 4; D'_ff from Eq. 8 (112 for this shape: divisible by TP=2).
SMOE = TINY_GPT + ["--model-family", "structmoe", "--structmoe-num-experts", "4",
                   "--structmoe-rank", "4", "--structmoe-topk", "2"]
HYBRID = ["--hybrid-layer-pattern", "*-*-*-*-"]  # TINY_GPT's 4 blocks; --num-layers is derived
ITERS = ["--train-iters", "6"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# The stage boundary in the pattern; full recompute of every layer.
PP2_RECOMPUTE = ["--hybrid-layer-pattern", "*-*-|*-*-", "--pipeline-model-parallel-size", "2",
                 "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
ALL = [1, 2, 3, 4, 5, 6]
FIRST5 = [1, 2, 3, 4, 5]
AFTER_RESUME = [4, 5, 6]
BLOCKS, EXPERTS = 4, 4
LBL = "load_balancing_loss"


def fraction_tag(expert: int, block: int) -> str:
    return f"moe/structmoe_routing_fraction_expert_{expert}_layer_{block}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_structmoe")
    ck_gpt, ck_init, ck_ref = (str(tmp / n) for n in ("ck_gpt", "ck_init", "ck_ref"))
    start = ["--load", ck_init, "--finetune"]
    launches = Launches(str(tmp))
    # From scratch: the same seed draws the same parameters on both paths.
    launches.add("gpt_path", SMOE + ITERS + ["--save", ck_gpt, "--save-interval", "3"])
    launches.add("hybrid", SMOE + ITERS + HYBRID)
    # The GPT path's step-3 checkpoint continued on the hybrid path.
    launches.add("gpt_to_hybrid", SMOE + ITERS + HYBRID + ["--load", ck_gpt, "--ckpt-step", "3"])
    # Every layout starts from one checkpoint (initialisation independent of the layout).
    launches.add("init", SMOE + HYBRID + ["--train-iters", "1", "--lr-warmup-iters", "0",
                                          "--save", ck_init, "--save-interval", "1"])
    launches.add("ref", SMOE + HYBRID + ITERS + start + ["--save", ck_ref, "--save-interval", "3"])
    launches.add("tp2_sp", SMOE + HYBRID + ITERS + start + TP2_SP)
    launches.add("pp2_recompute", SMOE + ITERS + start + PP2_RECOMPUTE)
    launches.add("resume", SMOE + HYBRID + ITERS + ["--load", ck_ref, "--ckpt-step", "3"])
    launches.add("dp1", SMOE + HYBRID + ITERS + start, nproc=1)  # 4 micro-batches
    r = launches.run()
    require_ok(r.pop("init"))
    return r


def test_star_dash_repeated_gives_the_gpt_path_losses(runs):
    gpt, hybrid = require_ok(runs["gpt_path"]), require_ok(runs["hybrid"])
    assert sorted(hybrid.losses) == ALL
    assert hybrid.losses[6] < hybrid.losses[1]
    assert "GPTModel IS DEPRECATED" not in hybrid.log  # HybridModel is built instead
    assert_close_curves(hybrid, gpt, ALL, tol=1e-6)


def test_router_metrics_are_logged_per_mlp_block_as_on_the_gpt_path(runs):
    """Per MLP block (``_layer_0`` .. ``_layer_3``), not per pattern position: the same tags and
    values as the GPT path, fractions summing to 1; the mean loss over the 4 blocks, not 8."""
    gpt, hybrid = require_ok(runs["gpt_path"]), require_ok(runs["hybrid"])
    per_block = sorted(t for t in hybrid.scalars if t.startswith("moe/"))
    assert per_block == sorted(t for t in gpt.scalars if t.startswith("moe/")), per_block
    assert fraction_tag(0, BLOCKS - 1) in per_block and fraction_tag(0, BLOCKS) not in per_block
    for tag in per_block + [LBL]:
        steps = [s for s, _ in hybrid.scalars[tag]]
        assert steps == ALL, tag
        for (_, a), (_, b) in zip(hybrid.scalars[tag], gpt.scalars[tag]):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7), (tag, a, b)
    lbl = dict(hybrid.scalars[LBL])
    assert all(0.9 < v < EXPERTS for v in lbl.values())  # 1 when balanced; diluted would be < 0.6
    for block in range(BLOCKS):
        series = [dict(hybrid.scalars[fraction_tag(e, block)]) for e in range(EXPERTS)]
        for step in ALL:
            assert math.isclose(sum(s[step] for s in series), 1.0, abs_tol=1e-5), (block, step)
    assert "load_balancing_loss:" in hybrid.log


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2_recompute", "dp1"])
def test_layout_does_not_change_losses(runs, layout):
    ref = require_ok(runs["ref"])
    assert ref.losses[6] < ref.losses[1]
    run = require_ok(runs[layout])
    assert_close_curves(run, ref, FIRST5)
    # The load-balancing loss, reduced over the stages under PP, agrees as well.
    ref_lbl, lbl = dict(ref.scalars[LBL]), dict(run.scalars[LBL])
    for step in FIRST5:
        assert math.isclose(lbl[step], ref_lbl[step], rel_tol=1e-5), (step, lbl[step])


def test_resume_continues_the_curve_exactly(runs):
    ref, resumed = require_ok(runs["ref"]), require_ok(runs["resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == ref.curve(AFTER_RESUME)


def test_gpt_path_checkpoint_continues_on_the_hybrid_path(runs):
    gpt, resumed = require_ok(runs["gpt_path"]), require_ok(runs["gpt_to_hybrid"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert_close_curves(resumed, gpt, AFTER_RESUME, tol=1e-6)
    # The routers continue too: the same load balance per block.
    for tag in [LBL, fraction_tag(1, 2)]:
        gpt_values = dict(gpt.scalars[tag])
        for step, value in resumed.scalars[tag]:
            assert math.isclose(value, gpt_values[step], rel_tol=1e-6), (tag, step)


def test_teardown_frees_every_training(runs):
    """The launches' StructMoE trainings on the hybrid path are each freed at their teardown with
    their process groups."""
    assert_teardown_left_only_the_default_group(runs)
