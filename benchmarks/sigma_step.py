"""Training-step time of Sigma layers vs the same model on upstream's router with ``aux_loss``.

    .venv/bin/python benchmarks/sigma_step.py                 # CPU: 2 layers, 512 tokens, fp32
    .venv/bin/python benchmarks/sigma_step.py --layers 8 --seq 4096   # GPU, bf16

Both models are Megatron-Core ``GPTModel``s with the Sigma-MoE-Tiny layer shape (H = 1536, GQA
16/4 with QK-norm, RMSNorm, 96 SwiGLU experts of 768, top-1 pre-softmax, FP32 router; Table 1 of
the report) built from this project's Sigma block spec, wrapped in Megatron's
``DistributedDataParallel``. They differ only in the router:

* ``upstream``: ``TopKRouter`` with ``--moe-router-load-balancing-type aux_loss`` (coefficient
  1e-3, micro-batch Switch loss);
* ``sigma``: ``SigmaRouter`` with the global-batch LBL (coefficient 1e-3), including the end of the
  global batch (``end_global_batch``: the statistics' all-reduce) in every step.

One step is forward, LM loss, backward (and for Sigma the end of the global batch); the
optimizer step is left out (same parameters on both sides). The two are interleaved, twice, so
drift in machine load hits both; medians are reported. Goal: at most +2% for Sigma.
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


def build(args, dtype, router: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.specs import dense_layer_spec, final_norm_impl
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec

    upstream = router == "upstream"
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.expert_ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, qk_layernorm=True,
        normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True,
        add_bias_linear=False, num_moe_experts=args.experts, moe_ffn_hidden_size=args.expert_ffn,
        moe_router_topk=args.topk, moe_router_pre_softmax=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if upstream else "none",
        moe_aux_loss_coeff=1e-3 if upstream else 0.0, moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    if upstream:
        moe = dense_layer_spec(False, qk_layernorm=True, num_experts=args.experts)
        spec = TransformerBlockSubmodules(layer_specs=[moe] * args.layers,
                                          layer_norm=final_norm_impl(False))
    else:
        sigma = SigmaConfig(num_layers=args.layers, num_experts=args.experts, topk=args.topk,
                            lbl="global", lbl_coeff=1e-3)
        spec = sigma_block_spec(config, sigma, use_te=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--layers", type=int, default=8 if gpu else 2)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--experts", type=int, default=96)
    parser.add_argument("--expert-ffn", type=int, default=768)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096 if gpu else 512)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    add_run_args(parser, gpu_reps=10, cpu_reps=3)
    args = parser.parse_args()

    from megatron_ext.sigma.router import end_global_batch

    run = RunSetup(args)
    dtype_name, dtype, reps, warmup, device = (run.dtype_name, run.dtype, run.reps,
                                               run.warmup, run.device)

    models = {}
    for name in ("upstream", "sigma"):
        torch.manual_seed(0)
        models[name] = wrap_ddp(build(args, dtype, name).to(device))
        models[name].train()
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(tokens)

    def step_fn(name, model):
        def step():
            model(tokens, position_ids, None, labels=labels).float().mean().backward()
            if name == "sigma":
                end_global_batch([model])
        return step

    results = {name: [] for name in models}
    for _ in range(2):
        for name, model in models.items():
            results[name].extend(timed(step_fn(name, model), model.zero_grad_buffer, reps,
                                       warmup))
    medians = {name: statistics.median(t) for name, t in results.items()}
    ratio = medians["sigma"] / medians["upstream"]

    # The routers alone (forward + backward of one layer's router on the step's tokens): the part
    # that differs, measured without the experts' and attention's time and noise.
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device=device, dtype=dtype,
                    requires_grad=True)
    routers = {name: m.module.decoder.layers[0].mlp.router for name, m in models.items()}
    router_times = {name: [] for name in routers}

    def router_step(name, router):
        def step():
            probs, _ = router(x)
            probs.sum().backward()
            if name == "sigma":
                router.end_global_batch()
        return step

    for _ in range(2):
        for name, router in routers.items():
            router_times[name].extend(timed(router_step(name, router), lambda: None, 10 * reps,
                                            warmup))
    router_ms = {name: 1e3 * statistics.median(t) for name, t in router_times.items()}
    summary = {
        "device": torch.cuda.get_device_name(0) if gpu else
        f"cpu ({torch.get_num_threads()} threads)",
        "dtype": dtype_name, "layers": args.layers, "hidden": args.hidden,
        "experts": args.experts, "expert_ffn": args.expert_ffn, "topk": args.topk,
        "tokens": args.seq * args.micro_batch, "vocab": args.vocab, "reps": 2 * reps,
        "params": counts, "step_ms": {n: 1e3 * m for n, m in medians.items()},
        "ratio_sigma_vs_upstream": ratio, "router_ms": router_ms,
    }
    print(f"Sigma vs upstream router (aux_loss) step (forward + loss + backward) | "
          f"{summary['device']} {dtype_name} | {args.layers} layers, H={args.hidden}, "
          f"{args.experts} experts of {args.expert_ffn}, top-{args.topk}, {summary['tokens']} "
          f"tokens")
    for name, ms in summary["step_ms"].items():
        print(f"  {name:9s}: {ms:10.1f} ms  params {counts[name]:,}")
    print(f"  ratio sigma / upstream: {ratio:.4f} ({100 * (ratio - 1):+.2f}%; goal <= +2%)")
    print(f"  one router alone (forward + backward): sigma {router_ms['sigma']:.3f} ms, upstream "
          f"{router_ms['upstream']:.3f} ms; x {args.layers} layers = "
          f"{100 * args.layers * (router_ms['sigma'] - router_ms['upstream']) / (1e3 * medians['upstream']):+.2f}% "
          "of the upstream step")
    run.write_json(summary)


if __name__ == "__main__":
    main()
