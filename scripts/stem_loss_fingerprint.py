"""The per-iteration losses (exact floats, from tensorboard) of nine short STEM trainings on the
CPU: ordinary, cpu and tiered tables under DP=2 and TP=2 + SP, PP=2 with full recompute (cpu and
ordinary tables), and the sparse optimizer without prefetch; hidden dropout 0.1, 8 iterations.
Run it on two checkouts and compare the JSONs to show that a change leaves the numbers bit for bit
(issue 52: docs/results/stem_redesign_losses_2026-11-28/).

    python scripts/stem_loss_fingerprint.py CHECKOUT OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

CONFIGS = {
    "ordinary_dp2": [],
    "ordinary_tp2sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cpu_dp2": ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab"],
    "cpu_tp2sp": ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab",
                  "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tiered_dp2": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                   "--stem-gpu-tier", "25%"],
    "tiered_tp2sp": ["--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                     "--stem-gpu-tier", "25%", "--tensor-model-parallel-size", "2",
                     "--sequence-parallel"],
    "cpu_pp2_recompute": ["--stem-table-placement", "cpu", "--stem-table-sharding", "vocab",
                          "--pipeline-model-parallel-size", "2", "--recompute-granularity",
                          "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "ordinary_pp2_recompute": ["--pipeline-model-parallel-size", "2", "--recompute-granularity",
                               "full", "--recompute-method", "uniform",
                               "--recompute-num-layers", "1"],
    "cpu_dp2_sparse_noprefetch": ["--stem-table-placement", "cpu", "--stem-table-sharding",
                                  "vocab", "--stem-optimizer", "sparse", "--no-stem-prefetch"],
}


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    repo, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    sys.path.insert(0, os.path.join(repo, "tests"))
    os.chdir(repo)
    from multirank import TINY_GPT, Launches  # the checkout's own test launcher

    stem = TINY_GPT + ["--model-family", "stem", "--stem-layers", "1,3", "--train-iters", "8",
                       "--hidden-dropout", "0.1"]
    launches = Launches(tempfile.mkdtemp(prefix="stem_fingerprint_"))
    for name, flags in CONFIGS.items():
        launches.add(name, stem + flags, nproc=2)
    runs = launches.run()
    result = {name: {"rc": run.returncode,
                     "losses": {str(k): v for k, v in sorted(run.losses.items())}}
              for name, run in runs.items()}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for name, r in result.items():
        print(name, "rc", r["rc"], "last loss", list(r["losses"].values())[-1:] or "none")
    if any(r["rc"] for r in result.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
