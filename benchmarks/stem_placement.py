"""Training-step time of STEM layers with host-resident tables (``--stem-table-placement cpu``)
against GPU-resident ones, in one run, through the real training entry point.

    .venv/bin/python benchmarks/stem_placement.py            # GPU: 1B-shaped layers, bf16
    .venv/bin/python benchmarks/stem_placement.py --shape tiny   # CPU smoke run of the same code

The 1B shape is Llama-3.2-1B's layer (H 2048, F 8192, 32 heads, 8 query groups, vocabulary
128256) with as many layers as fit one GPU with GPU-resident tables and Megatron's Adam (each
1.05B-row-element table costs 18 bytes per element there: bf16 weight, fp32 main copy, fp32
gradient, two moments): 4 layers, STEM at layers 1 and 3 (``--stem-layers 1,3``), sequence 2048,
4 micro-batches of 2 sequences per step.

Tokens come from a synthetic corpus written first: ids drawn from a Zipf law over the vocabulary
(exponent ``--zipf``, 1.0 by default, the unigram law of natural text), so the number of distinct
rows per micro-batch (what is fetched) is like real text's, unlike Megatron's mock data (runs of
consecutive ids).

Variants (one process, NCCL on a GPU):

* ``gpu`` -- ordinary STEM parameters, Megatron's DDP and Adam on the GPU (the baseline);
* ``cpu`` -- tables in host memory, rows prefetched to the GPU through a pinned buffer on a side
  stream, row gradients back through pinned buffers, sparse AdamW on the CPU
  (``--stem-optimizer sparse``) overlapping the next step;
* ``cpu-no-prefetch`` -- the same, fetching synchronously and stepping the tables before the
  next step starts (what prefetch and the overlapped table step hide);
* ``cpu-dense`` (name it in ``--variants``) -- every owned row steps each iteration on the CPU
  (DeepSpeed's CPU Adam over whole tables).
* ``tiered`` -- the hottest 10% of the rows (by the corpus's token counts) on the GPU with their
  optimizer state, stepped there; the other rows as ``cpu`` (the issue's goal: at most 1.03x
  ``gpu``).
* ``tiered-20`` (name it in ``--variants``) -- the same with the hottest 20% on the GPU.
* ``tiered-direct`` (name it in ``--variants``) -- ``tiered`` with the host rows read by a GPU
  kernel from the registered host shards (``--stem-host-read direct``, ``kernels/host_rows.py``)
  instead of the CPU gather into pinned staging and its copy.
* ``tiered-gpu-step``, ``gpu-sparse-gpu-step`` (name them in ``--variants``) -- ``tiered`` and
  ``gpu-sparse`` with the GPU tier's sparse step in one Triton kernel (``--stem-gpu-step triton``,
  ``kernels/row_adam_gpu.py``) instead of torch ops.
* ``gpu-sparse`` -- every row in the GPU tier (``--stem-gpu-tier 100%``): the host variants'
  sparse row-wise AdamW, on the GPU, with no host rows. ``gpu`` steps whole tables with
  Megatron's dense Adam every step, which at the 1B shape costs more than the host variants'
  background step of the touched rows (2026-11-27: tiered 0.89-0.93x gpu); against
  ``gpu-sparse`` a host variant's ratio is the cost of its host rows alone.

The JSON (``--json``) is rewritten after every run of a variant, so a run stopped part-way (a
lease's time limit) keeps the variants that finished. A variant whose training fails or outlives
``--timeout`` is a record too (``status`` "failed" or "timeout", ``reason``: its error line; each
run in ``runs``), and the benchmark then exits 1 naming it, after the JSON is written.

``--repeats R`` trains the variants R times, every other time in the reverse order (ABBA): each
ratio is given per repeat, with their median, the worst (highest) and the spread (highest less
lowest); ``scripts/gpu_evidence.py`` judges a goal on the worst, so met means met in every run.

``--profile VARIANTS`` traces two steps of each named variant with PyTorch's profiler (Megatron's
``--profile --use-pytorch-profiler``; iterations ``skip - 3`` and ``skip - 2``, before the timed
ones), copies the trace to ``OUT/trace_<shape>_<variant>.json.gz`` and prints its summary
(``megatron_ext/tools/trace_summary.py``): how long the GPU's main stream sat idle per step and
before which kernels, the copies on each stream, the host's blocking CUDA calls. A profiled run
that fails is run again without the profiler. Each variant's run folder is emptied first, so no
earlier run's events mix into its numbers.

Reported per variant: the median iteration time after ``--skip`` iterations and its ratio to
``gpu`` (and to ``gpu-sparse``; for ``tiered-direct``, ``tiered-gpu-step`` and
``gpu-sparse-gpu-step`` also to the variant each changes by one flag, ``BASELINES``, where that
trained in the same run), the fetch time the forward step waited for (exposed) and the background fetch time it did
not wait for (hidden), the CPU optimizer time (all, exposed, and the part before the next
micro-batch's fetch), unique rows and bytes moved per step, and the peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The ABBA order and a failure's one-line reason are the step benchmarks' too.
from common import failure_reason, run_order  # noqa: E402,F401

SHAPES = {
    "1b": dict(layers=4, stem_layers="1,3", hidden=2048, ffn=8192, heads=32, groups=8,
               vocab=128256, seq=2048, mbs=2, micro_batches=4),
    "tiny": dict(layers=3, stem_layers="1,2", hidden=64, ffn=256, heads=4, groups=2,
                 vocab=4096, seq=128, mbs=2, micro_batches=4),
}

MANAGED = ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]
VARIANTS = {
    "gpu": [],
    "cpu": MANAGED + ["--stem-optimizer", "sparse"],
    "cpu-no-prefetch": MANAGED + ["--stem-optimizer", "sparse", "--no-stem-prefetch"],
    "cpu-dense": MANAGED + ["--stem-optimizer", "dense"],
    # The hottest 10% of rows (by the corpus's token counts) on the GPU, the rest on the host.
    "tiered": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
               "--stem-optimizer", "sparse", "--stem-gpu-tier", "10%"],
    # Twice the GPU tier, for when 10% misses: on a Zipf(1.0) stream (4 x 4096 tokens a step,
    # benchmarks/stem_critical_path.py) the hottest 20% take 86% of the tokens (10%: 81%), leave
    # 19 host rows on the next step's critical path (34) and 2,285 host rows to step (3,075).
    "tiered-20": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                  "--stem-optimizer", "sparse", "--stem-gpu-tier", "20%"],
    # tiered with the host tier's rows read by the GPU kernel over the bus (--stem-host-read).
    "tiered-direct": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                      "--stem-optimizer", "sparse", "--stem-gpu-tier", "10%",
                      "--stem-host-read", "direct"],
    # tiered and gpu-sparse with the GPU tier's step in one kernel (--stem-gpu-step triton).
    "tiered-gpu-step": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                        "--stem-optimizer", "sparse", "--stem-gpu-tier", "10%",
                        "--stem-gpu-step", "triton"],
    "gpu-sparse-gpu-step": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                            "--stem-optimizer", "sparse", "--stem-gpu-tier", "100%",
                            "--stem-gpu-step", "triton"],
    # Every row in the GPU tier: the sparse optimizer's semantics with no host rows, the
    # like-for-like baseline of the host tiers (gpu steps whole tables with Megatron's dense Adam).
    "gpu-sparse": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                   "--stem-optimizer", "sparse", "--stem-gpu-tier", "100%"],
}
# The variant each one changes by one flag: where both train in a run, the variant's ratio to it
# (per repeat, as to gpu) is what that flag costs or saves (--stem-host-read, --stem-gpu-step).
BASELINES = {"tiered-direct": "tiered", "tiered-gpu-step": "tiered",
             "gpu-sparse-gpu-step": "gpu-sparse"}


def write_zipf_corpus(prefix: str, vocab: int, tokens: int, exponent: float, seed: int) -> None:
    """A Megatron indexed dataset of documents (~1000 tokens) with Zipf-distributed ids; id
    ``vocab - 1`` is kept for the end-of-document token (NullTokenizer's eod is its size)."""
    import torch

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if os.path.exists(prefix + ".idx"):
        return
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab, dtype=np.float64)
    p = ranks ** -exponent
    p /= p.sum()
    # Frequency rank -> token id: a fixed random permutation, so frequent ids are spread over the
    # vocabulary as a BPE tokenizer's are not (the ownership benchmark measures that case).
    ids = rng.permutation(vocab - 1)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    written = 0
    while written < tokens:
        n = int(rng.integers(500, 1500))
        doc = ids[rng.choice(vocab - 1, size=n, p=p)].astype(np.int32)
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
        written += n
    builder.finalize(prefix + ".idx")


def flags(shape: dict, args, data_prefix: str, tb: str) -> list:
    import torch

    gpu = torch.cuda.is_available()
    gbs = shape["mbs"] * shape["micro_batches"]
    out = [
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--ffn-hidden-size", str(shape["ffn"]), "--num-attention-heads", str(shape["heads"]),
        "--group-query-attention", "--num-query-groups", str(shape["groups"]),
        "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
        "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(shape["mbs"]), "--global-batch-size", str(gbs),
        "--train-iters", str(args.iters), "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--adam-beta2", "0.95", "--seed", "1234",
        "--data-path", data_prefix, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(shape["vocab"] - 1), "--make-vocab-size-divisible-by", "128",
        "--data-cache-path", os.path.join(args.out, "cache"),
        "--eval-iters", "0", "--eval-interval", str(10 * args.iters),
        "--log-interval", "1", "--tensorboard-dir", tb, "--tensorboard-log-interval", "1",
        "--log-timers-to-tensorboard", "--timing-log-level", "1",
        "--model-family", "stem", "--stem-layers", shape["stem_layers"],
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-rope-fusion", "--use-cpu-initialization",
    ]
    if gpu:
        out += ["--bf16", "--distributed-backend", "nccl", "--log-memory-to-tensorboard"]
    else:
        out += ["--distributed-backend", "gloo"]
    return out


def stepped_params_per_second(r: dict) -> float:
    """The table step's throughput: row gradients the owners received (fp32) are the parameters
    the sparse optimizer stepped (the dense one steps every owned row: a lower bound there), over
    its time less what it waited for the host tier's gradients to arrive from the GPU."""
    seconds = r["stem/optimizer-seconds"] - r.get("stem/optimizer-seconds-grad-wait", 0.0)
    return r["stem/grad-bytes-received"] / 4 / seconds if seconds > 0 else float("nan")


def profile_flags(skip: int, all_threads: bool = True) -> list:
    """Megatron's PyTorch-profiler flags for iterations ``skip - 3`` and ``skip - 2``: before the
    timed iterations, and the trace is written before them too (its export is slow).
    ``all_threads``: every thread is recorded (the tables' worker: its row reads and table step,
    ``stem/...`` ranges) and, on a GPU, CUDA's stream waits (``--ext-profile-all-threads``,
    PyTorch's experimental options)."""
    return ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0",
            "--profile-step-start", str(skip - 3), "--profile-step-end", str(skip - 1)] + \
        (["--ext-profile-all-threads"] if all_threads else [])


def keep_trace(run_dir: str, out: str, label: str) -> dict:
    """The trace Megatron wrote for the run in ``run_dir`` (``torch_profile/rank-0.json.gz``
    beside its tensorboard folder), copied to ``out/trace_<label>.json.gz``, and its summary."""
    from megatron_ext.tools.trace_summary import load_events, summarize

    src = os.path.join(run_dir, "torch_profile", "rank-0.json.gz")
    if not os.path.exists(src):
        return {"path": None, "summary": {}, "error": f"no trace at {src}"}
    dst = os.path.join(out, f"trace_{label}.json.gz")
    shutil.copyfile(src, dst)
    return {"path": dst, "bytes": os.path.getsize(dst), "summary": summarize(load_events(dst))}


def describe(r: dict) -> str:
    return (f"fetch exposed {1e3 * r['stem/fetch-seconds-exposed']:.1f} ms/step, hidden "
            f"{1e3 * r['stem/fetch-seconds-hidden']:.1f} ms/step, gradient exchange "
            f"{1e3 * r['stem/grad-exchange-seconds']:.1f} ms/step, CPU optimizer "
            f"{1e3 * r['stem/optimizer-seconds']:.1f} ms/step (exposed "
            f"{1e3 * r['stem/optimizer-seconds-exposed']:.1f}; before the next micro-batch's "
            f"fetch {1e3 * r['stem/optimizer-seconds-before-fetch']:.1f}; waiting for its "
            f"gradients from the GPU {1e3 * r['stem/optimizer-seconds-grad-wait']:.1f}; "
            f"{stepped_params_per_second(r) / 1e9:.2f} G row params/s), unique rows/step "
            f"{r['stem/unique-rows-fetched']:.0f}, rows to the layers "
            f"{r['stem/fetch-bytes-to-device'] / 2**20:.1f} MiB/step (from host memory "
            f"{r['stem/fetch-bytes-from-host'] / 2**20:.1f}), row gradients "
            f"{r['stem/grad-bytes-sent'] / 2**20:.1f} MiB/step (stepped on the CPU "
            f"{r['stem/grad-bytes-to-host'] / 2**20:.1f})" + kernel_share(r))


def kernel_share(r: dict) -> str:
    """The CPU row kernel's own part of the table step: its row loops (the OpenMP team at
    work) and its calls as the worker saw them (the loops, the checks, the GIL taken back)."""
    params = r.get("stem/optimizer-kernel-params", float("nan"))
    loop = r.get("stem/optimizer-kernel-loop-seconds", float("nan"))
    call = r.get("stem/optimizer-kernel-call-seconds", float("nan"))
    if not params == params or params <= 0:  # NaN or none: no host rows on the row kernel
        return ""
    return (f"; CPU row kernel {params / 1e6:.1f} M params/step: loops {1e3 * loop:.1f} ms "
            f"({params / loop / 1e9 if loop > 0 else float('nan'):.2f} G params/s), calls "
            f"{1e3 * call:.1f} ms")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        default="1b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10, help="iterations left out of the median")
    parser.add_argument("--variants", default="gpu,cpu,cpu-no-prefetch",
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_stem_placement"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    parser.add_argument("--profile", default="",
                        help="comma-separated variants to trace two steps of (before the timed "
                             "ones; needs --skip >= 4)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="train the variants this many times, every other time in the "
                             "reverse order (ABBA), and give each its repeats' own ratios to "
                             "gpu, their median, worst and spread; only the first is profiled")
    parser.add_argument("--extra", default="",
                        help="training flags added to the host-table variants, e.g. "
                             "'--stem-cpu-threads 8'")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed {', '.join(VARIANTS)}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be at least 1")
    if args.iters <= args.skip:
        raise SystemExit(f"--iters={args.iters} must exceed --skip={args.skip}")
    profiled = [n for n in args.profile.split(",") if n]
    if [n for n in profiled if n not in names]:
        raise SystemExit(f"--profile: {args.profile!r} names variants not in --variants")
    if profiled and args.skip < 4:
        raise SystemExit(f"--profile traces iterations skip - 3 and skip - 2: --skip={args.skip} "
                         "must be at least 4")

    from megatron_ext.tools.metrics import read_tensorboard_scalars

    tokens = int(1.2 * args.iters * shape["mbs"] * shape["micro_batches"] * (shape["seq"] + 1))
    prefix = os.path.join(args.out, f"zipf_{args.shape}", "corpus_text_document")
    write_zipf_corpus(prefix, shape["vocab"], max(tokens, 200_000), args.zipf, seed=0)
    print(f"shape {args.shape}: {shape}", flush=True)

    all_threads = True  # until a run profiled with every thread fails

    def run_variant(name: str, rep: int) -> dict:
        """Train variant ``name`` once (repeat ``rep``; only the first is profiled): its
        record; :class:`RunFailed` when it failed or timed out."""
        nonlocal all_threads
        tb = os.path.join(args.out, f"{args.shape}_{name}" + (f"_r{rep}" if rep else ""), "tb")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", os.path.join(ROOT, "launch", "pretrain.py"),
               *flags(shape, args, prefix, tb), *VARIANTS[name],
               *(args.extra.split() if name != "gpu" else [])]
        # A profiled run that fails (the profiler itself, say) is run again without it: the
        # step time is what the variant is for. One that failed while recording every thread
        # (experimental in PyTorch) makes the later variants' traces record the training
        # thread only.
        attempts = [(cmd + profile_flags(args.skip, all_threads), True), (cmd, False)] \
            if name in profiled and rep == 0 else [(cmd, False)]
        rc, traced = None, False
        for argv, traced in attempts:
            # No earlier run's events or trace taken for this one's.
            shutil.rmtree(os.path.dirname(tb), ignore_errors=True)
            rc, log = run_logged(argv, args.timeout)
            os.makedirs(os.path.dirname(tb), exist_ok=True)
            with open(os.path.join(os.path.dirname(tb), "log.txt"), "w") as f:
                f.write(log)
            if rc is None:
                raise RunFailed("timeout", f"no result within --timeout={args.timeout} s")
            if rc == 0:
                break
            print(f"{name} failed{' (profiled; again without the profiler)' if traced else ''}:"
                  f"\n{log[-6000:]}", flush=True)
            if traced and all_threads:
                all_threads = False
                print("later variants' traces: the training thread only (no "
                      "--ext-profile-all-threads)", flush=True)
        if rc:
            raise RunFailed("failed", failure_reason(log, rc))
        s = read_tensorboard_scalars(tb)

        def mean(tag):
            values = [v for step, v in s.get(tag, []) if step > args.skip]
            return statistics.mean(values) if values else float("nan")

        times = [v for step, v in s.get("iteration-time", []) if step > args.skip]
        if not times or not s.get("lm loss"):
            raise RunFailed("failed", f"exit 0 but no iteration times after --skip={args.skip} "
                                      f"or no loss in its events ({tb})")
        r = {"iteration_ms": 1e3 * statistics.median(times),
             "loss_last": s["lm loss"][-1][1],
             "peak_gpu_gib": max((v for _, v in s.get("mem-max-allocated-bytes", [])),
                                 default=float("nan")) / 2**30}
        for tag in ("stem/fetch-seconds-exposed", "stem/fetch-seconds-hidden",
                    "stem/optimizer-seconds", "stem/optimizer-seconds-exposed",
                    "stem/optimizer-seconds-before-fetch", "stem/optimizer-seconds-grad-wait",
                    "stem/grad-exchange-seconds",
                    "stem/unique-rows-fetched", "stem/fetch-bytes-to-device",
                    "stem/grad-bytes-sent", "stem/grad-bytes-received",
                    "stem/fetch-bytes-from-host", "stem/grad-bytes-to-host",
                    "stem/optimizer-kernel-params", "stem/optimizer-kernel-loop-seconds",
                    "stem/optimizer-kernel-call-seconds"):
            r[tag] = mean(tag)
        # Megatron's own timers (--log-timers-to-tensorboard): where the step's time goes.
        r["timers_ms"] = {tag[:-5]: 1e3 * mean(tag) for tag in s
                          if tag.endswith("-time") and tag != "iteration-time"}
        host = [line for line in log.splitlines() if "STEM tables on this rank" in line]
        r["host_memory"] = host[0].split("> ", 1)[-1] if host else ""
        team = [line for line in log.splitlines() if "CPU row kernel team" in line]
        r["row_kernel_team"] = team[0].split("> ", 1)[-1] if team else ""
        if traced:
            r["trace"] = keep_trace(os.path.dirname(tb), args.out, f"{args.shape}_{name}")
        report(name, r, rep, args.repeats)
        return r

    results = measure(names, args.repeats, run_variant, args.json)
    if "iteration_ms" in results.get("gpu", {}):
        print(f"\nratios against gpu placement ({results['gpu']['iteration_ms']:.1f} ms/iter), "
              f"median of iterations {args.skip + 1}..{args.iters}" +
              ("; each repeat's own ratio (ABBA order), their median, worst and spread"
               if args.repeats > 1 else "") + ":")
        for name, r in results.items():
            print(ratio_line(name, r, "ratio_vs_gpu", "ratios_per_repeat") +
                  ("  " + describe(r) if name != "gpu" and "iteration_ms" in r else ""),
                  flush=True)
    if "iteration_ms" in results.get("gpu-sparse", {}):  # the same optimizer, rows on the GPU
        print("\nratios against gpu-sparse (every row on the GPU, the same sparse row-wise "
              f"AdamW; {results['gpu-sparse']['iteration_ms']:.1f} ms/iter):")
        for name, r in results.items():
            if name not in ("gpu", "gpu-sparse"):
                print(ratio_line(name, r, "ratio_vs_gpu_sparse",
                                 "ratios_per_repeat_vs_gpu_sparse"), flush=True)
    paired = [name for name, r in results.items() if "baseline" in r]
    if paired:  # each against the variant it changes by one flag, in the same run
        print("\nratios against each variant's baseline (the same run, one flag changed):")
        for name in paired:
            print(ratio_line(name, results[name], "ratio_vs_baseline",
                             "ratios_per_repeat_vs_baseline") +
                  f"  vs {results[name]['baseline']}", flush=True)
    bad = unfinished(results)
    if bad:
        raise SystemExit(f"stem_placement: not every run finished: {'; '.join(bad)} (logs: "
                         f"{args.out}/{args.shape}_<variant>[_r<repeat>]/log.txt)")


class RunFailed(Exception):
    """A variant's training that gave no step time: ``status`` "failed" or "timeout", ``reason``
    the line that says why."""

    def __init__(self, status: str, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


def measure(names, repeats: int, run, json_path) -> dict:
    """Every variant of ``names`` trained ``repeats`` times in :func:`run_order` by ``run(name,
    rep)`` (its record, or :class:`RunFailed`): per variant its ``status`` ("ok", else the first
    failure's, with ``reason``), each run in ``runs``, the record of its first run that worked
    and every repeat's step time (``iteration_ms_repeats``, None where it failed); the JSON is
    rewritten after each run, so what ran survives a later kill."""
    results = {name: {"status": "ok", "runs": [], "iteration_ms_repeats": [None] * repeats}
               for name in names}
    for rep, name in run_order(names, repeats):
        entry = results[name]
        try:
            record = run(name, rep)
        except RunFailed as e:
            entry["runs"].append({"repeat": rep + 1, "status": e.status, "reason": e.reason})
            if entry["status"] == "ok":
                entry["status"] = e.status
                entry["reason"] = (f"repeat {rep + 1}: " if repeats > 1 else "") + e.reason
            print(f"  {name:16s} {e.status}: {e.reason}"
                  + (f" (repeat {rep + 1}/{repeats})" if repeats > 1 else ""), flush=True)
        else:
            entry["runs"].append({"repeat": rep + 1, "status": "ok"})
            entry["iteration_ms_repeats"][rep] = record["iteration_ms"]
            for k, v in record.items():
                entry.setdefault(k, v)
        write_results(results, json_path)
    return results


def unfinished(results: dict) -> list:
    """``"variant (status: reason)"`` for each variant with a run that failed or timed out."""
    return [f"{n} ({r['status']}: {r['reason']})" for n, r in results.items()
            if r.get("status", "ok") != "ok"]


def ratio_line(name: str, r: dict, median: str, per_repeat: str) -> str:
    if r.get("status", "ok") != "ok" and median not in r:
        return f"{name:16s} {r['status']}: {r['reason']}"
    line = f"{name:16s} {r.get(median, float('nan')):.3f}x"
    ratios = r.get(per_repeat) or []
    if len(ratios) > 1:
        known = [x for x in ratios if x is not None]
        line += (" (runs " + " / ".join("-" if x is None else f"{x:.3f}" for x in ratios) +
                 (f"; worst {max(known):.3f}, spread {max(known) - min(known):.3f}"
                  if known else "") + ")")
    if r.get("status", "ok") != "ok":
        line += f" [{r['status']}: {r['reason']}]"
    return line


def run_logged(argv, timeout: float):
    """``argv`` run from the repository's root: ``(exit status, output)``, the status None when
    it outlived ``timeout`` seconds. Then torchrun gets SIGTERM, on which it stops its workers
    (a SIGKILL would leave them holding the GPU through the next variants), and SIGKILL 30 s
    later if it is still there."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        out = proc.communicate(timeout=timeout)[0]
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    return None, out


def report(name: str, r: dict, rep: int, repeats: int) -> None:
    """What one run of a variant printed as it finished."""
    tag = f" (repeat {rep + 1}/{repeats})" if repeats > 1 else ""
    print(f"  {name:16s} {r['iteration_ms']:9.1f} ms/iter  final loss {r['loss_last']:.4f}"
          f"  peak GPU {r['peak_gpu_gib']:.1f} GiB{tag}", flush=True)
    print("    timers (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                        sorted(r["timers_ms"].items())), flush=True)
    if name != "gpu":
        print("    " + describe(r), flush=True)
        if r["host_memory"]:
            print("    " + r["host_memory"], flush=True)
        if r["row_kernel_team"]:
            print("    " + r["row_kernel_team"], flush=True)
    if r.get("trace"):
        from megatron_ext.tools.trace_summary import describe as describe_trace

        trace = r["trace"]
        print(f"    trace: {trace.get('error') or trace['path']}", flush=True)
        for line in describe_trace(trace["summary"]):
            print("      " + line, flush=True)


def write_results(results: dict, path) -> None:
    """``results`` to ``path`` (JSON; nothing without a path), each variant with its ratio to
    the gpu variant once that has run: per repeat, its step time over that repeat's gpu step
    time (``ratios_per_repeat``, None where either failed), their median (``ratio_vs_gpu``; one
    repeat: the ratio), the worst (highest, ``ratio_vs_gpu_worst``) and the spread (highest
    less lowest, ``ratio_vs_gpu_spread``); likewise against ``gpu-sparse`` where it ran
    (``..._vs_gpu_sparse``), and a variant of :data:`BASELINES` against its baseline where that
    ran (``baseline``, ``..._vs_baseline``). Every variant is written, one that failed with its
    status and reason; whole to a temporary file, then renamed."""
    pairs = [("gpu", "ratios_per_repeat", "ratio_vs_gpu", list(results)),
             ("gpu-sparse", "ratios_per_repeat_vs_gpu_sparse", "ratio_vs_gpu_sparse",
              list(results))]
    for name in results:
        if BASELINES.get(name) in results:
            results[name]["baseline"] = BASELINES[name]
            pairs.append((BASELINES[name], "ratios_per_repeat_vs_baseline", "ratio_vs_baseline",
                          [name]))
    for base, per_repeat, median, names in pairs:
        times_base = results.get(base, {}).get("iteration_ms_repeats")
        if not times_base:
            continue
        for r in (results[n] for n in names):
            times = r.get("iteration_ms_repeats") or []
            ratios = [None if x is None or g is None else x / g
                      for x, g in zip(times, times_base)]
            r[per_repeat] = ratios
            known = [x for x in ratios if x is not None]
            if known:
                r[median] = statistics.median(known)
                r[median + "_worst"] = max(known)
                r[median + "_spread"] = max(known) - min(known)
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)

if __name__ == "__main__":
    main()
