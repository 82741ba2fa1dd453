"""The attention's rotary position embedding, forward and backward: Megatron-Core's unfused
``_apply_rotary_pos_emb_bshd`` (what runs without Transformer Engine) against the fused Triton
kernel (``megatron_ext_kernels/rope.py``, ``--ext-rope fused``), in one run.

    .venv/bin/python benchmarks/rope.py        # GPU: dense_1b's attention, 2 x 4096 tokens, bf16
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/rope.py --seq 16 --heads 4 --groups 2 --head-dim 16

One side's call is what one attention layer does: the queries (``--heads`` heads, contiguous, as
Megatron's QKV split reshapes them) and the keys (``--groups`` heads, a strided view of the fused
QKV projection) through RoPE with dense_1b's frequencies (base 5e5), then the backward of both
with fixed gradients. The alternating runs (A B B A) give per run each side's median ms and the
ratio fused / upstream. Prints them; ``--json`` writes them. Both sides' outputs are compared
with a float64 rotation of the same inputs (``max_error``): the fused one rounds once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_order, timed, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--seq", type=int, default=4096 if gpu else 64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32 if gpu else 4)
    parser.add_argument("--groups", type=int, default=8 if gpu else 2)
    parser.add_argument("--head-dim", type=int, default=64 if gpu else 16)
    parser.add_argument("--rotary-base", type=float, default=500000.0)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if gpu else "fp32")
    parser.add_argument("--reps", type=int, default=20 if gpu else 2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.heads % args.groups:
        parser.error(f"--heads {args.heads} is not a multiple of --groups {args.groups}")

    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_ext_kernels import rope

    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    s, b, d, per_group = args.seq, args.micro_batch, args.head_dim, args.heads // args.groups
    g = torch.Generator(device=device).manual_seed(0)
    mixed = torch.randn(s, b, args.groups, (per_group + 2) * d, generator=g,
                        device=device).to(dtype)
    query = mixed[..., :per_group * d].reshape(s, b, args.heads, d)  # a copy, as upstream's
    key = mixed[..., per_group * d:(per_group + 1) * d]  # a strided view
    grads = [torch.randn(t.shape, generator=g, device=device).to(dtype) for t in (query, key)]
    inv = 1.0 / (args.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                   device=device) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # RotaryEmbedding's layout

    def run(apply: Callable) -> List[torch.Tensor]:
        inputs = [t.detach().requires_grad_() for t in (query, key)]
        outs = [apply(t) for t in inputs]
        torch.autograd.backward(outs, grads)
        return outs

    sides: Dict[str, Callable] = {
        "upstream": lambda t: _apply_rotary_pos_emb_bshd(t, freqs),
        "fused": lambda t: rope.fused_rope(t, freqs),
    }
    exact = [rope.reference(t, freqs) for t in (query, key)]
    max_error = {name: max((o.double() - e).abs().max().item()
                           for o, e in zip(run(fn), exact)) for name, fn in sides.items()}

    ms: Dict[str, List[float]] = {name: [0.0] * args.repeats for name in sides}
    for rep, name in run_order(list(sides), args.repeats):
        fn = sides[name]
        times = timed(lambda: run(fn), lambda: None, args.reps, args.warmup)
        ms[name][rep] = 1e3 * statistics.median(times)
    ratios = [f / u for f, u in zip(ms["fused"], ms["upstream"])]
    moved = 2 * sum(t.numel() for t in (query, key)) * query.element_size()
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "seq": s,
              "micro_batch": b, "heads": args.heads, "groups": args.groups, "head_dim": d,
              "dtype": args.dtype, "repeats": args.repeats, "reps": args.reps, "ms": ms,
              "ratio_runs": ratios, "median_ms": {k: statistics.median(v) for k, v in ms.items()},
              "max_error": max_error,
              # the fused side's least traffic: each tensor read and written once each way
              "fused_min_bytes": 2 * moved}
    print(f"RoPE fwd+bwd of one layer's queries and keys: {s} x {b} tokens, {args.heads} heads "
          f"/ {args.groups} groups of {d}, {args.dtype}, {result['device']}")
    for name in sides:
        print(f"  {name:8s}: {result['median_ms'][name]:8.3f} ms, max error vs float64 "
              f"{max_error[name]:.3g}")
    print(f"  fused / upstream per run: {', '.join(f'{r:.3f}' for r in ratios)}")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
