"""Our command-line flags, added to Megatron's parser through ``extra_args_provider``.

Every Megatron flag keeps working; ours map 1:1 onto the family option dataclasses.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from megatron_ext.stem.config import (
    INITS,
    KERNELS,
    OPTIMIZERS,
    OWNERSHIPS,
    PLACEMENTS,
    RATIOS,
    SHARDINGS,
    VARIANTS,
    StemConfig,
    parse_layers,
)
from megatron_ext.sigma.config import LBLS as SIGMA_LBLS
from megatron_ext.structmoe.config import BACKENDS as SMOE_BACKENDS
from megatron_ext.structmoe.config import FUSIONS as SMOE_FUSIONS
from megatron_ext.structmoe.config import INITS as SMOE_INITS

FAMILIES = ("gpt", "stem", "structmoe", "sigma")  # the flag's choices; models/registry.py says
# which are built in this version


def add_extension_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron-ext")
    group.add_argument("--model-family", choices=FAMILIES, default="gpt",
                       help="gpt: dense SwiGLU baseline; stem: token-indexed up-projection tables; "
                            "structmoe: routed low-rank experts; sigma: Sigma MoE (every layer MoE)")
    group.add_argument("--ext-data-manifest", default=None,
                       help="manifest.json written by megatron_ext.training.data_prep; checked "
                            "against the tokenizer at start-up (found automatically next to a "
                            "--data-path prefix)")
    group.add_argument("--no-verify-checkpoint", action="store_true",
                       help="load --load's checkpoint without checking its files against the "
                            "checksum manifest written beside it at save time")

    launch = parser.add_argument_group("megatron-ext launch")
    launch.add_argument("--preset", default=None,
                        help="a model preset from launch/presets (e.g. stem_1b, dense_350m, "
                             "structmoe_0p9b, sigma_moe_tiny) or a JSON path; its flags come "
                             "first, flags given on the command line win")
    launch.add_argument("--dry-run", action="store_true",
                        help="print parameters, FLOPs and a per-rank memory estimate for these "
                             "flags and exit without building the model (no torchrun needed)")
    launch.add_argument("--dry-run-world-size", type=int, default=None,
                        help="GPUs (ranks) the dry run assumes (default: $WORLD_SIZE or 1)")
    launch.add_argument("--dry-run-json", default=None, metavar="PATH",
                        help="also write the dry run's numbers as JSON to PATH")
    launch.add_argument("--ext-run-report", default=None, metavar="PATH",
                        help="rank 0 writes a JSON run report (iteration times, tokens, FLOPs per "
                             "token, peak memory per rank) to PATH at the end of training "
                             "(launch/scaling.py reads it)")

    stem = parser.add_argument_group("megatron-ext STEM")
    stem.add_argument("--stem-ratio", choices=RATIOS, default="1/3",
                      help="STEM layers: 1/3 -> (i+1)%%3==0, 1/2 -> (i+1)%%2==0, full -> all but 0")
    stem.add_argument("--stem-layers", type=str, default=None,
                      help="explicit 0-based STEM layers, e.g. 2,5,8 (wins over --stem-ratio)")
    stem.add_argument("--stem-variant", choices=VARIANTS, default="up",
                      help="up: U[t] replaces W_up (paper); gate: U[t] replaces W_gate (ablation); "
                           "dagger: W_up kept and U[t] added (STEM-dagger)")
    stem.add_argument("--stem-init", choices=INITS, default="fan-in",
                      help="table initialisation; default fan-in = N(0, (init_method_std * "
                           "sqrt(hidden))^2), the spread of W_up x at initialisation")
    stem.add_argument("--stem-table-placement", choices=PLACEMENTS, default="gpu",
                      help="gpu: tables are model parameters on the device; cpu: they live in "
                           "(pinned) host memory, touched rows are copied to the device; tiered: "
                           "the hottest rows (--stem-gpu-tier) on the device with their optimizer "
                           "state, the rest in host memory (needs --stem-table-sharding vocab)")
    stem.add_argument("--stem-gpu-tier", default="10%", metavar="SIZE",
                      help="tiered placement: rows of the GPU tier as a count (50000), a fraction "
                           "(0.1) or a percentage (10%%) of the vocabulary; the most frequent ids "
                           "of the --data-path datasets, counted at start-up")
    stem.add_argument("--stem-table-sharding", choices=SHARDINGS, default="replicated",
                      help="replicated: every data-parallel rank holds all rows; vocab: each "
                           "data-parallel rank owns a share of the rows (--stem-row-ownership)")
    stem.add_argument("--stem-row-ownership", choices=OWNERSHIPS, default="interleaved",
                      help="with vocab sharding: row r on rank r %% dp (interleaved, balanced on "
                           "BPE vocabularies) or contiguous ranges")
    stem.add_argument("--stem-optimizer", choices=OPTIMIZERS, default="dense",
                      help="for cpu or vocab-sharded tables, AdamW on the CPU: dense (every owned "
                           "row each step, equal to AdamW) or sparse (touched rows only, per-row "
                           "step counts, weight decay caught up)")

    stem.add_argument("--stem-prefetch", action=argparse.BooleanOptionalAction, default=True,
                      help="cpu/vocab-sharded tables: fetch the next micro-batch's rows in the "
                           "background while the current one computes")
    stem.add_argument("--stem-cpu-threads", type=int, default=0, metavar="N",
                      help="threads of the CPU row kernels (table step, row gather) per rank; 0: "
                           "the cores of the rank's affinity mask / ranks on the node (not "
                           "OMP_NUM_THREADS, which torchrun sets to 1 for several ranks)")
    stem.add_argument("--stem-kernel", choices=KERNELS, default="auto",
                      help="lookup-and-gate: triton = the fused kernel (kernels/stem_gate.py), "
                           "torch = the plain-PyTorch path, auto = triton on a CUDA device")
    stem.add_argument("--stem-dump-tables", default=None, metavar="DIR",
                      help="after training, write each rank's rows of cpu/vocab-sharded tables "
                           "to DIR (inspection and tests)")

    smoe = parser.add_argument_group("megatron-ext StructMoE")
    smoe.add_argument("--structmoe-num-experts", type=int, default=16,
                      help="L: low-rank experts per MLP")
    smoe.add_argument("--structmoe-rank", type=int, default=16, help="r: rank of each expert")
    smoe.add_argument("--structmoe-topk", type=int, default=1, help="k: experts per token")
    smoe.add_argument("--structmoe-fusion", choices=SMOE_FUSIONS, default="additive",
                      help="additive: routed update added before the activation (Eq. 5); "
                           "glu: it multiplies the activated base, as (1 + R)")
    smoe.add_argument("--structmoe-param-matched", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="D'_ff from Eq. 8 so the MLP has the dense MLP's parameters (the "
                           "default unless --structmoe-ffn-hidden-size is given)")
    smoe.add_argument("--structmoe-ffn-hidden-size", type=int, default=None,
                      help="explicit D'_ff (instead of --structmoe-param-matched)")
    smoe.add_argument("--structmoe-init", choices=SMOE_INITS, default="small",
                      help="small: SmallInit for W1', A, B, W_R and DeepNorm-style W2' (Sec. 3.6); "
                           "megatron: Megatron's --init-method-std rules")
    smoe.add_argument("--structmoe-backend", choices=SMOE_BACKENDS, default="auto",
                      help="routed low-rank path: reference (Algorithm 1), grouped "
                           "(torch._grouped_mm), dense-masked, triton (router and codes fused in "
                           "one Triton kernel; CUDA, or TRITON_INTERPRET=1 on CPU); auto: grouped "
                           "on CPU, dense-masked on GPU")
    smoe.add_argument("--structmoe-aux-loss-coeff", type=float, default=0.01,
                      help="coefficient of the Switch load-balancing loss on the router (0: off; "
                           "routing fractions are logged either way)")

    sigma = parser.add_argument_group(
        "megatron-ext Sigma MoE (experts, target top-k and EP are Megatron's --num-experts, "
        "--moe-ffn-hidden-size, --moe-router-topk, --expert-model-parallel-size)")
    sigma.add_argument("--sigma-preset", default=None,
                       help="the older spelling of --preset (sigma_moe_tiny: the report's "
                            "Sigma-MoE-Tiny; sigma_cpu: a small CPU model)")
    sigma.add_argument("--sigma-lbl", choices=SIGMA_LBLS, default="global",
                       help="global: global-batch LBL (Eq. 1); top1: Top-1 LBL (Eqs. 2-4); "
                            "none: no load-balancing loss (statistics are still logged)")
    sigma.add_argument("--sigma-lbl-coeff", type=float, default=1e-3,
                       help="coefficient of the load-balancing loss (the report: 1e-3)")
    sigma.add_argument("--sigma-top1-lbl-temperature", type=float, default=1.0,
                       help="tau of the temperature-scaled softmax of the Top-1 LBL (Eq. 3)")
    sigma.add_argument("--sigma-topk-schedule", default=None,
                       help="top-k of the first layers before --sigma-sparsify-at, e.g. "
                            "\"[8,8,6,6,4,4,2,2]\" (other layers use --moe-router-topk)")
    sigma.add_argument("--sigma-sparsify-at", default=None,
                       help="when every layer switches to --moe-router-topk: a fraction of "
                            "--train-iters (0.9) or a step (1000; steps after it use the target)")
    sigma.add_argument("--sigma-dump-router-grads", default=None, metavar="DIR",
                       help="after each step's gradients are final, rank 0 writes every router's "
                            "weight gradient and global-batch statistics to DIR/step_N.pt "
                            "(inspection and tests)")
    return parser


def sigma_config_from_args(args):
    from megatron_ext.sigma.config import SigmaConfig, parse_sparsify_at, parse_topk_schedule

    if args.model_family != "sigma":
        return None
    return SigmaConfig(
        num_layers=args.num_layers, num_experts=args.num_experts, topk=args.moe_router_topk,
        ep_size=args.expert_model_parallel_size, lbl=args.sigma_lbl,
        lbl_coeff=args.sigma_lbl_coeff, top1_temperature=args.sigma_top1_lbl_temperature,
        topk_schedule=parse_topk_schedule(args.sigma_topk_schedule),
        sparsify_at=parse_sparsify_at(args.sigma_sparsify_at))


def validate_sigma_args(args) -> None:
    """The Sigma layer's fixed choices (Sec. 2 of the report) and a layout that can work."""
    sigma = sigma_config_from_args(args)
    if sigma is None:
        return
    switch = sigma.switch_iteration(args.train_iters)  # a fraction needs --train-iters
    if switch is not None and args.train_iters and switch >= args.train_iters \
            and os.environ.get("RANK", "0") == "0":
        print(f"megatron-ext: warning: --sigma-sparsify-at={args.sigma_sparsify_at} switches to "
              f"the target top-k after step {switch}, at or beyond --train-iters="
              f"{args.train_iters}: the switch will not happen in this run", file=sys.stderr,
              flush=True)
    required = [
        (args.moe_ffn_hidden_size is not None, "--moe-ffn-hidden-size (the expert width)"),
        (args.swiglu, "--swiglu (SwiGLU experts)"),
        (args.normalization == "RMSNorm", "--normalization RMSNorm"),
        (args.qk_layernorm, "--qk-layernorm (QK-norm)"),
        (args.moe_router_pre_softmax, "--moe-router-pre-softmax (top-1 gates must carry the "
                                      "router's gradient)"),
        (args.moe_router_dtype == "fp32", "--moe-router-dtype fp32 (FP32 router)"),
        (args.moe_router_score_function == "softmax", "--moe-router-score-function softmax"),
        (not args.add_bias_linear, "--disable-bias-linear (Sigma layers have no biases)"),
        (args.moe_router_load_balancing_type in ("none", ["none"]),
         "--moe-router-load-balancing-type none (Sigma's --sigma-lbl replaces upstream's losses)"),
        (args.moe_shared_expert_intermediate_size is None,
         "no --moe-shared-expert-intermediate-size (Sigma has no shared expert)"),
        (args.moe_expert_capacity_factor is None, "no --moe-expert-capacity-factor (dropless)"),
    ]
    for ok, flag in required:
        if not ok:
            raise ValueError(f"--model-family=sigma needs {flag}")
    if sigma.topk_schedule is not None and args.moe_token_dispatcher_type == "flex":
        raise ValueError("--sigma-topk-schedule with --moe-token-dispatcher-type flex: the flex "
                         "dispatcher sizes its buffers once for one top-k; use alltoall or "
                         "allgather")
    if sigma.lbl != "none" and sigma.lbl_coeff > 0 and args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss with Sigma's load-balancing loss is not "
                         "supported: drop the flag or pass --sigma-lbl none")


def structmoe_config_from_args(args):
    from megatron_ext.structmoe.config import StructMoEConfig

    if args.model_family != "structmoe":
        return None
    explicit_ffn = args.structmoe_ffn_hidden_size is not None
    if explicit_ffn and args.structmoe_param_matched:
        raise ValueError("--structmoe-param-matched and --structmoe-ffn-hidden-size exclude "
                         "each other: Eq. 8 gives D'_ff, or you give it")
    param_matched = (args.structmoe_param_matched if args.structmoe_param_matched is not None
                     else not explicit_ffn)
    return StructMoEConfig(
        num_experts=args.structmoe_num_experts, rank=args.structmoe_rank,
        topk=args.structmoe_topk, fusion=args.structmoe_fusion,
        param_matched=param_matched,
        ffn_hidden_size=args.structmoe_ffn_hidden_size, init=args.structmoe_init,
        backend=args.structmoe_backend, aux_loss_coeff=args.structmoe_aux_loss_coeff)


def stem_config_from_args(args) -> Optional[StemConfig]:
    if args.model_family != "stem":
        return None
    layers = parse_layers(args.stem_layers) if args.stem_layers else None
    return StemConfig(ratio=args.stem_ratio, layers=layers, variant=args.stem_variant,
                      init=args.stem_init, placement=args.stem_table_placement,
                      sharding=args.stem_table_sharding, ownership=args.stem_row_ownership,
                      optimizer=args.stem_optimizer, prefetch=args.stem_prefetch,
                      kernel=args.stem_kernel, gpu_tier=args.stem_gpu_tier)


def data_manifest_path(args) -> Optional[str]:
    """The explicit --ext-data-manifest, or a data_prep manifest beside a single --data-path."""
    if args.ext_data_manifest:
        return args.ext_data_manifest
    paths = [p for p in (args.data_path or []) if not _is_number(p)]
    if len(paths) == 1:
        candidate = os.path.join(os.path.dirname(os.path.abspath(paths[0])), "manifest.json")
        if os.path.isfile(candidate):
            return candidate
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def validate_extension_args(args, tokenizer_vocab_size: Optional[int] = None) -> None:
    """Checks that need Megatron's parsed args; raise ValueError naming the flag."""
    manifest = data_manifest_path(args)
    if manifest is not None and tokenizer_vocab_size is not None:
        from megatron_ext.training.data_prep import verify_manifest

        verify_manifest(manifest, tokenizer_vocab_size)
    from megatron_ext.models.registry import registered_families

    if args.model_family not in registered_families():
        raise ValueError(f"--model-family={args.model_family}: not available yet in this version "
                         f"(available: {', '.join(registered_families())})")
    smoe = structmoe_config_from_args(args)  # raises for bad --structmoe-* values
    if smoe is not None and smoe.aux_loss_coeff > 0 and args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss with StructMoE's load-balancing loss is not "
                         "supported: drop the flag or pass --structmoe-aux-loss-coeff 0")
    if smoe is not None:
        from megatron_ext.structmoe.routed import check_fused_backend

        check_fused_backend(smoe.backend)  # --structmoe-backend triton where it cannot run
    validate_sigma_args(args)
    stem = stem_config_from_args(args)
    if stem is not None:
        stem.stem_layers(args.num_layers)  # raises for out-of-range layers
        if stem.placement == "tiered":
            from megatron_ext.stem.hot_rows import parse_tier_size

            # The size against the table's rows where they are known (entry point), else its
            # form alone (dry run).
            rows = getattr(args, "padded_vocab_size", None) or tokenizer_vocab_size
            try:
                parse_tier_size(stem.gpu_tier, rows if rows else 2**62)
            except ValueError as exc:
                raise ValueError(f"--stem-gpu-tier: {exc}") from None
        if args.stem_cpu_threads < 0:
            raise ValueError(f"--stem-cpu-threads={args.stem_cpu_threads}: must be >= 0 (0 = "
                             "automatic)")
        if not args.swiglu:
            raise ValueError("--model-family=stem needs a gated activation: pass --swiglu "
                             "(STEM replaces one input of the SwiGLU product)")
        if args.add_bias_linear:
            raise ValueError("--model-family=stem: pass --disable-bias-linear (STEM layers "
                             "have no biases)")
        from megatron_ext_kernels import stem_gate

        stem_gate.resolve(stem.kernel)  # --stem-kernel triton where it cannot run
        if args.recompute_granularity == "selective" and "mlp" in (args.recompute_modules or []):
            raise ValueError("--recompute-modules mlp is not supported with STEM layers; use "
                             "--recompute-granularity full")
        if stem.managed_tables:
            where = (f"--stem-table-placement {stem.placement} --stem-table-sharding "
                     f"{stem.sharding}")
            unsupported = [
                ((args.save is not None or args.load is not None)
                 and args.ckpt_format != "torch_dist",
                 f"--ckpt-format {args.ckpt_format} (their checkpoints are torch_dist)"),
                (args.calculate_per_token_loss, "--calculate-per-token-loss"),
                (args.context_parallel_size > 1, "--context-parallel-size > 1"),
            ]
            for bad, flag in unsupported:
                if bad:
                    raise ValueError(f"{where} does not support {flag} yet; use the default "
                                     "--stem-table-placement gpu --stem-table-sharding replicated")


def drop_unavailable_fusions(args) -> List[str]:
    """Turn off the fused paths whose kernels this machine lacks; returns one line per change.

    Megatron defaults ``--apply-rope-fusion`` and ``--gradient-accumulation-fusion`` on, and
    fails only when the model is built (rope: Transformer Engine) or at the first backward
    (weight-gradient accumulation: Transformer Engine or Apex's ``fused_weight_gradient_mlp_cuda``).
    The plugin runs without those extras, so a GPU run without them falls back to the unfused
    PyTorch paths (the same numbers) instead of failing. Availability is read from the very
    module-level flags Megatron checks (``rope_utils``, ``tensor_parallel.layers``).
    """
    changed = []
    if getattr(args, "apply_rope_fusion", False):
        from megatron.core.models.common.embeddings import rope_utils

        if (rope_utils.fused_apply_rotary_pos_emb is None
                and rope_utils.fused_apply_rotary_pos_emb_thd is None):
            args.apply_rope_fusion = False
            changed.append("rope fusion off (no Transformer Engine): as --no-rope-fusion")
    if getattr(args, "gradient_accumulation_fusion", False):
        from megatron.core.tensor_parallel import layers

        import importlib.util

        # With Transformer Engine its own linear layers fuse the accumulation (and older TE
        # refuses the flag off), so only a machine with neither extra changes.
        if (not layers._grad_accum_fusion_available
                and importlib.util.find_spec("transformer_engine") is None):
            args.gradient_accumulation_fusion = False
            changed.append("gradient-accumulation fusion off (no Transformer Engine or Apex "
                           "fused_weight_gradient_mlp_cuda): as --no-gradient-accumulation-fusion")
    if getattr(args, "masked_softmax_fusion", False):
        import importlib.util

        # Megatron's FusedScaleMaskSoftmax imports this extension (built by Apex or Megatron's
        # own fused_kernels) when the fusion is on.
        if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
            args.masked_softmax_fusion = False
            changed.append("masked-softmax fusion off (no scaled_masked_softmax_cuda extension): "
                           "as --no-masked-softmax-fusion")
    return changed
