"""``launch/pretrain.py --dry-run``: what a run would hold, without a process group or a model.

Megatron's own parser and ``validate_args`` read the flags (so a layout Megatron refuses is
refused here too, with its message), for ``--dry-run-world-size`` ranks; the numbers come from
``planning/estimate.py`` (parameters and FLOPs: ``planning/model_shape.py``, the layout rules:
``planning/layout.py``). Without a tokenizer the vocabulary is the preset's (``"tokenizer"`` entry)
or ``--vocab-size``, through Megatron's ``NullTokenizer`` so the padding is Megatron's.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from typing import List, Optional, Sequence

import torch
from megatron.training.arguments import parse_and_validate_args
from megatron.training.global_vars import unset_global_variables

from megatron_ext.compat import cpu
from megatron_ext.flags import flag_value, has_flag
from megatron_ext.models.specs import te_available
from megatron_ext.planning.estimate import LABELS, estimate_from_args
from megatron_ext.training.arguments import add_extension_args, validate_extension_args
from megatron_ext.training.presets import preset_tokenizer


# What the dry run sets in the environment for Megatron's parser, and restores after it.
_DRY_RUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS")


def _without(argv: Sequence[str], flag: str) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


def _cuda() -> bool:
    return torch.cuda.is_available()


def dry_run_argv(argv: Sequence[str], raw_argv: Sequence[str]) -> List[str]:
    """``argv`` with what a dry run needs: a tokenizer (the vocabulary as a NullTokenizer), a
    micro batch (1 unless given), and on a GPU without Transformer Engine the local backend
    the training would fall back to here (``training/entry.py``); without a GPU Megatron's
    default, Transformer Engine, stays (the estimate is for the cluster's run)."""
    argv = list(argv)
    if not has_flag(argv, "--transformer-impl") and _cuda() and not te_available():
        argv += ["--transformer-impl", "local"]
    if not has_flag(argv, "--tokenizer-type"):
        vocab = flag_value(raw_argv, "--vocab-size")
        vocab = int(vocab) if vocab is not None else preset_tokenizer(raw_argv).get("vocab_size")
        if vocab is None:
            raise ValueError("--dry-run needs the vocabulary: give --vocab-size V (the "
                             "tokenizer's vocabulary), a preset with a \"tokenizer\" entry, or "
                             "--tokenizer-type/--tokenizer-model")
        # NullTokenizer adds an end-of-document id: V - 1 gives a V-token vocabulary.
        argv = _without(argv, "--vocab-size") + ["--tokenizer-type", "NullTokenizer",
                                                 "--vocab-size", str(int(vocab) - 1)]
    if not has_flag(argv, "--micro-batch-size"):
        argv += ["--micro-batch-size", "1"]
    return argv


def parse_for_dry_run(argv: Sequence[str], raw_argv: Sequence[str], world_size: int):
    """Megatron's parsed and validated arguments for ``world_size`` ranks (rank 0). The process
    is left as it was found (the environment's rank variables, ``sys.argv``, Megatron's global
    state): a dry run is a function call, so several can run in one process (every preset's:
    tests/test_presets_dry_run.py)."""
    saved_env = {k: os.environ.get(k) for k in _DRY_RUN_ENV}
    saved_argv = sys.argv
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = [sys.argv[0]] + dry_run_argv(argv, raw_argv)
    quiet = logging.getLogger("megatron")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        try:  # validate_args prints every argument: keep the dry run's output to its numbers
            # A dry run on the CPU backend plans for GPUs: --moe-grouped-gemm passes upstream's
            # compute-capability check there, as in a CPU training (cpu.grouped_gemm_validation).
            with contextlib.redirect_stdout(io.StringIO()), cpu.grouped_gemm_validation():
                args = parse_and_validate_args(extra_args_provider=add_extension_args)
        finally:
            quiet.setLevel(level)
        validate_extension_args(args)
    finally:
        # parse_and_validate_args also sets Megatron's globals (args, tokenizer, timers, the
        # micro-batch calculator); nothing of the dry run reads them after this point.
        unset_global_variables()
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return args


def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f} GiB"


def _count(n: float) -> str:
    if n >= 1e9:
        return f"{n:,.0f} ({n / 1e9:.2f}B)"
    return f"{n:,.0f} ({n / 1e6:.2f}M)"


def core_attention_line(core: str, argv: Sequence[str], cuda: bool) -> str:
    """Which core attention the estimate assumed (``Layout.core_attention``) and why, with the
    flag that chooses another: a dry run on a machine without a GPU cannot see the cluster's."""
    if core == "te":
        given = has_flag(argv, "--transformer-impl")
        return ("core attention: Transformer Engine's fused attention (--transformer-impl "
                f"transformer_engine{'' if given else ', Megatron default'}; without Transformer "
                "Engine pass --transformer-impl local, whose --ext-core-attention sdpa keeps no "
                "[b, heads, s, s] scores either)")
    choice = flag_value(argv, "--ext-core-attention") or "auto"
    what = {"sdpa": "PyTorch's fused scaled_dot_product_attention, no [b, heads, s, s] scores",
            "unfused": "Megatron's DotProductAttention, [b, heads, s, s] scores kept"}[core]
    if choice != "auto":
        why = f"--ext-core-attention {choice}"
    elif core == "sdpa":
        why = "--ext-core-attention auto on this GPU without Transformer Engine"
    elif cuda:
        why = "--ext-core-attention auto beside Transformer Engine"
    else:
        why = ("--ext-core-attention auto on a machine without a GPU, as a run here builds it; "
               "a GPU without Transformer Engine builds sdpa: pass --ext-core-attention sdpa "
               "to estimate that run")
    return f"core attention: {core} ({what}; {why})"


def report(est, preset: Optional[str], attention: Optional[str] = None) -> str:
    m, lay = est.model, est.layout
    head = f"{m.family}" + (f" (preset {preset})" if preset else "")
    lines = [
        f"megatron-ext dry run: {head}, {lay.world_size} ranks = TP {lay.tp} x PP {lay.pp} x "
        f"CP {lay.cp} x DP {lay.dp} (EP {lay.ep}, expert TP {lay.etp}); micro batch "
        f"{lay.micro_batch}, global batch {lay.global_batch} ({lay.microbatches} micro-batches "
        f"per step per DP rank), sequence {m.seq_length}, vocabulary {m.vocab:,} (padded)",
    ]
    if attention:
        lines.append(attention)
    if m.hybrid_layer_pattern:  # the hybrid path: the pattern's blocks, not --num-layers
        lines.append(f"hybrid path: --hybrid-layer-pattern {m.hybrid_layer_pattern!r}: "
                     f"{m.attention_layers} attention blocks, {m.num_layers} MLP blocks")
    lines += [
        "parameters",
        f"  total                          {_count(est.total_params)}",
    ]
    if est.stem_table_params:
        lines.append(f"    of which STEM tables         {_count(est.stem_table_params)}")
    lines.append(f"  active per token               {_count(est.active_params)}")
    lines.append(f"    without embedding/output     {_count(est.active_params_without_embeddings)}")
    if est.active_params_target != est.active_params:
        drop = est.active_params - est.active_params_target
        lines.append(f"  active after the top-k switch  {_count(est.active_params_target)} "
                     f"(without embedding/output "
                     f"{_count(est.active_params_without_embeddings - drop)})")
    lines += [
        f"  paper-style active (Table 3)   {_count(est.paper_active_params)} (whole input "
        "embedding counted)",
        "training FLOPs per token (forward + backward)",
        f"  total                          {est.flops['total']:.4g}  (attention linear "
        f"{est.flops['attention_linear']:.3g}, attention core {est.flops['attention_core']:.3g}, "
        f"MLP {est.flops['mlp']:.3g}, output layer {est.flops['output_layer']:.3g})",
    ]
    if est.flops_target["total"] != est.flops["total"]:
        lines.append(f"  after the top-k switch         {est.flops_target['total']:.4g}")
    lines += [
        f"  paper ROI denominator          {est.paper_gflops_per_token:.3f} GFLOPs per token "
        "(2 x paper-style active parameters, STEM Table 3)",
        f"memory per rank (busiest: pipeline stage {est.busiest_stage}, TP rank 0; "
        f"{_count(sum(est.rank_params.values()))} parameters on it)",
    ]
    for key, value in est.gpu_bytes.items():
        lines.append(f"  GPU   {LABELS.get(key, key):34s} {_gib(value)}")
    lines.append(f"  GPU   {'total':34s} {_gib(sum(est.gpu_bytes.values()))}  (plus CUDA "
                 "context, NCCL and allocator slack: budget 2-5 GiB)")
    for key, value in est.host_bytes.items():
        lines.append(f"  host  {LABELS.get(key, key):34s} {_gib(value)}")
    if est.host_bytes:
        lines.append(f"  host  {'total':34s} {_gib(sum(est.host_bytes.values()))}")
    for note in est.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(argv: Sequence[str], raw_argv: Sequence[str]) -> int:
    size = flag_value(argv, "--dry-run-world-size") or os.environ.get("WORLD_SIZE") or "1"
    try:
        world_size = int(size)
        if world_size < 1:
            raise ValueError
    except ValueError:
        print(f"megatron-ext: --dry-run-world-size={size}: must be an integer >= 1",
              file=sys.stderr)
        return 2
    try:
        args = parse_for_dry_run(argv, raw_argv, world_size)
        est = estimate_from_args(args, world_size)
    except (ValueError, AssertionError) as exc:
        print(f"megatron-ext: --dry-run: {exc}", file=sys.stderr)
        return 2
    preset = flag_value(raw_argv, "--preset") or flag_value(raw_argv, "--sigma-preset")
    attention = core_attention_line(est.layout.core_attention, dry_run_argv(argv, raw_argv),
                                    _cuda())
    print(report(est, preset, attention), flush=True)
    if args.dry_run_json:
        path = args.dry_run_json
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(est.as_dict(), preset=preset, core_attention=attention), f, indent=2)
        os.replace(tmp, path)
    return 0
