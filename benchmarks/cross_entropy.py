"""The loss's vocab-parallel cross entropy, forward and backward: Megatron-Core's
(``tensor_parallel.vocab_parallel_cross_entropy``, fp32 copies of the logits) against the fused
one (``megatron_ext_kernels/vocab_ce.py``, ``--ext-cross-entropy fused``), in one run.

    .venv/bin/python benchmarks/cross_entropy.py          # GPU: 4 x 4096 tokens, vocab 128256, bf16
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/cross_entropy.py --tokens 64 --vocab 512

Both sides take the same bf16 logits (as the output layer gives them) and targets and run the
loss and its backward; the alternating runs (A B B A) give per run each side's median ms, the
ratio fused / upstream, and each side's peak GPU memory above the logits (what the loss adds:
upstream's fp32 copy and softmax, the fused one's gradient). Prints them; ``--json`` writes them.
The counted traffic (``kernels/vocab_ce.py``): about 126 GB upstream, 13 GB fused at the default
shape.
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
    parser.add_argument("--tokens", type=int, default=4 * 4096 if gpu else 64)
    parser.add_argument("--vocab", type=int, default=128256 if gpu else 512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if gpu else "fp32")
    parser.add_argument("--reps", type=int, default=10 if gpu else 2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from megatron_ext.compat.standalone import init_single_rank
    from megatron_ext_kernels import vocab_ce

    ps = init_single_rank()
    group = ps.get_tensor_model_parallel_group()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.tokens, 1, args.vocab, generator=g, device=device) * 3).to(dtype)
    target = torch.randint(0, args.vocab, (args.tokens, 1), generator=g, device=device)
    grad_loss = torch.full((args.tokens, 1), 1.0 / args.tokens, device=device)

    def upstream() -> None:
        # Upstream subtracts the max in place from fp32 logits (a bf16 input gets its fp32 copy):
        # with --dtype fp32 its side also times a copy of the logits.
        x = (logits.clone() if dtype == torch.float32 else logits.detach()).requires_grad_()
        vocab_parallel_cross_entropy(x, target, tp_group=group).backward(grad_loss)

    def fused() -> None:
        x = logits.detach().requires_grad_()
        vocab_ce.fused_vocab_parallel_cross_entropy(x, target, group).backward(grad_loss)

    sides: Dict[str, Callable[[], None]] = {"upstream": upstream, "fused": fused}
    base_bytes = torch.cuda.memory_allocated() if gpu else 0

    def measure(fn: Callable[[], None]) -> tuple:
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        times = timed(fn, lambda: None, args.reps, args.warmup)
        peak = (torch.cuda.max_memory_allocated() - base_bytes) / 2**30 if gpu else None
        return 1e3 * statistics.median(times), peak

    ms: Dict[str, List[float]] = {name: [0.0] * args.repeats for name in sides}
    peak: Dict[str, float] = {}
    for rep, name in run_order(list(sides), args.repeats):
        ms[name][rep], p = measure(sides[name])
        if p is not None:
            peak[name] = max(peak.get(name, 0.0), p)
    ratios = [f / u for f, u in zip(ms["fused"], ms["upstream"])]
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "tokens": args.tokens,
              "vocab": args.vocab, "dtype": args.dtype, "repeats": args.repeats,
              "reps": args.reps, "ms": ms, "ratio_runs": ratios,
              "median_ms": {k: statistics.median(v) for k, v in ms.items()},
              "peak_gib_above_logits": peak or None,
              "logits_gib": logits.numel() * logits.element_size() / 2**30}
    print(f"cross entropy fwd+bwd: {args.tokens} tokens x vocab {args.vocab}, {args.dtype}, "
          f"{result['device']}")
    for name in sides:
        extra = f", peak {peak[name]:.2f} GiB above the logits" if name in peak else ""
        print(f"  {name:8s}: {result['median_ms'][name]:8.3f} ms{extra}")
    print(f"  fused / upstream per run: {', '.join(f'{r:.3f}' for r in ratios)}")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
