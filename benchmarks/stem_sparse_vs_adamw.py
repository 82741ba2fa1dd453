"""How far the sparse STEM optimizer (``--stem-optimizer sparse``: only touched rows computed, the
others brought up to date when read; ``megatron_ext/stem/row_adam.py``) is from
``torch.optim.AdamW`` stepping the whole table, in one run.

    .venv/bin/python benchmarks/stem_sparse_vs_adamw.py                 # 60 and 800 iterations

A table of ``--rows`` x ``--width`` fp32 rows, Zipf-distributed touches (``--touches`` ids per
iteration, deduplicated), a cosine learning rate, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1,
and reads of every third row every seventh iteration (each read brings its rows up to date). The
only documented difference from AdamW is the eps of an untouched row, which decays with
``sqrt(v)``; the rest is fp32 rounding. Prints, per kernel, the largest absolute difference of
the rows and moments from AdamW's after all rows are brought up to date.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(kernel: str, steps: int, rows: int, width: int, touches: int) -> dict:
    from megatron_ext.stem.row_adam import AdamHyper, RowAdamW

    g = torch.Generator().manual_seed(0)
    init = torch.randn(rows, width, generator=g)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    shard = init.clone()
    sparse = RowAdamW([shard], mode="sparse", kernel=kernel)
    ref = torch.nn.Parameter(init.clone())
    adamw = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for t in range(steps):
        lr = 1e-2 * 0.5 * (1 + math.cos(math.pi * t / steps))
        ids = torch.unique(torch.multinomial(1 / ranks, touches, True, generator=g))
        grad = torch.randn(ids.numel(), width, generator=g)
        sparse.step([(ids, grad)], AdamHyper(lr, 0.9, 0.95, 1e-8, 0.1))
        if t % 7 == 3:
            sparse.catch_up(0, torch.arange(0, rows, 3))
        full = torch.zeros(rows, width)
        full[ids] = grad
        ref.grad = full
        adamw.param_groups[0]["lr"] = lr
        adamw.step()
    sparse.materialize()
    state = adamw.state[ref]
    return {"p": float((shard - ref.detach()).abs().max()),
            "m": float((sparse.exp_avg[0] - state["exp_avg"]).abs().max()),
            "v": float((sparse.exp_avg_sq[0] - state["exp_avg_sq"]).abs().max()),
            "p_max": float(ref.detach().abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="60,800")
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--touches", type=int, default=8)
    args = parser.parse_args()

    from megatron_ext_kernels import row_adam_cpu

    kernels = ["torch"] + (["rowwise"] if row_adam_cpu.load() is not None else [])
    for steps in (int(s) for s in args.steps.split(",")):
        for kernel in kernels:
            d = run(kernel, steps, args.rows, args.width, args.touches)
            print(f"{steps:5d} iterations, {kernel:7s}: max |p - AdamW| {d['p']:.2e} "
                  f"(|p| up to {d['p_max']:.2f}), |m - AdamW| {d['m']:.2e}, "
                  f"|v - AdamW| {d['v']:.2e}", flush=True)


if __name__ == "__main__":
    main()
