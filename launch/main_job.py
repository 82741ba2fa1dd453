"""The main job: dense SwiGLU baseline vs STEM-1/3 on the offline corpus, side by side.

    .venv/bin/python launch/main_job.py [--out runs/main] [--iters N] [--nproc 2] [--repeats R]

1. builds (or reuses) the offline corpus with ``megatron_ext.tools.data_prep``;
2. trains the dense baseline (``--model-family gpt``) and STEM-1/3 (``--model-family stem
   --stem-ratio 1/3`` with the tables managed as recommended at scale: ``STEM_TABLES``) with
   ``torchrun launch/pretrain.py``: same data, seed and hyperparameters, each with its own log
   file, tensorboard directory and checkpoints (``RUN/ckpt``, every quarter of the run, each
   with its checksum manifest; the last one kept);
3. reads Megatron's tensorboard scalars (``lm loss``, ``iteration-time``, ``lm loss validation``)
   and prints a summary table (losses, tokens/s and step time beside dense's) with the analytic
   counts of ``megatron_ext.planning.model_shape``; writes
   ``summary.json`` and ``loss_curves.png`` into ``--out``.

The preset (model shape and schedule) keeps the whole job under ten minutes on a 2-core CPU.

The same command again resumes: a run whose settings are unchanged (``RUN/run.json``) and whose
last checkpoint is its final iteration is not trained again (its logs are read); one stopped
part-way (a crash, Ctrl-C) resumes from its last checkpoint; one whose settings changed trains
from scratch. Step times leave out the first iterations after every start, so a resumed run's
warm-up is not counted twice.

``--repeats R`` trains the pair R times, in the order dense, STEM, STEM, dense, dense, STEM, ...
(so a drift of the machine's speed that is linear in time slows both alike), and reports the
median over the repeats of each repeat's own STEM/dense step-time ratio: on a shared machine
the speed drifts by more than 5% between two runs minutes apart, and one pair of runs cannot
tell a 5% goal from the drift. Same seed and data in every repeat: the losses are those of the
first, and the job says if a later repeat's differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The job's settings (launch/main_job.json, beside this script: not a --preset of flags, so not
# under launch/presets): a small Llama-style model (SwiGLU, RMSNorm, RoPE, untied embeddings, as
# the paper's MobileLLM/Llama-3.2 setups) and its schedule, sized so that two CPU ranks train it
# at a few thousand tokens/s.
PRESET_PATH = os.path.join(ROOT, "launch", "main_job.json")
with open(PRESET_PATH) as _f:
    _PRESET = json.load(_f)
MODEL: Dict[str, int] = _PRESET["model"]
TRAIN: Dict[str, float] = _PRESET["train"]
# STEM runs with the table mode docs/stem.md recommends at scale: managed tables sharded by
# vocabulary over the data-parallel ranks, the hottest rows in the device tier (on a CPU machine
# the device is the CPU), the sparse row optimizer stepping only the rows the batch touched, in
# the background while the next step computes. (Ordinary tables, Megatron parameters, would be
# all-reduced and Adam-stepped whole every step: 1.22x dense's step time on 2 CPU ranks.)
STEM_TABLES = ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
               "--stem-optimizer", "sparse"]
RUNS = (
    ("dense", ["--model-family", "gpt"]),
    ("stem-1/3", ["--model-family", "stem", "--stem-ratio", "1/3", *STEM_TABLES]),
)
ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.eE+-]+)")
# A run's own record beside its logs: the flags it trained with, the iterations it (re)started
# at, its wall time and whether it finished; what the next job compares to resume or skip it.
RUN_RECORD = "run.json"
CHECKPOINTS_PER_RUN = 4


class JobError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[main_job] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# training


def data_flags(manifest: dict) -> List[str]:
    """Megatron's data flags for the prepared corpus, with its manifest (``data_prep``)."""
    from megatron_ext.tools import data_prep

    return data_prep.megatron_data_args(manifest) + [
        "--ext-data-manifest", os.path.join(os.path.dirname(manifest["data_prefix"]),
                                            data_prep.MANIFEST)]


def pretrain_command(nproc: int, flags: Sequence[str]) -> List[str]:
    """``torchrun --standalone --nproc_per_node=nproc launch/pretrain.py flags``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", os.path.join(ROOT, "launch", "pretrain.py"), *flags]


def megatron_flags(iters: int, seed: int, data_args: Sequence[str], tensorboard_dir: str,
                   cache_dir: str, checkpoint_dir: Optional[str] = None) -> List[str]:
    m, t = MODEL, TRAIN
    eval_interval = max(1, math.ceil(iters / t["evaluations"]))
    # --load is --save: a second job resumes a run stopped part-way (the entry point says that
    # a first run starts from scratch). Megatron keeps checkpoint time out of the step time.
    saving = [] if checkpoint_dir is None else [
        "--save", checkpoint_dir, "--load", checkpoint_dir, "--ckpt-format", "torch_dist",
        "--save-interval", str(max(1, math.ceil(iters / CHECKPOINTS_PER_RUN)))]
    return [
        "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
        "--ffn-hidden-size", str(m["ffn_hidden_size"]),
        "--num-attention-heads", str(m["num_attention_heads"]),
        "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
        "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(t["micro_batch_size"]),
        "--global-batch-size", str(t["global_batch_size"]),
        "--train-iters", str(iters),
        "--lr", str(t["lr"]), "--min-lr", str(t["min_lr"]), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, int(iters * t["warmup_fraction"]))),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", str(t["adam_beta2"]),
        "--seed", str(seed),
        *data_args, "--data-cache-path", cache_dir,
        "--eval-iters", str(t["eval_iters"]), "--eval-interval", str(eval_interval),
        "--log-interval", "1",
        "--tensorboard-dir", tensorboard_dir, "--tensorboard-log-interval", "1",
        "--log-timers-to-tensorboard",
        "--distributed-backend", distributed_backend(), "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-rope-fusion",
        *saving,
    ]


def distributed_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class Progress:
    """A tqdm bar on a terminal; one line per tenth of the run otherwise (logs, CI)."""

    def __init__(self, name: str, total: int, start: int = 0):
        self.name, self.total, self.n, self.bar = name, total, start, None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=f"{name:>9}", unit="it",
                            dynamic_ncols=True)
        self.every = max(1, total // 10)

    def update(self, iteration: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(iteration - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}")
        elif iteration % self.every == 0 or iteration == self.total:
            log(f"{self.name}: iteration {iteration}/{self.total}, lm loss {loss:.3f}")
        self.n = iteration

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_training(name: str, cmd: List[str], log_path: str, iters: int, first: int = 0) -> float:
    """Run one torchrun job, streaming its output to ``log_path`` (appended to: a resumed run's
    log keeps the earlier attempts) and showing progress from iteration ``first``."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.perf_counter()
    progress = Progress(name, iters, first)
    with open(log_path, "a") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            for line in proc.stdout:
                logf.write(line)
                match = ITERATION_RE.search(line)
                if match:
                    progress.update(int(match.group(1)), float(match.group(3)))
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        finally:
            progress.close()
    wall = time.perf_counter() - start
    if rc != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-25:])
        raise JobError(f"run {name!r} failed with exit code {rc} after {wall:.0f}s; last lines "
                       f"of {log_path}:\n{tail}")
    if progress.n <= first:
        raise JobError(f"run {name!r} finished but logged no training iteration; see {log_path}")
    return wall


def parameters_from_log(log_path: str) -> Optional[int]:
    """Megatron's own count ('number of parameters on ... rank (0, ...): N')."""
    with open(log_path) as f:
        for line in f:
            match = re.search(r"number of parameters on .*?: (\d+)", line)
            if match:
                return int(match.group(1))
    return None


# ---------------------------------------------------------------------------------------------
# summary


def run_metrics(name: str, scalars: Dict[str, List[Tuple[int, float]]], iters: int,
                tokens_per_iter: int, starts: Sequence[int] = (0,)) -> Dict[str, object]:
    """The run's numbers from its tensorboard scalars; ``starts``: the iterations each of its
    launches began at (0, then those it resumed from), whose first iterations (warm-up) are
    left out of the step times."""
    loss = scalars.get("lm loss", [])
    if len(loss) < iters:
        raise JobError(f"run {name!r}: tensorboard holds {len(loss)} of {iters} training losses")
    valid = scalars.get("lm loss validation", [])
    if not valid:
        raise JobError(f"run {name!r}: no validation loss in tensorboard")
    # Megatron evaluates once more at the end of training, after the periodic evaluation that
    # falls on the last iteration when the interval divides it: average what it logged there.
    last_step = max(step for step, _ in valid)
    final_valid = [v for step, v in valid if step == last_step]
    skip = TRAIN["timing_skip_iters"]
    times = [v for step, v in scalars.get("iteration-time", [])
             if not any(start < step <= start + skip for start in starts)]
    if not times:
        raise JobError(f"run {name!r}: no iteration-time in tensorboard")
    k = TRAIN["last_iters_for_loss"]
    mean_time = sum(times) / len(times)
    return {
        "train_loss_first": loss[0][1],
        "train_loss_final": sum(v for _, v in loss[-k:]) / len(loss[-k:]),
        "valid_loss_final": sum(final_valid) / len(final_valid),
        "valid_loss_curve": valid,
        "train_loss_curve": loss,
        "seconds_per_iter": mean_time,
        # The median beside the mean: a few slow iterations move the mean, a slower machine both.
        "seconds_per_iter_median": statistics.median(times),
        "tokens_per_s": tokens_per_iter / mean_time,
    }


def checkpoint_iteration(checkpoint_dir: str) -> Optional[int]:
    """The iteration of the last complete checkpoint in ``checkpoint_dir`` (the tracker Megatron
    writes after a whole save), or None."""
    from megatron_ext.checkpoint_manifest import read_tracker

    text = read_tracker(checkpoint_dir) if os.path.isdir(checkpoint_dir) else None
    return int(text) if text and text.isdigit() else None


def read_record(run_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(run_dir, RUN_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def plan_run(run_dir: str, flags: Sequence[str], iters: int) -> Tuple[str, dict]:
    """What a job does with the run in ``run_dir``, and the run's record: ``"done"`` (trained to
    ``iters`` with these flags: its logs are read), ``"resume"`` (stopped part-way with these
    flags: from its last checkpoint) or ``"fresh"`` (none, or other flags: the folder is
    emptied; a line says why)."""
    record = read_record(run_dir)
    done = checkpoint_iteration(os.path.join(run_dir, "ckpt"))
    if record is not None and record.get("flags") == list(flags) and done is not None:
        # Its final checkpoint is written after its last logged iteration: done, even where the
        # launch failed after it.
        return ("done" if done >= iters else "resume"), record
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        why = ("its settings changed" if record is not None and record.get("flags") != list(flags)
               else "no checkpoint of its settings there")
        log(f"{os.path.basename(run_dir)}: training from scratch ({why}); removing its old "
            "logs and checkpoints")
        shutil.rmtree(run_dir)
    return "fresh", {"flags": list(flags), "starts": [], "wall_s": 0.0, "complete": False}


def write_record(run_dir: str, record: dict) -> None:
    write_json(os.path.join(run_dir, RUN_RECORD), record)


def drop_older_checkpoints(checkpoint_dir: str) -> None:
    """Remove the iteration folders before the tracker's (the run is finished: only its last
    checkpoint is of use, to resume or convert)."""
    last = checkpoint_iteration(checkpoint_dir)
    if last is None:
        return
    for name in os.listdir(checkpoint_dir):
        m = re.fullmatch(r"iter_(\d+)", name)
        if m and int(m.group(1)) < last:
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)


def run_order(repeats: int) -> List[Tuple[int, str, List[str]]]:
    """``(repeat, name, family flags)`` in the order they train: dense first in even repeats,
    STEM first in odd ones (ABBA)."""
    order = []
    for repeat in range(repeats):
        runs = RUNS if repeat % 2 == 0 else tuple(reversed(RUNS))
        order.extend((repeat, name, list(flags)) for name, flags in runs)
    return order


def run_dir_name(name: str, repeat: int) -> str:
    """The run's folder under ``--out``: the first repeat's keeps the plain name."""
    base = name.replace("/", "_")
    return base if repeat == 0 else f"{base}.repeat{repeat + 1}"


def combine_repeats(per_repeat: List[Dict[str, dict]], baseline: str = "dense"
                    ) -> Dict[str, dict]:
    """One result per run name from the repeats' ``run_metrics`` (``per_repeat[r][name]``):
    the first repeat's losses and curves; step times and tokens/s as the median over the
    repeats; ``step_time_ratio`` (``_median``) the median over the repeats of each repeat's
    ratio of the means (medians) to ``baseline``'s in the same repeat, the per-repeat ratios
    beside it; ``loss_max_diff_repeats`` how far a later repeat's training losses are from the
    first's (0.0: the same bits)."""
    if not per_repeat:
        raise ValueError("combine_repeats: no repeats")
    combined = {}
    for name in per_repeat[0]:
        runs = [rep[name] for rep in per_repeat]
        first = dict(runs[0])
        ratios = [r["seconds_per_iter"] / rep[baseline]["seconds_per_iter"]
                  for r, rep in zip(runs, per_repeat)]
        ratios_median = [r["seconds_per_iter_median"] / rep[baseline]["seconds_per_iter_median"]
                         for r, rep in zip(runs, per_repeat)]
        first_loss = [v for _, v in runs[0]["train_loss_curve"]]
        diff = 0.0
        for r in runs[1:]:
            loss = [v for _, v in r["train_loss_curve"]]
            if len(loss) != len(first_loss):
                diff = math.inf
                break
            diff = max([diff] + [abs(a - b) for a, b in zip(loss, first_loss)])
        first.update(
            seconds_per_iter=statistics.median(r["seconds_per_iter"] for r in runs),
            seconds_per_iter_median=statistics.median(r["seconds_per_iter_median"] for r in runs),
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in runs),
            wall_s=sum(r["wall_s"] for r in runs),
            step_time_ratios=ratios, step_time_ratio=statistics.median(ratios),
            step_time_ratios_median=ratios_median,
            step_time_ratio_median=statistics.median(ratios_median),
            repeats=len(runs), loss_max_diff_repeats=diff,
            seconds_per_iter_repeats=[r["seconds_per_iter"] for r in runs])
        combined[name] = first
    return combined


def human(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.4g}"


def print_table(results: Dict[str, dict]) -> str:
    names = list(results)
    repeats = max(r.get("repeats", 1) for r in results.values())
    of_repeats = "; median of repeats" if repeats > 1 else ""
    ratios = " (median of the repeats' ratios)" if repeats > 1 else ""
    rows = [
        ("training loss, first iteration", lambda r: f"{r['train_loss_first']:.3f}"),
        (f"training loss, mean of last {TRAIN['last_iters_for_loss']}",
         lambda r: f"{r['train_loss_final']:.3f}"),
        ("validation loss, end", lambda r: f"{r['valid_loss_final']:.3f}"),
        ("tokens/s (all ranks, w/o first iters)", lambda r: f"{r['tokens_per_s']:.0f}"),
        (f"step time (ms, mean w/o first iters{of_repeats})",
         lambda r: f"{1000 * r['seconds_per_iter']:.0f}"),
        (f"step time vs dense{ratios}", lambda r: f"{r['step_time_ratio']:.3f}x"),
        *([("  per repeat (order D S S D ...)",
            lambda r: " ".join(f"{x:.3f}" for x in r["step_time_ratios"]))]
          if repeats > 1 else []),
        (f"step time (ms, median w/o first iters{of_repeats})",
         lambda r: f"{1000 * r['seconds_per_iter_median']:.0f}"),
        (f"step time vs dense, medians{ratios}",
         lambda r: f"{r['step_time_ratio_median']:.3f}x"),
        *([("  per repeat",
            lambda r: " ".join(f"{x:.3f}" for x in r["step_time_ratios_median"]))]
          if repeats > 1 else []),
        ("total parameters", lambda r: human(r["total_params"])),
        ("  of which STEM tables", lambda r: human(r["stem_table_params"])),
        ("active parameters / token", lambda r: human(r["active_params_per_token"])),
        ("training FLOPs / token", lambda r: human(r["train_flops_per_token"])),
        ("total training FLOPs", lambda r: human(r["total_train_flops"])),
        ("FLOP ratio vs dense", lambda r: f"{r['flop_ratio']:.4f}"),
        ("proxy ROI vs dense (exp(-val loss)/FLOPs)", lambda r: f"{r['proxy_roi']:.4f}x"),
        (f"wall time of the run{'s' if repeats > 1 else ''} (s)",
         lambda r: f"{r['wall_s']:.0f}"),
    ]
    width = max(len(label) for label, _ in rows)
    cells = [[fmt(results[n]) for n in names] for _, fmt in rows]
    cols = [max([12, len(n)] + [len(row[i]) for row in cells]) for i, n in enumerate(names)]
    lines = [" " * width + " | " + " | ".join(f"{n:>{w}}" for n, w in zip(names, cols)),
             "-" * (width + sum(c + 3 for c in cols))]
    for (label, _), row in zip(rows, cells):
        lines.append(f"{label:<{width}} | " + " | ".join(
            f"{cell:>{w}}" for cell, w in zip(row, cols)))
    table = "\n".join(lines)
    print(table)
    return table


def plot(results: Dict[str, dict], tokens_per_iter: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_it, ax_fl) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        steps = [s for s, _ in r["train_loss_curve"]]
        values = [v for _, v in r["train_loss_curve"]]
        flops = [s * tokens_per_iter * r["train_flops_per_token"] for s in steps]
        line, = ax_it.plot(steps, values, label=f"{name} (train)", lw=1.2)
        ax_fl.plot(flops, values, label=f"{name} (train)", lw=1.2, color=line.get_color())
        vs = [s for s, _ in r["valid_loss_curve"]]
        vv = [v for _, v in r["valid_loss_curve"]]
        ax_it.plot(vs, vv, "o", color=line.get_color(), label=f"{name} (validation)")
        ax_fl.plot([s * tokens_per_iter * r["train_flops_per_token"] for s in vs], vv, "o",
                   color=line.get_color(), label=f"{name} (validation)")
    ax_it.set_xlabel("iteration")
    ax_fl.set_xlabel("training FLOPs (analytic)")
    for ax in (ax_it, ax_fl):
        ax.set_ylabel("lm loss")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_it.set_title("loss vs iterations (same tokens)")
    ax_fl.set_title("loss vs training FLOPs (paper Fig. 3b)")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "main"),
                   help="output directory (logs, tensorboard, summary.json, loss_curves.png)")
    p.add_argument("--iters", type=int, default=200, help="training iterations per run")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (data parallel)")
    p.add_argument("--data-dir", default=None,
                   help="corpus directory (default: OUT/data); reused when up to date")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-mb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1,
                   help="train the pair this many times, dense and STEM alternating first "
                        "(D S S D ...), and report the median of the repeats' step-time ratios "
                        "(a shared machine's speed drifts between runs)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats}: at least 1")
    if args.iters < TRAIN["timing_skip_iters"] + 2:
        p.error(f"--iters={args.iters}: at least {TRAIN['timing_skip_iters'] + 2} are needed")
    if args.nproc < 1 or TRAIN["global_batch_size"] % (TRAIN["micro_batch_size"] * args.nproc):
        p.error(f"--nproc={args.nproc}: the global batch {TRAIN['global_batch_size']} must be a "
                f"multiple of micro batch {TRAIN['micro_batch_size']} x nproc")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    job_start = time.perf_counter()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    import logging

    logging.basicConfig(level=logging.INFO, format="[main_job] %(message)s")
    for noisy in ("tensorboard", "matplotlib", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron_ext.stem.config import select_stem_layers
    from megatron_ext.planning import model_shape
    from megatron_ext.tools import data_prep
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    # 1. data
    t0 = time.perf_counter()
    manifest = data_prep.prepare(data_prep.DataPrepConfig(
        out=args.data_dir or os.path.join(out, "data"), vocab_size=args.vocab_size,
        max_mb=args.max_mb, seed=args.seed))
    data_s = time.perf_counter() - t0
    log(f"data ready in {data_s:.0f}s: {manifest['num_tokens']:,} tokens, vocab "
        f"{manifest['tokenizer_vocab_size']}, {manifest['data_prefix']}")
    data_args = data_flags(manifest)

    # 2. analytic shapes (Megatron pads the vocabulary to a multiple of 128)
    vocab = model_shape.padded_vocab_size(manifest["tokenizer_vocab_size"])
    tokens_per_iter = TRAIN["global_batch_size"] * MODEL["seq_length"]
    base_shape = model_shape.ModelShape(
        family="gpt", num_layers=MODEL["num_layers"], hidden=MODEL["hidden_size"],
        ffn=MODEL["ffn_hidden_size"], heads=MODEL["num_attention_heads"], vocab=vocab,
        seq_length=MODEL["seq_length"])
    shapes = {"dense": base_shape,
              "stem-1/3": dataclasses.replace(base_shape, family="stem", stem_layers=tuple(
                  select_stem_layers(MODEL["num_layers"], "1/3")))}

    # 3. the two runs, one after the other (``--repeats``: again, in ABBA order)
    per_repeat: List[Dict[str, dict]] = [{} for _ in range(args.repeats)]
    for repeat, name, family_args in run_order(args.repeats):
        results = per_repeat[repeat]
        run_dir = os.path.join(out, run_dir_name(name, repeat))
        tb_dir = os.path.join(run_dir, "tensorboard")
        ckpt_dir = os.path.join(run_dir, "ckpt")
        flags = [*megatron_flags(args.iters, args.seed, data_args, tb_dir,
                                 os.path.join(out, "cache"), ckpt_dir), *family_args]
        state, record = plan_run(run_dir, flags, args.iters)
        os.makedirs(run_dir, exist_ok=True)
        log_path = os.path.join(run_dir, "train.log")
        of = f" (repeat {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
        if state == "done":
            log(f"{name}{of}: trained already with these settings (checkpoint of iteration "
                f"{args.iters} in {ckpt_dir}): reading its logs")
        else:
            first = (checkpoint_iteration(ckpt_dir) or 0) if state == "resume" else 0
            if state == "resume":
                log(f"resuming {name}{of} from its checkpoint of iteration {first} "
                    f"({ckpt_dir}), log: {log_path}")
            else:
                log(f"training {name}{of} for {args.iters} iterations ({tokens_per_iter} tokens "
                    f"each), log: {log_path}")
            record["starts"].append(first)
            write_record(run_dir, record)
            record["wall_s"] += run_training(name, pretrain_command(args.nproc, flags), log_path,
                                             args.iters, first)
            record["complete"] = True
            write_record(run_dir, record)
            drop_older_checkpoints(ckpt_dir)
        wall = record["wall_s"]
        metrics = run_metrics(name, read_tensorboard_scalars(tb_dir), args.iters, tokens_per_iter,
                              record["starts"])
        analytic = model_shape.summary(shapes[name])
        megatron_params = parameters_from_log(log_path)
        # Managed STEM tables are not Megatron parameters (stem/runtime/tables.py): its count omits them.
        expected = analytic["total_params"] - (analytic["stem_table_params"]
                                               if "--stem-table-placement" in family_args else 0)
        if megatron_params is not None and megatron_params != expected:
            log(f"WARNING: {name}: Megatron reports {megatron_params:,} parameters, the analytic "
                f"count is {expected:,}")
        results[name] = {**metrics, **analytic, "wall_s": wall, "starts": record["starts"],
                         "megatron_reported_params": megatron_params,
                         "total_train_flops": analytic["train_flops_per_token"] * tokens_per_iter
                         * args.iters}
        log(f"{name}: done in {wall:.0f}s, final training loss "
            f"{metrics['train_loss_final']:.3f}, validation loss {metrics['valid_loss_final']:.3f}")

    # 4. ratios against the dense baseline (of the same repeat, then their median)
    results = combine_repeats(per_repeat)
    base = results["dense"]
    for name, r in results.items():
        if r["loss_max_diff_repeats"] != 0.0:
            log(f"WARNING: {name}: a later repeat's training losses differ from the first's by "
                f"up to {r['loss_max_diff_repeats']:.3g} (same seed and data); the table shows "
                "the first's")
        r["flop_ratio"] = model_shape.flop_ratio(shapes[name], shapes["dense"])
        r["proxy_roi"] = model_shape.proxy_relative_roi(
            r["valid_loss_final"], r["total_train_flops"], base["valid_loss_final"],
            base["total_train_flops"])

    print()
    table = print_table(results)
    print("proxy ROI = (exp(-validation loss) / total training FLOPs) relative to dense. It stands "
          "in for the paper's\naccuracy-based ROI (Table 3), which needs downstream benchmarks; "
          "read it as indicative only.")
    plot(results, tokens_per_iter, os.path.join(out, "loss_curves.png"))
    job_s = time.perf_counter() - job_start
    write_json(os.path.join(out, "summary.json"), {
        "model": MODEL, "train": TRAIN, "iters": args.iters, "nproc": args.nproc,
        "repeats": args.repeats,
        "seed": args.seed, "tokens_per_iter": tokens_per_iter, "padded_vocab_size": vocab,
        "data": {k: manifest[k] for k in ("data_prefix", "tokenizer_dir", "tokenizer_vocab_size",
                                          "eod_id", "num_documents", "num_tokens",
                                          "corpus_bytes")},
        "flop_counting": "analytic, megatron_ext.planning.model_shape: 6 x matmul weights per "
                         "token + 12 x seq x heads x head_dim per layer (full score matrix); "
                         "lookups and element-wise ops not counted",
        "proxy_roi_definition": "(exp(-valid loss) / total training FLOPs) / same for dense; a "
                                "proxy, not the paper's accuracy-based ROI",
        "runs": results, "table": table, "data_prep_s": data_s, "job_wall_s": job_s,
    })
    log(f"wrote {os.path.join(out, 'summary.json')} and {os.path.join(out, 'loss_curves.png')}")
    log(f"main job finished in {job_s:.0f}s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except JobError as exc:
        print(f"[main_job] FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
