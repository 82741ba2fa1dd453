"""Our command-line flags, added to Megatron's parser through ``extra_args_provider``.

Every Megatron flag keeps working. The generic flags are here; each family adds its own group
(its folder's ``family.py``, ``models/family.py``), which maps 1:1 onto its option dataclass.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
from typing import List, Optional

from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers
from megatron.training.arguments import add_megatron_arguments

from megatron_ext.data_manifest import verify_manifest
from megatron_ext.models.hybrid_pattern import check_family_symbols
from megatron_ext.models.registry import families, family_of, registered_families
from megatron_ext.models.specs import CORE_ATTENTION_CHOICES, te_available
from megatron_ext.training.adam_impl import CHOICES as ADAM_CHOICES
from megatron_ext.training.cross_entropy import CHOICES as CROSS_ENTROPY_CHOICES
from megatron_ext.training.rope import CHOICES as ROPE_CHOICES


def add_extension_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron-ext")
    group.add_argument("--model-family", choices=registered_families(), default="gpt",
                       help="; ".join(f"{f.name}: {f.description}"
                                      for f in families()).replace("%", "%%"))
    group.add_argument("--ext-plugin", action="append", default=[], metavar="MODULE",
                       help="import MODULE before the flags are parsed: it registers model "
                            "families of its own (megatron_ext.models.registry.register_family)")
    group.add_argument("--ext-data-manifest", default=None,
                       help="manifest.json written by megatron_ext.tools.data_prep; checked "
                            "against the tokenizer at start-up (found automatically next to a "
                            "--data-path prefix)")
    group.add_argument("--no-verify-checkpoint", action="store_true",
                       help="load --load's checkpoint without checking its files against the "
                            "checksum manifest written beside it at save time")
    group.add_argument("--ext-allow-fresh-start", action="store_true",
                       help="start from scratch when --load holds no complete checkpoint (an "
                            "unfinished save, or nothing) instead of refusing to start; an "
                            "empty or missing --load that is also --save starts fresh anyway")
    group.add_argument("--ext-core-attention", choices=CORE_ATTENTION_CHOICES, default="auto",
                       help="core attention of --transformer-impl local: sdpa (PyTorch's fused "
                            "scaled_dot_product_attention, no [b, heads, s, s] scores; refuses "
                            "context parallelism and window attention), unfused (Megatron's "
                            "DotProductAttention); auto: sdpa on a GPU without "
                            "Transformer Engine, unfused otherwise")

    group.add_argument("--ext-adam-impl", choices=ADAM_CHOICES, default="auto",
                       help="torch's AdamW implementation when Megatron has neither Transformer "
                            "Engine's nor Apex's FusedAdam: fused (one pass over parameters and "
                            "states per step), foreach (torch's default on CUDA); auto: fused "
                            "when every parameter is on a GPU, foreach otherwise")

    group.add_argument("--ext-cross-entropy", choices=CROSS_ENTROPY_CHOICES, default="auto",
                       help="the loss's vocab-parallel cross entropy without "
                            "--cross-entropy-loss-fusion: fused (Triton: no fp32 copy of the "
                            "logits), upstream (Megatron's); auto: upstream's until a GPU run "
                            "has measured the fused one")

    group.add_argument("--ext-rope", choices=ROPE_CHOICES, default="auto",
                       help="the attention's rotary position embedding when Megatron's rope "
                            "fusion is off (no Transformer Engine): fused (one Triton kernel "
                            "each way), upstream (Megatron's unfused ops); auto: upstream's "
                            "until a GPU run has measured the fused one")

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
    launch.add_argument("--ext-profile-all-threads", action="store_true",
                        help="with --profile --use-pytorch-profiler: the trace records every "
                             "thread (the STEM tables' worker too) and, on a GPU, CUDA's stream "
                             "waits and synchronisations (PyTorch's experimental profiler "
                             "options; megatron_ext/training/profiler.py)")

    for family in families():  # each family's own group (its folder's family.py)
        if family.add_args is not None:
            family.add_args(parser)
    return parser


def parse_error_line(usage_and_error: str) -> str:
    """argparse's complaint (the usage, then ``PROG: error: MESSAGE``) as one line: the message,
    with the closest flag for each unknown one (argparse 3.12 suggests none)."""
    lines = [ln for ln in usage_and_error.strip().splitlines() if ln.strip()]
    message = lines[-1].split(": error: ", 1)[-1] if lines else "the flags could not be parsed"
    head, sep, rest = message.partition("unrecognized arguments: ")
    if sep:
        known = known_flags()
        hints = []
        for flag in (word.split("=", 1)[0] for word in rest.split()):
            if not flag.startswith("--"):  # a value of the unknown flag
                continue
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
            if close:
                hints.append((flag, close[0]))
        if len(hints) == 1:
            message += f" (did you mean {hints[0][1]}?)"
        elif hints:
            message += " (" + "; ".join(f"{a}: did you mean {b}?" for a, b in hints) + ")"
    return message + "; launch/pretrain.py --help lists every flag"


def known_flags() -> List[str]:
    """Every flag of the entry point's parser: Megatron's and this plugin's."""
    parser = add_extension_args(add_megatron_arguments(
        argparse.ArgumentParser(allow_abbrev=False)))
    return sorted({s for action in parser._actions for s in action.option_strings
                   if s.startswith("--")})


def check_family_args(args) -> None:
    """The family's checks before Megatron validates the flags (a message naming our flag
    rather than one of Megatron's assertions)."""
    family = family_of(args)
    if getattr(args, "hybrid_layer_pattern", None) and family.hybrid_stack_spec is None:
        raise ValueError(f"--hybrid-layer-pattern: --model-family {args.model_family} does not "
                         "build on the hybrid path yet (docs/hybrid.md); drop "
                         "--hybrid-layer-pattern to build it on the GPT path")
    if getattr(args, "hybrid_layer_pattern", None):
        check_family_symbols(args.hybrid_layer_pattern, family.name, family.hybrid_symbols)
    if family.check_args is not None:
        family.check_args(args)


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
        verify_manifest(manifest, tokenizer_vocab_size)
    if args.model_family not in registered_families():
        raise ValueError(f"--model-family={args.model_family}: not available yet in this version "
                         f"(available: {', '.join(registered_families())})")
    family = family_of(args)
    if family.validate_args is not None:
        family.validate_args(args, tokenizer_vocab_size)


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
        if (rope_utils.fused_apply_rotary_pos_emb is None
                and rope_utils.fused_apply_rotary_pos_emb_thd is None):
            args.apply_rope_fusion = False
            changed.append("rope fusion off (no Transformer Engine): as --no-rope-fusion")
    if getattr(args, "gradient_accumulation_fusion", False):
        # With Transformer Engine its own linear layers fuse the accumulation (and older TE
        # refuses the flag off), so only a machine with neither extra changes; an installed TE
        # that does not import counts as none (the local backend trains).
        if not layers._grad_accum_fusion_available and not te_available():
            args.gradient_accumulation_fusion = False
            changed.append("gradient-accumulation fusion off (no Transformer Engine or Apex "
                           "fused_weight_gradient_mlp_cuda): as --no-gradient-accumulation-fusion")
    if getattr(args, "masked_softmax_fusion", False):
        # Megatron's FusedScaleMaskSoftmax imports this extension (built by Apex or Megatron's
        # own fused_kernels) when the fusion is on.
        if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
            args.masked_softmax_fusion = False
            changed.append("masked-softmax fusion off (no scaled_masked_softmax_cuda extension): "
                           "as --no-masked-softmax-fusion")
    return changed
