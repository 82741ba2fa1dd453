"""How far the sparse STEM optimizer (``--stem-optimizer sparse``) is from dense AdamW on a
table's realistic gradients, and what an exact catch-up would cost.

    .venv/bin/python benchmarks/stem_sparse_semantics.py    # 1000 iterations, 3 gradient scales

(35 minutes on the 2-core development machine while other work ran; docs/stem.md has its numbers.)

The sparse optimizer brings a row untouched since iteration ``s`` to ``u`` in O(1); the one
difference from AdamW (``megatron_ext/stem/runtime/row_adam.py``): an untouched step ``j`` uses
``eps b2^((j-s0)/2) / sqrt(1-b2^j)`` in place of ``eps`` (``s0``: the row's last gradient). It
matters only where a row's ``sqrt(v)`` comes near ``eps``, so the gradients' scale is swept.

A table of ``--rows`` x ``--width``, ``--tokens`` tokens per iteration drawn from Zipf(1) over
the rows (the main job's 16 x 128), a row's gradient the sum of
one N(0, scale^2) vector per occurrence divided by the tokens (a mean loss), AdamW with the
main job's schedule shape: lr 3e-4, linear warm-up over the first 10%, cosine to 10%, betas 0.9,
0.95, eps 1e-8, weight decay 0.1, rows initialised N(0, 0.02^2). Both optimizers step the same
gradients; the sparse one's rows are all brought up to date at the end.

Prints, per gradient scale: the per-element gradient of a row touched once (``scale / tokens``);
per row, the distance ``|sparse - AdamW|`` relative to how far AdamW moved the row from its
initial value (``|AdamW - init|``), median and max over rows, and relative to the row
(``|AdamW|``); the same for fp32 AdamW against float64 AdamW (the rounding floor). Then the gap
distribution (iterations between two touches of a row) and what an exact catch-up would compute:
an untouched step's eps sits inside each element's denominator, so an exact catch-up loops over
the missed steps of each element, up to the momentum's horizon ``H`` (376 iterations for these
betas; past it the move is below 1e-13 of its total), against the one pass of the O(1) catch-up.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import report_json  # noqa: E402

BETAS, WD, LR = (0.9, 0.95), 0.1, 3e-4
EPS = 1e-8  # --eps (1e-30: the sparse optimizer is AdamW to fp32 rounding; 0 divides 0 by 0)


def schedule(t: int, steps: int) -> float:
    """Learning rate of iteration ``t`` (1-based): linear warm-up over 10%, cosine to 10%."""
    warm = max(1, steps // 10)
    if t <= warm:
        return LR * t / warm
    x = (t - warm) / max(1, steps - warm)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x)))


def token_stream(steps: int, rows: int, tokens: int, seed: int):
    """Per iteration: the touched rows (unique) and their occurrence counts, Zipf(1)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    for _ in range(steps):
        ids = torch.multinomial(weights, tokens, replacement=True, generator=g)
        yield torch.unique(ids, return_counts=True)


def run(steps: int, rows: int, width: int, tokens: int, scale: float, kernel: str,
        seed: int = 0) -> dict:
    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW

    g = torch.Generator().manual_seed(seed + 1)
    init = torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.02
    sparse_rows = init.float().clone()
    sparse = RowAdamW([sparse_rows], mode="sparse", kernel=kernel)
    dense32 = torch.nn.Parameter(init.float().clone())
    dense64 = torch.nn.Parameter(init.clone())
    opts = [torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            for p in (dense32, dense64)]
    gaps, last_seen = [], torch.full((rows,), -1, dtype=torch.long)
    for t, (ids, counts) in enumerate(token_stream(steps, rows, tokens, seed), start=1):
        lr = schedule(t, steps)
        noise = torch.randn(ids.numel(), width, generator=g, dtype=torch.float64)
        grad = noise * counts.sqrt().unsqueeze(1).double() * (scale / tokens)
        sparse.step([(ids, grad.float())], AdamHyper(lr, *BETAS, EPS, WD))
        for p, opt, dtype in ((dense32, opts[0], torch.float32), (dense64, opts[1],
                                                                  torch.float64)):
            full = torch.zeros(rows, width, dtype=dtype)
            full[ids] = grad.to(dtype)
            p.grad = full
            opt.param_groups[0]["lr"] = lr
            opt.step()
        seen = last_seen[ids]
        gaps.append((t - seen[seen >= 0]))
        last_seen[ids] = t
    sparse.materialize()
    ref = dense32.detach().double()
    moved = (ref - init).norm(dim=1)
    row = ref.norm(dim=1)
    d_sparse = (sparse_rows.double() - ref).norm(dim=1)
    d_round = (ref - dense64.detach()).norm(dim=1)
    touched = last_seen >= 0
    out = {"grad_once": scale / tokens, "touched_rows": int(touched.sum())}
    for name, d in (("sparse", d_sparse), ("fp32", d_round)):
        rel_move = (d / moved)[touched]
        rel_row = d / row
        out[name] = {"move_median": float(rel_move.median()), "move_max": float(rel_move.max()),
                     "row_median": float(rel_row.median()), "row_max": float(rel_row.max())}
    out["gaps"] = torch.cat(gaps)
    return out


def exact_cost(gaps: torch.Tensor, steps: int, rows: int, horizon: int) -> dict:
    """What an exact catch-up computes per touch (``min(gap - 1, H)`` missed steps, each a pass
    over the row's elements) against the O(1) catch-up's one pass and dense AdamW's
    ``rows`` row passes per iteration."""
    missed = (gaps - 1).clamp(min=0)
    exact = missed.clamp(max=horizon)
    q = torch.quantile(gaps.double(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"touches": int(gaps.numel()), "gap_median": float(q[0]), "gap_p90": float(q[1]),
            "gap_p99": float(q[2]), "gap_max": int(gaps.max()),
            "exact_passes_per_touch": float(exact.double().mean()),
            "exact_vs_dense": float(exact.sum() + gaps.numel()) / (steps * rows),
            "sparse_vs_dense": float(gaps.numel()) / (steps * rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--eps", type=float, default=1e-8,
                        help="1e-30: where the one difference vanishes (fp32 rounding is left)")
    parser.add_argument("--scales", default="1,1e-2,1e-3",
                        help="per-occurrence gradient scales (a row touched once: scale/tokens)")
    parser.add_argument("--kernel", default="auto", choices=("auto", "torch", "rowwise"))
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args()
    global EPS
    EPS = args.eps

    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowClock

    clock = RowClock()
    clock.advance(1, AdamHyper(LR, *BETAS, EPS, WD))
    print(f"{args.steps} iterations, {args.rows} x {args.width} rows, {args.tokens} Zipf(1) "
          f"tokens per iteration, lr {LR} warm-up 10% + cosine, betas {BETAS}, eps {EPS}, "
          f"wd {WD}, kernel {args.kernel}", flush=True)
    summary = {"steps": args.steps, "rows": args.rows, "width": args.width,
               "tokens": args.tokens, "horizon": clock.horizon, "runs": []}
    gaps = None
    for scale in (float(s) for s in args.scales.split(",")):
        r = run(args.steps, args.rows, args.width, args.tokens, scale, args.kernel)
        gaps = r.pop("gaps")
        s, f = r["sparse"], r["fp32"]
        print(f"gradient of a row touched once {r['grad_once']:.1e}/element: |sparse - AdamW| / "
              f"|AdamW's move| median {s['move_median']:.2e} max {s['move_max']:.2e}; / |row| "
              f"median {s['row_median']:.2e} max {s['row_max']:.2e}   (fp32 AdamW vs float64: "
              f"{f['move_median']:.2e} / {f['move_max']:.2e}; {f['row_median']:.2e} / "
              f"{f['row_max']:.2e})", flush=True)
        summary["runs"].append(dict(r, scale=scale))
    cost = exact_cost(gaps, args.steps, args.rows, clock.horizon)
    print(f"gaps between touches of a row ({cost['touches']} touches): median "
          f"{cost['gap_median']:.0f}, p90 {cost['gap_p90']:.0f}, p99 {cost['gap_p99']:.0f}, max "
          f"{cost['gap_max']}; an exact catch-up (missed steps up to H = {clock.horizon}) makes "
          f"{cost['exact_passes_per_touch']:.1f} row passes per touch on average: "
          f"{cost['exact_vs_dense']:.2f}x the row passes of dense AdamW, against "
          f"{cost['sparse_vs_dense']:.3f}x for the O(1) catch-up")
    summary["exact_catch_up"] = cost
    report_json(summary, args.json)


if __name__ == "__main__":
    main()
