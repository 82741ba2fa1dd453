"""STEM under TP, SP, PP (with full recompute, and interleaved), and checkpoint resume: the layout must not change
the numbers. Every run starts from the same checkpoint (``--finetune``), so initialisation is
identical whatever the layout. fp32, CPU, gloo, 2 ranks."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from multirank import (TINY_GPT, Launches, assert_close_curves, assert_close_scalars,
                       assert_teardown_left_only_the_default_group, require_ok, torchrun)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

STEM = TINY_GPT + ["--model-family", "stem", "--stem-ratio", "1/2"]  # STEM layers 1 and 3
ITERS = ["--train-iters", "6"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2_RECOMPUTE = ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1"]
PP2_VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
DOPT = ["--use-distributed-optimizer"]
FIRST5 = [1, 2, 3, 4, 5]
ITERATIONS = [1, 2, 3, 4, 5, 6]
AFTER_RESUME = [4, 5, 6]
# The fused kernel's run stops after step 3 (``--exit-interval``; ``--train-iters`` and so the
# learning-rate schedule stay the reference's): under Triton's interpreter each step costs it
# about 17 s on 2 cores, and steps 1-3 already hold what the comparison checks: step 1's loss the
# kernel's forward, steps 2 and 3 two updates from its gradients (rows into main_grad, W_gate and
# W_down), Adam's moments included. Steps 4-6 run the same kernel on the same path again. Its
# gradient norm is compared too: the kernel's gradient into fc1 scaled by 1.01 moved it by 3e-5
# (relative) at step 1, while the losses of steps 1-5 stayed within 1e-5 with it scaled by 1.01
# and moved 1.0e-5 at step 4 with 1.05; unbroken, 5e-7 (measured 2026-11-28).
KERNEL_STEPS = [1, 2, 3]
CKPT = {}  # the fixture's checkpoint directories
# The CPU preset as docs/cpu_backend.md runs it, with its dropout (Megatron's 0.1 for attention
# and hidden states), for a resume that must still be exact.
PRESET_DROPOUT = ["--preset", "stem_cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", "511", "--micro-batch-size", "2", "--log-interval", "1",
                  "--eval-iters", "0", "--ckpt-format", "torch_dist"] + ITERS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stem_parallel")
    ck_init, ck_ref, ck_tp2, ck_dopt = (str(tmp / n) for n in
                                        ("ck_init", "ck_ref", "ck_tp2", "ck_dopt"))
    start = ["--load", ck_init, "--finetune"]
    # In order, in one launch of 2 ranks (tests/multirank.py, Launches).
    launches = Launches(str(tmp))
    launches.add("init", STEM + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save",
                                 ck_init, "--save-interval", "1"])
    # Reference layout TP=1 x DP=2; it also saves at iteration 3 without stopping.
    launches.add("ref", STEM + ITERS + start + ["--save", ck_ref, "--save-interval", "3"])
    launches.add("tp2", STEM + ITERS + start + TP2 + ["--save", ck_tp2, "--save-interval", "3"])
    launches.add("tp2_sp", STEM + ITERS + start + TP2 + ["--sequence-parallel"])
    launches.add("pp2_recompute", STEM + ITERS + start + PP2_RECOMPUTE)
    # Interleaved 1F1B: chunks hold layers {0, 2} (dense) and {1, 3} (STEM) of the two stages.
    launches.add("pp2_vpp", STEM + ITERS + start + PP2_VPP)
    launches.add("resume", STEM + ITERS + ["--load", ck_ref, "--ckpt-step", "3"])
    launches.add("resume_tp2_as_tp1", STEM + ITERS + ["--load", ck_tp2, "--ckpt-step", "3"])
    # Distributed optimizer with torch's Adam (no Apex/TE): needs megatron_ext.compat.upstream_fixes.
    launches.add("dopt", STEM + ITERS + start + DOPT + ["--save", ck_dopt, "--save-interval", "3"])
    launches.add("dopt_resume", STEM + ITERS + DOPT + ["--load", ck_dopt, "--ckpt-step", "3"])
    ck_dropout = str(tmp / "ck_dropout")
    launches.add("dropout", PRESET_DROPOUT + ["--save", ck_dropout, "--save-interval", "3"])
    launches.add("dropout_resume", PRESET_DROPOUT + ["--load", ck_dropout, "--ckpt-step", "3"])
    # The fused lookup-and-gate kernel (Triton's interpreter on the CPU: tests/conftest.py sets
    # TRITON_INTERPRET for the suite's processes, the ranks included, so it shares the launch),
    # its row gradients going into Megatron DDP's main_grad, under TP=2 + SP; steps 1-3 only
    # (KERNEL_STEPS).
    launches.add("tp2_sp_kernel", STEM + ITERS + start + TP2 +
                 ["--sequence-parallel", "--stem-kernel", "triton", "--exit-interval", "3"])
    r = launches.run()
    require_ok(r.pop("init"))
    CKPT.update(ref=ck_ref, workdir=str(tmp))
    return r


def test_reference_trains(runs):
    ref = require_ok(runs["ref"])
    assert sorted(ref.losses) == [1, 2, 3, 4, 5, 6]
    assert ref.losses[6] < ref.losses[1]


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "tp2_sp_kernel", "pp2_recompute",
                                    "pp2_vpp"])
def test_layout_does_not_change_losses(runs, layout):
    run = require_ok(runs[layout])
    steps = KERNEL_STEPS if layout == "tp2_sp_kernel" else FIRST5
    assert sorted(run.losses) == (steps if layout == "tp2_sp_kernel" else ITERATIONS)
    assert_close_curves(run, require_ok(runs["ref"]), steps)
    if layout == "tp2_sp_kernel":
        assert_close_scalars(run, require_ok(runs["ref"]), "grad-norm", KERNEL_STEPS)


def test_resume_continues_the_curve_exactly(runs):
    ref, resumed = require_ok(runs["ref"]), require_ok(runs["resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == ref.curve(AFTER_RESUME)


def test_resume_with_dropout_continues_the_curve_exactly(runs):
    """Dropout on (the preset's 0.1): the resumed run draws the same masks as the uninterrupted
    one. On the CPU backend dropout's generator is the CPU one, from which each data loader's
    iterator, built after the checkpoint's random state is restored, draws a seed
    (megatron_ext/compat/cpu.py)."""
    ref, resumed = require_ok(runs["dropout"]), require_ok(runs["dropout_resume"])
    for flag in ("attention_dropout", "hidden_dropout"):  # Megatron's dump of its arguments
        assert re.search(rf"^  {flag} \.+ 0\.1$", ref.log, re.M), flag
    assert sorted(resumed.losses) == AFTER_RESUME
    assert_close_curves(resumed, ref, AFTER_RESUME, tol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend's defaults")
def test_cpu_runs_need_no_cpu_flags(runs):
    """TINY_GPT names no backend, initialization or fusion flag: without CUDA the entry point
    chooses them and says so (megatron_ext/compat/cpu.py)."""
    log = require_ok(runs["ref"]).log
    assert ("megatron-ext: no CUDA: CPU backend defaults --distributed-backend gloo "
            "--use-cpu-initialization --no-gradient-accumulation-fusion") in log


def test_console_losses_after_resume_are_the_iterations_own(runs):
    """The loss the console prints for each iteration after a resume is that iteration's (as in
    tensorboard), not the mean of the first two (megatron_ext/compat/upstream_fixes.py)."""
    resumed = require_ok(runs["resume"])
    printed = {int(i): float(v) for i, v in
               re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", resumed.log)}
    assert sorted(printed) == AFTER_RESUME
    for i in AFTER_RESUME:
        assert abs(printed[i] - resumed.losses[i]) <= 1e-6 * abs(resumed.losses[i]), (i, printed)


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


def test_saves_write_checksum_manifests_and_resume_verifies_them(runs):
    """Every save of the trainer leaves a manifest (written by rank 0's manifest thread) that
    matches the files; the resume checks the checkpoint against it before loading."""
    from megatron_ext import checkpoint_manifest as cm

    require_ok(runs["ref"])
    for it in (3, 6):
        folder = cm.iteration_dir(CKPT["ref"], it)
        manifest = cm.verify(folder)
        assert manifest is not None and manifest["iteration"] == it
        assert sorted(manifest["files"]) == cm.checkpoint_files(folder)
        assert any(n.endswith(".distcp") for n in manifest["files"])
    resumed = require_ok(runs["resume"])
    assert re.search(rf"megatron-ext: checkpoint {re.escape(cm.iteration_dir(CKPT['ref'], 3))}: "
                     r"\d+ files match their checksums", resumed.log), resumed.log[-3000:]


def test_a_damaged_checkpoint_is_refused_naming_the_file(runs):
    """4 KiB of garbage written into a .distcp: DCP loads it silently (no checksums); the trainer
    stops on every rank before loading, naming the file."""
    from megatron_ext import checkpoint_manifest as cm

    require_ok(runs["ref"])
    damaged = os.path.join(CKPT["workdir"], "ck_damaged")
    shutil.copytree(CKPT["ref"], damaged)
    folder = cm.iteration_dir(damaged, 3)
    target = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[-1]
    with open(os.path.join(folder, target), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(folder, target)) // 2)
        f.write(b"\x5a" * 4096)
    run = torchrun("damaged_resume", CKPT["workdir"], STEM + ITERS +
                   ["--load", damaged, "--ckpt-step", "3"])
    assert run.returncode != 0
    line = (f"megatron-ext: checkpoint {folder} is damaged: {os.path.join(folder, target)}: its "
            "SHA-256 differs from the manifest's")
    assert line in run.log, run.log[-3000:]
    assert "Traceback" not in run.log


def test_teardown_frees_every_training(runs):
    """The launches' STEM trainings (TP=2 + SP, PP=2, the fused kernel) are each freed at their
    teardown with their process groups."""
    assert_teardown_left_only_the_default_group(runs)
