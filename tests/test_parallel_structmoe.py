"""StructMoE under TP (with and without SP) and DP, and checkpoint resharding: the layout must not
change the numbers. All runs start from one checkpoint (``--finetune``); fp32, CPU, gloo."""

from __future__ import annotations

import pytest

from multirank import TINY_GPT, assert_close_curves, require_ok, torchrun

# k = 2 of 4 experts of rank 4; D'_ff from Eq. 8 (112 for this shape: divisible by TP=2).
SMOE = TINY_GPT + ["--model-family", "structmoe", "--structmoe-num-experts", "4",
                   "--structmoe-rank", "4", "--structmoe-topk", "2"]
ITERS = ["--train-iters", "6"]
TP2 = ["--tensor-model-parallel-size", "2"]
FIRST5 = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structmoe_parallel")
    ck_init, ck_tp2 = str(tmp / "ck_init"), str(tmp / "ck_tp2")
    start = ["--load", ck_init, "--finetune"]
    init = require_ok(torchrun("init", str(tmp), SMOE + [
        "--train-iters", "1", "--lr-warmup-iters", "0", "--save", ck_init, "--save-interval", "1"]))
    r = {"init": init}
    r["ref"] = torchrun("ref", str(tmp), SMOE + ITERS + start)  # TP=1 x DP=2, 2 micro-batches
    r["tp2"] = torchrun("tp2", str(tmp), SMOE + ITERS + start + TP2 +
                        ["--save", ck_tp2, "--save-interval", "3"])
    r["tp2_sp"] = torchrun("tp2_sp", str(tmp), SMOE + ITERS + start + TP2 + ["--sequence-parallel"])
    r["dp1"] = torchrun("dp1", str(tmp), SMOE + ITERS + start, nproc=1)  # 4 micro-batches
    r["resume_tp2_as_tp1"] = torchrun("resume_tp2_as_tp1", str(tmp),
                                      SMOE + ITERS + ["--load", ck_tp2, "--ckpt-step", "3"])
    return r


def test_build_prints_the_budget(runs):
    lines = [l for l in runs["init"].log.splitlines() if "Eqs. 7-9" in l]
    assert lines and "D'_ff=112 (dense D_ff=128)" in lines[0]
    assert "params 24,576 vs dense 24,576" in lines[0]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "dp1"])
def test_layout_does_not_change_losses(runs, layout):
    ref = require_ok(runs["ref"])
    assert ref.losses[6] < ref.losses[1]
    assert_close_curves(require_ok(runs[layout]), ref, FIRST5)


def test_tp2_checkpoint_resumes_with_tp1(runs):
    resumed = require_ok(runs["resume_tp2_as_tp1"])
    assert sorted(resumed.losses) == [4, 5, 6]
    assert_close_curves(resumed, require_ok(runs["tp2"]), [4, 5, 6])
