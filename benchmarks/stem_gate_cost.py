"""A cost model of STEM's lookup-and-gate (kernels/stem_gate.py) at the benchmark's shape: bytes
each design moves, its programs, and the serial work of its longest program, from the very ids
``benchmarks/stem_mlp.py`` draws. Arithmetic only: it runs on any machine, in a second.

    .venv/bin/python benchmarks/stem_gate_cost.py                    # H 2048 shape, Zipf ids
    .venv/bin/python benchmarks/stem_gate_cost.py --ids uniform --json OUT.json

Model. A kernel takes at least its DRAM bytes over the bandwidth (``--bandwidth``, 3 TB/s), and
at least the time the GPU's block scheduler needs to get through its programs when each
program is a chain of dependent memory round trips of ``--latency`` microseconds each (a load
whose address comes from an earlier load: the sorted position's token, then that token's rows)
with ``slots`` programs resident per SM (from the registers ``offline_build`` reports). The
scheduler is simulated: programs start in launch order (axis 0 fastest) as slots free up. The
larger of the two bounds is the model's time; the latency is not known without a GPU, so the
model is printed at three values and the GPU run (``stem_mlp.py``'s ``gate_*`` times) decides.

Designs: ``walk`` is the backward until 2026-11-28 (one program per distinct row, a fixed
number of programs striding over the rows, each walking its row's tokens 4 at a time); ``chunk``
the one that replaced it (one program per 16 sorted positions, a segmented scan, a carry pass
over the runs that cross chunk edges); ``torch`` the PyTorch path's bytes (its ops are
elementwise over all tokens, so bytes decide).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stem_mlp import draw_ids  # noqa: E402

SMS = 132  # H100 SXM


def makespan(durations: List[float], slots: int) -> float:
    """When the last program ends, programs started in order on ``slots`` resident places."""
    free = [0.0] * min(slots, len(durations))
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + d)
        end = max(end, start + d)
    return end


def runs_of(ids: torch.Tensor) -> torch.Tensor:
    """Tokens per distinct row, in sorted row order (the order both backwards visit them)."""
    return torch.unique(ids, sorted=True, return_counts=True)[1]


def walk_design(runs: torch.Tensor, n_cols: int, programs: int = 4 * SMS, rows: int = 4,
                block_f: int = 1024) -> Dict[str, object]:
    """One program per segment-stride (``4 x SMs`` of them) and column block; per row: 3 round
    trips to find it and load it (segment start -> sorted id -> table row), 2 per step of
    ``rows`` tokens (sorted position -> token's gradient and activation), 1 for ``main_grad``."""
    grid_f = math.ceil(n_cols / block_f)
    steps = [0] * programs
    for s, length in enumerate(runs.tolist()):
        steps[s % programs] += 3 + 2 * math.ceil(length / rows) + 1
    launch_order = [steps[p] for _ in range(grid_f) for p in range(programs)]
    return dict(programs=programs * grid_f, slots_per_sm=2, steps=launch_order,
                max_steps=max(steps), mean_steps=sum(steps) / programs)


def chunk_design(runs: torch.Tensor, n_cols: int, chunk: int = 16, block_f: int = 128,
                 span: int = 8, slots_per_sm: int = 5) -> Dict[str, object]:
    """One program per ``chunk`` sorted positions and column block: 3 round trips each (sorted
    ids and tokens -> rows -> ``main_grad`` of the runs it completes); then the carry pass, 2
    round trips for every program plus, for a run that starts in its chunk and crosses an edge,
    2 per ``span`` chunks it covers and 1 for ``main_grad``."""
    n = int(runs.sum())
    n_chunks = math.ceil(n / chunk)
    grid_f = math.ceil(n_cols / block_f)
    carry = [2] * n_chunks
    partial_rows = 0
    first = 0
    for length in runs.tolist():
        last = first + length - 1
        c0, c1 = first // chunk, last // chunk
        if c1 > c0:  # crosses c1 - c0 edges: a partial in each chunk it touches
            partial_rows += c1 - c0 + 1
            carry[c0] += 2 * math.ceil((c1 - c0) / span) + 1
        first = last + 1
    main = [3] * (n_chunks * grid_f)
    carry_order = [s for _ in range(grid_f) for s in carry]
    return dict(programs=n_chunks * grid_f, slots_per_sm=slots_per_sm, steps=main,
                carry_steps=carry_order, max_steps=3 + max(carry), partial_rows=partial_rows)


def bytes_moved(n: int, distinct: int, n_cols: int, elem: int, partial_rows: int) -> Dict:
    """DRAM bytes, counting a table row once per distinct row (repeats hit L2) and fp32
    ``main_grad`` rows read and written once per distinct row."""
    act = n * n_cols * elem          # one [tokens, F] operand in the model's dtype
    rows = distinct * n_cols * elem  # the distinct table rows
    grads = 2 * distinct * n_cols * 4  # main_grad rows, read and written
    fused_fwd = 2 * act + rows        # fc1 in, product out, rows in
    fused_bwd = 3 * act + rows + grads  # grad, fc1 in, dfc1 out, rows in, main_grad
    # PyTorch path (kernels/stem_lookup.py + silu * rows): forward gather (rows in, [n, F] out),
    # silu (in, out), product (2 in, out); backward: grad x rows and grad x silu (2 in, 1 out
    # each), silu's backward (2 in, 1 out), the row gradients cast to fp32 (in, 2x out), and
    # index_add_ reading them (2x) into main_grad.
    torch_fwd = rows + act + 2 * act + 3 * act
    torch_bwd = 3 * act + 3 * act + 3 * act + 3 * act + 2 * act + grads
    return dict(fused_fwd=fused_fwd, walk_bwd=fused_bwd,
                chunk_bwd=fused_bwd + 2 * partial_rows * n_cols * 4,
                torch_fwd=torch_fwd, torch_bwd=torch_bwd)


def model(ids: torch.Tensor, n_cols: int, elem: int, bandwidth: float,
          latencies=(0.5, 1.0, 2.0)) -> Dict[str, object]:
    runs = runs_of(ids)
    walk, chunk = walk_design(runs, n_cols), chunk_design(runs, n_cols)
    b = bytes_moved(ids.numel(), runs.numel(), n_cols, elem, chunk["partial_rows"])
    ms = {k: v / bandwidth * 1e3 for k, v in b.items()}
    out = dict(tokens=ids.numel(), distinct_rows=runs.numel(), longest_run=int(runs.max()),
               runs_over_16=int((runs > 16).sum()), n_cols=n_cols, bytes=b,
               bandwidth_ms=ms, walk={k: v for k, v in walk.items() if k != "steps"},
               chunk={k: v for k, v in chunk.items() if k not in ("steps", "carry_steps")},
               latency_bound_ms={})
    for lat in latencies:
        w = makespan([s * lat for s in walk["steps"]], walk["slots_per_sm"] * SMS) / 1e3
        c = (makespan([s * lat for s in chunk["steps"]], chunk["slots_per_sm"] * SMS)
             + makespan([s * lat for s in chunk["carry_steps"]], 8 * SMS)) / 1e3
        out["latency_bound_ms"][f"{lat}us"] = dict(walk_bwd=w, chunk_bwd=c)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ids", choices=("zipf", "uniform"), default="zipf")
    parser.add_argument("--bandwidth", type=float, default=3e12, help="bytes/s (3 TB/s)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ids = draw_ids(args.ids, args.vocab, args.tokens)
    m = model(ids, args.ffn, 2, args.bandwidth)
    print(f"lookup-and-gate cost model | {args.ids} ids, {m['tokens']} tokens, "
          f"{m['distinct_rows']} distinct rows, longest run {m['longest_run']}, "
          f"{m['runs_over_16']} runs over 16 | F {args.ffn} bf16 | "
          f"{args.bandwidth / 1e12:.1f} TB/s")
    b, ms = m["bytes"], m["bandwidth_ms"]
    for k in ("fused_fwd", "walk_bwd", "chunk_bwd", "torch_fwd", "torch_bwd"):
        print(f"  {k:10s} {b[k] / 1e6:8.1f} MB  {ms[k]:.3f} ms at bandwidth")
    w, c = m["walk"], m["chunk"]
    print(f"  walk : {w['programs']} programs, 2 per SM; longest program {w['max_steps']} "
          f"dependent round trips (mean {w['mean_steps']:.0f})")
    print(f"  chunk: {c['programs']} programs, {c['slots_per_sm']} per SM, 3 round trips each; "
          f"carry at most {c['max_steps']}; {c['partial_rows']} partial rows")
    for lat, t in m["latency_bound_ms"].items():
        print(f"  latency bound at {lat} per round trip: walk backward {t['walk_bwd']:.3f} ms, "
              f"chunk backward {t['chunk_bwd']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m, f, indent=1)


if __name__ == "__main__":
    main()
