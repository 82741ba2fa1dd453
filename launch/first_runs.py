"""First training runs on one GPU: the presets of issue 51 one after another, from a real
tokenized corpus, each for a time budget; tokens/s, TFLOP/s, MFU, peak memory, loss curves and
the pairs' ratios against their goals.

    python launch/first_runs.py --out runs/first_runs [--runs dense_1b,stem_1b,...]
        [--run-seconds 90] [--micro-batch-size 4] [--warmup-iters 3] [--peak-tflops X]
    python launch/first_runs.py --out /tmp/fr --runs dense_cpu,stem_cpu --iters 6 \\
        --warmup-iters 2 --micro-batch-size 2 --corpus-tokens 200000   # CPU

1. builds (or reuses) an offline corpus with the main job's builder
   (``megatron_ext.tools.data_prep``): every run trains on the same tokens. By default
   (``--corpus zipf``) synthetic ids drawn from a Zipf law over the whole vocabulary of the
   smallest preset run (128,256 ids for the GPU runs; ``tools/synthetic_corpus.py``), so that a
   STEM GPU tier serves the share of tokens it would on real text and the host tier is read;
   ``--corpus text`` is the main job's BPE text corpus (8,192 ids: a 10% tier of a 128,256-row
   table holds every row it touches). Its tokenizer's vocabulary is padded to the preset's
   (``--make-vocab-size-divisible-by``), so the embedding, output layer and STEM tables have the
   preset's rows;
2. trains each run with ``launch/scaling.py``'s torchrun command on one device (bf16 as the
   presets say; one micro-batch of whole sequences per iteration unless --global-batch-size).
   A run gets SIGTERM ``--run-seconds`` after its start (start-up included) and, with
   Megatron's ``--exit-signal-handler``, ends after that iteration: as many iterations as fit,
   whatever the device's speed (Megatron's ``--exit-duration-in-mins`` counts whole minutes).
   Its ``--train-iters`` is what the device could not outrun (``iteration_cap``): Megatron
   indexes that many iterations' samples before the first step;
   ``--iters N`` trains N iterations instead (tests: a count that does not depend on the
   machine's load);
3. reads each run report (``training/run_report.py``) with ``scaling.metrics_from_report`` and
   the loss curve from Megatron's tensorboard scalars (``tools/metrics.py``); writes
   ``first_runs.json``, ``first_runs.md`` and ``first_runs.png`` into ``--out``.

A run that fails, runs out of memory or out of time is a row saying so; the exit status is 1 when
any run did not finish (after the summary is written). ``docs/scaling.md`` describes the output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "launch")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import scaling  # noqa: E402  (launch/scaling.py: the command, the numbers, the peak)
from main_job import STEM_TABLES  # noqa: E402  (the recommended STEM table mode)

from megatron_ext.planning.layout import parse_layout  # noqa: E402

# name -> (preset, flags after the preset's). Sigma-MoE-Tiny with 6 of its 56 layers (the
# per-layer shape unchanged; its progressive top-k schedule cut to those layers) in micro-batches
# of 2 (the same tokens per iteration as the others': two of them) to fit an H100's 80 GB: the
# dry run's estimate with the GPU runs' local backend and sdpa is 53.8 GiB, 8 layers in
# micro-batches of 4 80.3 GiB.
RUNS: Dict[str, Tuple[str, List[str]]] = {
    "dense_1b": ("dense_1b", []),
    "stem_1b": ("stem_1b", [*STEM_TABLES, "--stem-gpu-tier", "10%"]),
    "dense_structmoe_0p9b": ("dense_structmoe_0p9b", []),
    "structmoe_0p9b": ("structmoe_0p9b", []),
    "sigma_moe_tiny_6l": ("sigma_moe_tiny", ["--num-layers", "6", "--sigma-topk-schedule",
                                             "[8,8,6,6,4,4]", "--micro-batch-size", "2"]),
    # tiny shapes for the CPU (tests, the runner's smoke test, the docs' example)
    "dense_cpu": ("dense_cpu", []),
    "stem_cpu": ("stem_cpu", [*STEM_TABLES]),
}
GPU_RUNS = ["dense_1b", "stem_1b", "dense_structmoe_0p9b", "structmoe_0p9b", "sigma_moe_tiny_6l"]

# (baseline, other, metric, goal, better): issue 51's goals, as ratios other / baseline.
PAIR_GOALS = [
    ("dense_1b", "stem_1b", "tokens_per_s_per_gpu", 1.05, "higher"),
    ("dense_1b", "stem_1b", "peak_mem_gib", 1.10, "lower"),
    ("dense_structmoe_0p9b", "structmoe_0p9b", "tokens_per_s_per_gpu", 0.97, "higher"),
    ("dense_cpu", "stem_cpu", "tokens_per_s_per_gpu", None, "higher"),
    ("dense_cpu", "stem_cpu", "peak_mem_gib", None, "lower"),
]
# dense_1b's MFU on an H100 (Megatron-LM publishes 41% for a 1.7B GPT with Transformer Engine).
MFU_GOALS = {"dense_1b": (0.40, "H100")}

OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")
# The zipf corpus's tokens: more than a run of --run-seconds reads on a GPU (about 3M for a 1B
# model at 40,000 tokens/s), built in seconds.
ZIPF_TOKENS = 1 << 24


def log(msg: str) -> None:
    print(f"[first_runs] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the command


def schedule_flags(preset: str, iters: int) -> List[str]:
    """A short run's learning-rate schedule: the presets' spans the whole pretraining (23,842
    warm-up iterations for dense_1b), during which a two-minute run would barely move; warm-up
    over 20 iterations, decay over 2,000 (sigma: WSD needs its decay span)."""
    if scaling.flag_value(scaling.expand_argv(["--preset", preset]), "--lr-warmup-iters"):
        return ["--lr-warmup-iters", "20", "--lr-decay-iters", "2000",
                "--lr-wsd-decay-iters", "1000", "--train-iters", str(iters)]
    return ["--lr-warmup-fraction", "0.01", "--lr-decay-iters", "2000",
            "--train-iters", str(iters)]


# A run stopped by --run-seconds still needs a --train-iters: Megatron builds its dataset's
# sample and shuffle indices for train-iters x global batch samples before the first step. An
# arbitrary large count is not free: 10,000,000 iterations of 4 x 4096 tokens over the 2^24-token
# zipf corpus took 55.9 s and 4.5 GB to index on the development machine (2026-11-28; 1,000,000:
# 3.0 s), time inside the run's --run-seconds. So the count is what the device could at most
# train in --run-seconds: at its peak FLOP/s (100% MFU) for the model's FLOPs per token, doubled
# for FLOPs the count leaves out. Where no peak is known, this one (above any single device's
# dense bf16 today).
FALLBACK_PEAK_TFLOPS = 5000.0
CAP_MARGIN = 2.0


def iteration_cap(name: str, vocab: int, global_batch: int, run_seconds: float,
                  peak_tflops: Optional[float]) -> int:
    """Iterations a ``--run-seconds`` run of ``name`` cannot outrun (its ``--train-iters``, less
    warm-up): ``CAP_MARGIN`` x the iterations of ``global_batch`` sequences that ``run_seconds``
    at ``peak_tflops`` (100% MFU) allow, at the model's training FLOPs per token
    (``planning/model_shape.py``); at least 1."""
    from megatron_ext.planning.model_shape import training_flops_per_token

    preset, flags = RUNS[name]
    # The shape of the flags: what only a family's parsed config knows keeps its default there
    # (STEM's layers count as dense ones, StructMoE's D'ff as the preset's); Sigma's top-k at
    # its least (1 expert per token), a count that can only be low: the cap only higher.
    shape = scaling.model_shape(preset, flags, vocab)
    topks = shape.topks or (1,) * shape.num_layers
    per_token = training_flops_per_token(shape, topks=topks).total
    per_iter = per_token * global_batch * shape.seq_length
    peak = (peak_tflops or FALLBACK_PEAK_TFLOPS) * 1e12
    return max(1, math.ceil(CAP_MARGIN * run_seconds * peak / per_iter))


def run_command(name: str, opts, data: Dict[str, object], run_dir: str, report: str,
                cuda: bool, peak_tflops: Optional[float] = None) -> List[str]:
    preset, flags = RUNS[name]
    vocab = scaling.preset_vocab(preset, None)
    if data["vocab"] > vocab:
        raise ValueError(f"--corpus-vocab={data['vocab']} exceeds {name}'s vocabulary {vocab}")
    mbs = opts.micro_batch_size
    lay = parse_layout("tp1ep1pp1dp1")
    harness = SimpleNamespace(gpus=1, preset=preset, micro_batch_size=mbs,
                              warmup_iters=opts.warmup_iters, iters=1,
                              data_path=[data["prefix"]], tokenizer_type="HuggingFaceTokenizer",
                              tokenizer_model=data["tokenizer"], out=opts.out, vocab_size=None)
    # Every flag after the harness's own wins (argparse keeps the last value).
    gbs = opts.global_batch_size or mbs
    iters = opts.warmup_iters + (opts.iters or iteration_cap(name, vocab, gbs, opts.run_seconds,
                                                             peak_tflops))
    extra = [*flags, "--global-batch-size", str(gbs),
             "--make-vocab-size-divisible-by", str(vocab), "--split", "98,2,0",
             "--ext-data-manifest", data["manifest"],
             *schedule_flags(preset, iters),
             "--tensorboard-dir", os.path.join(run_dir, "tensorboard"),
             "--tensorboard-log-interval", "1"]
    if not opts.iters:
        extra += ["--exit-signal-handler"]
    return scaling.torchrun_command(lay, harness, extra, report, cuda)


# ---------------------------------------------------------------------------------------------
# the numbers


def loss_curve(tb_dir: str) -> List[Tuple[int, float]]:
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    try:
        return read_tensorboard_scalars(tb_dir).get("lm loss", [])
    except FileNotFoundError:
        return []


def run_row(name: str, report: Dict[str, object], warmup_iters: int,
            peak_tflops: Optional[float], losses: Sequence[Tuple[int, float]]) -> Dict[str, object]:
    """One run's row: ``scaling.metrics_from_report``'s numbers, its loss curve against tokens
    (tokens of an iteration: the report's global batch x sequence length) and the goal on MFU."""
    row: Dict[str, object] = {"run": name, "status": "ok"}
    row.update(scaling.metrics_from_report(report, warmup_iters, peak_tflops))
    lay = report["layout"]
    per_iter = int(lay["global_batch_size"]) * int(lay["seq_length"])
    row["tokens_per_iteration"] = per_iter
    row["total_iters"] = len(report["iterations"])
    row["finished_by"] = report.get("finished_by")
    row["loss"] = [[it * per_iter, loss] for it, loss in losses]
    row["loss_final"] = losses[-1][1] if losses else None
    return row


def pair_rows(rows: Dict[str, Dict[str, object]], device: str) -> List[Dict[str, object]]:
    """Each pair's ratio (other / baseline) against its goal; dense_1b's MFU against 40% where the
    device is an H100. A pair with a run that did not finish has no ratio and misses its goal."""
    out = []
    for base, other, metric, goal, better in PAIR_GOALS:
        if base not in rows and other not in rows:
            continue
        b, o = rows.get(base, {}), rows.get(other, {})
        ok = b.get("status") == "ok" and o.get("status") == "ok"
        ratio = (float(o[metric]) / float(b[metric])
                 if ok and o.get(metric) is not None and b.get(metric) else None)
        met = None if goal is None else (ratio is not None and (
            ratio >= goal if better == "higher" else ratio <= goal))
        note = "" if ok else (f"{base}: {b.get('status', 'not run')}, "
                              f"{other}: {o.get('status', 'not run')}")
        out.append({"pair": f"{other} / {base}", "metric": metric, "ratio": ratio, "goal": goal,
                    "better": better, "met": met, "note": note})
    for name, (goal, gpu) in MFU_GOALS.items():
        r = rows.get(name)
        if r is None:
            continue
        mfu = r.get("mfu") if r.get("status") == "ok" else None
        on = gpu.lower() in (device or "").lower()
        out.append({"pair": name, "metric": "mfu", "ratio": mfu, "goal": goal if on else None,
                    "better": "higher", "met": (mfu is not None and mfu >= goal) if on else None,
                    "note": "" if on else f"goal is for an {gpu}; this device: {device}"})
    return out


def failed_row(name: str, status: str, error: str) -> Dict[str, object]:
    return {"run": name, "status": status, "error": error}


def failure_status(log_text: str) -> str:
    return "out of memory" if any(m in log_text for m in OOM_MARKERS) else "failed"


# ---------------------------------------------------------------------------------------------
# the summary


CORPUS_NAMES = {"zipf": "synthetic Zipf ids (not text: loss curves say nothing about the models)",
                "text": "BPE text"}


def markdown(summary: Dict[str, object]) -> str:
    unit = "GPU" if summary["cuda"] else "rank"
    lines = [f"# First runs on {summary['device']}", "",
             f"Peak {summary['peak_tflops']} TFLOP/s ({summary['peak_source']}); corpus "
             f"{CORPUS_NAMES.get(summary['corpus'].get('source'), 'text')}, "
             f"{summary['corpus']['tokens']:,} tokens, vocabulary {summary['corpus']['vocab']} "
             "padded to each preset's.", "",
             f"| run | status | tokens/s/{unit} | TFLOP/s/{unit} | MFU | peak memory GiB | "
             "iterations measured | final loss | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for r in summary["runs"]:
        lines.append(
            f"| {r['run']} | {r['status']} | {f(r.get('tokens_per_s_per_gpu'), ',.0f')} | "
            f"{f(r.get('tflops_per_s_per_gpu'), '.4g')} | "
            f"{f(None if r.get('mfu') is None else 100 * r['mfu'], '.2f')}"
            f"{'%' if r.get('mfu') is not None else ''} | {f(r.get('peak_mem_gib'), '.3g')} | "
            f"{r.get('measured_iters', '')} | {f(r.get('loss_final'), '.4g')} | "
            f"{r.get('error', '')} |")
    lines += ["", "| pair | metric | value | goal | met | note |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in summary["pairs"]:
        goal = "" if p["goal"] is None else (">= " if p["better"] == "higher" else "<= ") + \
            f"{p['goal']:g}"
        met = {True: "yes", False: "**no**", None: ""}[p["met"]]
        lines.append(f"| {p['pair']} | {p['metric']} | {f(p['ratio'], '.4g')} | {goal} | {met} | "
                     f"{p['note']} |")
    return "\n".join(lines) + "\n"


def plot(summary: Dict[str, object], path: str) -> None:
    """Top: tokens/s, MFU and peak memory per run (a run that did not finish: a grey bar named
    by its status); bottom: training loss against tokens, one panel per pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    by_name = {r["run"]: r for r in runs}
    pairs: List[Tuple[str, ...]] = []
    for base, other, *_ in PAIR_GOALS:
        group = tuple(n for n in (base, other) if n in by_name)
        if group and group not in pairs:
            pairs.append(group)
    pairs += [(r["run"],) for r in runs if not any(r["run"] in p for p in pairs)]
    unit = "GPU" if summary["cuda"] else "rank"
    ncol = max(3, len(pairs))
    fig, axes = plt.subplots(2, ncol, figsize=(4.2 * ncol, 8.0), squeeze=False)
    panels = [("tokens_per_s_per_gpu", 1.0, f"tokens/s per {unit}"), ("mfu", 100.0, "MFU (%)"),
              ("peak_mem_gib", 1.0, "peak memory (GiB)")]
    for ax, (key, scale, title) in zip(axes[0], panels):
        values = [(r.get(key) or 0.0) * scale for r in runs]
        top = max(values + [0.0]) or 1.0
        bars = ax.bar(range(len(runs)), values, color="tab:blue")
        for i, (bar, r) in enumerate(zip(bars, runs)):
            if r["status"] != "ok":
                bar.set_color("lightgrey")
                ax.text(i, 0.02 * top, r["status"], ha="center", va="bottom", rotation=90,
                        fontsize=9, color="dimgrey")
            elif r.get(key) is not None:
                ax.text(i, values[i], scaling._label(values[i]), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([r["run"] for r in runs], rotation=25, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, top * 1.2)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[0][len(panels):]:
        ax.axis("off")
    for ax, group in zip(axes[1], pairs):
        for name in group:
            curve = by_name[name].get("loss") or []
            if curve:
                ax.plot([t for t, _ in curve], [v for _, v in curve], label=name)
            else:
                ax.plot([], [], label=f"{name} ({by_name[name]['status']}, no curve)")
        ax.set_xlabel("tokens")
        ax.set_ylabel("training loss")
        ax.set_title(" vs ".join(group), fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[1][len(pairs):]:
        ax.axis("off")
    fig.suptitle(summary["title"], fontsize=11)
    fig.tight_layout()
    try:
        scaling._replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)


def write_outputs(summary: Dict[str, object], out: str, with_plot: bool = True) -> None:
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")

    def md(tmp):
        with open(tmp, "w") as f:
            f.write(markdown(summary))

    scaling._replace_atomically(os.path.join(out, "first_runs.json"), dump)
    scaling._replace_atomically(os.path.join(out, "first_runs.md"), md)
    if with_plot:
        plot(summary, os.path.join(out, "first_runs.png"))


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str]):
    p = argparse.ArgumentParser(prog="launch/first_runs.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/first_runs", help="output directory")
    p.add_argument("--runs", default=",".join(GPU_RUNS),
                   help=f"comma list, in training order, of: {', '.join(RUNS)}")
    p.add_argument("--run-seconds", type=float, default=90.0,
                   help="each run ends at the first iteration after this many seconds from "
                        "its start (start-up included)")
    p.add_argument("--iters", type=int, default=None,
                   help="measured iterations per run instead of --run-seconds")
    p.add_argument("--warmup-iters", type=int, default=3,
                   help="iterations left out of the numbers (>= 1: the first includes start-up)")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="sequences per micro-batch (whole sequences of the preset's length)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="default: one micro-batch per iteration")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="default: the GPU's datasheet bf16 dense peak (launch/scaling.py), a "
                        "measured fp32 GEMM on the CPU")
    p.add_argument("--corpus", choices=("zipf", "text"), default="zipf",
                   help="zipf: synthetic Zipf-distributed ids over the whole vocabulary "
                        "(realistic STEM tier hit rates; not text: its loss curves say nothing "
                        "about the models); text: the main job's BPE corpus (8,192 ids)")
    p.add_argument("--corpus-vocab", type=int, default=None,
                   help="the corpus tokenizer's (default: zipf the smallest vocabulary of the "
                        "runs' presets, text 8192)")
    p.add_argument("--corpus-tokens", type=int, default=None,
                   help=f"--corpus zipf: its tokens (default {ZIPF_TOKENS:,})")
    p.add_argument("--corpus-mb", type=float, default=None,
                   help="--corpus text: the corpus's text, MB (default 8)")
    p.add_argument("--data-dir", default=None, help="corpus directory (default OUT/data)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run before it is killed (default --run-seconds + 120)")
    opts = p.parse_args(argv)
    opts.run_list = [n for n in opts.runs.split(",") if n]
    unknown = [n for n in opts.run_list if n not in RUNS]
    if unknown or not opts.run_list:
        p.error(f"--runs={opts.runs}: unknown {unknown}; known: {', '.join(RUNS)}")
    if opts.warmup_iters < 1:
        p.error(f"--warmup-iters={opts.warmup_iters}: must be >= 1")
    if opts.iters is not None and opts.iters < 1:
        p.error(f"--iters={opts.iters}: must be >= 1")
    if opts.micro_batch_size < 1:
        p.error(f"--micro-batch-size={opts.micro_batch_size}: must be >= 1")
    if opts.run_seconds <= 0:
        p.error(f"--run-seconds={opts.run_seconds}: must be > 0")
    if opts.corpus == "zipf" and opts.corpus_mb is not None:
        p.error("--corpus-mb sizes the text corpus: with --corpus zipf give --corpus-tokens")
    if opts.corpus == "text" and opts.corpus_tokens is not None:
        p.error("--corpus-tokens sizes the zipf corpus: with --corpus text give --corpus-mb")
    if opts.corpus_vocab is None:
        opts.corpus_vocab = (min(scaling.preset_vocab(RUNS[n][0], None) for n in opts.run_list)
                             if opts.corpus == "zipf" else 8192)
    return opts


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    opts = parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    try:
        peak, peak_source = scaling.resolve_peak(opts.peak_tflops, cuda, device, threads)
    except ValueError as exc:
        log(str(exc))
        return 2

    from megatron_ext.tools import data_prep

    try:
        manifest = data_prep.prepare(data_prep.DataPrepConfig(
            out=opts.data_dir or os.path.join(out, "data"), vocab_size=opts.corpus_vocab,
            max_mb=opts.corpus_mb or 8.0, source=opts.corpus,
            zipf_tokens=opts.corpus_tokens or ZIPF_TOKENS))
    except ValueError as exc:
        log(str(exc))
        return 2
    data = {"source": opts.corpus, "prefix": manifest["data_prefix"],
            "tokenizer": manifest["tokenizer_dir"],
            "vocab": int(manifest["tokenizer_vocab_size"]), "tokens": int(manifest["num_tokens"]),
            "manifest": os.path.join(os.path.dirname(manifest["data_prefix"]),
                                     data_prep.MANIFEST)}
    timeout = opts.timeout or (opts.run_seconds + 120 if not opts.iters else 1800)
    rows: Dict[str, Dict[str, object]] = {}
    for k, name in enumerate(opts.run_list, 1):
        run_dir = os.path.join(out, name)
        shutil.rmtree(os.path.join(run_dir, "tensorboard"), ignore_errors=True)
        os.makedirs(run_dir, exist_ok=True)
        report_path, log_path = os.path.join(run_dir, "report.json"), os.path.join(run_dir,
                                                                                   "log.txt")
        if os.path.exists(report_path):
            os.unlink(report_path)  # a stale report must not pass for this run's
        try:
            cmd = run_command(name, opts, data, run_dir, report_path, cuda, peak)
        except ValueError as exc:
            rows[name] = failed_row(name, "refused", str(exc))
            continue
        log(f"{k}/{len(opts.run_list)} {name}: "
            f"{f'{opts.iters} iterations' if opts.iters else f'{opts.run_seconds:g} s'} "
            f"after {opts.warmup_iters} warm-up, log {log_path}")
        status, rc, wall = scaling.run_layout(cmd, log_path, timeout, threads,
                                              None if opts.iters else opts.run_seconds)
        if status == "ok":
            try:
                with open(report_path) as f:
                    row = run_row(name, json.load(f), opts.warmup_iters, peak,
                                  loss_curve(os.path.join(run_dir, "tensorboard")))
            except (OSError, ValueError, KeyError) as exc:
                row = failed_row(name, "no-report", f"{report_path}: {exc}")
        elif status == "timeout":
            row = failed_row(name, "timeout", f"killed after {timeout:.0f} s")
        else:
            with open(log_path, errors="replace") as f:
                text = f.read()
            error = scaling.last_error_line(text)
            if not opts.iters and "SIGTERM" in text and "iteration " not in text:
                # the stop came before Megatron's handler was installed: start-up took longer
                error = (f"no iteration within --run-seconds={opts.run_seconds:g} (start-up took "
                         "longer)")
            row = failed_row(name, failure_status(text), f"exit code {rc}: {error}")
        row.update(preset=RUNS[name][0], flags=RUNS[name][1], wall_s=wall,
                   log=os.path.relpath(log_path, out))
        rows[name] = row
        if row["status"] == "ok":
            mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.2f}%"
            log(f"{name}: {row['tokens_per_s_per_gpu']:,.0f} tokens/s, MFU {mfu}, "
                f"{row['peak_mem_gib']:.3g} GiB, {row['measured_iters']} measured iterations, "
                f"{wall:.0f} s")
        else:
            log(f"{name}: {row['status']}: {row['error']} ({wall:.0f} s)")

        # after each run: a step killed at its limit still leaves the runs before
        write_outputs(make_summary(opts, rows, device, cuda, peak, peak_source, data), out,
                      with_plot=False)
    write_outputs(make_summary(opts, rows, device, cuda, peak, peak_source, data), out)
    log(f"wrote {out}/first_runs.json, first_runs.md and first_runs.png")
    print(markdown(make_summary(opts, rows, device, cuda, peak, peak_source, data)))
    return 0 if all(r["status"] == "ok" for r in rows.values()) else 1


def make_summary(opts, rows: Dict[str, Dict[str, object]], device: str, cuda: bool,
                 peak: Optional[float], peak_source: str,
                 data: Dict[str, object]) -> Dict[str, object]:
    """The summary of the runs so far (a run not yet trained: ``not run``)."""
    runs = [rows.get(n) or {"run": n, "status": "not run"} for n in opts.run_list]
    return {
        "device": device, "cuda": cuda, "peak_tflops": peak, "peak_source": peak_source,
        "corpus": {k: data[k] for k in ("source", "prefix", "vocab", "tokens")},
        "micro_batch_size": opts.micro_batch_size,
        "global_batch_size": opts.global_batch_size or opts.micro_batch_size,
        "warmup_iters": opts.warmup_iters, "iters": opts.iters, "run_seconds": opts.run_seconds,
        "title": f"first runs on {device}, micro batch {opts.micro_batch_size}" + (
            f", {opts.iters} measured iterations" if opts.iters
            else f", {opts.run_seconds:g} s per run"),
        "runs": runs, "pairs": pair_rows(rows, device)}


if __name__ == "__main__":
    sys.exit(main())
