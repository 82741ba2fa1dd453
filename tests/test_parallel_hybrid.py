"""The hybrid path (``--hybrid-layer-pattern``, upstream's ``HybridModel``): the dense and STEM
families train on it, ``*-`` repeated gives the GPT path's losses, and STEM's layout does not
change the numbers (TP=2 + SP, PP=2 with full recompute, interleaved PP=2, managed tables alone
and with PP=2 and full recompute, the tiered placement alone and with PP=2 and full recompute,
against TP=1 x DP=2), and a resume is exact. fp32, CPU, gloo, 2 ranks, all in one launch."""

from __future__ import annotations

import pytest

from multirank import (TINY_GPT, Launches, assert_close_curves,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

HYBRID = ["--hybrid-layer-pattern", "*-*-*-*-"]  # TINY_GPT's 4 blocks; --num-layers is derived
STEM = ["--model-family", "stem", "--stem-ratio", "1/2"]  # MLP blocks 1 and 3 (layers 3 and 7)
ITERS = ["--train-iters", "6"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# The stage boundary in the pattern; full recompute of every layer.
PP2_RECOMPUTE = ["--hybrid-layer-pattern", "*-*-|*-*-", "--pipeline-model-parallel-size", "2",
                 "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
# Four segments on two stages: interleaved 1F1B, chunks {0, 2} and {1, 3}; STEM in chunks 1, 3.
PP2_VPP = ["--hybrid-layer-pattern", "*-|*-|*-|*-", "--pipeline-model-parallel-size", "2"]
# Managed tables: host-resident, rows sharded over DP, bound per micro-batch (stem/runtime/tables.py).
CPU_VOCAB = ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]
# The tiered placement: the hottest 25% of rows in a tier on the model's device, the rest host rows.
TIERED = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
          "--stem-gpu-tier", "25%"]
EVAL = ["--eval-interval", "3", "--eval-iters", "1"]  # evaluation: no recompute, model.eval()
FIRST5 = [1, 2, 3, 4, 5]
AFTER_RESUME = [4, 5, 6]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_parallel")
    ck_init, ck_ref, ck_gpt, ck_stem_gpt = (str(tmp / n) for n in
                                            ("ck_init", "ck_ref", "ck_gpt", "ck_stem_gpt"))
    start = ["--load", ck_init, "--finetune"]
    launches = Launches(str(tmp))
    # From scratch: the same seed draws the same parameters on both paths.
    launches.add("gpt_path", TINY_GPT + ITERS + ["--save", ck_gpt, "--save-interval", "3"])
    launches.add("gpt_hybrid", TINY_GPT + ITERS + HYBRID)
    # A GPT-path checkpoint resumed on the hybrid path (upstream's GPT/hybrid interoperation,
    # megatron.core.dist_checkpointing.gpt_checkpoint_interop).
    launches.add("gpt_to_hybrid_resume", TINY_GPT + ITERS + HYBRID + ["--load", ck_gpt,
                                                                      "--ckpt-step", "3"])
    launches.add("stem_gpt_path", TINY_GPT + ITERS + STEM + EVAL + ["--save", ck_stem_gpt,
                                                                    "--save-interval", "3"])
    launches.add("stem_hybrid", TINY_GPT + ITERS + HYBRID + STEM + EVAL)
    # STEM's GPT-path checkpoints have a key per layer: our retargeting
    # (models/hybrid_checkpoint.py), also into another layout and into managed tables.
    from_stem_gpt = ["--load", ck_stem_gpt, "--ckpt-step", "3"]
    launches.add("stem_gpt_to_hybrid_resume", TINY_GPT + ITERS + HYBRID + STEM + from_stem_gpt)
    launches.add("stem_gpt_to_hybrid_pp2", TINY_GPT + ITERS + STEM + from_stem_gpt +
                 PP2_RECOMPUTE)
    # Into managed tables the optimizer state does not load (the tables are no parameters of
    # Megatron's optimizer, as on the GPT path): compared with the GPT path doing the same.
    to_managed = from_stem_gpt + CPU_VOCAB + ["--no-load-optim"]
    launches.add("stem_gpt_to_gpt_cpu_vocab", TINY_GPT + ITERS + STEM + to_managed)
    launches.add("stem_gpt_to_hybrid_cpu_vocab", TINY_GPT + ITERS + HYBRID + STEM + to_managed)
    # Every layout starts from one checkpoint (initialisation independent of the layout).
    launches.add("init", TINY_GPT + HYBRID + STEM + ["--train-iters", "1", "--lr-warmup-iters",
                                                     "0", "--save", ck_init,
                                                     "--save-interval", "1"])
    launches.add("ref", TINY_GPT + HYBRID + STEM + ITERS + start +
                 ["--save", ck_ref, "--save-interval", "3"])
    launches.add("tp2_sp", TINY_GPT + HYBRID + STEM + ITERS + start + TP2_SP)
    launches.add("pp2_recompute", TINY_GPT + STEM + ITERS + start + PP2_RECOMPUTE)
    launches.add("pp2_vpp", TINY_GPT + STEM + ITERS + start + PP2_VPP)
    launches.add("cpu_vocab", TINY_GPT + HYBRID + STEM + ITERS + start + CPU_VOCAB)
    launches.add("cpu_vocab_pp2_recompute", TINY_GPT + STEM + ITERS + start + CPU_VOCAB +
                 PP2_RECOMPUTE)
    launches.add("tiered", TINY_GPT + HYBRID + STEM + ITERS + start + TIERED)
    launches.add("tiered_pp2_recompute", TINY_GPT + STEM + ITERS + start + TIERED +
                 PP2_RECOMPUTE)
    launches.add("resume", TINY_GPT + HYBRID + STEM + ITERS + ["--load", ck_ref,
                                                               "--ckpt-step", "3"])
    r = launches.run()
    require_ok(r.pop("init"))
    return r


@pytest.mark.parametrize("name", ["gpt_hybrid", "stem_hybrid", "ref"])
def test_hybrid_path_trains_a_hybrid_model(runs, name):
    run = require_ok(runs[name])
    assert sorted(run.losses) == [1, 2, 3, 4, 5, 6]
    assert run.losses[6] < run.losses[1]
    # GPTModel's constructor logs its deprecation; HybridModel is built instead.
    assert "GPTModel IS DEPRECATED" not in run.log
    assert "GPTModel IS DEPRECATED" in require_ok(runs["gpt_path"]).log


@pytest.mark.parametrize("gpt,hybrid", [("gpt_path", "gpt_hybrid"),
                                        ("stem_gpt_path", "stem_hybrid")])
def test_star_dash_repeated_gives_the_gpt_path_losses(runs, gpt, hybrid):
    assert_close_curves(require_ok(runs[hybrid]), require_ok(runs[gpt]), [1, 2, 3, 4, 5, 6])


def test_stem_evaluation_on_the_hybrid_path_gives_the_gpt_path_losses(runs):
    gpt, hybrid = require_ok(runs["stem_gpt_path"]), require_ok(runs["stem_hybrid"])
    valid = hybrid.scalars["lm loss validation"]
    assert [step for step, _ in valid][:2] == [3, 6]
    assert valid == gpt.scalars["lm loss validation"]


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2_recompute", "pp2_vpp", "cpu_vocab",
                                    "cpu_vocab_pp2_recompute", "tiered",
                                    "tiered_pp2_recompute"])
def test_stem_layout_does_not_change_losses(runs, layout):
    assert_close_curves(require_ok(runs[layout]), require_ok(runs["ref"]), FIRST5)


def test_stem_resume_continues_the_curve_exactly(runs):
    ref, resumed = require_ok(runs["ref"]), require_ok(runs["resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == ref.curve(AFTER_RESUME)


def test_dense_gpt_path_checkpoint_resumes_on_the_hybrid_path(runs):
    gpt, resumed = require_ok(runs["gpt_path"]), require_ok(runs["gpt_to_hybrid_resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == gpt.curve(AFTER_RESUME)


@pytest.mark.parametrize("name", ["stem_gpt_to_hybrid_resume", "stem_gpt_to_hybrid_pp2"])
def test_stem_gpt_path_checkpoint_continues_on_the_hybrid_path(runs, name):
    gpt, resumed = require_ok(runs["stem_gpt_path"]), require_ok(runs[name])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert_close_curves(resumed, gpt, AFTER_RESUME)
    if name == "stem_gpt_to_hybrid_resume":  # the same layout: the same numbers
        assert resumed.curve(AFTER_RESUME) == gpt.curve(AFTER_RESUME)


def test_stem_gpt_path_checkpoint_loads_into_managed_tables_on_the_hybrid_path(runs):
    gpt, hybrid = (require_ok(runs[n]) for n in ("stem_gpt_to_gpt_cpu_vocab",
                                                 "stem_gpt_to_hybrid_cpu_vocab"))
    assert sorted(hybrid.losses) == AFTER_RESUME
    assert_close_curves(hybrid, gpt, AFTER_RESUME)


def test_teardown_between_trainings_leaves_only_the_default_group(runs):
    """The launch's trainings (TP=2, PP=2, DP=2, managed and tiered tables) end with every process
    group but the default one destroyed and freed (megatron_ext.training.teardown), so gloo's
    threads do not pile up across the trainings of a launch."""
    assert_teardown_left_only_the_default_group(runs)
