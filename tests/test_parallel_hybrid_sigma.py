"""Sigma MoE on the hybrid path (``--hybrid-layer-pattern`` with ``*E`` repeated, upstream's
``HybridModel``): the k-th ``E`` is Sigma layer k, so ``*E*E*E*E`` gives the GPT path's losses,
per-layer top-k and global-batch LBL logs; the layout does not change the numbers (TP=2 + SP,
PP=2 with the stage boundary in the pattern and full recompute, EP=2, against TP=1 x DP=2); a
resume is exact; a GPT-path Sigma checkpoint continues on the hybrid path with the GPT path's
losses (upstream's GPT/hybrid interoperation maps ``E`` positions onto GPT layers).

The tiny Sigma of ``tests/test_parallel_sigma.py`` (fp32, CPU, gloo, 2 ranks, 32 experts of
width 16, global-batch LBL 0.01), with a top-k that differs between layers before the switch
(``[3,1,2]`` for layers 0-2 in steps 1-3, every layer top-1 from steps 4-5): a Sigma layer
that took another layer's top-k would route differently (giving every ``E`` Sigma layer 0 fails
the GPT-path comparisons and the log checks). Every layout starts from one checkpoint (with EP
each rank initializes only its own experts). All in one launch.
"""

from __future__ import annotations

import pytest

from multirank import (TINY_GPT, Launches, assert_close_curves,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

SIGMA = TINY_GPT + [
    "--model-family", "sigma", "--num-experts", "32", "--moe-ffn-hidden-size", "16",
    "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--sigma-lbl", "global", "--sigma-lbl-coeff", "0.01",
    "--sigma-topk-schedule", "[3,1,2]", "--sigma-sparsify-at", "3",
    "--moe-token-dispatcher-type", "alltoall",
]
HYBRID = ["--hybrid-layer-pattern", "*E*E*E*E"]  # TINY_GPT's 4 blocks; --num-layers is derived
ITERS = ["--train-iters", "5"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2 = ["--expert-model-parallel-size", "2"]
# The stage boundary in the pattern; full recompute of every layer.
PP2_RECOMPUTE = ["--hybrid-layer-pattern", "*E*E|*E*E", "--pipeline-model-parallel-size", "2",
                 "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
STEPS = [1, 2, 3, 4, 5]
AFTER_RESUME = [4, 5]
LAYERS = 4  # Sigma layers: the E symbols


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_sigma")
    ck_gpt, ck_init, ck_ref = (str(tmp / n) for n in ("ck_gpt", "ck_init", "ck_ref"))
    start = ["--load", ck_init, "--finetune"]
    launches = Launches(str(tmp))
    # From scratch: the same seed draws the same parameters on both paths.
    launches.add("gpt_path", SIGMA + ITERS + ["--save", ck_gpt, "--save-interval", "3"])
    launches.add("hybrid", SIGMA + ITERS + HYBRID)
    # A GPT-path checkpoint (stacked layers) continued on the hybrid path.
    launches.add("gpt_to_hybrid", SIGMA + ITERS + HYBRID + ["--load", ck_gpt,
                                                             "--ckpt-step", "3"])
    launches.add("init", SIGMA + HYBRID + ["--train-iters", "1", "--lr-warmup-iters", "0",
                                           "--save", ck_init, "--save-interval", "1"])
    launches.add("ref", SIGMA + HYBRID + ITERS + start + ["--save", ck_ref,
                                                          "--save-interval", "3"])  # DP=2
    launches.add("tp2_sp", SIGMA + HYBRID + ITERS + start + TP2_SP)
    launches.add("pp2_recompute", SIGMA + ITERS + start + PP2_RECOMPUTE)
    launches.add("ep2", SIGMA + HYBRID + ITERS + start + EP2)
    launches.add("resume", SIGMA + HYBRID + ITERS + ["--load", ck_ref, "--ckpt-step", "3"])
    r = launches.run()
    require_ok(r.pop("init"))
    return r


def sigma_tags(run):
    return sorted(tag for tag in run.scalars if tag.startswith("sigma/"))


def test_star_e_repeated_gives_the_gpt_path_losses(runs):
    gpt, hybrid = require_ok(runs["gpt_path"]), require_ok(runs["hybrid"])
    assert len(set(gpt.losses.values())) == len(STEPS)  # it trains
    assert "GPTModel IS DEPRECATED" not in hybrid.log  # HybridModel was built
    assert hybrid.curve(STEPS) == gpt.curve(STEPS)  # the same computation: exactly


def test_the_kth_e_is_sigma_layer_k(runs):
    """The per-layer logs name Sigma layers (E blocks), not pattern positions, with the top-k of
    that layer: layers 0-2 differ before the switch. The parameter counts count 4 layers."""
    gpt, hybrid = require_ok(runs["gpt_path"]), require_ok(runs["hybrid"])
    assert sigma_tags(hybrid) == sigma_tags(gpt)
    assert f"sigma/topk_layer_{LAYERS - 1}" in sigma_tags(hybrid)
    assert f"sigma/topk_layer_{LAYERS}" not in sigma_tags(hybrid)
    for layer, before in enumerate([3, 1, 2, 1]):
        want = {s: (before if s <= 3 else 1) for s in STEPS}
        assert dict(hybrid.scalars[f"sigma/topk_layer_{layer}"]) == want, layer
    assert "Sigma top-k per layer: [3, 1, 2, 1], after step 3: [1, 1, 1, 1]" in hybrid.log

    def budget(log):
        return next(line.split("> ", 1)[1] for line in log.splitlines()
                    if "Sigma MoE parameters" in line)

    assert budget(hybrid.log) == budget(gpt.log)


def test_global_batch_lbl_logs_match_the_gpt_path(runs):
    """Per layer and their mean (over the Sigma layers only: no attention position dilutes it),
    exactly."""
    gpt, hybrid = require_ok(runs["gpt_path"]), require_ok(runs["hybrid"])
    for tag in [f"sigma/global_lbl_layer_{layer}" for layer in range(LAYERS)] + [
            "sigma/global_lbl"]:
        got, want = dict(hybrid.scalars[tag]), dict(gpt.scalars[tag])
        assert sorted(got) == STEPS, tag
        assert got == want, tag
    mean = dict(hybrid.scalars["sigma/global_lbl"])
    per_layer = [dict(hybrid.scalars[f"sigma/global_lbl_layer_{layer}"]) for layer in
                 range(LAYERS)]
    for step in STEPS:
        assert abs(mean[step] - sum(p[step] for p in per_layer) / LAYERS) < 1e-6


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2_recompute", "ep2"])
def test_layout_does_not_change_losses(runs, layout):
    ref = require_ok(runs["ref"])
    assert len(set(ref.losses.values())) == len(STEPS)  # it trains
    assert_close_curves(require_ok(runs[layout]), ref, STEPS)


@pytest.mark.parametrize("layout", ["pp2_recompute", "ep2"])
def test_load_balance_logs_agree_across_layouts(runs, layout):
    """The global-batch statistics, all-reduced over DP (DP=2 in ``ref``, 1 under PP=2), per
    Sigma layer (under PP=2 two on each stage)."""
    run, ref = require_ok(runs[layout]), require_ok(runs["ref"])
    assert sigma_tags(run) == sigma_tags(ref)
    for layer in range(LAYERS):
        for tag in (f"sigma/global_lbl_layer_{layer}", f"sigma/p_cv_layer_{layer}",
                    f"sigma/load_deviation_max_layer_{layer}"):
            got, want = dict(run.scalars[tag]), dict(ref.scalars[tag])
            assert sorted(got) == STEPS, tag
            for step in STEPS:
                assert abs(got[step] - want[step]) < 1e-5, (tag, step, got[step], want[step])


def test_resume_continues_the_curve_exactly(runs):
    ref, resumed = require_ok(runs["ref"]), require_ok(runs["resume"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == ref.curve(AFTER_RESUME)


def test_gpt_path_checkpoint_continues_on_the_hybrid_path(runs):
    gpt, resumed = require_ok(runs["gpt_path"]), require_ok(runs["gpt_to_hybrid"])
    assert sorted(resumed.losses) == AFTER_RESUME
    assert resumed.curve(AFTER_RESUME) == gpt.curve(AFTER_RESUME)


def test_teardown_frees_every_training(runs):
    """The launches' Sigma trainings on the hybrid path are each freed at their teardown with their
    process groups."""
    assert_teardown_left_only_the_default_group(runs)
