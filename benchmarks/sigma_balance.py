"""Load balance of a short Sigma run on the real corpus with each load-balancing loss, in one run.

    .venv/bin/python benchmarks/sigma_balance.py            # CPU preset, 150 iterations each

Trains the ``sigma_cpu`` preset (4 layers, 8 experts of 32, top-1; first two layers top-2 until
half of training) on the main job's corpus (``runs/main/data``, prepared if missing) with
``--sigma-lbl none``, ``global`` and ``top1`` (coefficient ``--coeff``, the report's 1e-3 by
default), same seed and data, and prints from the tensorboard logs, averaged over the last
``--tail`` iterations and over layers: the relative deviation from uniform allocation of the
most- and least-loaded expert (the report's Fig. 2a), the coefficient of variation of the token
fractions f and of the mean router probabilities p, and the LM loss.
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

METRICS = (("max load dev.", "sigma/load_deviation_max"), ("min load dev.", "sigma/load_deviation_min"),
           ("CV(f)", "sigma/f_cv"), ("CV(p)", "sigma/p_cv"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--tail", type=int, default=20)
    parser.add_argument("--coeff", type=float, default=1e-3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_sigma_balance"))
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "runs", "main", "data"))
    parser.add_argument("--lbls", nargs="+", default=["none", "global", "top1"],
                        choices=["none", "global", "top1"])
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="--sigma-top1-lbl-temperature of the top1 runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.iters <= args.tail:
        raise SystemExit(f"--iters={args.iters} must exceed --tail={args.tail}")

    from megatron_ext.tools import data_prep
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    manifest = data_prep.prepare(data_prep.DataPrepConfig(out=args.data_dir))
    data_args = data_prep.megatron_data_args(manifest)
    results = {}
    for lbl in args.lbls:
        tb = os.path.join(args.out, lbl, "tb")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", os.path.join(ROOT, "launch", "pretrain.py"),
               "--sigma-preset", "sigma_cpu", "--sigma-lbl", lbl,
               "--sigma-lbl-coeff", str(args.coeff),
               "--sigma-top1-lbl-temperature", str(args.temperature),
               "--micro-batch-size", "4", "--global-batch-size", "16",
               "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
               "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--weight-decay", "0.1",
               "--clip-grad", "1.0", "--seed", "1234", "--attention-dropout", "0",
               "--hidden-dropout", "0", *data_args, "--data-cache-path",
               os.path.join(args.out, "cache"), "--eval-iters", "0", "--eval-interval",
               str(10 * args.iters), "--log-interval", "10", "--tensorboard-dir", tb,
               "--tensorboard-log-interval", "1", "--distributed-backend", "gloo",
               "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
               "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode:
            raise SystemExit(f"--sigma-lbl {lbl} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        s = read_tensorboard_scalars(tb)
        first = args.iters - args.tail

        def tail(tag):
            return statistics.mean(v for step, v in s[tag] if step > first)

        def over_layers(prefix):
            tags = [t for t in s if t.startswith(prefix + "_layer_")]
            if not tags:
                raise SystemExit(f"no {prefix}_layer_* in the logs of --sigma-lbl {lbl}")
            return statistics.mean(tail(t) for t in tags)

        results[lbl] = {name: over_layers(tag) for name, tag in METRICS}
        results[lbl]["lm loss"] = tail("lm loss")
    header = "| LBL | " + " | ".join(n for n, _ in METRICS) + " | LM loss |"
    print(f"\nlast {args.tail} of {args.iters} iterations, mean over layers; coefficient "
          f"{args.coeff:g}, Top-1 temperature {args.temperature:g}\n\n{header}\n|" + " --- |" * (len(METRICS) + 2))
    for lbl, r in results.items():
        print(f"| {lbl} | " + " | ".join(f"{r[n]:.3f}" for n, _ in METRICS)
              + f" | {r['lm loss']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
