"""StructMoE as a model family (``--model-family structmoe``; the contract:
``models/family.py``): its flags, ``StructMoEConfig`` from them, their checks, the block spec with
``StructMoEMLP`` in every layer (on the hybrid path: in every ``-``), the per-layer budget line,
the aux-loss gradient scale of each micro-batch and the router metrics in the training log."""

from __future__ import annotations

import argparse
from typing import Optional

from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_model_config

from megatron_ext.models import hybrid_specs, saved_settings
from megatron_ext.models.family import Family, FamilyRun
from megatron_ext.models.hybrid_pattern import mlp_block_count
from megatron_ext.models.log import print_rank_0
from megatron_ext.models.specs import block_spec as build
from megatron_ext.models.terms import MLPTerms
from megatron_ext.structmoe.balance import report, set_aux_loss_scale
from megatron_ext.compiled import check_available
from megatron_ext.structmoe.config import BACKENDS as SMOE_BACKENDS
from megatron_ext.structmoe.config import COMPILE_CHOICES as SMOE_COMPILE
from megatron_ext.structmoe.config import FUSIONS as SMOE_FUSIONS
from megatron_ext.structmoe.config import INITS as SMOE_INITS
from megatron_ext.structmoe.config import StructMoEConfig, layer_budget
from megatron_ext.structmoe.routed import check_compile, check_fused_backend, resolve_backend
from megatron_ext.structmoe.specs import structmoe_layer_spec, structmoe_layers_fn

NAME = "structmoe"


def add_args(parser: argparse.ArgumentParser) -> None:
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
    smoe.add_argument("--structmoe-ffn-pad-to", type=int, default=1, metavar="N",
                      help="store D'_ff rounded up to a multiple of N, the extra columns of W1', "
                           "B and W2' zeros that stay zero (the same model; GEMM widths that "
                           "cuBLAS's aligned bf16 kernels take: 6618 is not a multiple of 8); "
                           "1: as it is. Checkpoints hold the stored width")
    smoe.add_argument("--structmoe-init", choices=SMOE_INITS, default="small",
                      help="small: SmallInit for W1', A, B, W_R and DeepNorm-style W2' (Sec. 3.6); "
                           "megatron: Megatron's --init-method-std rules")
    smoe.add_argument("--structmoe-backend", choices=SMOE_BACKENDS, default="auto",
                      help="routed low-rank path: reference (Algorithm 1), grouped "
                           "(torch._grouped_mm), dense-masked, triton (router and codes fused in "
                           "one Triton kernel; CUDA, or TRITON_INTERPRET=1 on CPU); auto: grouped "
                           "on CPU, dense-masked on GPU")
    smoe.add_argument("--structmoe-compile", choices=SMOE_COMPILE, default="none",
                      help="routed: torch.compile the routed path's small ops between the GEMMs "
                           "(router softmax and top-k, dense-masked's gate and masked codes, the "
                           "load-balancing statistics; docs/structmoe.md); none: eager (the "
                           "default until a GPU run measures it)")
    smoe.add_argument("--structmoe-aux-loss-coeff", type=float, default=0.01,
                      help="coefficient of the Switch load-balancing loss on the router (0: off; "
                           "routing fractions are logged either way)")


def config_from_args(args) -> StructMoEConfig:
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
        ffn_pad_to=getattr(args, "structmoe_ffn_pad_to", 1),
        backend=args.structmoe_backend, aux_loss_coeff=args.structmoe_aux_loss_coeff,
        # Absent from the arguments of a checkpoint saved before the flag existed.
        compile=getattr(args, "structmoe_compile", "none"))


def validate_args(args, tokenizer_vocab_size: Optional[int] = None) -> None:
    smoe = config_from_args(args)  # raises for bad --structmoe-* values
    if smoe.aux_loss_coeff > 0 and args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss with StructMoE's load-balancing loss is not "
                         "supported: drop the flag or pass --structmoe-aux-loss-coeff 0")

    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if smoe.ffn_pad_to > 1 and args.ffn_hidden_size is not None:
        stored = layer_budget(smoe, args.hidden_size, args.ffn_hidden_size,
                              bool(args.swiglu)).storage_ffn
        if stored % tp:
            raise ValueError(f"--structmoe-ffn-pad-to={smoe.ffn_pad_to}: StructMoE's D'_ff "
                             f"stored as {stored} is not divisible by "
                             f"--tensor-model-parallel-size={tp}; choose a multiple of it")
    check_fused_backend(smoe.backend)  # --structmoe-backend triton where it cannot run
    if smoe.compile != "none":
        problem = check_compile(resolve_backend(smoe.backend), smoe.compile)
        if problem is not None:
            raise ValueError(problem)
        check_available("--structmoe-compile")


# What changes a StructMoE model on resume (models/saved_settings.py): the shapes of its
# projections and experts, and what a layer computes with them (top-k, fusion). Backend, init
# and the load-balancing coefficient are free.
SETTINGS = (
    saved_settings.FFN,
    ("--structmoe-num-experts", lambda a: a.structmoe_num_experts),
    ("--structmoe-rank", lambda a: a.structmoe_rank),
    ("--structmoe-topk", lambda a: a.structmoe_topk),
    ("--structmoe-fusion", lambda a: a.structmoe_fusion),
    ("StructMoE D'_ff (--structmoe-ffn-hidden-size, or Eq. 8 with --structmoe-param-matched)",
     lambda a: layer_budget(config_from_args(a), a.hidden_size, a.ffn_hidden_size,
                            bool(a.swiglu)).ffn),
    # The tensors' width: a checkpoint saved without padding has the model's D'_ff.
    ("StructMoE D'_ff as stored (--structmoe-ffn-pad-to)",
     lambda a: layer_budget(config_from_args(a), a.hidden_size, a.ffn_hidden_size,
                            bool(a.swiglu)).storage_ffn),
)


def check_checkpoint(chunks, args, smoe: StructMoEConfig, load_dir: str, step: Optional[int],
                     tokenizer_vocab_size: Optional[int]) -> None:
    """The checkpoint's StructMoE model is this run's (``SETTINGS``)."""
    saved_settings.check(load_dir, step, args, SETTINGS)


def block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    return build(config, use_te, structmoe_layers_fn(config_from_args(args)), vp_stage=vp_stage)


def hybrid_stack_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    """The hybrid path: every ``-`` of ``--hybrid-layer-pattern`` is upstream's ``MLPLayer`` with a
    StructMoE MLP, told which MLP block it is (the i-th ``-``) and how many there are, which
    ``config.num_layers`` (every symbol) does not say: the DeepNorm depth and the per-block
    router metrics are those of the GPT path's model with as many layers."""
    smoe = config_from_args(args)
    blocks = mlp_block_count(args)

    def mlp_fn(k, dense):
        return structmoe_layer_spec(dense, smoe, mlp_block=k + 1, num_mlp_blocks=blocks)

    return hybrid_specs.hybrid_stack_spec(config, args.hybrid_layer_pattern, use_te, mlp_fn)


class StructMoERun(FamilyRun):
    """What a StructMoE training does beside the model: the per-layer budget line, the router
    metrics in the log, the aux-loss scale of each micro-batch."""

    def __init__(self, args, smoe: StructMoEConfig):
        self.args, self.smoe = args, smoe

    def model_state(self, model, config) -> None:
        budget = layer_budget(self.smoe, config.hidden_size, config.ffn_hidden_size,
                              bool(config.gated_linear_unit))
        print_rank_0(f"> per layer (Eqs. 7-9): {budget.describe()}")

    def log_report(self, args, iteration, total_loss_dict, writer, wandb_writer) -> None:
        """StructMoE's router metrics each iteration (upstream reports the tracker only for
        models with ``--num-experts``)."""
        report(args, iteration, total_loss_dict, writer, wandb_writer, mlp_block_count(args))

    def before_forward(self, model) -> None:
        """Upstream sets the aux-loss gradient scale only for models with --num-experts."""
        set_aux_loss_scale(get_model_config(model), get_num_microbatches(),
                           self.args.context_parallel_size)


def hf_mlp_layers(args, iteration, gated: bool, refuse) -> list:
    s = config_from_args(args)
    budget = layer_budget(s, args.hidden_size, args.ffn_hidden_size, gated)
    m = {"type": "structmoe", "intermediate_size": budget.ffn, "num_experts": s.num_experts,
         "rank": s.rank, "top_k": s.topk, "fusion": s.fusion}
    if budget.storage_ffn != budget.ffn:
        m["_stored_size"] = budget.storage_ffn  # the export's own: not in the config it writes
    return [dict(m) for _ in range(mlp_block_count(args))]


def hf_structmoe_tensors(plan, i: int, m: dict) -> None:
    """A StructMoE MLP: the dense projections of width D', the router and the LoREs; a
    checkpoint stored wider (``--structmoe-ffn-pad-to``) loses its zero padding."""
    h, f, L, r = plan.desc.hidden, m["intermediate_size"], m["num_experts"], m["rank"]
    stored = m.get("_stored_size", f)
    p = f"model.layers.{i}.mlp."
    plan.fc(i, "mlp.", f, ("gate_proj", "up_proj") if plan.desc.gated else ("up_proj",),
            stored=stored)
    plan.add(p + "router.weight", (L, h), plan.layer(i, ["mlp.router"], (L, h)))
    plan.add(p + "lore_a", (L, h, r), plan.layer(i, ["mlp.lore_a"], (L, h, r)))
    plan.add(p + "lore_b", (L, r, f), plan.unpad(plan.layer(i, ["mlp.lore_b"], (L, r, stored)),
                                                 2, f, f"decoder.layers.{i}.mlp.lore_b"))
    plan.down_proj(i, f, stored=stored)


class StructMoETerms(MLPTerms):
    """StructMoE in the estimate: Eq. 7 of its paper per layer (``m h D' + L r (h + D') + h L``),
    the ``k`` selected LoREs active, Eq. 9's FLOPs."""

    def spec_fields(self, args, smoe) -> dict:
        budget = layer_budget(smoe, args.hidden_size, args.ffn_hidden_size, bool(args.swiglu))
        return dict(smoe_ffn=budget.ffn, smoe_stored_ffn=budget.storage_ffn,
                    smoe_experts=smoe.num_experts, smoe_rank=smoe.rank, smoe_topk=smoe.topk)

    @staticmethod
    def stored(spec) -> int:
        """The tensors' D'_ff: parameters and memory count the zero padding of
        ``--structmoe-ffn-pad-to`` (it is held and saved), FLOPs the model's D'_ff."""
        return spec.smoe_stored_ffn or spec.smoe_ffn

    def mlp_params(self, spec, layer: int, tp: int = 1) -> int:
        h, m = spec.hidden, spec.m
        d, n, r = self.stored(spec), spec.smoe_experts, spec.smoe_rank
        base = m * h * d // tp + (((m - 1) * d // tp + h) if spec.bias else 0)
        return base + n * h + n * h * r + n * r * d // tp  # router and A replicated, B split

    def active_extra(self, spec, layer, topks) -> int:
        h, d, e, r, k = (spec.hidden, self.stored(spec), spec.smoe_experts, spec.smoe_rank,
                         spec.smoe_topk)
        return -(e - k) * r * (h + d)  # the unselected LoREs are not used

    def mlp_flops(self, spec, layer, topks) -> float:
        h, d, n, r, k = (spec.hidden, spec.smoe_ffn, spec.smoe_experts, spec.smoe_rank,
                         spec.smoe_topk)
        return 3.0 * (2 * spec.m * h * d + 2 * h * n + 2 * k * r * (h + d))  # Eq. 9, x3

    def mlp_activation_bytes(self, spec, layout, layer, topks, s, b, sp) -> float:
        d = self.stored(spec) / layout.tp
        return (layout.act_bytes * s * b * d * ((5 if spec.gated else 2) + 1)
                + 4 * s * b * spec.smoe_experts)

    def widths(self, spec):
        if self.stored(spec) != spec.smoe_ffn:  # TP splits the stored width
            return [("StructMoE D'_ff as stored (--structmoe-ffn-pad-to)", self.stored(spec))]
        return [("StructMoE D'_ff (Eq. 8; or --structmoe-ffn-hidden-size)", spec.smoe_ffn)]


FAMILY = Family(NAME, "StructMoE: routed low-rank experts inside the dense MLP", block_spec,
                hybrid_stack_spec=hybrid_stack_spec,
                add_args=add_args, config_from_args=config_from_args,
                validate_args=validate_args, check_checkpoint=check_checkpoint,
                start_run=StructMoERun,
                estimate_terms=StructMoETerms(),
                hf_mlp_layers=hf_mlp_layers, hf_mlp_tensors={"structmoe": hf_structmoe_tensors})
