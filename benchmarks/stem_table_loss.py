"""Validation loss of the main job's STEM-1/3 model with ordinary tables against the table mode the
main job uses (``launch/main_job.py`` ``STEM_TABLES``: tiered placement, vocab sharding, sparse
row optimizer), over several seeds, paired by seed.

    .venv/bin/python benchmarks/stem_table_loss.py                       # seeds 1234,1,2
    .venv/bin/python benchmarks/stem_table_loss.py --seeds 1234 --modes ordinary,main

The sparse optimizer computes only the rows a batch touched and brings the others up to date when
they are read (``stem/runtime/row_adam.py``): AdamW up to ``eps``, so its loss should be the ordinary
table's up to that and to the order of floating-point operations; ``tiered-dense`` (every row
steps every iteration) reproduces the ordinary table exactly. Each run is
the main job's STEM training (its model, data, 200-iteration schedule and evaluations) with only
``--seed`` and the table flags changed. Reports each run's final validation loss (as the main
job's summary computes it), per mode the mean and spread over seeds, and per seed the difference
against ``ordinary``: a difference within the seed-to-seed spread of either mode is noise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import report_json  # noqa: E402

MODES = {
    "ordinary": [],
    "main": None,  # main_job.STEM_TABLES
    "tiered-dense": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                     "--stem-optimizer", "dense"],
    "cpu-sparse": ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab",
                   "--stem-optimizer", "sparse"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1234,1,2",
                        help="comma-separated seeds (1234 is the main job's)")
    parser.add_argument("--modes", default="ordinary,main",
                        help=f"comma-separated table modes among {', '.join(MODES)}")
    parser.add_argument("--iters", type=int, default=200, help="the main job's 200 by default")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_stem_table_loss"))
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "runs", "main", "data"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose among {', '.join(MODES)}")
    if not seeds:
        parser.error("--seeds names no seed")

    import main_job

    from megatron_ext.tools import data_prep

    manifest = data_prep.prepare(data_prep.DataPrepConfig(out=args.data_dir))
    data_args = main_job.data_flags(manifest)
    tokens_per_iter = main_job.TRAIN["global_batch_size"] * main_job.MODEL["seq_length"]
    results = {m: {} for m in modes}
    for seed in seeds:  # modes in turn within a seed: a slow spell hits every mode alike
        for mode in modes:
            r = run(args, main_job, data_args, mode, seed, tokens_per_iter)
            results[mode][seed] = r
            print(f"  seed {seed:5d}  {mode:13s} validation loss {r['valid_loss_final']:.4f}  "
                  f"training loss (last {main_job.TRAIN['last_iters_for_loss']}) "
                  f"{r['train_loss_final']:.4f}  {1e3 * r['seconds_per_iter']:.0f} ms/iter",
                  flush=True)
    summary = {"seeds": seeds, "iters": args.iters, "modes": {}}
    for mode in modes:
        losses = [results[mode][s]["valid_loss_final"] for s in seeds]
        entry = {"valid_loss": dict(zip(map(str, seeds), losses)),
                 "mean": statistics.mean(losses),
                 "spread": max(losses) - min(losses),
                 "stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0}
        if "ordinary" in modes and mode != "ordinary":
            diffs = [results[mode][s]["valid_loss_final"]
                     - results["ordinary"][s]["valid_loss_final"] for s in seeds]
            entry["minus_ordinary"] = dict(zip(map(str, seeds), diffs))
            entry["minus_ordinary_mean"] = statistics.mean(diffs)
        summary["modes"][mode] = entry
    print(f"\nfinal validation loss over seeds {seeds} ({args.iters} iterations):")
    for mode, e in summary["modes"].items():
        line = (f"  {mode:13s} mean {e['mean']:.4f}  spread {e['spread']:.4f}  stdev "
                f"{e['stdev']:.4f}")
        if "minus_ordinary" in e:
            line += ("  minus ordinary per seed " +
                     ", ".join(f"{d:+.4f}" for d in e["minus_ordinary"].values()) +
                     f" (mean {e['minus_ordinary_mean']:+.4f})")
        print(line)
    report_json(summary, args.json)


def run(args, main_job, data_args, mode: str, seed: int, tokens_per_iter: int) -> dict:
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    tables = main_job.STEM_TABLES if MODES[mode] is None else MODES[mode]
    run_dir = os.path.join(args.out, f"{mode}_seed{seed}")
    tb = os.path.join(run_dir, "tb")
    shutil.rmtree(tb, ignore_errors=True)
    os.makedirs(run_dir, exist_ok=True)
    cmd = main_job.pretrain_command(args.nproc, [
        *main_job.megatron_flags(args.iters, seed, data_args, tb, os.path.join(args.out, "cache")),
        "--model-family", "stem", "--stem-ratio", "1/3", *tables])
    main_job.run_training(f"{mode} seed {seed}", cmd, os.path.join(run_dir, "train.log"),
                          args.iters)
    return main_job.run_metrics(f"{mode} seed {seed}", read_tensorboard_scalars(tb), args.iters,
                                tokens_per_iter)


if __name__ == "__main__":
    main()
