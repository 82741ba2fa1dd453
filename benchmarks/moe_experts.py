"""MoE experts without Transformer Engine, forward and backward: upstream's ``SequentialMLP`` (what
the local spec builds; one GEMM per expert and direction) against the torch grouped experts of
``--moe-grouped-gemm`` (``megatron_ext/models/grouped_experts.py``), in one run, same weights and
tokens.

    .venv/bin/python benchmarks/moe_experts.py     # GPU: Sigma-MoE-Tiny's layer, 4096 tokens, bf16
    .venv/bin/python benchmarks/moe_experts.py --experts 8 --hidden 64 --ffn 32 --tokens 64

The tokens come as the dispatcher hands them to the experts: permuted, grouped by expert, with
the router's probabilities; their counts per expert follow ``--routing`` (``zipf``: a skewed load
as an unbalanced router gives early in training, ``uniform``: the balanced load the
load-balancing loss aims for). Alternating runs (A B B A) give per run each side's median ms and
the ratio grouped / sequential; the JSON also says which GEMM path the grouped linears took
(``grouped_mm`` or the per-expert loop, and why) and the largest difference of the two sides'
outputs (a sanity check: ``tests/test_grouped_experts.py`` checks them against each other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_order, timed  # noqa: E402


def counts_per_expert(tokens: int, experts: int, routing: str, seed: int = 0) -> List[int]:
    """Tokens per expert summing to ``tokens``: Zipf-like (``1/(rank+1)``) or uniform."""
    if routing == "uniform":
        w = torch.ones(experts)
    else:
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        w = w[torch.randperm(experts, generator=torch.Generator().manual_seed(seed))]
    counts = torch.floor(w / w.sum() * tokens).long()
    counts[torch.argmax(w)] += tokens - int(counts.sum())
    return counts.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--experts", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=4096 if gpu else 256,
                        help="tokens routed to this rank's experts (top-1: the micro-batch's)")
    parser.add_argument("--routing", choices=["zipf", "uniform"], default="zipf")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if gpu else "fp32")
    parser.add_argument("--reps", type=int, default=10 if gpu else 2)
    parser.add_argument("--warmup", type=int, default=3 if gpu else 1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.compat.standalone import init_single_rank
    from megatron_ext.models import grouped_experts

    init_single_rank()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8,
        ffn_hidden_size=args.ffn, num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, moe_router_topk=1,
        moe_router_pre_softmax=True,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        hidden_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not gpu, moe_grouped_gemm=True)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    sequential = SequentialMLP(args.experts, config, MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=pg)
    grouped = grouped_experts.grouped_experts_builder()(args.experts, config, pg_collection=pg)
    sequential.to(device)
    grouped.to(device)
    with torch.no_grad():  # the same experts on both sides
        for e, expert in enumerate(sequential.local_experts):
            grouped.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            grouped.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)

    counts = counts_per_expert(args.tokens, args.experts, args.routing)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device).to(dtype)
    probs = torch.rand(args.tokens, generator=g, device=device)
    grad = torch.randn(args.tokens, args.hidden, generator=g, device=device).to(dtype)
    tokens_per_expert = torch.tensor(counts)  # on the host, as the alltoall dispatcher gives them
    outputs: Dict[str, torch.Tensor] = {}

    def side(name: str, experts) -> Callable[[], None]:
        def step() -> None:
            xi = x.detach().requires_grad_()
            out, _ = experts(xi, tokens_per_expert, probs)
            out.backward(grad)
            outputs[name] = out.detach()
        return step

    def reset() -> None:
        for m in (sequential, grouped):
            for p in m.parameters():
                p.grad = None

    sides = {"sequential": side("sequential", sequential), "grouped": side("grouped", grouped)}
    ms: Dict[str, List[float]] = {name: [0.0] * args.repeats for name in sides}
    for rep, name in run_order(list(sides), args.repeats):
        ms[name][rep] = 1e3 * statistics.median(timed(sides[name], reset, args.reps, args.warmup))
    ratios = [gr / sq for gr, sq in zip(ms["grouped"], ms["sequential"])]
    paths = {name: getattr(getattr(grouped, name), "last_path", None)
             for name in ("linear_fc1", "linear_fc2")}
    diff = float((outputs["grouped"].float() - outputs["sequential"].float()).abs().max())
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "experts": args.experts,
              "hidden": args.hidden, "ffn": args.ffn, "tokens": args.tokens,
              "routing": args.routing, "counts_min_max": [min(counts), max(counts)],
              "dtype": args.dtype, "repeats": args.repeats, "reps": args.reps, "ms": ms,
              "median_ms": {k: statistics.median(v) for k, v in ms.items()},
              "ratio_runs": ratios, "gemm_paths": paths, "max_output_diff": diff}
    print(f"MoE experts fwd+bwd: {args.experts} experts of {args.ffn} (SwiGLU), H {args.hidden}, "
          f"{args.tokens} tokens ({args.routing}: {min(counts)}-{max(counts)} per expert), "
          f"{args.dtype}, {result['device']}")
    for name in sides:
        print(f"  {name:10s}: {result['median_ms'][name]:9.3f} ms")
    print(f"  grouped / sequential per run: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"GEMM paths {paths}; max output difference {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
