"""Scaling harness: train a preset briefly under several TP/EP/PP/DP layouts and compare them.

    python launch/scaling.py --preset stem_1b --gpus 8 \\
        --layouts "tp1ep1pp1dp8,tp2ep1pp1dp4,tp1ep1pp2dp4" --iters 10 --warmup-iters 2 \\
        --micro-batch-size 1 --out runs/scaling [--peak-tflops X] [--dry-run] [-- Megatron flags]

Each layout is checked against Megatron's rules before anything starts, then trained with
``torchrun launch/pretrain.py --ext-run-report`` (``training/run_report.py``); its log is kept in
``OUT/<layout>/log.txt``. A layout that fails or times out is recorded and the sweep goes on.
``OUT/scaling.csv`` gets one row per layout, ``OUT/scaling.png`` four panels (tokens/s/GPU,
TFLOP/s/GPU, MFU, peak memory). Without a GPU the ranks are CPU processes on gloo ("GPU" in the
column names then means "rank"). Columns, the peak used for MFU and how to read the plot:
``docs/scaling.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The package is imported from the repository: after the path is set.
from megatron_ext.flags import flag_value
from megatron_ext.planning.layout import Layout, parse_layouts, validate_layout
from megatron_ext.planning.layout import parse_layout  # noqa: F401  (tests read it from here)
from megatron_ext.planning.model_shape import ModelShape
from megatron_ext.training.presets import expand_argv, preset_tokenizer

PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")

# Flags the harness sets from the layout and the sweep; giving them after `--` would make the
# row describe a run other than the one trained.
OWNED_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
               "--expert-model-parallel-size", "--context-parallel-size",
               "--expert-tensor-parallel-size", "--train-iters", "--micro-batch-size",
               "--ext-run-report", "--preset", "--sigma-preset")

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s per GPU.
# Matched against torch.cuda.get_device_name() in order: the first substring that occurs wins.
GPU_PEAK_BF16_DENSE: List[Tuple[str, float, str]] = [
    ("H100 PCIe", 756.0, "H100 PCIe"),
    ("H100 80GB HBM3", 989.4, "H100 SXM"),
    ("H100 SXM", 989.4, "H100 SXM"),
    ("H200", 989.4, "H200"),
    ("A100", 312.0, "A100"),
]

COLUMNS = [
    "layout", "tp", "ep", "pp", "cp", "etp", "dp", "gpus", "status", "error",
    "tokens_per_s_per_gpu", "tflops_per_s_per_gpu", "mfu", "peak_tflops", "peak_source",
    "peak_mem_gib", "peak_mem_metric", "peak_alloc_gib", "host_rss_gib", "iter_time_ms",
    "measured_iters", "measured_tokens", "measured_seconds", "train_flops_per_token",
    "micro_batch_size", "global_batch_size", "num_microbatches", "seq_length", "preset",
    "model_family", "device", "wall_s", "log",
]

GIB = float(1 << 30)


def log(msg: str) -> None:
    print(f"[scaling] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the model
#
# The layouts themselves (names like tp2ep1pp1dp4, Megatron's rules) are megatron_ext/tools/
# layout.py's; the model's shape megatron_ext/planning/model_shape.py's.


def preset_vocab(preset: str, vocab_size: Optional[int]) -> int:
    """The tokenizer's vocabulary: ``vocab_size`` (``--vocab-size``), else the preset's
    ``tokenizer`` entry."""
    if vocab_size is None:
        vocab_size = preset_tokenizer(["--preset", preset]).get("vocab_size")
        if vocab_size is None:
            raise ValueError(f"--preset={preset} names no tokenizer vocabulary: give "
                             "--vocab-size V")
    return int(vocab_size)


def model_shape(preset: str, extra: Sequence[str],
                vocab_size: Optional[int] = None) -> ModelShape:
    """The model the preset and the flags after ``--`` describe (for the layout rules, which do
    not read the vocabulary: 1 where neither ``--vocab-size`` nor the preset gives it, as with
    ``--data-path`` and a tokenizer of the user's)."""
    known = vocab_size or preset_tokenizer(["--preset", preset]).get("vocab_size")
    return ModelShape.from_flags(expand_argv(["--preset", preset, *extra]), int(known or 1))


def global_batch_size(preset: str, extra: Sequence[str]) -> Optional[int]:
    """``--global-batch-size`` of the preset and the flags after ``--`` (None: not given)."""
    value = flag_value(expand_argv(["--preset", preset, *extra]), "--global-batch-size")
    return int(value) if value is not None else None


# ---------------------------------------------------------------------------------------------
# peak FLOP/s


def gpu_peak(device_name: str) -> Tuple[Optional[float], str]:
    for key, tflops, label in GPU_PEAK_BF16_DENSE:
        if key.lower() in device_name.lower():
            return tflops, f"datasheet bf16 dense ({label})"
    return None, f"unknown GPU {device_name!r}: give --peak-tflops"


_GEMM_BENCH = r"""
import sys, time, torch
n, reps, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
a, b = torch.randn(n, n), torch.randn(n, n)
for _ in range(2):
    a @ b
best = float("inf")
for _ in range(reps):
    t = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - t)
print(2.0 * n ** 3 / best / 1e12)
"""


def measure_cpu_peak(threads: int, n: int = 2048, reps: int = 5) -> float:
    """TFLOP/s of the best of ``reps`` fp32 ``n x n`` matmuls with ``threads`` threads, in a fresh
    process (the sweep's ranks are separate processes with this many threads each)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", _GEMM_BENCH, str(n), str(reps), str(threads)],
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def resolve_peak(given: Optional[float], cuda: bool, device_name: str,
                 threads: int) -> Tuple[Optional[float], str]:
    if given is not None:
        if given <= 0:
            raise ValueError(f"--peak-tflops={given}: must be > 0")
        return given, "--peak-tflops"
    if cuda:
        return gpu_peak(device_name)
    n = 2048
    tflops = measure_cpu_peak(threads, n=n)
    return tflops, f"measured fp32 GEMM ({threads} thread{'s' if threads > 1 else ''}, n={n})"


# ---------------------------------------------------------------------------------------------
# one layout


def torchrun_command(layout: Layout, opts, extra: Sequence[str], report: str,
                     cuda: bool) -> List[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={opts.gpus}", PRETRAIN, "--preset", opts.preset, *layout.flags(),
           "--micro-batch-size", str(opts.micro_batch_size),
           "--train-iters", str(opts.warmup_iters + opts.iters),
           "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000000"]
    if opts.data_path:
        cmd += ["--data-path", *opts.data_path, "--tokenizer-type", opts.tokenizer_type,
                "--tokenizer-model", opts.tokenizer_model,
                "--data-cache-path", os.path.join(os.path.abspath(opts.out), "data_cache")]
    else:
        cmd += ["--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", str(null_tokenizer_vocab(opts.preset, opts.vocab_size))]
    # Without CUDA the entry point's CPU backend defaults (gloo, CPU initialization, no fused
    # kernels: megatron_ext/compat/cpu.py) apply. On a GPU the batch carries no [b, 1, s, s]
    # mask: the presets are causal without EOD resets, and the local backend's fused attention
    # (--ext-core-attention sdpa, models/sdpa_attention.py) takes its flash kernel only without
    # a mask (with one, the memory-efficient kernel; Transformer Engine ignores it either way).
    if cuda:
        cmd += ["--no-create-attention-mask-in-dataloader"]
    cmd += ["--ext-run-report", report, *extra]
    return cmd


def null_tokenizer_vocab(preset: str, vocab_size: Optional[int]) -> int:
    """``--vocab-size`` for NullTokenizer giving the preset's vocabulary (it adds an EOD id)."""
    return preset_vocab(preset, vocab_size) - 1


_EXC = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s*)?"
                  r"((?:[A-Za-z_][\w.]*(?:Error|Exception)|SystemExit|megatron-ext)\b:?.*)$")
# Secondary failures: other ranks losing their peer after the first one died.
_SECONDARY = ("ChildFailedError", "Connection closed by peer", "Connection reset by peer",
              "ECONNRESET", "Broken pipe", "SIGTERM", "failed to recv", "Socket Timeout")


def last_error_line(text: str, limit: int = 300) -> str:
    """The message that explains a failed run: the last exception or ``megatron-ext:`` line,
    other ranks' lost connections skipped when there is a primary error."""
    found = [m.group(1).strip() for line in text.splitlines()
             if (m := _EXC.match(line.strip()))]
    primary = [f for f in found if not any(s in f for s in _SECONDARY)]
    pick = (primary or found or [ln.strip() for ln in text.splitlines() if ln.strip()] or [""])
    return pick[-1][:limit]


def child_pids(pid: int) -> List[int]:
    """The processes whose parent is ``pid`` (torchrun's ranks), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the fields after the command's closing parenthesis: state, ppid, ...
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def run_layout(cmd: List[str], log_path: str, timeout: float, threads: int,
               stop_after: Optional[float] = None) -> Tuple[str, int, float]:
    """Run ``cmd`` (its own process group, so a timeout kills every rank); output to
    ``log_path``. Returns (status, return code, seconds).

    ``stop_after``: seconds after which torchrun's ranks get SIGTERM, which a run with
    Megatron's ``--exit-signal-handler`` answers by ending after its current iteration and
    exiting 0 (torchrun itself is not signalled: it would tear the ranks down and fail)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with open(log_path, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            if stop_after is not None:
                try:
                    proc.wait(timeout=stop_after)
                except subprocess.TimeoutExpired:
                    for child in child_pids(proc.pid):
                        try:
                            os.kill(child, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
            rc = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, status = proc.returncode, "timeout"
    return status, rc, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# numbers


def metrics_from_report(report: Dict[str, object], warmup_iters: int,
                        peak_tflops: Optional[float]) -> Dict[str, object]:
    """A CSV row's numbers from a run report. The first ``warmup_iters`` iterations (at least the
    start-up one) are left out; the rest are "measured".

    tokens/s/GPU = measured tokens / measured seconds / world size; TFLOP/s/GPU = that x training
    FLOPs per token (token-weighted over the measured iterations) / 1e12; MFU = TFLOP/s/GPU / peak;
    iteration time: the median of the measured iterations.
    """
    its = list(report["iterations"])
    measured = [it for i, it in enumerate(its) if i >= warmup_iters and not it.get("startup")]
    if not measured:
        raise ValueError(f"the report has {len(its)} iterations and {warmup_iters} are warm-up: "
                         "nothing left to measure")
    lay = report["layout"]
    world = int(lay["world_size"])
    tokens = sum(int(it["tokens"]) for it in measured)
    seconds = sum(float(it["seconds"]) for it in measured)
    tok_s_gpu = tokens / seconds / world
    if any(it.get("train_flops_per_token") is None for it in measured):
        flops_per_token = tflops = None  # the estimate did not cover this run (flops_error)
    else:
        flops_per_token = sum(int(it["tokens"]) * float(it["train_flops_per_token"])
                              for it in measured) / tokens
        tflops = tok_s_gpu * flops_per_token / 1e12
    mem = report["memory"]
    return {
        "tokens_per_s_per_gpu": tok_s_gpu, "tflops_per_s_per_gpu": tflops,
        "mfu": tflops / peak_tflops if peak_tflops and tflops is not None else None,
        "peak_mem_gib": mem["peak_bytes"] / GIB, "peak_mem_metric": mem["peak_metric"],
        "peak_alloc_gib": (mem["max_allocated_bytes"] / GIB
                           if mem.get("max_allocated_bytes") is not None else None),
        "host_rss_gib": mem["max_rss_bytes"] / GIB,
        "iter_time_ms": 1e3 * statistics.median(float(it["seconds"]) for it in measured),
        "measured_iters": len(measured), "measured_tokens": tokens, "measured_seconds": seconds,
        "train_flops_per_token": flops_per_token,
        "micro_batch_size": lay["micro_batch_size"], "global_batch_size": lay["global_batch_size"],
        "num_microbatches": lay["num_microbatches"], "seq_length": lay["seq_length"],
        "preset": report.get("preset"), "model_family": report.get("model_family"),
        "device": report["device"]["name"],
    }


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _replace_atomically(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".scaling.", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_csv(rows: Sequence[Dict[str, object]], path: str) -> None:
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow({k: _fmt(row.get(k)) for k in COLUMNS})

    _replace_atomically(path, write)


def _num(row, key) -> Optional[float]:
    value = row.get(key)
    if value in (None, ""):
        return None
    return float(value)


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def plot(rows: Sequence[Dict[str, object]], path: str, title: str, unit: str = "GPU") -> None:
    """Four bar panels over the layouts; ``unit`` names what "per GPU" is (``rank`` on a CPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [str(r["layout"]) for r in rows]
    peak = next((r for r in rows if _num(r, "peak_tflops")), None)
    metric = next((r["peak_mem_metric"] for r in rows if r.get("peak_mem_metric")), "n/a")
    peak_label = (f"of {float(peak['peak_tflops']):.3g} TFLOP/s, {peak['peak_source']}"
                  if peak else "no peak: give --peak-tflops")
    panels = [
        ("tokens_per_s_per_gpu", 1.0, f"tokens/s per {unit}",
         f"training throughput per {unit} (higher is better)"),
        ("tflops_per_s_per_gpu", 1.0, f"TFLOP/s per {unit}",
         f"achieved training FLOP/s per {unit} (model FLOPs)"),
        ("mfu", 100.0, "MFU (%)", f"MFU ({peak_label})"),
        ("peak_mem_gib", 1.0, "GiB (max over ranks)", f"peak memory per rank ({metric})"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(max(9.0, 1.6 * len(rows) + 5), 7.5))
    for ax, (key, scale, ylabel, panel_title) in zip(axes.flat, panels):
        values = [(_num(r, key) or 0.0) * scale for r in rows]
        bars = ax.bar(range(len(rows)), values, color="tab:blue")
        top = max(values) if values and max(values) > 0 else 1.0
        for i, (bar, row) in enumerate(zip(bars, rows)):
            if row.get("status") != "ok":
                bar.set_color("lightgrey")
                ax.text(i, 0.02 * top, str(row.get("status")), ha="center", va="bottom",
                        rotation=90, color="dimgrey", fontsize=9)
            elif _num(row, key) is not None:
                ax.text(i, bar.get_height(), _label(values[i]), ha="center", va="bottom",
                        fontsize=9)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=9)
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title, fontsize=10)
        ax.set_ylim(0, top * 1.18)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()

    def write(tmp):
        fig.savefig(tmp, format="png", dpi=110)

    try:
        _replace_atomically(path, write)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------
# the sweep


def parse_args(argv: Sequence[str]):
    argv = list(argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        prog="launch/scaling.py", description=__doc__.split("\n\n")[0],
        epilog="Flags after `--` go to launch/pretrain.py (after the harness's own, so they win).")
    p.add_argument("--preset", required=True, help="a preset under launch/presets or a path")
    p.add_argument("--gpus", type=int, required=True,
                   help="ranks per run (GPUs; CPU processes without a GPU)")
    p.add_argument("--layouts", required=True,
                   help="comma-separated layouts, e.g. 'tp1ep1pp1dp2,tp2ep1pp1dp1' "
                        "(keys tp, ep, pp, dp, cp, etp; a missing one is 1)")
    p.add_argument("--iters", type=int, default=10, help="measured iterations per layout")
    p.add_argument("--warmup-iters", type=int, default=2,
                   help="iterations before the measured ones (>= 1: the first includes start-up)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--out", default="runs/scaling", help="output directory")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per GPU for MFU (default: datasheet table on a GPU, a "
                        "measured fp32 GEMM on the CPU)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--mock-data", action="store_true",
                      help="Megatron's mock data with a NullTokenizer (the default)")
    data.add_argument("--data-path", nargs="+", default=None, help="Megatron --data-path")
    p.add_argument("--tokenizer-model", default=None, help="with --data-path")
    p.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", help="with --data-path")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (default: the preset's tokenizer entry); "
                        "with mock data the NullTokenizer's")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per layout")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU: OMP threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the layouts and print the torchrun commands; launch nothing")
    opts = p.parse_args(argv)
    if opts.gpus < 1:
        p.error(f"--gpus={opts.gpus}: must be >= 1")
    if opts.iters < 1:
        p.error(f"--iters={opts.iters}: must be >= 1")
    if opts.warmup_iters < 1:
        p.error(f"--warmup-iters={opts.warmup_iters}: must be >= 1 (the first iteration "
                "includes start-up and is never measured)")
    if opts.micro_batch_size < 1:
        p.error(f"--micro-batch-size={opts.micro_batch_size}: must be >= 1")
    if opts.data_path and not opts.tokenizer_model:
        p.error("--data-path needs --tokenizer-model")
    owned = [a for a in extra if a.split("=", 1)[0] in OWNED_FLAGS]
    if owned:
        p.error(f"{', '.join(owned)} after `--`: the harness sets these (use --layouts, --iters, "
                "--micro-batch-size, --preset)")
    try:
        opts.layout_list = parse_layouts(opts.layouts)
    except ValueError as exc:
        p.error(str(exc))
    return opts, extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts, extra = parse_args(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    if cuda and opts.gpus > torch.cuda.device_count():
        log(f"--gpus={opts.gpus} but this node has {torch.cuda.device_count()} GPUs")
        return 2
    threads = opts.threads_per_rank or (
        int(os.environ.get("OMP_NUM_THREADS", "0"))
        or max(1, (os.cpu_count() or 1) // opts.gpus))
    try:
        shape = model_shape(opts.preset, extra, opts.vocab_size)
        global_batch = global_batch_size(opts.preset, extra)
    except ValueError as exc:
        log(str(exc))
        return 2

    rows: List[Dict[str, object]] = []
    to_run: List[Tuple[Layout, Dict[str, object]]] = []
    for lay in opts.layout_list:
        row: Dict[str, object] = dict(layout=lay.name, tp=lay.tp, ep=lay.ep, pp=lay.pp,
                                      cp=lay.cp, etp=lay.expert_tp, dp=lay.dp, gpus=opts.gpus,
                                      preset=opts.preset, model_family=shape.family)
        try:
            lay = replace(lay, micro_batch=opts.micro_batch_size, global_batch=global_batch,
                          check=False)
            validate_layout(lay, shape, gpus=opts.gpus, cpu=not cuda)
        except ValueError as exc:
            row.update(status="refused", error=str(exc))
            log(f"refused {exc}")
        else:
            to_run.append((lay, row))
        rows.append(row)

    out = os.path.abspath(opts.out)
    if opts.dry_run:
        for lay, _ in to_run:
            report = os.path.join(out, lay.name, "report.json")
            print(shlex.join(torchrun_command(lay, opts, extra, report, cuda)))
        return 0 if to_run else 1

    device_name = torch.cuda.get_device_name(0) if cuda else None
    try:
        peak, peak_source = resolve_peak(opts.peak_tflops, cuda, device_name or "", threads)
    except (ValueError, subprocess.SubprocessError) as exc:
        log(f"peak FLOP/s: {exc}")
        return 2
    log(f"peak {peak if peak is None else f'{peak:.4g}'} TFLOP/s per "
        f"{'GPU' if cuda else 'rank'} ({peak_source})")
    for row in rows:
        row.update(peak_tflops=peak, peak_source=peak_source)

    os.makedirs(out, exist_ok=True)
    for k, (lay, row) in enumerate(to_run, 1):
        lay_dir = os.path.join(out, lay.name)
        os.makedirs(lay_dir, exist_ok=True)
        report_path = os.path.join(lay_dir, "report.json")
        if os.path.exists(report_path):
            os.unlink(report_path)  # a stale report must not pass for this run's
        log_path = os.path.join(lay_dir, "log.txt")
        cmd = torchrun_command(lay, opts, extra, report_path, cuda)
        log(f"{k}/{len(to_run)} {lay.name}: torchrun on {opts.gpus} "
            f"{'GPUs' if cuda else f'CPU ranks x {threads} threads'}, "
            f"{opts.warmup_iters}+{opts.iters} iterations, log {log_path}")
        status, rc, wall = run_layout(cmd, log_path, opts.timeout, threads)
        row.update(wall_s=wall, log=os.path.relpath(log_path, out))
        if status == "ok":
            try:
                with open(report_path) as f:
                    row.update(metrics_from_report(json.load(f), opts.warmup_iters, peak))
            except (OSError, ValueError, KeyError) as exc:
                status = "no-report"
                row["error"] = f"{report_path}: {exc}"
        elif status == "timeout":
            row["error"] = f"timed out after {opts.timeout:.0f} s"
        else:
            with open(log_path, errors="replace") as f:
                row["error"] = f"exit code {rc}: {last_error_line(f.read())}"
        row["status"] = status
        if status == "ok":
            mfu = f"{100 * row['mfu']:.2f}%" if row.get("mfu") is not None else "n/a"
            tflops = row.get("tflops_per_s_per_gpu")
            log(f"{lay.name}: ok, {row['tokens_per_s_per_gpu']:.4g} tokens/s/GPU, "
                f"{'n/a' if tflops is None else f'{tflops:.4g}'} TFLOP/s/GPU, MFU {mfu}, "
                f"{row['peak_mem_gib']:.3g} GiB, {row['iter_time_ms']:.4g} ms/iter ({wall:.0f} s)")
        else:
            log(f"{lay.name}: {status}: {row.get('error')} ({wall:.0f} s)")

    csv_path, png_path = os.path.join(out, "scaling.csv"), os.path.join(out, "scaling.png")
    write_csv(rows, csv_path)
    device = device_name or next((r["device"] for r in rows if r.get("device")), "CPU")
    plot(rows, png_path, f"{opts.preset} on {opts.gpus} {'GPUs' if cuda else 'CPU ranks'} "
                         f"({device}), micro batch {opts.micro_batch_size}, "
                         f"{opts.iters} measured iterations", unit="GPU" if cuda else "rank")
    summary = {"preset": opts.preset, "gpus": opts.gpus, "cuda": cuda, "device": device,
               "threads_per_rank": None if cuda else threads, "peak_tflops": peak,
               "peak_source": peak_source, "iters": opts.iters,
               "warmup_iters": opts.warmup_iters, "micro_batch_size": opts.micro_batch_size,
               "extra_flags": extra, "rows": rows}

    def write_summary(tmp):
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")

    _replace_atomically(os.path.join(out, "scaling.json"), write_summary)
    log(f"wrote {csv_path} and {png_path}")
    # A sweep with failing layouts is a result; a sweep where nothing trained is an error.
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
