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
  global batch (``end_global_batch``: the statistics' all-reduce) in every step;
* ``sigma_compiled`` (on a GPU, or with ``--compiled``): the same with ``--sigma-compile router``
  (upstream's top-k routing and Sigma's statistics and loss as one compiled region,
  ``sigma/router.py``); its first two steps, where it compiles, are timed apart
  (``compile_s``) before its warm-up.

``--moe-grouped-gemm`` builds both sides' experts as grouped GEMMs: without Transformer Engine the
torch grouped experts (``megatron_ext/models/grouped_experts.py``; upstream's local spec would
build ``SequentialMLP``), so a run with and one without the flag compare sequential and grouped
experts; the JSON's ``experts`` says which ran (class, and the GEMM path of the grouped linears).

One step is forward, LM loss, backward (and for Sigma the end of the global batch); the
optimizer step is left out (same parameters on both sides). The two are measured in
``--repeats`` runs (2), every other one in the reverse order (upstream, sigma, sigma, upstream),
so drift in machine load hits both; each run gives its own ratio (``ratio_runs``), reported with
their median. Goal: at most +2% for Sigma, in every run (``scripts/gpu_evidence.py`` judges it on
the worse). ``--profile DIR`` traces a few steps of each instead of timing them
(``benchmarks/common.py``'s ``profile_sides``): where Sigma's time goes against upstream's, per
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
                    alternate_timed, compile_seconds, medians, profile_sides, run_ratios,
                    side_line, timed, wrap_ddp)

from gpu_memory import PeakMemory  # noqa: E402
from megatron_ext.tools import host_syncs  # noqa: E402


SIDES = ("upstream", "sigma", "sigma_compiled")


def build(args, dtype, router: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.specs import dense_layer_spec, final_norm_impl
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec

    upstream = router == "upstream"
    # host_overhead.py builds from a shape of its own, without the flag: sequential experts.
    grouped = getattr(args, "moe_grouped_gemm", False)
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
        attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        moe_grouped_gemm=grouped)
    if upstream:
        moe = dense_layer_spec(False, qk_layernorm=True, num_experts=args.experts,
                               moe_grouped_gemm=grouped)
        spec = TransformerBlockSubmodules(layer_specs=[moe] * args.layers,
                                          layer_norm=final_norm_impl(False))
    else:
        sigma = SigmaConfig(num_layers=args.layers, num_experts=args.experts, topk=args.topk,
                            lbl="global", lbl_coeff=1e-3,
                            compile="router" if router == "sigma_compiled" else "none")
        spec = sigma_block_spec(config, sigma, use_te=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                    max_sequence_length=args.seq, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def experts_ran(model) -> dict:
    """Which experts a side ran: the class, and for the grouped ones the GEMM path each linear
    took in its last forward (``grouped_mm``, or ``loop (reason)``)."""
    experts = model.module.decoder.layers[0].mlp.experts
    out = {"class": type(experts).__name__}
    for name in ("linear_fc1", "linear_fc2"):
        path = getattr(getattr(experts, name, None), "last_path", None)
        if path is not None:
            out[name] = path
    return out


def step_fn(name: str, model, tokens, position_ids, labels):
    """One training step of a side: forward, LM loss and backward, and for Sigma's sides the
    end of the global batch (``end_global_batch``: the statistics' all-reduce), once per step."""
    from megatron_ext.sigma.router import end_global_batch

    def step():
        model(tokens, position_ids, None, labels=labels).float().mean().backward()
        if name != "upstream":
            end_global_batch([model])

    return step


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
    parser.add_argument("--moe-grouped-gemm", action="store_true",
                        help="both sides' experts as grouped GEMMs (without Transformer Engine: "
                             "megatron_ext/models/grouped_experts.py); default: upstream's local "
                             "SequentialMLP")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="also time sigma_compiled (--sigma-compile router; not under "
                             "--profile); default: on a GPU only (on the CPU Inductor's C++ "
                             "compile takes seconds to tens of seconds)")
    add_run_args(parser, gpu_reps=10, cpu_reps=3)
    add_profile_args(parser)
    args = parser.parse_args()

    run = RunSetup(args)
    dtype_name, dtype, reps, warmup, device = (run.dtype_name, run.dtype, run.reps,
                                               run.warmup, run.device)

    compiled = (gpu if args.compiled is None else args.compiled) and not run.profile_dir
    models = {}
    for name in SIDES if compiled else SIDES[:2]:
        torch.manual_seed(0)
        models[name] = wrap_ddp(build(args, dtype, name).to(device))
        models[name].train()
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(tokens)
    inputs = (tokens, position_ids, labels)

    device_name = torch.cuda.get_device_name(0) if gpu else \
        f"cpu ({torch.get_num_threads()} threads)"
    shape = {"dtype": dtype_name, "layers": args.layers, "hidden": args.hidden,
             "experts": args.experts, "expert_ffn": args.expert_ffn, "topk": args.topk,
             "tokens": args.seq * args.micro_batch, "vocab": args.vocab,
             "moe_grouped_gemm": args.moe_grouped_gemm}
    if run.profile_dir:
        profile_sides({name: (step_fn(name, m, *inputs), m.zero_grad_buffer)
                       for name, m in models.items()}, "upstream", run.profile_dir, warmup,
                      run.profile_steps, {"benchmark": "sigma_step", "device": device_name,
                                          **shape})
        return
    # The compiled side compiles in its first steps: timed apart, before anything else runs it.
    compile_s = {name: compile_seconds(step_fn(name, m, *inputs), m.zero_grad_buffer)
                 for name, m in models.items() if name == "sigma_compiled"}
    # One step of each under the op recorder and CUDA's sync check (megatron_ext/tools/
    # host_syncs.py): kernels launched per step and host syncs, beside the profile's. Not of
    # the compiled side: the recorder sees aten ops, and a compiled region's fused kernels are
    # none (the profile step counts them).
    census = {}
    for name, m in models.items():
        if name == "sigma_compiled":
            continue
        census[name] = host_syncs.census(step_fn(name, m, *inputs))
        m.zero_grad_buffer()
    memory = PeakMemory()  # each side's peak with every model resident (GPU only)
    run_ms, host_runs = alternate_timed(memory.track(
        {name: (lambda name=name, m=m: timed(step_fn(name, m, *inputs), m.zero_grad_buffer,
                                             reps, warmup))
         for name, m in models.items()}), run.repeats)
    ratios = run_ratios(run_ms, "upstream")
    ratio_runs = ratios["sigma"]
    step_ms = medians(run_ms)
    ratio = statistics.median(ratio_runs)

    # The routers alone (forward + backward of one layer's router on the step's tokens): the part
    # that differs, measured without the experts' and attention's time and noise.
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device=device, dtype=dtype,
                    requires_grad=True)
    routers = {name: m.module.decoder.layers[0].mlp.router for name, m in models.items()}

    def router_step(name, router):
        def step():
            probs, _ = router(x)
            probs.sum().backward()
            if name != "upstream":
                router.end_global_batch()
        return step

    router_runs = alternate({name: (lambda name=name, r=r: timed(
        router_step(name, r), lambda: None, 10 * reps, warmup)) for name, r in routers.items()},
        run.repeats)
    router_ms = medians(router_runs)
    summary = {
        "device": device_name, **shape, "reps": reps, "repeats": run.repeats,
        "params": counts, "step_ms": step_ms, "step_ms_runs": run_ms,
        # The host's time per step, until step() returns, before the device sync (common.py
        # StepTimes): on a GPU near step_ms where the step is host-bound.
        "host_ms": medians(host_runs), "host_ms_runs": host_runs,
        # Per run (ABBA order) and their median: the goal is judged per run.
        "ratio_runs": ratio_runs, "ratio_sigma_vs_upstream": ratio,
        "router_ms": router_ms, "router_ms_runs": router_runs,
        # Per model: kernels per step, syncs the recorder flags, syncs CUDA reports (GPU).
        "census": census,
        # Per side, the experts that ran (class; the grouped linears' GEMM path).
        "experts": {name: experts_ran(m) for name, m in models.items()},
        # Per side, its timed steps' peak GPU memory, every model resident, and what was
        # allocated before them (gpu_memory.py); null on the CPU.
        **memory.summary(),
    }
    if compiled:
        summary.update({
            "ratio_compiled_runs": ratios["sigma_compiled"],
            "ratio_compiled_vs_upstream": statistics.median(ratios["sigma_compiled"]),
            "compile_s": compile_s})
    print(f"Sigma vs upstream router (aux_loss) step (forward + loss + backward) | "
          f"{summary['device']} {dtype_name} | {args.layers} layers, H={args.hidden}, "
          f"{args.experts} experts of {args.expert_ffn}, top-{args.topk}, {summary['tokens']} "
          f"tokens, experts: " + ", ".join(
              f"{name} " + " ".join(str(v) for v in e.values())
              for name, e in summary["experts"].items()))
    for name, ms in summary["step_ms"].items():
        print(side_line(name, 9, ms, summary["host_ms"][name], counts[name], memory.line(name),
                        census.get(name), compile_s.get(name)))
    print(f"  ratio sigma / upstream: {ratio:.4f} ({100 * (ratio - 1):+.2f}%; runs "
          + " / ".join(f"{r:.4f}" for r in ratio_runs) + "; goal <= +2% in every run)")
    if compiled:
        rc = summary["ratio_compiled_vs_upstream"]
        print(f"  ratio sigma_compiled / upstream: {rc:.4f} ({100 * (rc - 1):+.2f}%; runs "
              + " / ".join(f"{r:.4f}" for r in ratios["sigma_compiled"]) + ")")
    if compiled:
        print(f"  one router alone, compiled: {router_ms['sigma_compiled']:.3f} ms")
    print(f"  one router alone (forward + backward): sigma {router_ms['sigma']:.3f} ms, upstream "
          f"{router_ms['upstream']:.3f} ms; x {args.layers} layers = "
          f"{100 * args.layers * (router_ms['sigma'] - router_ms['upstream']) / step_ms['upstream']:+.2f}% "
          "of the upstream step")
    run.write_json(summary)


if __name__ == "__main__":
    main()
