"""STEM under TP, SP, PP (with full recompute, and interleaved), and checkpoint resume: the layout must not change
the numbers. Every run starts from the same checkpoint (``--finetune``), so initialisation is
identical whatever the layout. fp32, CPU, gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch

from multirank import TINY_GPT, assert_close_curves, require_ok, torchrun

STEM = TINY_GPT + ["--model-family", "stem", "--stem-ratio", "1/2"]  # STEM layers 1 and 3
ITERS = ["--train-iters", "6"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2_RECOMPUTE = ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1"]
PP2_VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
DOPT = ["--use-distributed-optimizer"]
FIRST5 = [1, 2, 3, 4, 5]
INTERPRET = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
AFTER_RESUME = [4, 5, 6]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stem_parallel")
    ck_init, ck_ref, ck_tp2, ck_dopt = (str(tmp / n) for n in
                                        ("ck_init", "ck_ref", "ck_tp2", "ck_dopt"))
    start = ["--load", ck_init, "--finetune"]
    require_ok(torchrun("init", str(tmp), STEM + ["--train-iters", "1", "--lr-warmup-iters", "0",
                                                   "--save", ck_init, "--save-interval", "1"]))
    r = {}
    # Reference layout TP=1 x DP=2; it also saves at iteration 3 without stopping.
    r["ref"] = torchrun("ref", str(tmp), STEM + ITERS + start +
                        ["--save", ck_ref, "--save-interval", "3"])
    r["tp2"] = torchrun("tp2", str(tmp), STEM + ITERS + start + TP2 +
                        ["--save", ck_tp2, "--save-interval", "3"])
    r["tp2_sp"] = torchrun("tp2_sp", str(tmp), STEM + ITERS + start + TP2 +
                           ["--sequence-parallel"])
    # The fused lookup-and-gate kernel (Triton's interpreter on the CPU), its row gradients going
    # into Megatron DDP's main_grad, under TP=2 + SP.
    r["tp2_sp_kernel"] = torchrun("tp2_sp_kernel", str(tmp), STEM + ITERS + start + TP2 +
                                  ["--sequence-parallel", "--stem-kernel", "triton"],
                                  env=INTERPRET)
    r["pp2_recompute"] = torchrun("pp2_recompute", str(tmp), STEM + ITERS + start + PP2_RECOMPUTE)
    # Interleaved 1F1B: chunks hold layers {0, 2} (dense) and {1, 3} (STEM) of the two stages.
    r["pp2_vpp"] = torchrun("pp2_vpp", str(tmp), STEM + ITERS + start + PP2_VPP)
    r["resume"] = torchrun("resume", str(tmp), STEM + ITERS + ["--load", ck_ref, "--ckpt-step", "3"])
    r["resume_tp2_as_tp1"] = torchrun("resume_tp2_as_tp1", str(tmp),
                                      STEM + ITERS + ["--load", ck_tp2, "--ckpt-step", "3"])
    # Distributed optimizer with torch's Adam (no Apex/TE): needs megatron_ext.compat.upstream_fixes.
    r["dopt"] = torchrun("dopt", str(tmp), STEM + ITERS + start + DOPT +
                         ["--save", ck_dopt, "--save-interval", "3"])
    r["dopt_resume"] = torchrun("dopt_resume", str(tmp), STEM + ITERS + DOPT +
                                ["--load", ck_dopt, "--ckpt-step", "3"])
    return r


def test_reference_trains(runs):
    ref = require_ok(runs["ref"])
    assert sorted(ref.losses) == [1, 2, 3, 4, 5, 6]
    assert ref.losses[6] < ref.losses[1]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_sp_kernel", "pp2_recompute",
                                    "pp2_vpp"])
def test_layout_does_not_change_losses(runs, layout):
    assert_close_curves(require_ok(runs[layout]), require_ok(runs["ref"]), FIRST5)


def test_resume_continues_the_curve_exactly(runs):
    ref, resumed = require_ok(runs["ref"]), require_ok(runs["resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == ref.curve(AFTER_RESUME)


def test_tp2_checkpoint_resumes_with_tp1(runs):
    tp2, resumed = require_ok(runs["tp2"]), require_ok(runs["resume_tp2_as_tp1"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert_close_curves(resumed, tp2, AFTER_RESUME)
    assert_close_curves(resumed, require_ok(runs["ref"]), AFTER_RESUME)


def test_distributed_optimizer_matches_and_resumes_exactly(runs):
    dopt, resumed = require_ok(runs["dopt"]), require_ok(runs["dopt_resume"])
    assert_close_curves(dopt, require_ok(runs["ref"]), [1, 2, 3, 4, 5, 6])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == dopt.curve(AFTER_RESUME)
