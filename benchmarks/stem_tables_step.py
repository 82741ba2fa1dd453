"""Training-step time of the main job's STEM-1/3 model with its tables as ordinary parameters
(Megatron's DDP all-reduce of the whole table gradient, Adam over whole tables) against managed
tables (host placement, vocab sharding, CPU AdamW dense or sparse), in one run.

    .venv/bin/python benchmarks/stem_tables_step.py                 # 60 iterations, 2 ranks

Uses the main job's model, data and hyperparameters (``launch/main_job.py``; the corpus under
``runs/main/data`` is prepared if missing). Reports the median iteration time after the first 10
iterations, the mean loss of the last 10 (the dense table optimizer must reproduce the ordinary
one), and the per-step table traffic and optimizer time from the tensorboard logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

VARIANTS = (
    ("ordinary (gpu, replicated)", []),
    ("cpu, vocab, dense", ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"]),
    ("cpu, vocab, sparse", ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab",
                            "--stem-optimizer", "sparse"]),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=60,
                        help="iterations run; the LR schedule is the main job's 200-iteration one")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_stem_tables"))
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "runs", "main", "data"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import main_job

    from megatron_ext.training import data_prep
    from megatron_ext.training.metrics import read_tensorboard_scalars

    manifest = data_prep.prepare(data_prep.DataPrepConfig(out=args.data_dir))
    data_args = data_prep.megatron_data_args(manifest) + [
        "--ext-data-manifest", os.path.join(os.path.dirname(manifest["data_prefix"]),
                                            data_prep.MANIFEST)]
    results = {}
    for name, extra in VARIANTS:
        tb = os.path.join(args.out, name.replace(" ", "").replace(",", "_").replace("(", "")
                          .replace(")", ""), "tb")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", os.path.join(ROOT, "launch", "pretrain.py"),
               *main_job.megatron_flags(args.iters, 1234, data_args, tb,
                                        os.path.join(args.out, "cache")),
               # Later flags win: no evaluation inside the timing, and the main job's schedule
               # (warm-up 20 of 200), whose first iterations are stable enough that the dense
               # table optimizer's 1e-7 differences stay 1e-7 (with a 6-iteration warm-up an
               # early loss spike amplifies them to 1e-1 within a few steps).
               "--eval-interval", str(10 * args.iters),
               "--lr-warmup-iters", "20", "--lr-decay-iters", "200",
               "--model-family", "stem", "--stem-ratio", "1/3", *extra]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        scalars = read_tensorboard_scalars(tb)
        times = [v for step, v in scalars["iteration-time"] if step > 10]
        last = [v for step, v in scalars["lm loss"] if step > args.iters - 10]
        stem = {k: statistics.mean(v for step, v in scalars[k] if step > 10)
                for k in scalars if k.startswith("stem/")}
        results[name] = {"iteration_ms": 1e3 * statistics.median(times),
                         "loss_last10": statistics.mean(last), **stem}
        print(f"  {name:28s} {results[name]['iteration_ms']:8.1f} ms/iter  loss(last 10) "
              f"{results[name]['loss_last10']:.4f}", flush=True)
    base = results[VARIANTS[0][0]]["iteration_ms"]
    for name, r in results.items():
        r["ratio_vs_ordinary"] = r["iteration_ms"] / base
        traffic = (f"; unique rows/step {r['stem/unique-rows-fetched']:.0f}, fetch "
                   f"{r['stem/fetch-bytes-to-device'] / 2**20:.2f} MiB, optimizer "
                   f"{1e3 * r['stem/optimizer-seconds']:.1f} ms") if len(r) > 3 else ""
        print(f"{name:28s} {r['ratio_vs_ordinary']:.3f}x the ordinary step time{traffic}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
