"""Sigma under expert parallelism (Megatron's alltoall and allgather dispatchers, alone and with
TP=2 + SP on 4 ranks; alltoall under TP needs the CPU backend's uneven gather/reduce-scatter) and progressive sparsification across a resume: the layout must not change
the losses (1e-5), nor does PP=2 with full recompute, and the top-k switch happens at its step inside one run and after a resume on
either side of it.

``--moe-grouped-gemm`` (without Transformer Engine: the torch grouped experts,
``megatron_ext/models/grouped_experts.py``) under EP=2 and TP=2 + SP + EP=2 must give the same
losses, starting from the checkpoint saved with sequential experts; a checkpoint the grouped
experts save (EP=2) resumes with sequential ones at EP=1, optimizer state included.

A checkpoint resumes at another expert-parallel size, optimizer state included (EP=2 makes
Megatron's optimizer a chain of a dense and an expert optimizer, EP=1 one optimizer:
``compat/upstream_fixes.py``, ``optimizer_state_across_expert_parallel_sizes``): EP=1 -> EP=2
(``resume_before``), EP=2 -> EP=1 (``resume_after``), and with the distributed optimizer's
model-space format (``--dist-ckpt-optim-fully-reshardable``) EP=2 -> EP=1.

Every run starts from one checkpoint (``--finetune``: with EP each rank initializes only its own
experts, so fresh initializations would differ). fp32, CPU, gloo, global-batch LBL on (coefficient
0.01). 32 experts of width 16 and 16 tokens per micro-batch per rank (8 per rank under TP=2 + SP):
in every micro-batch at least half of the experts get no token from a rank, so the dispatchers
run with empty experts and zero-sized splits. Layers 0 and 1 route to 2 experts for steps 1-3
(``--sigma-topk-schedule [2,2] --sigma-sparsify-at 3``), every layer to 1 from step 4 on, so the
dispatchers' buffers change size inside the run.
"""

from __future__ import annotations

import pytest

from megatron_ext.checkpoint_reader import MegatronCheckpoint
from multirank import (TINY_GPT, Launches, assert_close_curves,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

SIGMA = TINY_GPT + [
    "--model-family", "sigma", "--num-experts", "32", "--moe-ffn-hidden-size", "16",
    "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--sigma-lbl", "global", "--sigma-lbl-coeff", "0.01",
    "--sigma-topk-schedule", "[2,2]", "--sigma-sparsify-at", "3",
]
ITERS = ["--train-iters", "6"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
AG = ["--moe-token-dispatcher-type", "allgather"]
EP2 = ["--expert-model-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
GROUPED = ["--moe-grouped-gemm"]
DOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
STEPS = [1, 2, 3, 4, 5, 6]
LAYERS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigma_parallel")
    init = str(tmp / "init")
    ck = str(tmp / "ck")
    grouped_ck = str(tmp / "grouped_ck")
    dopt_ck = str(tmp / "dopt_ck")
    start = ["--load", init, "--finetune"]
    # In order; those of one rank count in one launch (tests/multirank.py, Launches).
    launches = Launches(str(tmp))
    launches.add("init", SIGMA + A2A + ["--train-iters", "1", "--lr-warmup-iters", "0", "--save",
                                        init, "--save-interval", "1"])
    launches.add("ref", SIGMA + A2A + ITERS + start + ["--save", ck, "--save-interval", "2"])
    launches.add("ep2_alltoall", SIGMA + A2A + ITERS + start + EP2)  # DP=2, EP=1 above
    # The grouped experts load the sequential experts' checkpoint, and save one at step 4 that
    # resume_after resumes from with sequential experts.
    launches.add("grouped_ep2_alltoall", SIGMA + A2A + ITERS + start + EP2 + GROUPED + [
        "--save", grouped_ck, "--save-interval", "4"])
    launches.add("ep2_allgather", SIGMA + AG + ITERS + start + EP2)
    # The distributed optimizer at EP=2 (a dense and an expert one), saved at step 4 in its
    # model-space format for resume_dopt_ep1.
    launches.add("dopt_ep2", SIGMA + A2A + ITERS + start + EP2 + DOPT + [
        "--save", dopt_ck, "--save-interval", "4"])
    # DP=1 (8 micro-batches) with PP=2 and full recompute (the no-grad first pass must not add
    # to the statistics; the per-layer logs come from both stages).
    launches.add("pp2_recompute", SIGMA + A2A + ITERS + start + [
        "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    # Before the switch, from the EP=1 checkpoint, at EP=2.
    launches.add("resume_before", SIGMA + A2A + ITERS + EP2 + ["--load", ck, "--ckpt-step", "2"])
    # After the switch, from the grouped experts' EP=2 checkpoint (model and Adam's moments),
    # with sequential experts at EP=1.
    launches.add("resume_after", SIGMA + A2A + ITERS + ["--load", grouped_ck, "--ckpt-step", "4"])
    launches.add("resume_dopt_ep1", SIGMA + A2A + ITERS + DOPT + ["--load", dopt_ck,
                                                                  "--ckpt-step", "4"])
    launches.add("tp2_ep2_alltoall", SIGMA + A2A + ITERS + start + EP2 + TP2_SP, nproc=4)
    launches.add("tp2_ep2_allgather", SIGMA + AG + ITERS + start + EP2 + TP2_SP, nproc=4)
    launches.add("grouped_tp2_ep2_alltoall", SIGMA + A2A + ITERS + start + EP2 + TP2_SP +
                 GROUPED, nproc=4)
    r = launches.run()
    require_ok(r["init"])
    r["checkpoints"] = {"sequential": ck, "grouped": grouped_ck, "dopt": dopt_ck}
    return r


@pytest.mark.parametrize("layout", ["ep2_alltoall", "ep2_allgather", "tp2_ep2_alltoall",
                                    "tp2_ep2_allgather", "pp2_recompute",
                                    "grouped_ep2_alltoall", "grouped_tp2_ep2_alltoall",
                                    "dopt_ep2"])
def test_expert_parallel_layouts_do_not_change_losses(runs, layout):
    ref = require_ok(runs["ref"])
    assert len({round(v, 4) for v in ref.losses.values()}) == len(STEPS)  # it trains
    assert_close_curves(require_ok(runs[layout]), ref, STEPS)


@pytest.mark.parametrize("layout", ["ep2_allgather", "tp2_ep2_alltoall", "pp2_recompute"])
def test_load_balance_logs_agree_across_layouts(runs, layout):
    """Global statistics: the same per-layer LBL and max-load deviation in every layout.

    The token counts (max-load deviation, CV of f) are discrete: under TP the router's inputs
    differ in the last bits (other reduction order), so a token whose two best logits nearly tie
    may go to the other expert, which moves N_E f by N_E / (k T) = 0.25 here. The TP layout may
    therefore differ in what depends on f (LBL, deviation, CV of f) in one (layer, step); the CV
    of the probabilities P must always agree. (Seen once in CI: one flip at layer 1, step 3,
    while the losses still agreed to 1e-6.)"""
    run, ref = require_ok(runs[layout]), require_ok(runs["ref"])
    count_mismatches = set()
    for layer in range(LAYERS):
        for tag in (f"sigma/global_lbl_layer_{layer}", f"sigma/load_deviation_max_layer_{layer}",
                    f"sigma/f_cv_layer_{layer}", f"sigma/p_cv_layer_{layer}"):
            got, want = dict(run.scalars[tag]), dict(ref.scalars[tag])
            assert sorted(got) == STEPS
            counts = "p_cv" not in tag  # the LBL, the deviation and CV(f) contain f
            for step in STEPS:
                if counts and "tp2" in layout and abs(got[step] - want[step]) >= 1e-5:
                    count_mismatches.add((layer, step))
                    continue
                assert abs(got[step] - want[step]) < 1e-5, (tag, step, got[step], want[step])
    assert len(count_mismatches) <= 1, count_mismatches


def topk_log(run, layer):
    return dict(run.scalars[f"sigma/topk_layer_{layer}"])


def test_topk_switches_at_its_step(runs):
    ref = require_ok(runs["ref"])
    assert topk_log(ref, 0) == {1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 1}
    assert topk_log(ref, 1) == topk_log(ref, 0)
    assert topk_log(ref, 2) == {s: 1 for s in STEPS}
    assert "Sigma top-k per layer: [2, 2, 1, 1], after step 3: [1, 1, 1, 1]" in ref.log


@pytest.mark.parametrize("name,first", [("resume_before", 3), ("resume_after", 5)])
def test_resume_across_the_switch(runs, name, first):
    """Resumed before the switch (from step 2 of the EP=1 run, at EP=2) and after it (from step
    4 of the grouped experts' EP=2 run, at EP=1): same top-k per step and the uninterrupted
    run's losses. Before ``optimizer_state_across_expert_parallel_sizes`` both stopped in
    Megatron's load: "Expected 2 entries in state dict, but got 4" and "Could not find parameter
    group with key (..., False, False) in loaded checkpoint"."""
    run, ref = require_ok(runs[name]), require_ok(runs["ref"])
    steps = list(range(first, 7))
    assert sorted(run.losses) == steps
    assert_close_curves(run, ref, steps)
    assert {s: v for s, v in topk_log(run, 0).items()} == {s: topk_log(ref, 0)[s] for s in steps}


def test_distributed_optimizer_state_resumes_at_another_expert_parallel_size(runs):
    """``--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable`` saved at EP=2
    (``dopt_ep2``, whose losses are the reference's), resumed from step 4 at EP=1: the
    uninterrupted run's losses (steps 5-6, 1e-5; a resume of this model with
    ``--no-load-optim`` moved its second step's loss by 2.5e-2). It stopped in Megatron's load on KeyError 'optimizer' (the chain's common state),
    then KeyError 'step' (torch's Adam: no fully reshardable resume at any size)."""
    resumed, ref = require_ok(runs["resume_dopt_ep1"]), require_ok(runs["ref"])
    assert "dopt_ck/iter_0000004" in resumed.log
    assert sorted(resumed.losses) == [5, 6]
    assert_close_curves(resumed, ref, [5, 6])


def test_grouped_experts_checkpoints_interchange_with_sequential_ones(runs):
    """The grouped runs built the torch grouped experts (their log says which GEMM ran: the
    CPU's grouped_mm in fp32) from the sequential experts' checkpoint (their losses:
    ``test_expert_parallel_layouts_do_not_change_losses``); sequential experts resumed from the
    grouped experts' step-4 checkpoint at EP=1 (model and Adam's moments; ``resume_after``)
    continue the uninterrupted run (steps 5-6, 1e-5)."""
    for name in ("grouped_ep2_alltoall", "grouped_tp2_ep2_alltoall"):
        log = require_ok(runs[name]).log
        assert "megatron-ext: grouped experts, fc1: grouped_mm" in log, name
        assert "megatron-ext: grouped experts, fc2: grouped_mm" in log, name
    # What the converters read (megatron_ext/checkpoint_reader.py): the same model tensors, of
    # the same global shapes, in the grouped EP=2 checkpoint as in the sequential EP=1 one.
    def model_shapes(path):
        ckpt = MegatronCheckpoint(path, 4)
        return {k: ckpt.shape(k) for k in ckpt.tensor_keys() if not k.startswith("optimizer")}

    shapes = model_shapes(runs["checkpoints"]["grouped"])
    assert shapes == model_shapes(runs["checkpoints"]["sequential"])
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 32, 32, 64)
    resumed, ref = require_ok(runs["resume_after"]), require_ok(runs["ref"])
    assert "grouped experts" not in resumed.log
    assert "grouped_ck/iter_0000004" in resumed.log
    assert sorted(resumed.losses) == [5, 6]
    assert_close_curves(resumed, ref, [5, 6])


def test_build_prints_parameter_counts(runs):
    log = require_ok(runs["init"]).log
    line = next(l for l in log.splitlines() if "Sigma MoE parameters" in l)
    from megatron_ext.sigma.budget import SigmaBudget

    # 4 layers, hidden 64, 4 heads of 16 in 2 groups, 32 experts of 16, vocab 1000 padded to 1024
    b = SigmaBudget(4, 64, 4, 2, 16, 32, 16, 1024, tied_embeddings=False)
    assert f"total {b.total:,}" in line
    assert f"active per token {b.active([1, 1, 1, 1]):,}" in line
    assert f"before the sparsification switch {b.active([2, 2, 1, 1]):,}" in line


def test_teardown_frees_each_sigma_model_and_its_groups(runs):
    """Each Sigma training's model is freed at its teardown with its process groups (the alltoall
    dispatcher's last routing probabilities kept it alive: ``sigma.layer.release_layers``), under
    both dispatchers, EP=2 with TP=2 + SP on 4 ranks among them."""
    assert_teardown_left_only_the_default_group(runs)

