"""STEM MLP vs dense SwiGLU MLP, forward + backward, measured in the same run.

    .venv/bin/python benchmarks/stem_mlp.py                 # paper's 1B shape, fp32 on CPU
    .venv/bin/python benchmarks/stem_mlp.py --dtype bf16    # on a GPU

Both sides are the real modules (Megatron-Core's ``MLP`` with SwiGLU, and ``StemMLP``), built with
the same linear layers and wrapped in Megatron's ``DistributedDataParallel`` as in training, so
gradients land in ``main_grad`` buffers (the table's only in the touched rows). Ideal speed-up: 1.5x (one of the three GEMMs of SwiGLU is replaced by a
row gather). Prints the per-iteration times, their ratio and achieved GEMM throughput.
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

from common import RunSetup, add_run_args, timed, wrap_ddp  # noqa: E402


def build(hidden: int, ffn: int, vocab: int, dtype: torch.dtype):
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
    stem = StemMLP.as_mlp_submodule(submodules=submodules, stem=StemConfig(variant="up"),
                                    vocab_size=vocab, config=config, pg_collection=pgs)
    return dense, stem


def time_fwd_bwd(ddp, x, grad, token_ids, reps: int, warmup: int):
    """Median-ready list of forward+backward times; the grad buffer is zeroed outside the timing
    (in training it is zeroed once per global batch, not per micro-batch)."""
    def step():
        if token_ids is not None:
            with ddp.module.bind_token_ids(token_ids):
                out, _ = ddp(x)
        else:
            out, _ = ddp(x)
        out.backward(grad)

    def reset():
        ddp.zero_grad_buffer()
        x.grad = None

    return timed(step, reset, reps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tokens", type=int, default=8192)
    add_run_args(parser, gpu_reps=20, cpu_reps=3)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    if args.warmup is None and gpu:
        args.warmup = 5
    run = RunSetup(args, quiet=False)
    dtype_name, dtype, reps, warmup, device = (run.dtype_name, run.dtype, run.reps,
                                               run.warmup, run.device)
    torch.manual_seed(0)

    dense, stem = build(args.hidden, args.ffn, args.vocab, dtype)
    dense = wrap_ddp(dense.to(device))
    stem = wrap_ddp(stem.to(device))
    # [s, b, h] with b = 1: the token count is what matters for the GEMMs.
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype)
    # Zipf-like ids, as in text: many repeats.
    ranks = torch.arange(1, args.vocab + 1, dtype=torch.float64)
    ids = torch.multinomial(1.0 / ranks, args.tokens, replacement=True).view(args.tokens, 1)
    ids = ids.to(device)

    results = {}
    for name, module, tok in (("dense", dense, None), ("stem", stem, ids),
                              ("dense", dense, None), ("stem", stem, ids)):
        # Interleaved twice so that drift in machine load hits both sides.
        results.setdefault(name, []).extend(time_fwd_bwd(module, x, grad, tok, reps, warmup))
    dense_s = statistics.median(results["dense"])
    stem_s = statistics.median(results["stem"])
    gemm_flops_dense = 3 * 3 * 2 * args.tokens * args.hidden * args.ffn  # 3 GEMMs x (fwd + 2 bwd)
    gemm_flops_stem = 2 * 3 * 2 * args.tokens * args.hidden * args.ffn
    summary = {
        "device": torch.cuda.get_device_name(0) if gpu else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": dtype_name, "hidden": args.hidden, "ffn": args.ffn, "vocab": args.vocab,
        "tokens": args.tokens, "reps": reps,
        "dense_ms": dense_s * 1e3, "stem_ms": stem_s * 1e3,
        "speedup": dense_s / stem_s, "ideal_speedup": 1.5,
        "dense_gemm_tflops": gemm_flops_dense / dense_s / 1e12,
        "stem_gemm_tflops": gemm_flops_stem / stem_s / 1e12,
        "unique_tokens": int(torch.unique(ids).numel()),
    }
    print(f"STEM MLP vs dense SwiGLU, forward+backward | {summary['device']} {dtype_name} | "
          f"d={args.hidden} d_ff={args.ffn} vocab={args.vocab} tokens={args.tokens} "
          f"(unique {summary['unique_tokens']})")
    print(f"  dense SwiGLU : {summary['dense_ms']:10.1f} ms  "
          f"({summary['dense_gemm_tflops']:.3f} TFLOP/s in GEMMs)")
    print(f"  STEM (up)    : {summary['stem_ms']:10.1f} ms  "
          f"({summary['stem_gemm_tflops']:.3f} TFLOP/s in GEMMs)")
    print(f"  speed-up     : {summary['speedup']:.3f}x  (ideal 1.5x)")
    run.write_json(summary)


if __name__ == "__main__":
    main()
