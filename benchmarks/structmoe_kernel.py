"""StructMoE MLP layer (routed path per backend) vs the dense SwiGLU MLP, forward + backward, in one run.

    .venv/bin/python benchmarks/structmoe_kernel.py              # GPU: bf16, H=2048, D_ff=5632
    .venv/bin/python benchmarks/structmoe_kernel.py --cpu-smoke  # CPU: tiny shape, checks the script

Dense side: Megatron-Core's ``MLP`` with SwiGLU, ``D_ff = 5632``. StructMoE side: ``StructMoEMLP``
with ``L = 16`` experts of rank 16, top-1, ``D'_ff`` from the project's parameter matching
(Eq. 8 with three base matrices: 5319 at this shape), once per backend of the routed path:
``triton`` (router and codes fused, kernels/structmoe_routed.py), ``dense-masked`` and ``grouped``.
Both sides are built with the same linear layers and wrapped in Megatron's
``DistributedDataParallel`` as in training; the aux loss is attached as in training. Each step is
forward + backward of one micro-batch of ``--tokens`` tokens, timed with CUDA events (the grad
buffer is zeroed outside the timing); sides are measured in ``--repeats`` runs (2), every other
one in the reverse order, so drift in machine load hits all of them; each run gives each backend
its own overhead over that run's dense time (``overhead_pct_runs``), reported with their median,
and the goal is judged on the worse run. The routed update alone (router, codes, expand and their
backward) is timed per backend too. Issue goal: the StructMoE layer at most +3% over dense.

On a GPU (or with ``--compiled``) dense-masked and grouped are also measured with
``--structmoe-compile routed`` (sides ``<backend>+compiled``: the small ops between the GEMMs
compiled, ``structmoe/routed.py``); their first two steps, where they compile, are timed apart
(``compile_s``) before their warm-up.

``--pad-to N`` adds dense-masked with D'_ff stored as a multiple of N (``--structmoe-ffn-pad-to``,
the same layer: zero columns that stay zero; side ``dense-masked+pad<N>``, and its compiled twin):
5319 is not a multiple of 8, which keeps bf16 GEMMs off cuBLAS's aligned tensor-core kernels.

Without a GPU the script says so and exits 0; ``--cpu-smoke`` then runs a tiny shape in fp32
(the triton backend under Triton's interpreter), wall-clock timed, to check the script runs: its
numbers mean nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (COMPILED, RunSetup, add_run_args, alternate,  # noqa: E402
                    compile_seconds, medians, padded_sides, run_ratios, structmoe_side, timed,
                    wrap_ddp)

BACKENDS = ("triton", "dense-masked", "grouped")
SMOKE = dict(hidden=64, ffn=176, tokens=64)



def build(args, dtype):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=16,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(1)
    sides = {"dense": MLP.as_mlp_submodule(submodules=submodules, config=config, pg_collection=pgs,
                                           is_mtp_layer=False, ffn_hidden_size=args.ffn)}
    for name in args.structmoe_sides:
        backend, pad, mode = structmoe_side(name)
        torch.manual_seed(1)
        mlp = StructMoEMLP.as_mlp_submodule(
            submodules=submodules, config=config, pg_collection=pgs,
            structmoe=StructMoEConfig(num_experts=args.experts, rank=args.rank, topk=args.topk,
                                      backend=backend, compile=mode, ffn_pad_to=pad))
        mlp.set_layer_number(1)
        sides[name] = mlp
    if args.backends and not args.no_alignment_check:
        # Is D'_ff itself slow? Eq. 8 gives widths such as 5319 and 6618, not multiples of 8,
        # which keeps bf16 GEMMs off cuBLAS's aligned tensor-core kernels. The dense MLP at that
        # width, and StructMoE (dense-masked) with D'_ff rounded down to a multiple of 64.
        width = sides[args.backends[0]].budget.ffn
        aligned_width = width // 64 * 64 if width >= 128 else width // 8 * 8  # (the CPU smoke)
        sides[f"dense@{width}"] = MLP.as_mlp_submodule(
            submodules=submodules, config=dataclasses.replace(config, ffn_hidden_size=width),
            pg_collection=pgs, is_mtp_layer=False, ffn_hidden_size=width)
        torch.manual_seed(1)
        aligned = StructMoEMLP.as_mlp_submodule(
            submodules=submodules, config=config, pg_collection=pgs,
            structmoe=StructMoEConfig(num_experts=args.experts, rank=args.rank, topk=args.topk,
                                      backend="dense-masked",
                                      ffn_hidden_size=aligned_width))
        aligned.set_layer_number(1)
        sides[f"dense-masked@{aligned_width}"] = aligned
    return sides


def timed_events(step, reset, reps: int, warmup: int):
    """Seconds of ``reps`` calls of ``step`` after ``warmup`` untimed ones, from CUDA events (one
    synchronisation at the end, so the host runs ahead as in training); ``reset`` runs before
    each call, outside the timed interval. On the CPU: wall clock."""
    if not torch.cuda.is_available():
        return timed(step, reset, reps, warmup)
    for _ in range(warmup):
        reset()
        step()
    events = []
    for _ in range(reps):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events]


def layer_step(ddp, x, grad):
    """``(step, reset)``: forward + backward of the layer; the grad buffer zeroed outside."""
    def step():
        out, _ = ddp(x)
        out.backward(grad)

    def reset():
        ddp.zero_grad_buffer()
        x.grad = None

    return step, reset


def time_layer(ddp, x, grad, reps, warmup):
    return timed_events(*layer_step(ddp, x, grad), reps, warmup)


def time_routed(ddp, x, reps, warmup):
    """The routed update alone (aux loss attached as in training), forward + backward."""
    mlp = ddp.module
    grad = torch.randn(x.shape[0], x.shape[1], mlp.ffn_per_partition, device=x.device,
                       dtype=x.dtype)

    def step():
        mlp.routed_update(x).backward(grad)

    def reset():
        ddp.zero_grad_buffer()
        x.grad = None

    return timed_events(step, reset, reps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632, help="dense D_ff (SwiGLU)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--pad-to", type=int, default=None, metavar="N",
                        help="also time dense-masked with D'_ff stored as a multiple of N "
                             "(--structmoe-ffn-pad-to; the same layer: side "
                             "dense-masked+pad<N>), and its compiled twin")
    parser.add_argument("--no-alignment-check", action="store_true",
                        help="leave out the dense MLP at D'_ff and StructMoE at D'_ff rounded "
                             "down to a multiple of 64")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"without a GPU: run a tiny shape ({SMOKE}) to check the script")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="also time dense-masked and grouped with --structmoe-compile routed "
                             "(sides <backend>+compiled); default: on a GPU only (on the CPU "
                             "Inductor's C++ compile takes tens of seconds)")
    add_run_args(parser, gpu_reps=20, cpu_reps=2)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    compiled = gpu if args.compiled is None else args.compiled
    eager = list(args.backends) + padded_sides(["dense-masked"], args.pad_to)
    args.compiled_sides = [n + COMPILED for n in eager
                           if compiled and structmoe_side(n)[0] != "triton"]
    args.structmoe_sides = eager + args.compiled_sides
    if not gpu:
        if not args.cpu_smoke:
            print("benchmarks/structmoe_kernel.py measures the Triton kernel on a GPU: no CUDA "
                  "device here, nothing timed (--cpu-smoke runs a tiny shape to check the script)")
            return
        # Triton's interpreter is chosen when the kernels are first imported (lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.warmup is None and gpu:
        args.warmup = 5
    run = RunSetup(args)
    dtype_name, dtype, reps, warmup, device = (run.dtype_name, run.dtype, run.reps,
                                               run.warmup, run.device)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device))

    sides = {name: wrap_ddp(m.to(device)) for name, m in build(args, dtype).items()}
    budget = next(m.module.budget for n, m in sides.items() if n != "dense") \
        if args.backends else None
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in sides.items()}
    ours = args.structmoe_sides
    # [s, b, h] with b = 1: the token count is what matters for the GEMMs.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype)
    x.requires_grad_(True)
    grad = torch.randn(args.tokens, 1, args.hidden, generator=g).to(device, dtype)

    # The compiled sides compile in their first steps: timed apart, before their warm-up.
    compile_s = {name: compile_seconds(*layer_step(sides[name], x, grad))
                 for name in args.compiled_sides}
    layer_runs = alternate({name: (lambda ddp=ddp: time_layer(ddp, x, grad, reps, warmup))
                            for name, ddp in sides.items()}, args.repeats)
    routed_runs = alternate({name: (lambda ddp=ddp: time_routed(ddp, x, reps, warmup))
                             for name, ddp in sides.items()
                             if hasattr(ddp.module, "routed_update")}, args.repeats)
    layer_ms, routed_ms = medians(layer_runs), medians(routed_runs)
    overhead_runs = run_ratios(layer_runs, "dense", lambda t, d: 100.0 * (t / d - 1.0))
    summary = {
        "device": torch.cuda.get_device_name(0) if gpu else
        f"cpu smoke ({torch.get_num_threads()} threads; not a speed measurement)",
        "dtype": dtype_name, "hidden": args.hidden, "ffn": args.ffn,
        "structmoe_ffn": budget.ffn if budget else None, "experts": args.experts,
        "rank": args.rank, "topk": args.topk, "tokens": args.tokens, "reps": reps,
        "repeats": args.repeats, "params": counts, "layer_ms": layer_ms, "routed_ms": routed_ms,
        "layer_ms_runs": layer_runs,
        # Per run (ABBA order) and their median: the goal is judged per run.
        "overhead_pct_runs": {n: overhead_runs[n] for n in ours},
        "overhead_pct": {n: statistics.median(overhead_runs[n]) for n in ours},
        "compile_s": compile_s,
        # The alignment check's sides (see build()), against the dense MLP.
        "alignment_pct": {n: statistics.median(overhead_runs[n]) for n in layer_ms if "@" in n},
    }
    print(f"StructMoE MLP vs dense SwiGLU MLP, forward + backward | {summary['device']} "
          f"{dtype_name} | {args.tokens} tokens, H={args.hidden}, D_ff={args.ffn} -> "
          f"D'_ff={summary['structmoe_ffn']}, L={args.experts} r={args.rank} k={args.topk}")
    if budget:
        print("  " + budget.describe())
    for name, ms in layer_ms.items():
        extra = "" if name == "dense" else (
            f"  ({summary['alignment_pct'][name]:+.2f}% vs dense: alignment check)"
            if "@" in name else (
            f"  ({summary['overhead_pct'][name]:+.2f}% vs dense, goal <= +3%; "
            f"routed update alone {routed_ms[name]:.3f} ms)"))
        if name in compile_s:
            extra += f"; compiled in {compile_s[name]:.1f} s"
        print(f"  {name:13s}: {ms:9.3f} ms  params {counts[name]:,}{extra}")
    run.write_json(summary)


if __name__ == "__main__":
    main()
