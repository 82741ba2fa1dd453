"""Logits of a Megatron checkpoint on given tokens, under any TP/PP/EP layout (for verifying a
conversion against the Hugging Face model).

    torchrun --nproc_per_node=N -m megatron_ext.convert.megatron_logits \\
        --logits-tokens TOKENS.pt --logits-out LOGITS.pt  <the run's Megatron flags> \\
        --load CKPT_DIR [--ckpt-step N]

``TOKENS.pt`` holds an int64 ``[batch, seq]`` tensor (``seq`` = ``--seq-length``); ``LOGITS.pt``
gets the fp32 ``[batch, seq, padded_vocab]`` logits, written by the rank that holds the last
pipeline stage with TP rank 0 and DP rank 0. Uses megatron.training's own initialisation, model
builder (our ``model_provider``), checkpoint loader and pipeline schedule (forward only), so what
it runs is the trained model, not a re-implementation. Sigma layers route with the top-k of the
checkpoint's iteration. A checkpoint saved on the hybrid path (``--hybrid-layer-pattern``) is
evaluated as the ``HybridModel`` it was: its pattern is added when the flags give none (upstream's
loader refuses a hybrid checkpoint in a GPT model).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

# Modules, not their functions: the CPU layer and the checkpoint hooks replace these functions
# after this module is imported (compat/cpu.py, training/checkpoint_hooks.py).
from megatron.training import checkpointing, get_args, initialize
from megatron.training.arguments import parse_and_validate_args
from megatron.training.training import get_model

from megatron_ext.checkpoint_manifest import CheckpointError
from megatron_ext.checkpoint_reader import MegatronCheckpoint
from megatron_ext.compat import cpu, upstream_fixes
from megatron_ext.flags import flag_value, has_flag
from megatron_ext.models.family import FamilyRun
from megatron_ext.models.registry import family_of
from megatron_ext.training.arguments import add_extension_args, drop_unavailable_fusions
from megatron_ext.training.entry import _default_transformer_impl
from megatron_ext.training.model_provider import model_provider
from megatron_ext.training.presets import expand_argv


def _split_argv(argv: Sequence[str]) -> Tuple[str, str, List[str]]:
    own = {"--logits-tokens": None, "--logits-out": None}
    rest, it = [], iter(argv)
    for a in it:
        if a in own:
            own[a] = next(it, None)
        else:
            rest.append(a)
    missing = [k for k, v in own.items() if v is None]
    if missing:
        raise SystemExit(f"megatron_logits: {' and '.join(missing)} required")
    return own["--logits-tokens"], own["--logits-out"], rest


def _checkpoint_pattern(argv: Sequence[str]) -> List[str]:
    """``--hybrid-layer-pattern`` of the checkpoint's run when ``argv`` gives none (``[]`` for a
    GPT-path checkpoint, or one Megatron's loader will report as missing or unreadable)."""
    load, step = flag_value(argv, "--load"), flag_value(argv, "--ckpt-step")
    if load is None or has_flag(argv, "--hybrid-layer-pattern"):
        return []
    try:
        ck = MegatronCheckpoint(load, int(step) if step is not None else None)
    except (CheckpointError, ValueError):
        return []
    pattern = getattr(ck.args, "hybrid_layer_pattern", None)
    return ["--hybrid-layer-pattern", pattern] if pattern else []


def main(argv: Optional[Sequence[str]] = None) -> None:
    tokens_path, out_path, rest = _split_argv(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    cpu.install()
    upstream_fixes.install()

    argv, _ = cpu.default_flags(expand_argv(rest))  # gloo etc. without CUDA, as pretrain
    argv = list(argv) + _checkpoint_pattern(argv)
    sys.argv = [sys.argv[0]] + _default_transformer_impl(argv) + [
        "--no-load-optim", "--no-load-rng", "--exit-on-missing-checkpoint"]

    # megatron.training 0.19 parses the arguments before initialising (as ``pretrain`` callers do).

    with cpu.grouped_gemm_validation():  # --moe-grouped-gemm on the CPU backend: as a training
        drop_unavailable_fusions(parse_and_validate_args(extra_args_provider=add_extension_args))
    initialize.initialize_megatron()
    args = get_args()
    if args.load is None:
        raise SystemExit("megatron_logits: --load CKPT_DIR required")
    # The family's run for this evaluation (STEM's managed tables under the run's own placement
    # flags, Sigma's layers): built with the model, closed at the end.
    family = family_of(args)
    run = family.start_run(args, family.config_from_args(args)) \
        if family.start_run is not None else FamilyRun()
    try:
        return _evaluate(args, run, tokens_path, out_path)
    finally:
        run.close()


def _evaluate(args, run: FamilyRun, tokens_path: str, out_path: str):
    model = get_model(partial(model_provider, run=run), ModelType.encoder_or_decoder,
                      wrap_with_ddp=False)
    iteration, _ = checkpointing.load_checkpoint(model, None, None)
    for m in model:
        m.eval()
    run.at_iteration(model, iteration)  # e.g. Sigma's top-k of the loaded step

    tokens = torch.load(tokens_path).to(torch.int64)
    b, s = tokens.shape
    if s != args.seq_length:
        raise SystemExit(f"megatron_logits: tokens have length {s}, --seq-length is "
                         f"{args.seq_length}")
    device = torch.cuda.current_device()
    tokens = tokens.to(device)
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    captured = []

    def loss_func(output_tensor):
        captured.append(output_tensor.detach())
        zero = output_tensor.sum() * 0.0
        return zero, torch.ones((), dtype=torch.int, device=device), {}

    def forward_step(data_iterator, model_chunk):
        # What the chunk reads beside its inputs, as the training forward step readies it (STEM's
        # managed tables under the run's own placement flags: the tokens' rows fetched from their
        # owners, a collective over the data-parallel group).
        extra = run.bind_tokens(model_chunk, tokens)
        # attention_mask None: causal attention (as in training with the default data flags).
        return model_chunk(tokens, position_ids, None, **extra), loss_func

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([None])] * len(model),
            model=model, num_microbatches=1, seq_length=s, micro_batch_size=b,
            forward_only=True)
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        logits = gather_from_tensor_model_parallel_region(captured[-1].float())
        if mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0 \
                and mpu.get_expert_model_parallel_rank() == 0:
            torch.save(logits.cpu(), out_path)
            print(f"megatron_logits: iteration {iteration}, logits {tuple(logits.shape)} -> "
                  f"{out_path}", flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
