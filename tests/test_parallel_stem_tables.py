"""Managed STEM tables (host placement, vocab sharding, CPU AdamW) trained through ``pretrain``:
every placement x sharding x parallel layout gives the losses of the ordinary table (a Megatron
parameter, DP=1) and, with the dense optimizer, the same final table. fp32, CPU, gloo; all runs
start from the same seed. Table values do not depend on the layout, but Megatron's other
initial weights depend on TP and PP, so TP and PP layouts are compared with the ordinary table in
the same layout (tests/test_parallel_stem.py shows that layout matches TP=1 / PP=1)."""

from __future__ import annotations

import glob
import json
import re

import pytest
import torch

from multirank import (TINY_GPT, Launches, assert_close_curves, assert_close_scalars,
                       assert_teardown_left_only_the_default_group, require_ok)

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

STEM = TINY_GPT + ["--model-family", "stem", "--stem-layers", "1,3", "--train-iters", "10"]
CPU_VOCAB = ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]
TIERED = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
          "--stem-gpu-tier", "25%"]
# benchmarks/stem_placement.py's gpu-sparse variant.
GPU_SPARSE = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
              "--stem-optimizer", "sparse", "--stem-gpu-tier", "100%"]
STEPS = list(range(1, 11))
# The fused kernel's run stops after step 3 (``--exit-interval``; ``--train-iters`` and so the
# learning-rate schedule stay the reference's): under Triton's interpreter each step costs it
# about 9 s on 2 cores, and steps 1-3 already hold what the comparison checks: step 1's loss the
# kernel's forward on the fetched rows, steps 2 and 3 two updates from its gradients (the rows'
# through the exchange into the host optimizer, W_gate's and W_down's), Adam's moments and the
# overlapped table step included. Steps 4-10 run the same kernel on the same path again. Its
# gradient norm (the tables' included) is compared too: a wrong gradient shows in it at the step
# it is made (1e-7 apart unbroken; tests/test_parallel_stem.py's KERNEL_STEPS: a 1% error in the
# kernel's gradient into fc1 moved it 3e-5, the losses of 5 steps not beyond 1e-5).
KERNEL_STEPS = [1, 2, 3]
VOCAB, FFN = 1024, 128  # padded vocab of TINY_GPT, --ffn-hidden-size


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stem_tables")
    launches = Launches(str(tmp))

    def run(name, flags, nproc=2, **options):
        launches.add(name, STEM + flags, nproc=nproc, **options)

    # In the order they run. Trainings of one rank count share a launch (tests/multirank.py,
    # Launches), so those of a count are together, each resume after the run it loads from: one
    # rank (ref, whose checkpoint two 2-rank trainings load), four, two (one of them resumes a
    # 4-rank checkpoint), one (resumes of 2-rank checkpoints). Four launches; a launch pays
    # seconds before its first step that the trainings after it in the launch do not.
    at5 = ["--ckpt-step", "5"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    pp2 = ["--pipeline-model-parallel-size", "2"]
    vpp = pp2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
    evals = ["--eval-interval", "4", "--eval-iters", "2"]

    run("ref", ["--save", str(tmp / "ck_ref"), "--save-interval", "5"], nproc=1)  # 4 micro-b.

    # Four ranks.
    run("ref_tp2_dp2", tp2, nproc=4)
    run("gpu_vocab_tp2_dp2", ["--stem-table-sharding", "vocab"] + tp2, nproc=4)
    run("tiered_tp2_dp2", TIERED + tp2, nproc=4)
    run("ref_pp2_dp2", pp2, nproc=4)
    run("cpu_vocab_pp2_dp2", CPU_VOCAB + pp2 + ["--stem-row-ownership", "contiguous"], nproc=4)
    # Full recompute under 1F1B: a recomputed layer must read its own micro-batch's rows, not
    # those bound for the micro-batch in flight (measured: 6.5e-3 off when it did).
    run("cpu_vocab_pp2_dp2_recompute", CPU_VOCAB + pp2 + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"], nproc=4)
    # Interleaved 1F1B: both chunks of the second stage (layers 1 and 3) have tables, so two
    # chunks share the rank's background thread and prefetch group (measured: a gloo collective
    # mismatch when each chunk had its own thread).
    run("ref_pp2_vpp_dp2", vpp, nproc=4)
    run("cpu_vocab_pp2_vpp_dp2", CPU_VOCAB + vpp, nproc=4)
    run("sparse_pp2_vpp_dp2", CPU_VOCAB + vpp + ["--stem-optimizer", "sparse", "--save",
                                                 str(tmp / "ck_sparse_vpp"), "--save-interval",
                                                 "5"], nproc=4)
    run("sparse_pp2_vpp_dp2_no_prefetch", CPU_VOCAB + vpp + ["--stem-optimizer", "sparse",
                                                             "--no-stem-prefetch"], nproc=4)
    # Its step-5 checkpoint, whose global rank 0 holds no tables (stage 0: layers 0 and 2),
    # resumed interleaved, and as PP=2 x DP=1 (stage 0: layers 0 and 1, below).
    run("resume_sparse_pp2_vpp_dp2", CPU_VOCAB + vpp + [
        "--stem-optimizer", "sparse", "--load", str(tmp / "ck_sparse_vpp")] + at5, nproc=4)

    # This one and tiered_sparse_dp2 (below) report their collectives, and their launches (and so
    # every training of 4 and of 2 ranks) run with every torch.distributed collective wrapped
    # (tests/dist/thread_guard.py): two chunks of tables per rank, and sparse with evaluation and
    # a checkpoint; prefetch and the overlapped table step on in both.
    run("tiered_pp2_vpp_dp2_recompute", TIERED + vpp + [
        "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"], nproc=4, thread_guard=True)

    # Two ranks.
    run("cpu_vocab_dp2", CPU_VOCAB + ["--stem-dump-tables", str(tmp / "dump_cpu_vocab"),
                                      "--save", str(tmp / "ck_vocab"), "--save-interval", "5"])
    # Resume at step 5 with another DP size, sharding or placement (and the model weights of an
    # ordinary checkpoint into managed tables and back).
    run("resume_cpu_replicated_dp2", ["--stem-table-placement", "cpu", "--load",
                                      str(tmp / "ck_vocab")] + at5)
    run("managed_from_ordinary", CPU_VOCAB + ["--load", str(tmp / "ck_ref"), "--no-load-optim",
                                              "--train-iters", "6"] + at5)
    run("cpu_vocab_dp2_no_prefetch", CPU_VOCAB + ["--no-stem-prefetch"])
    run("cpu_replicated_dp2", ["--stem-table-placement", "cpu", "--stem-cpu-threads", "3"])
    # Megatron's distributed optimizer (with overlapped gradient reduce and parameter gather) for
    # the rest of the model, chained with the table optimizer.
    run("cpu_vocab_dp2_dopt", CPU_VOCAB + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                           "--overlap-param-gather"])
    # Sparse, overlapped table step (prefetch on) vs synchronous, with evaluation and a checkpoint
    # between steps while the step of the rows may still run in the background.
    run("sparse_dp2", CPU_VOCAB + ["--stem-optimizer", "sparse", "--save",
                                   str(tmp / "ck_sparse"), "--save-interval", "5",
                                   "--stem-dump-tables", str(tmp / "dump_sparse")] + evals)
    run("sparse_dp2_no_prefetch", CPU_VOCAB + ["--stem-optimizer", "sparse",
                                               "--no-stem-prefetch"] + evals)
    # Tiered tables (a quarter of the rows in the "GPU" tier: the model's device, here the CPU).
    run("tiered_dp2", TIERED + ["--stem-dump-tables", str(tmp / "dump_tiered"), "--save",
                                str(tmp / "ck_tiered"), "--save-interval", "5"])
    run("tiered_sparse_dp2_no_prefetch", TIERED + ["--stem-optimizer", "sparse",
                                                   "--no-stem-prefetch"] + evals)
    # gpu-sparse (benchmarks/stem_placement.py): every row in the "GPU" tier, the sparse
    # row-wise AdamW; the like-for-like baseline of the host placements.
    run("gpu_sparse_dp2", GPU_SPARSE + ["--stem-dump-tables", str(tmp / "dump_gpu_sparse")]
        + evals)
    # Across placements and DP sizes.
    run("resume_tiered_dp2_from_cpu", TIERED + ["--load", str(tmp / "ck_vocab")] + at5)
    run("tiered_from_ordinary", TIERED + ["--load", str(tmp / "ck_ref"), "--no-load-optim",
                                          "--train-iters", "6"] + at5)
    # The fused lookup-and-gate kernel on the managed rows (Triton's interpreter on the CPU:
    # tests/conftest.py sets TRITON_INTERPRET for the suite's processes, the ranks included);
    # steps 1-3 only (KERNEL_STEPS).
    run("cpu_vocab_dp2_kernel", CPU_VOCAB + ["--stem-kernel", "triton", "--exit-interval", "3"])
    # Sparse tiered tables, compared with sparse_dp2 (test_tiered_tables); also profiled (steps
    # 3-4, every thread): the trace shows the tables' work on both threads, and the losses show
    # that profiling changes nothing.
    profile = ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0",
               "--profile-step-start", "3", "--profile-step-end", "5",
               "--ext-profile-all-threads"]
    run("tiered_sparse_dp2", TIERED + ["--stem-optimizer", "sparse", "--save",
                                       str(tmp / "ck_tiered_sparse"), "--save-interval", "5"]
        + evals + profile, thread_guard=True)
    run("resume_sparse_pp2_dp1", CPU_VOCAB + pp2 + [
        "--stem-optimizer", "sparse", "--load", str(tmp / "ck_sparse_vpp")] + at5)

    # One rank: resumes from the checkpoints above.
    run("resume_gpu_vocab_dp1", ["--stem-table-sharding", "vocab", "--load",
                                 str(tmp / "ck_vocab")] + at5, nproc=1)
    run("ordinary_from_managed", ["--load", str(tmp / "ck_vocab"), "--no-load-optim",
                                  "--train-iters", "6"] + at5, nproc=1)
    run("sparse_dp1", CPU_VOCAB + ["--stem-optimizer", "sparse"], nproc=1)
    run("resume_sparse_replicated_dp1", ["--stem-table-placement", "cpu", "--stem-optimizer",
                                         "sparse", "--load", str(tmp / "ck_sparse"),
                                         "--ckpt-step", "5"], nproc=1)
    run("resume_cpu_dp1_from_tiered", CPU_VOCAB + ["--load", str(tmp / "ck_tiered")] + at5,
        nproc=1)
    # With the GPU tier chosen anew at resume.
    run("resume_tiered_sparse_dp1_other_tier", TIERED + [
        "--stem-gpu-tier", "100", "--stem-optimizer", "sparse", "--load",
        str(tmp / "ck_tiered_sparse")] + at5, nproc=1)
    # Refused checkpoints: each fails (one rank: in the shared launch, which goes on).
    run("bad_vocab", CPU_VOCAB + ["--load", str(tmp / "ck_vocab"), "--vocab-size", "2000"],
        nproc=1, fails=True)
    run("bad_ffn", CPU_VOCAB + ["--load", str(tmp / "ck_vocab"), "--ffn-hidden-size", "64"],
        nproc=1, fails=True)
    run("resume_sparse_as_dense", CPU_VOCAB + ["--load", str(tmp / "ck_sparse"),
                                               "--ckpt-step", "5"], nproc=1, fails=True)
    out = launches.run()
    out["tmp"] = tmp
    return out


@pytest.mark.parametrize("layout,reference", [("cpu_vocab_dp2", "ref"),
                                              ("cpu_replicated_dp2", "ref"),
                                              ("cpu_vocab_dp2_dopt", "ref"),
                                              ("cpu_vocab_dp2_kernel", "ref"),
                                              ("gpu_vocab_tp2_dp2", "ref_tp2_dp2"),
                                              ("cpu_vocab_pp2_dp2", "ref_pp2_dp2"),
                                              ("cpu_vocab_pp2_dp2_recompute", "ref_pp2_dp2"),
                                              ("cpu_vocab_pp2_vpp_dp2", "ref_pp2_vpp_dp2"),
                                              ("tiered_dp2", "ref"),
                                              ("tiered_tp2_dp2", "ref_tp2_dp2"),
                                              ("tiered_pp2_vpp_dp2_recompute",
                                               "ref_pp2_vpp_dp2")])
def test_losses_match_the_ordinary_table(runs, layout, reference):
    ref = require_ok(runs[reference])
    assert ref.losses[10] < ref.losses[1]
    run = require_ok(runs[layout])
    steps = KERNEL_STEPS if layout == "cpu_vocab_dp2_kernel" else STEPS
    assert sorted(run.losses) == steps
    assert_close_curves(run, ref, steps)
    if layout == "cpu_vocab_dp2_kernel":
        assert_close_scalars(run, ref, "grad-norm", KERNEL_STEPS)


@pytest.mark.parametrize("run_name,dump", [("cpu_vocab_dp2", "dump_cpu_vocab"),
                                           ("tiered_dp2", "dump_tiered")])
def test_final_table_matches(runs, run_name, dump, mcore_single_rank):
    """(cpu or tiered, vocab, DP=2, dense) ends with the table the ordinary parameter ends
    with."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    require_ok(runs["ref"])
    require_ok(runs[run_name])
    ckpt = load_plain_tensors(str(runs["tmp"] / "ck_ref" / "iter_0000010"))
    halfway = load_plain_tensors(str(runs["tmp"] / "ck_ref" / "iter_0000005"))
    dumps = [torch.load(f) for f in sorted(glob.glob(str(runs["tmp"] / dump / "*.pt")))]
    assert len(dumps) == 2
    for layer in (1, 3):  # 0-based STEM layers; layer numbers are 1-based
        full = torch.full((VOCAB, FFN), float("nan"))
        for dump in dumps:
            (chunk,) = dump["chunks"]
            full[chunk["ids"]] = chunk["rows"][chunk["layers"].index(layer + 1)]
        expected = ckpt[f"decoder.layers.{layer}.mlp.table"]
        assert not torch.isnan(full).any()
        key = f"decoder.layers.{layer}.mlp.table"
        assert (expected - halfway[key]).abs().max() > 1e-4  # the table trains
        torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6)


def test_startup_reports_host_memory(runs):
    log = require_ok(runs["cpu_vocab_dp2"]).log
    lines = [l for l in log.splitlines() if "STEM tables on this rank" in l]
    assert len(lines) == 2  # one per rank
    # 2 layers x 512 owned rows x 128 columns x 4 bytes = 0.5 MiB; moments twice that.
    assert "1,024 rows" in lines[0] and "tables (fp32, also the master copy) 0.5 MiB" in lines[0]
    # Row kernels: by default the 2 cores of this machine shared by the node's 2 ranks; or as set.
    from megatron_ext_kernels import row_adam_cpu

    if row_adam_cpu.load() is not None:
        import os

        share = len(os.sched_getaffinity(0)) // 2
        default = max(share - (1 if share > 2 and torch.cuda.is_available() else 0), 1)
        assert f"row gathers {default} threads" in lines[0]
        threads = [l for l in require_ok(runs["cpu_replicated_dp2"]).log.splitlines()
                   if "STEM tables on this rank" in l]
        assert len(threads) == 2 and all("row gathers 3 threads" in l for l in threads)
    assert "Adam moments 1.0 MiB" in lines[0] and "dense (deepspeed kernel," in lines[0]


def test_tiered_tables(runs):
    """Sparse tiered tables equal sparse host tables (the same semantics on both tiers, losses
    and evaluation losses to 1e-5); the start-up lines name the tier and its size per rank."""
    tiered, host = require_ok(runs["tiered_sparse_dp2"]), require_ok(runs["sparse_dp2"])
    assert_close_curves(tiered, host, STEPS)
    assert_close_validation(tiered, host)
    log = require_ok(runs["tiered_dp2"]).log
    assert "STEM GPU tier: 256 of 1024 rows (--stem-gpu-tier 25%)" in log
    lines = [line for line in log.splitlines() if "STEM tables on this rank" in line]
    # Per rank: 2 layers x 512 owned rows, 128 of them hot; the host holds the other 384.
    assert len(lines) == 2 and all("1,024 rows (256 in the GPU tier" in line for line in lines)
    assert "tables (fp32, also the master copy) 0.4 MiB" in lines[0]
    assert "STEM GPU tier: 100 of 1024 rows" in runs["resume_tiered_sparse_dp1_other_tier"].log


def assert_close_validation(a, b, rel=1e-5):
    """The evaluations of ``a`` and ``b`` (steps 4, 8 and the end, with ``evals``): the same
    steps, losses within ``rel``."""
    va, vb = a.scalars["lm loss validation"], b.scalars["lm loss validation"]
    assert [s for s, _ in va] == [s for s, _ in vb] and {4, 8} <= {s for s, _ in va}
    for (_, x), (_, y) in zip(va, vb):
        assert abs(x - y) <= rel * abs(y)


def test_gpu_sparse_placement_is_the_host_tables_semantics(runs, mcore_single_rank):
    """gpu-sparse (every row in the GPU tier, here the model's device, the CPU) trains as the
    host tables with the same sparse optimizer: losses and evaluation losses to 1e-5 (the
    tiers' kernels round differently from the host row kernel at most at fp32 rounding), final
    tables row by row to fp32 rounding; every row in the tier, nothing read from or stepped in
    host memory."""
    gpu_sparse, host = require_ok(runs["gpu_sparse_dp2"]), require_ok(runs["sparse_dp2"])
    assert_close_curves(gpu_sparse, host, STEPS)
    assert_close_validation(gpu_sparse, host)
    tables = {}
    for name in ("gpu_sparse", "sparse"):
        dumps = [torch.load(f) for f in sorted(glob.glob(str(runs["tmp"] / f"dump_{name}" /
                                                             "*.pt")))]
        assert len(dumps) == 2  # one per rank
        for layer in (2, 4):  # 1-based layer numbers of the STEM layers 1 and 3
            full = torch.full((VOCAB, FFN), float("nan"))
            for dump in dumps:
                (chunk,) = dump["chunks"]
                full[chunk["ids"]] = chunk["rows"][chunk["layers"].index(layer)]
            assert not torch.isnan(full).any()
            tables[name, layer] = full
    for layer in (2, 4):
        torch.testing.assert_close(tables["gpu_sparse", layer], tables["sparse", layer],
                                   rtol=1e-5, atol=1e-6)
    assert "STEM GPU tier: 1024 of 1024 rows (--stem-gpu-tier 100%)" in gpu_sparse.log
    scalars = gpu_sparse.scalars
    assert len(scalars["stem/fetch-bytes-served"]) == len(STEPS)
    assert all(v > 0 for _, v in scalars["stem/fetch-bytes-served"])
    assert all(v == 0 for _, v in scalars["stem/fetch-bytes-from-host"])
    assert all(v == 0 for _, v in scalars["stem/grad-bytes-to-host"])


def test_profiled_trace_shows_the_tables_threads(runs):
    """``--ext-profile-all-threads`` with Megatron's PyTorch profiler: the trace of rank 0 has
    the tables' ranges on the training thread (routing, waiting for the owners' read, binding)
    and on the worker, named stem-worker (the owners' reads, the table step), two steps' worth;
    ``megatron_ext.tools.trace_summary`` reports them. Upstream's profiler alone records the
    training thread only (tests/test_profiler.py)."""
    from megatron_ext.tools.trace_summary import load_events, summarize

    require_ok(runs["tiered_sparse_dp2"])
    trace = runs["tmp"] / "tiered_sparse_dp2" / "torch_profile" / "rank-0.json.gz"
    summary = summarize(load_events(str(trace)))
    assert [s["step"] for s in summary["steps"]] == [3, 4]
    by_name = {per["name"]: per["ranges"] for per in summary["stem_ranges"].values()}
    worker = [name for name in by_name if "stem-worker" in name]
    assert len(worker) == 1, by_name.keys()
    assert {"stem/read-rows", "stem/table-step"} <= set(by_name[worker[0]])
    training = [r for name, r in by_name.items() if name != worker[0]]
    assert len(training) == 1
    # 2 micro-batches a step per rank: each fetch started, waited for and bound on the
    # training thread.
    for name in ("stem/start-fetch", "stem/wait-read", "stem/finish-fetch"):
        assert training[0][name]["count"] >= 2 * 2, (name, training[0])


@pytest.mark.parametrize("run_name,ranks", [("tiered_pp2_vpp_dp2_recompute", 4),
                                            ("tiered_sparse_dp2", 2)])
def test_collectives_come_from_the_training_thread_only(runs, run_name, ranks):
    """Tiered runs with prefetch and the overlapped table step (two chunks of tables per rank
    under interleaved 1F1B; sparse with evaluation and a checkpoint) with every torch.distributed
    collective wrapped: none came from another thread (the earlier design's background thread
    routed ids and sent rows: this failed on it), and the tables' exchanges did run through the
    wrapper on every rank with tables (per step, for each of the 2 micro-batches of a rank, the 2
    all-to-alls of a fetch, and the 1 of the gradient push)."""
    run = runs[run_name]
    assert "THREAD GUARD:" not in run.log, run.log[-6000:]
    require_ok(run)
    calls = {int(m.group(1)): json.loads(m.group(2))
             for m in re.finditer(r"THREAD GUARD CALLS rank (\d+) (\{.*\})", run.log)}
    assert sorted(calls) == list(range(ranks))
    with_tables = [c for c in calls.values() if c.get("all_to_all_single", 0)]
    assert len(with_tables) >= 2
    assert all(c["all_to_all_single"] >= 10 * (2 * 2 + 1) for c in with_tables), calls


def test_sparse_optimizer_is_layout_invariant_and_trains(runs):
    """The sparse optimizer is a different optimizer (not compared with the dense reference);
    its result must not depend on the data-parallel layout."""
    dp2, dp1 = require_ok(runs["sparse_dp2"]), require_ok(runs["sparse_dp1"])
    assert dp2.losses[10] < dp2.losses[1]
    assert_close_curves(dp2, dp1, STEPS)
    ref = require_ok(runs["ref"])
    assert max(abs(dp2.losses[i] - ref.losses[i]) for i in STEPS) > 1e-5


def test_traffic_and_optimizer_time_logged(runs):
    """Per step: unique rows fetched (deduplicated: at most the 8 x 64 tokens of the global
    batch), bytes each way (vocab sharding: one fp32 row of both STEM layers per unique id), and
    the CPU optimizer time: with prefetch the table step of iteration i runs during, and is
    logged with, iteration i + 1 (the last one, with nothing to overlap, steps at once), with
    the time it ran before the next micro-batch's fetch and the time it waited for its gradients
    to arrive from a GPU; without, each iteration logs its own."""
    scalars = require_ok(runs["cpu_vocab_dp2"]).scalars
    unique = dict(scalars["stem/unique-rows-fetched"])
    to_device = dict(scalars["stem/fetch-bytes-to-device"])
    served = dict(scalars["stem/fetch-bytes-served"])
    optimizer = dict(scalars["stem/optimizer-seconds"])
    before_fetch = dict(scalars["stem/optimizer-seconds-before-fetch"])
    row_bytes = 2 * FFN * 4
    for step in STEPS:
        assert 0 < unique[step] <= 8 * 64
        assert to_device[step] == unique[step] * row_bytes
        assert served[step] == to_device[step]  # every fetched row was served by an owner
        assert dict(scalars["stem/grad-bytes-sent"])[step] > 0
        assert (optimizer[step] > 0) == (step > 1)
        # Overlapped (steps 1..9, logged at 2..10), the dense step of the rows runs whole before
        # the next micro-batch's fetch; the last step (10) is synchronous.
        assert (before_fetch[step] > 0) == (step > 1)
    # Logged, and nothing to wait for: the gradients are on the host already (no GPU copies).
    assert [v for _, v in scalars["stem/optimizer-seconds-grad-wait"]] == [0.0] * len(STEPS)
    synchronous = require_ok(runs["cpu_vocab_dp2_no_prefetch"]).scalars
    assert all(v > 0 for _, v in synchronous["stem/optimizer-seconds"])
    assert all(v == 0 for _, v in synchronous["stem/optimizer-seconds-before-fetch"])


def test_host_traffic_is_the_host_rows_share(runs):
    """The bytes the owners read from host memory and the gradient bytes they step there: all of
    what they serve with host tables, none with device tables, part with tiered ones (a quarter
    of the rows in the device tier: the mock data's lowest ids)."""
    for name, share in (("cpu_vocab_dp2", "all"), ("gpu_vocab_tp2_dp2", "none"),
                        ("tiered_dp2", "part"), ("tiered_sparse_dp2", "part")):
        scalars = require_ok(runs[name]).scalars
        served = dict(scalars["stem/fetch-bytes-served"])
        from_host = dict(scalars["stem/fetch-bytes-from-host"])
        received = dict(scalars["stem/grad-bytes-received"])
        to_host = dict(scalars["stem/grad-bytes-to-host"])
        for step in STEPS:
            assert served[step] > 0 and received[step] > 0, name
            # Gradients: each owned row once (the owners sum what several ranks send).
            if share == "all":
                assert from_host[step] == served[step], name
                assert 0 < to_host[step] <= received[step], name
            elif share == "none":
                assert from_host[step] == 0 and to_host[step] == 0, name
            else:  # a step of the mock data's runs of ids may read no tier row, or only those
                assert 0 <= from_host[step] <= served[step], (name, step)
                assert 0 <= to_host[step] <= received[step], (name, step)
        if share == "part":
            for host, total in ((from_host, served), (to_host, received)):
                assert 0 < sum(host.values()) < sum(total[step] for step in host), name


@pytest.mark.parametrize("on,off,evaluated", [
    ("cpu_vocab_dp2", "cpu_vocab_dp2_no_prefetch", False),
    ("sparse_dp2", "sparse_dp2_no_prefetch", True),
    ("tiered_sparse_dp2", "tiered_sparse_dp2_no_prefetch", True),
    ("sparse_pp2_vpp_dp2", "sparse_pp2_vpp_dp2_no_prefetch", False)])
def test_prefetch_is_bitwise_neutral_and_hides_fetches(runs, on, off, evaluated):
    """Prefetch on (the default) vs off, dense and sparse (also with two chunks of tables per
    rank, interleaved 1F1B): identical losses bit for bit over 10 steps (and, sparse, identical
    evaluation losses at steps 4, 8 and the end). With it on, part
    of the fetch time runs in the background (hidden), and the table step overlaps the next step:
    the training thread waits for less than the step takes; without it, nothing is hidden and the
    training thread waits for all of every table step."""
    on, off = require_ok(runs[on]), require_ok(runs[off])
    assert on.curve(STEPS) == off.curve(STEPS)
    assert ("lm loss validation" in off.scalars) == evaluated
    if evaluated:  # the runs with ``evals``
        assert {4, 8} <= {s for s, _ in off.scalars["lm loss validation"]}  # (and the end)
        assert on.scalars["lm loss validation"] == off.scalars["lm loss validation"]
    assert sum(v for _, v in on.scalars["stem/fetch-seconds-hidden"]) > 0
    assert sum(v for _, v in off.scalars["stem/fetch-seconds-hidden"]) == 0

    def total(run, tag):
        return sum(v for _, v in run.scalars[tag])

    assert total(on, "stem/optimizer-seconds-exposed") < total(on, "stem/optimizer-seconds")
    exposed, stepped = (off.scalars[tag] for tag in ("stem/optimizer-seconds-exposed",
                                                     "stem/optimizer-seconds"))
    assert [s for s, _ in exposed] == [s for s, _ in stepped] == STEPS
    for (_, waited), (_, step) in zip(exposed, stepped):
        assert waited >= step > 0


RESUMED = list(range(6, 11))


@pytest.mark.parametrize("resumed,original", [
    ("resume_gpu_vocab_dp1", "cpu_vocab_dp2"),           # DP 2 -> 1, placement cpu -> gpu
    ("resume_cpu_replicated_dp2", "cpu_vocab_dp2"),      # vocab -> replicated sharding
    ("resume_sparse_replicated_dp1", "sparse_dp2"),      # sparse: rows brought up to date
    ("resume_sparse_pp2_vpp_dp2", "sparse_pp2_vpp_dp2"),  # rank 0 without tables
    ("resume_sparse_pp2_dp1", "sparse_pp2_vpp_dp2"),      # interleaved -> not, DP 2 -> 1
    ("resume_tiered_dp2_from_cpu", "cpu_vocab_dp2"),      # placement cpu -> tiered
    ("resume_cpu_dp1_from_tiered", "tiered_dp2"),         # tiered -> cpu, DP 2 -> 1
    ("resume_tiered_sparse_dp1_other_tier", "tiered_sparse_dp2"),  # tier 25% -> 100 rows
])
def test_resume_continues_the_loss_curve(runs, resumed, original):
    """A managed-table checkpoint of step 5 (tables, moments, sparse: each row's last iteration
    with a gradient) resumed with another DP size, sharding or placement gives the original run's
    losses at steps 6..10."""
    new, old = require_ok(runs[resumed]), require_ok(runs[original])
    assert min(new.losses) == 6
    assert_close_curves(new, old, RESUMED)


@pytest.mark.parametrize("checkpoint,row_state", [("ck_sparse", {"stem_row_touched"}),
                                                  ("ck_tiered_sparse", {"stem_row_touched"}),
                                                  ("ck_vocab", set())])
def test_checkpoints_name_their_row_state(runs, checkpoint, row_state):
    """What the start-up check of a resume reads (``stem/runtime/checkpoint.py``, ``saved_tables``): a
    sparse table optimizer's checkpoint holds each row's last iteration with a gradient, a dense
    one no per-row state (a lazy-Adam state, ``stem_row_steps``, is refused for a sparse resume:
    tests/test_stem_checkpoint_check.py)."""
    from megatron_ext.stem.runtime.checkpoint import saved_tables

    saved = saved_tables(str(runs["tmp"] / checkpoint), 5)
    assert saved is not None and sorted(saved.shapes) == [1, 3]
    assert saved.row_state == row_state


@pytest.mark.parametrize("run_name,reference", [("managed_from_ordinary", "ref"),
                                                ("tiered_from_ordinary", "ref"),
                                                ("ordinary_from_managed", "cpu_vocab_dp2")])
def test_ordinary_and_managed_read_each_others_tables(runs, run_name, reference):
    """Same checkpoint key and global shape: the weights of step 5 give the loss of step 6
    (computed before the first update, so the fresh optimizer state does not enter)."""
    new, ref = require_ok(runs[run_name]), require_ok(runs[reference])
    assert abs(new.losses[6] - ref.losses[6]) <= 1e-5 * abs(ref.losses[6])


@pytest.mark.parametrize("name,message", [
    ("bad_vocab", "decoder.layers.1.mlp.table has shape [vocab, d_ff] = [1024, 128], but this "
                  "model's tables are [2048, 128]"),
    ("bad_ffn", "decoder.layers.1.mlp.table has shape [vocab, d_ff] = [1024, 128], but this "
                "model's tables are [1024, 64]"),
    ("resume_sparse_as_dense", "--stem-optimizer: sparse in the checkpoint, dense in this run: "
                               "the tables' optimizer state of one does not load into the other"),
])
def test_incompatible_checkpoints_are_refused(runs, name, message):
    run = runs[name]
    assert run.returncode != 0
    assert message in run.log
    if name == "resume_sparse_as_dense":  # refused before upstream's loader: no traceback
        assert "Traceback" not in run.log


def test_teardown_frees_every_training(runs):
    """Each training of the launches (managed-table trainings, the distributed optimizer with
    overlapped reduce and gather among them) is freed at its teardown with its process groups: the
    distributed optimizer's fp32 shards, views of the parameters with their autograd graph, kept the
    model and optimizer alive through DDP's config (``teardown.release_model_configs``)."""
    assert_teardown_left_only_the_default_group(runs)
