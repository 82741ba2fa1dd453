"""STEM MLP vs dense SwiGLU MLP, forward + backward, measured in the same run.

    .venv/bin/python benchmarks/stem_mlp.py                 # paper's 1B shape, fp32 on CPU
    .venv/bin/python benchmarks/stem_mlp.py --dtype bf16    # on a GPU

On a GPU with Triton, STEM is measured twice: with the fused lookup-and-gate kernel
(``--stem-kernel triton``, kernels/stem_gate.py) and with the plain-PyTorch path (``torch``), and the
lookup-and-gate alone (forward + backward of the gather, SiLU and product, row gradients into
``main_grad``) is timed for both, on the MLPs' Zipf ids and on uniform ones (``--gate-ids``),
and the fused one at other backward tiles (``--gate-tiles``; docs/benchmarks.md has its cost
model, ``benchmarks/stem_gate_cost.py``). Issue goal: STEM with the kernel at least 1.4x faster than dense
(ideal 1.5x). On the CPU only the PyTorch path runs (Triton's interpreter is for tests).

On a GPU (or with ``--compiled``) the PyTorch path is also measured with ``--stem-compile gate``
(side ``stem_compiled``, and the lookup-and-gate alone as ``gate_compiled``: the ops after the
gather compiled, ``kernels/stem_gate.py``'s ``gate_product``); their first two steps, where they compile,
are timed apart (``compile_s``) before their warm-up.

Both sides are the real modules (Megatron-Core's ``MLP`` with SwiGLU, and ``StemMLP``), built with
the same linear layers and wrapped in Megatron's ``DistributedDataParallel`` as in training, so
gradients land in ``main_grad`` buffers (the table's only in the touched rows). Ideal speed-up: 1.5x (one of the three GEMMs of SwiGLU is replaced by a
row gather). Prints the per-iteration times, their ratio and achieved GEMM throughput.

The sides are measured in ``--repeats`` runs (2), every other one in the reverse order (dense,
STEM, STEM, dense); each run gives each STEM path its own speed-up over that run's dense time
(``stem_<kernel>_speedup_runs``), reported with their median; ``scripts/gpu_evidence.py`` judges
the goal on the worse run. ``--profile DIR`` traces a few steps of each side instead of timing
them (``benchmarks/common.py``'s ``profile_sides``): where STEM's time goes against dense's, per
kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (RunSetup, add_profile_args, add_run_args, alternate,  # noqa: E402
                    alternate_timed, compile_seconds, medians, profile_sides, run_ratios, timed,
                    wrap_ddp)


def build(hidden: int, ffn: int, vocab: int, dtype: torch.dtype, kernels=("torch",)):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.mlp import StemMLP

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=16,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    dense = MLP.as_mlp_submodule(submodules=submodules, config=config, pg_collection=pgs,
                                 is_mtp_layer=False, ffn_hidden_size=ffn)
    stems = {}
    for kernel in kernels:
        torch.manual_seed(1)
        # "compiled": the PyTorch path with --stem-compile gate.
        stem = StemConfig(variant="up", kernel="torch", compile="gate") if kernel == "compiled" \
            else StemConfig(variant="up", kernel=kernel)
        stems[kernel] = StemMLP.as_mlp_submodule(
            submodules=submodules, stem=stem, vocab_size=vocab, config=config, pg_collection=pgs)
    return dense, stems


def draw_ids(kind: str, vocab: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """``tokens`` ids from a generator of their own (the same ids on every machine, and in
    ``benchmarks/stem_gate_cost.py``). ``zipf``: P(id = k) proportional to 1 / (k + 1), Zipf's law
    with exponent 1, which word frequencies in text roughly follow (at 8192 tokens of a 50304
    vocabulary: about 3,400 distinct rows, the most frequent with about 700 tokens); the
    benchmark's distribution since it was written (until 2026-11-28 drawn from the global
    generator, so other ids of the same law). ``uniform``: every row equally likely (few repeats:
    the backward's rows barely overlap)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.randint(0, vocab, (tokens,), generator=g)
    if kind != "zipf":
        raise ValueError(f"ids {kind!r}: zipf or uniform")
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(1.0 / ranks, tokens, replacement=True, generator=g)


def parse_tiles(spec: str):
    """``--gate-tiles``: ``CHUNKxBLOCK_FxWARPS`` comma list -> the fused backward's tiles."""
    from megatron_ext_kernels.stem_gate import BwdTile

    tiles = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            chunk, block_f, warps = (int(v) for v in item.split("x"))
        except ValueError:
            raise SystemExit(f"--gate-tiles={spec!r}: each tile is CHUNKxBLOCK_FxWARPS, "
                             f"e.g. 16x128x4 (got {item!r})")
        tiles[item] = BwdTile(chunk, block_f, warps)
    return tiles


def gate_alone(table, ids, fc1_out, grad, kernel: str, tile=None):
    """``(step, reset)`` of the lookup-and-gate by itself: forward + backward, row gradients into
    ``main_grad``; ``tile``: the fused backward's tile (its default if None)."""
    from megatron_ext.compiled import compile_region
    from megatron_ext.stem.mlp import gate_product
    from megatron_ext_kernels import stem_gate
    from megatron_ext_kernels.stem_lookup import lookup_rows

    fc1_out = fc1_out.detach().requires_grad_(True)
    # "compiled": StemMLP's PyTorch path under --stem-compile gate (the gather eager).
    product = compile_region(gate_product) if kernel == "compiled" else gate_product

    def step():
        if kernel == "triton":
            out = stem_gate.stem_gate(fc1_out, table, ids, "up", bwd_tile=tile)
        else:
            out = product(fc1_out, lookup_rows(table, ids), "up", F.silu)
        out.backward(grad)

    def reset():
        table.main_grad.zero_()
        fc1_out.grad = None

    return step, reset


def fwd_bwd(ddp, x, grad, token_ids):
    """``(step, reset)`` of forward+backward; the grad buffer is zeroed in ``reset``, outside the
    timing (in training it is zeroed once per global batch, not per micro-batch)."""
    def step():
        # StemMLP takes the ids as the block's context; the dense MLP takes none.
        out, _ = ddp(x) if token_ids is None else ddp(x, context=token_ids)
        out.backward(grad)

    def reset():
        ddp.zero_grad_buffer()
        x.grad = None

    return step, reset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--stem-kernels", default=None,
                        help="comma list of torch,triton; default: both on a GPU with Triton, "
                             "torch on the CPU (triton there only under TRITON_INTERPRET=1, "
                             "to check this script, not for speed)")
    parser.add_argument("--gate-ids", default="zipf,uniform",
                        help="comma list of zipf,uniform: the ids the lookup-and-gate alone is "
                             "timed on (zipf as the MLPs, gate_<kernel>_ms; uniform as "
                             "gate_<kernel>_uniform_ms); see draw_ids")
    parser.add_argument("--gate-tiles", default="16x128x4,16x256x8,32x128x4",
                        help="fused backward tiles CHUNKxBLOCK_FxWARPS also timed alone on the "
                             "zipf ids when the fused kernel runs (gate_triton_tile_<tile>_ms); "
                             "empty: none")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the PyTorch path with --stem-compile gate (stem_compiled, "
                             "gate_compiled; not under --profile); default: on a GPU only (on "
                             "the CPU Inductor's C++ compile takes seconds to tens of seconds)")
    add_run_args(parser, gpu_reps=20, cpu_reps=3)
    add_profile_args(parser)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    if args.warmup is None and gpu:
        args.warmup = 5
    run = RunSetup(args, quiet=False)
    dtype_name, dtype, reps, warmup, device = (run.dtype_name, run.dtype, run.reps,
                                               run.warmup, run.device)
    torch.manual_seed(0)

    from megatron_ext_kernels import stem_gate

    if args.stem_kernels:
        kernels = tuple(k.strip() for k in args.stem_kernels.split(","))
        for kernel in kernels:
            stem_gate.resolve(kernel)  # a clear error for a kernel this machine cannot run
    else:
        kernels = ("torch", "triton") if (gpu and stem_gate.available()) else ("torch",)
    if (gpu if args.compiled is None else args.compiled) and not run.profile_dir:
        kernels += ("compiled",)
    dense, stems = build(args.hidden, args.ffn, args.vocab, dtype, kernels)
    dense = wrap_ddp(dense.to(device))
    stems = {k: wrap_ddp(m.to(device)) for k, m in stems.items()}
    # [s, b, h] with b = 1: the token count is what matters for the GEMMs.
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype)
    # Zipf ids, as in text: many repeats (draw_ids).
    ids = draw_ids("zipf", args.vocab, args.tokens).view(args.tokens, 1).to(device)
    gate_ids = [k.strip() for k in args.gate_ids.split(",") if k.strip()]
    tiles = parse_tiles(args.gate_tiles) if "triton" in kernels else {}

    device_name = torch.cuda.get_device_name(0) if gpu else \
        f"cpu ({torch.get_num_threads()} threads)"
    counts = torch.unique(ids, return_counts=True)[1]
    shape = {"dtype": dtype_name, "hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab,
             "tokens": args.tokens, "ids": "zipf: P(id = k) ~ 1 / (k + 1), seed 0",
             "unique_tokens": int(counts.numel()), "most_frequent_row_tokens": int(counts.max())}
    sides = {"dense": fwd_bwd(dense, x, grad, None)}
    sides.update({f"stem_{k}": fwd_bwd(m, x, grad, ids) for k, m in stems.items()})
    if run.profile_dir:
        profile_sides(sides, "dense", run.profile_dir, warmup, run.profile_steps,
                      {"benchmark": "stem_mlp", "device": device_name, **shape})
        return
    # The compiled side compiles in its first steps: timed apart, before its warm-up.
    compile_s = {name: compile_seconds(*s) for name, s in sides.items() if name == "stem_compiled"}
    run_ms, host_runs = alternate_timed(
        {name: (lambda s=s: timed(*s, reps, warmup)) for name, s in sides.items()}, run.repeats)
    speedup_runs = run_ratios(run_ms, "dense", lambda t, d: d / t)
    med = medians(run_ms)
    gemm_flops_dense = 3 * 3 * 2 * args.tokens * args.hidden * args.ffn  # 3 GEMMs x (fwd + 2 bwd)
    gemm_flops_stem = 2 * 3 * 2 * args.tokens * args.hidden * args.ffn
    summary = {
        "device": device_name, **shape, "reps": reps, "repeats": run.repeats,
        "ideal_speedup": 1.5, "goal_speedup": 1.4,
        "dense_ms": med["dense"], "dense_ms_runs": run_ms["dense"],
        "dense_gemm_tflops": gemm_flops_dense / med["dense"] / 1e9,
        # Per side, the host's time per step until it returns, before the device sync
        # (common.py StepTimes): on a GPU near the side's time where it is host-bound.
        "host_ms": medians(host_runs), "host_ms_runs": host_runs,
    }
    for kernel in stems:
        t = med[f"stem_{kernel}"]
        summary[f"stem_{kernel}_ms"] = t
        summary[f"stem_{kernel}_ms_runs"] = run_ms[f"stem_{kernel}"]
        # Per run (ABBA order) and their median: a goal is judged per run.
        summary[f"stem_{kernel}_speedup_runs"] = speedup_runs[f"stem_{kernel}"]
        summary[f"stem_{kernel}_speedup"] = medians(speedup_runs)[f"stem_{kernel}"]
        summary[f"stem_{kernel}_gemm_tflops"] = gemm_flops_stem / t / 1e9
    # The lookup-and-gate alone, on the table of the first STEM module.
    table = next(iter(stems.values())).module.table
    fc1_out = torch.randn(args.tokens, 1, args.ffn, device=device, dtype=dtype)
    grad_gate = torch.randn(args.tokens, 1, args.ffn, device=device, dtype=dtype)
    cases = {}
    for kind in gate_ids:
        case_ids = ids if kind == "zipf" else \
            draw_ids(kind, args.vocab, args.tokens).view(args.tokens, 1).to(device)
        suffix = "" if kind == "zipf" else f"_{kind}"
        cases.update({f"{k}{suffix}": (case_ids, k, None) for k in stems})
    if "zipf" in gate_ids:
        cases.update({f"triton_tile_{name}": (ids, "triton", tile)
                      for name, tile in tiles.items()})
    compile_s.update({f"gate_{name}": compile_seconds(*gate_alone(table, c[0], fc1_out, grad_gate,
                                                                  c[1], c[2]))
                      for name, c in cases.items() if c[1] == "compiled"})
    alone = alternate({name: (lambda c=c: timed(*gate_alone(table, c[0], fc1_out, grad_gate, c[1],
                                                            c[2]), reps, warmup))
                       for name, c in cases.items()}, run.repeats)
    for name, runs in alone.items():
        summary[f"gate_{name}_ms"] = statistics.median(runs)
        summary[f"gate_{name}_ms_runs"] = runs
    summary["compile_s"] = compile_s

    print(f"STEM MLP vs dense SwiGLU, forward+backward | {summary['device']} {dtype_name} | "
          f"d={args.hidden} d_ff={args.ffn} vocab={args.vocab} tokens={args.tokens} "
          f"(unique {summary['unique_tokens']})")
    host = summary["host_ms"]
    print(f"  dense SwiGLU      : {summary['dense_ms']:10.2f} ms (host {host['dense']:.2f})  "
          f"({summary['dense_gemm_tflops']:.3f} TFLOP/s in GEMMs)")
    for kernel in stems:
        print(f"  STEM (up, {kernel:6s}): {summary[f'stem_{kernel}_ms']:10.2f} ms "
              f"(host {host[f'stem_{kernel}']:.2f})  "
              f"({summary[f'stem_{kernel}_gemm_tflops']:.3f} TFLOP/s in GEMMs)  "
              f"speed-up vs dense {summary[f'stem_{kernel}_speedup']:.3f}x (runs "
              + " / ".join(f"{r:.3f}" for r in summary[f"stem_{kernel}_speedup_runs"]) + ")")
    print("  goal: STEM with the fused kernel >= 1.4x dense in every run (ideal 1.5x)"
          + ("" if "triton" in stems else "; the fused kernel needs a GPU, not measured here"))
    for kind in gate_ids:
        suffix = "" if kind == "zipf" else f"_{kind}"
        line = f"  lookup-and-gate alone, fwd+bwd, {kind} ids: " + ", ".join(
            f"{k} {summary[f'gate_{k}{suffix}_ms']:.3f} ms" for k in stems)
        if "triton" in stems:
            fused, torch_ms = summary[f"gate_triton{suffix}_ms"], summary[f"gate_torch{suffix}_ms"]
            line += f"  (fused {torch_ms / fused:.2f}x faster; goal <= 0.5 ms)"
        if "compiled" in stems:
            comp, torch_ms = (summary[f"gate_compiled{suffix}_ms"],
                              summary[f"gate_torch{suffix}_ms"])
            line += f"  (compiled {torch_ms / comp:.2f}x faster than torch)"
        print(line)
    for name, secs in compile_s.items():
        print(f"  {name}: compiled in {secs:.1f} s (first two steps, not in its timing)")
    if tiles and "zipf" in gate_ids:
        print("  fused, zipf ids, per backward tile (CHUNKxBLOCK_FxWARPS): " + ", ".join(
            f"{name} {summary[f'gate_triton_tile_{name}_ms']:.3f} ms" for name in tiles))
    run.write_json(summary)


if __name__ == "__main__":
    main()
