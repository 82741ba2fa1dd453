"""Sigma MoE as a model family (``--model-family sigma``; the contract: ``models/family.py``): its
flags and the fixed flags it implies, ``SigmaConfig`` from them, the checks of the Sigma layer's
fixed choices, the block spec with ``SigmaMoELayer`` in every layer (on the hybrid path: every
``E`` of ``--hybrid-layer-pattern``), the router statistics closed at each global batch, and
progressive sparsification (every layer's top-k set before each micro-batch, and after a
checkpoint is loaded for evaluation).

Sigma's layers are its MoE blocks: GPT layer ``l`` on the GPT path, the ``l``-th ``E`` of the
pattern on the hybrid path (``mlp_block_count``), whatever stands between the ``E`` symbols; the
top-k schedule, the per-layer logs and ``SigmaMoELayer.layer_index`` count them so."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

from megatron_ext.models import hybrid_specs, saved_settings
from megatron_ext.models.family import Family, FamilyRun
from megatron_ext.models.fused_layout import split_gated_fc1
from megatron_ext.models.hybrid_pattern import main_pattern, mlp_block_count
from megatron_ext.models.log import print_rank_0
from megatron_ext.models.terms import MLPTerms
from megatron_ext.sigma import monitor
from megatron_ext.sigma.budget import SigmaBudget
from megatron_ext.compiled import check_available
from megatron_ext.sigma.config import COMPILE_CHOICES as SIGMA_COMPILE
from megatron_ext.sigma.config import LBLS as SIGMA_LBLS
from megatron_ext.sigma.config import SigmaConfig, parse_sparsify_at, parse_topk_schedule
from megatron_ext.sigma.layer import release_layers
from megatron_ext.sigma.monitor import report
from megatron_ext.sigma.presets import FAMILY_FLAGS
from megatron_ext.sigma.router import sigma_compile_problem
from megatron_ext.sigma.schedule import apply_schedule, sigma_layers
from megatron_ext.sigma.specs import sigma_block_spec, sigma_layer_spec

NAME = "sigma"


def add_args(parser: argparse.ArgumentParser) -> None:
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
    sigma.add_argument("--sigma-compile", choices=SIGMA_COMPILE, default="none",
                       help="router: torch.compile the router's top-k routing with Sigma's "
                            "statistics and load-balancing loss (docs/sigma.md); none: eager "
                            "(the default until a GPU run measures it)")
    sigma.add_argument("--sigma-dump-router-grads", default=None, metavar="DIR",
                       help="after each step's gradients are final, rank 0 writes every router's "
                            "weight gradient and global-batch statistics to DIR/step_N.pt "
                            "(inspection and tests)")


def config_from_args(args) -> SigmaConfig:
    return SigmaConfig(
        num_layers=mlp_block_count(args), num_experts=args.num_experts, topk=args.moe_router_topk,
        ep_size=args.expert_model_parallel_size, lbl=args.sigma_lbl,
        lbl_coeff=args.sigma_lbl_coeff, top1_temperature=args.sigma_top1_lbl_temperature,
        topk_schedule=parse_topk_schedule(args.sigma_topk_schedule),
        sparsify_at=parse_sparsify_at(args.sigma_sparsify_at),
        # Absent from the arguments of a checkpoint saved before the flag existed.
        compile=getattr(args, "sigma_compile", "none"))


@functools.lru_cache(maxsize=None)  # each distinct line once per process
def _say_once(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_args(args) -> None:
    """The Sigma layer's fixed choices (Sec. 2 of the report) and a layout that can work."""
    sigma = config_from_args(args)
    # A fraction needs --train-iters to train; a dry run trains nothing, and its numbers (before
    # and after the switch) do not depend on when the switch comes.
    switch = None if getattr(args, "dry_run", False) and not args.train_iters else \
        sigma.switch_iteration(args.train_iters)
    if switch is not None and args.train_iters and switch >= args.train_iters \
            and os.environ.get("RANK", "0") == "0":
        warning = (f"megatron-ext: warning: --sigma-sparsify-at={args.sigma_sparsify_at} switches "
                   f"to the target top-k after step {switch}, at or beyond --train-iters="
                   f"{args.train_iters}: the switch will not happen in this run")
        _say_once(warning)  # the entry point checks before and after Megatron's checks
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
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        # A Sigma layer is one attention and one MoE layer (the budget and the GPT-path
        # checkpoint pairing count them so); every FFN is an MoE (no dense '-').
        layers = main_pattern(pattern)
        if (set(layers) != {Symbols.ATTENTION, Symbols.MOE}
                or layers.count(Symbols.ATTENTION) != layers.count(Symbols.MOE)
                or parse_hybrid_pattern(pattern).mtp_num_depths):
            raise ValueError(f"--hybrid-layer-pattern {pattern!r}: a Sigma layer is one attention "
                             "layer (*) and one MoE layer (E; every FFN an MoE, no -): give only "
                             "* and E, as many of each, without MTP depths (e.g. '*E*E*E*E')")
    if sigma.topk_schedule is not None and args.moe_token_dispatcher_type == "flex":
        raise ValueError("--sigma-topk-schedule with --moe-token-dispatcher-type flex: the flex "
                         "dispatcher sizes its buffers once for one top-k; use alltoall or "
                         "allgather")
    if sigma.compile != "none":
        problem = sigma_compile_problem(sigma.compile, args)
        if problem is not None:
            raise ValueError(problem)
        check_available("--sigma-compile")
    if sigma.lbl != "none" and sigma.lbl_coeff > 0 and args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss with Sigma's load-balancing loss is not "
                         "supported: drop the flag or pass --sigma-lbl none")


def validate_args(args, tokenizer_vocab_size: Optional[int] = None) -> None:
    check_args(args)


# What changes a Sigma model on resume (models/saved_settings.py): its experts' number and width,
# and the top-k every layer routes with in the end. The load-balancing loss, the top-k schedule of
# training (--sigma-topk-schedule, --sigma-sparsify-at) and expert parallelism are free.
SETTINGS = (
    ("--num-experts", lambda a: a.num_experts),
    ("--moe-ffn-hidden-size", lambda a: a.moe_ffn_hidden_size),
    ("--moe-router-topk", lambda a: a.moe_router_topk),
)


def check_checkpoint(chunks, args, sigma: SigmaConfig, load_dir: str, step: Optional[int],
                     tokenizer_vocab_size: Optional[int]) -> None:
    """The checkpoint's Sigma model is this run's (``SETTINGS``)."""
    saved_settings.check(load_dir, step, args, SETTINGS)


def block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    return sigma_block_spec(config, config_from_args(args), use_te, vp_stage=vp_stage)


def hybrid_stack_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    """The hybrid path: the ``k``-th ``E`` of ``--hybrid-layer-pattern`` is Sigma layer ``k``
    (its top-k from the schedule, its logs), whatever its pattern position."""
    sigma = config_from_args(args)
    return hybrid_specs.hybrid_stack_spec(
        config, args.hybrid_layer_pattern, use_te,
        moe_fn=lambda k, moe: sigma_layer_spec(moe, sigma, k))


class SigmaRun(FamilyRun):
    """What a Sigma training (or evaluation) does beside the model: each chunk's Sigma layers,
    whose top-k the schedule sets every step, the routers' global-batch close at each step, the
    load-balance report; ``close`` drops the finished model's routers and layers' graphs."""

    def __init__(self, args, sigma: SigmaConfig):
        self.args, self.sigma = args, sigma
        self.layers = {}  # the chunk (unwrapped) -> its Sigma layers

    def model_state(self, model, config) -> None:
        """The chunk's Sigma layers, and the routers' global-batch close at each step (the
        finalize function)."""
        args, sigma = self.args, self.sigma
        # Sigma's layer count, not config.num_layers (on the hybrid path every symbol counts).
        budget = SigmaBudget.from_config(config, args.padded_vocab_size,
                                         tied=not args.untie_embeddings_and_output_weights,
                                         num_layers=sigma.num_layers)
        print_rank_0(f"> {budget.describe(sigma.target_topks(), sigma.initial_topks())}")
        print_rank_0(f"> Sigma top-k per layer: {list(sigma.initial_topks())}, after step "
                     f"{sigma.switch_iteration(args.train_iters)}: {list(sigma.target_topks())}"
                     if sigma.topk_schedule else
                     f"> Sigma top-k per layer: {list(sigma.target_topks())}")
        self.layers[model] = sigma_layers(model)
        # Close each global batch in the routers once its gradients are final (megatron.training
        # keeps a finalize function the model builder set).
        config.finalize_model_grads_func = functools.partial(monitor.finalize_model_grads,
                                                             ext_args=args)

    def routers(self) -> list:
        """The routers of this rank's Sigma layers, by layer."""
        return sorted((layer.router for layers in self.layers.values() for layer in layers),
                      key=lambda r: r.layer_index)

    def log_report(self, args, iteration, total_loss_dict, writer, wandb_writer) -> None:
        """Per-layer load balance and LBL values each iteration."""
        report(args, iteration, total_loss_dict, writer, wandb_writer, self.routers())

    def before_forward(self, model) -> None:
        """Progressive sparsification: every layer's top-k for this step (a function of the
        step)."""
        apply_schedule(self.layers[inner_model(model)], self.sigma, self.args.curr_iteration,
                       self.args.train_iters)

    def at_iteration(self, chunks, iteration: Optional[int]) -> None:
        """A checkpoint of ``iteration`` loaded for evaluation: the top-k of that step."""
        for m in chunks:
            apply_schedule(self.layers[inner_model(m)], self.sigma, iteration,
                           self.args.train_iters)

    def close(self) -> None:
        """Back to a fresh process's state: the finished model's layers' last autograd graphs
        dropped (``layer.release_layers``) and the layers let go."""
        release_layers([layer for layers in self.layers.values() for layer in layers])
        self.layers.clear()


def inner_model(model):
    """The model inside Megatron's wrappers (DDP, Float16Module, and Megatron-FSDP's two levels:
    ``FullyShardedDataParallel`` holds a ``MegatronFSDP``, which holds the model, where
    ``megatron.core.utils.unwrap_model`` stops at the ``MegatronFSDP``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def hf_mlp_layers(args, iteration, gated: bool, refuse) -> list:
    sigma = config_from_args(args)
    # The top-k every layer routes with at this iteration (progressive sparsification).
    topks = sigma.topks_at(iteration or 0, getattr(args, "train_iters", None))
    refuse(bool(getattr(args, "moe_router_enable_expert_bias", False)),
           "--moe-router-enable-expert-bias is not supported")
    refuse(getattr(args, "moe_shared_expert_intermediate_size", None) is not None,
           "shared experts are not supported")
    return [{"type": "moe", "num_experts": args.num_experts, "top_k": int(topks[i]),
             "intermediate_size": args.moe_ffn_hidden_size} for i in range(mlp_block_count(args))]


def hf_moe_tensors(plan, i: int, m: dict) -> None:
    """An MoE layer (upstream's layout: the router and the experts' stacked fc1/fc2) as
    Qwen3-MoE's gate and per-expert projections."""
    h, f, E = plan.desc.hidden, m["intermediate_size"], m["num_experts"]
    p = f"model.layers.{i}.mlp."
    plan.add(p + "gate.weight", (E, h), plan.layer(i, ["mlp.router.weight"], (E, h)))
    fc1 = plan.layer(i, ["mlp.experts.experts.linear_fc1.weight"], (E, 2 * f, h))
    fc2 = plan.layer(i, ["mlp.experts.experts.linear_fc2.weight"], (E, h, f))
    for e in range(E):
        q = p + f"experts.{e}."
        if fc1 is not None:
            fn = lambda t: [part for w in t for part in split_gated_fc1(w)]  # noqa: E731
            plan.add(q + "gate_proj.weight", (f, h),
                     plan.split((i, "experts_fc1"), fc1, fn, 2 * e))
            plan.add(q + "up_proj.weight", (f, h),
                     plan.split((i, "experts_fc1"), fc1, fn, 2 * e + 1))
        if fc2 is not None:
            plan.add(q + "down_proj.weight", (h, f),
                     plan.split((i, "experts_fc2"), fc2, lambda t: list(t), e))


class SigmaTerms(MLPTerms):
    """Sigma in the estimate: no dense MLP; per layer a router ``E h`` and ``E`` SwiGLU experts
    ``3 h F`` (split over EP and expert-TP), the ``k_l`` selected experts active in layer ``l``."""

    def check(self, spec) -> None:
        if len(spec.topks) != spec.num_layers:
            raise ValueError(f"{len(spec.topks)} top-k values for {spec.num_layers} layers")

    def spec_fields(self, args, sigma) -> dict:
        if not args.train_iters and isinstance(sigma.sparsify_at, float):
            # A dry run without --train-iters: a fraction of training (in (0, 1]) switches after
            # step 0 whatever the length, so training starts with the schedule's top-k.
            start = sigma.initial_topks()
        else:
            start = sigma.topks_at(0, args.train_iters)
        return dict(experts=args.num_experts, expert_ffn=args.moe_ffn_hidden_size,
                    topks=tuple(start),
                    target_topks=tuple(sigma.target_topks()))

    def layout_fields(self, args, sigma) -> dict:
        return dict(etp=args.expert_tensor_parallel_size or 1)

    def mlp_params(self, spec, layer: int, tp: int = 1) -> int:
        return 0

    def add_layer_parts(self, spec, layer, parts, tp, ep, etp, managed_tables) -> None:
        parts.routers += spec.experts * spec.hidden
        parts.experts += (spec.experts // ep) * 3 * spec.hidden * spec.expert_ffn // etp

    def active_extra(self, spec, layer, topks) -> int:
        return spec.experts * spec.hidden + topks[layer] * 3 * spec.hidden * spec.expert_ffn

    def mlp_flops(self, spec, layer, topks) -> float:
        return 6.0 * (spec.experts * spec.hidden
                      + topks[layer] * 3 * spec.hidden * spec.expert_ffn)

    def mlp_activation_bytes(self, spec, layout, layer, topks, s, b, sp) -> float:
        k = topks[layer]
        return (4 * 2 * s * b * spec.experts / sp
                + layout.act_bytes * k * (s * b / sp)
                * (2 * spec.hidden + 5 * spec.expert_ffn / layout.etp))

    def check_layout(self, spec, layout) -> None:
        if spec.experts % layout.ep:
            raise ValueError(f"--num-experts={spec.experts} is not divisible by the "
                             f"expert-parallel size {layout.ep}")

    def topks_at(self, args, sigma, completed_iterations: int):
        return sigma.topks_at(completed_iterations, args.train_iters)


FAMILY = Family(NAME, "Sigma MoE: every layer MoE, top-1, global-batch LBL", block_spec,
                hybrid_stack_spec=hybrid_stack_spec, hybrid_symbols="*E", add_args=add_args,
                config_from_args=config_from_args, default_flags=FAMILY_FLAGS,
                check_args=check_args, validate_args=validate_args,
                check_checkpoint=check_checkpoint, start_run=SigmaRun,
                estimate_terms=SigmaTerms(),
                hf_mlp_layers=hf_mlp_layers, hf_mlp_tensors={"moe": hf_moe_tensors})
