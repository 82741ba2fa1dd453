"""Run under torchrun like ``launch/pretrain.py`` (same flags) plus ``--estimate-out DIR``, or as a
``"module"`` item of a ``tests/dist/multi_config.py`` plan (several in one launch): trains
one step and writes, per rank, what the built model, Megatron's buffers and optimizer really hold,
next to ``planning/estimate.py``'s numbers for this rank's pipeline stage.

Measured on the real objects (captured by wrapping ``megatron.training.training``'s
``setup_model_and_optimizer`` and ``train_step``):

* parameters on this rank (each tensor once) and their bytes; experts (``allreduce == False``)
  apart;
* the bytes of the DDP gradient buffers (``grad_data``), dense and expert;
* the optimizer's state after the step: fp32 master copies and every tensor in ``state``;
* the matmul FLOPs of the whole step (forward and backward), counted by
  ``torch.utils.flop_counter.FlopCounterMode``;
* the activations one micro-batch leaves for backward: the bytes of the distinct storages autograd
  saves during the first forward on this rank (``saved_tensors_hooks``), parameters excluded.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megatron_ext.planning.estimate import rank_estimate
from megatron_ext.planning.layout import Layout
from megatron_ext.planning.model_shape import ModelShape


def main(argv=None) -> None:
    """``argv``: the flags (default: the command line's), as ``tests/dist/multi_config.py``
    passes a plan item's to a module's ``main``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--estimate-out")
    out_dir = argv[i + 1]
    del argv[i:i + 2]
    os.makedirs(out_dir, exist_ok=True)
    captured = {}

    from megatron_ext.compat import cpu

    cpu.install()
    from megatron.training import training

    upstream_setup = training.setup_model_and_optimizer
    upstream_step = training.train_step

    def setup_model_and_optimizer(*args, **kwargs):
        result = upstream_setup(*args, **kwargs)
        captured["model"], captured["optimizer"] = result[0], result[1]
        return result

    def train_step(*args, **kwargs):
        from torch.utils.flop_counter import FlopCounterMode

        params = {p.untyped_storage().data_ptr() for chunk in captured["model"]
                  for p in chunk.parameters()}
        saved = {}
        state = {"forwards": 0}

        def pack(t):
            if state["forwards"] == 0 and isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params and ptr != 0:
                    if os.environ.get("ESTIMATE_CHECK_DEBUG") and ptr not in saved:
                        print("saved", tuple(t.shape), t.dtype, t.untyped_storage().nbytes(),
                              flush=True)
                    saved[ptr] = t.untyped_storage().nbytes()
            return t

        # Count one micro-batch's saved tensors: the first forward on this rank.
        model = captured["model"]
        hooks = []
        for chunk in model:
            hooks.append(chunk.register_forward_hook(
                lambda *a: state.__setitem__("forwards", state["forwards"] + 1)))
        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = upstream_step(*args, **kwargs)
        for h in hooks:
            h.remove()
        captured["flops"] = counter.get_total_flops()
        captured["saved_bytes"] = sum(saved.values())
        return result

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step

    from megatron_ext.training.entry import main as entry_main

    try:
        entry_main(argv)
    finally:  # the next item of a shared launch builds its model unobserved
        training.setup_model_and_optimizer = upstream_setup
        training.train_step = upstream_step

    from megatron.core import parallel_state as mpu
    from megatron.training import get_args

    args = get_args()
    model, optimizer = captured["model"], captured["optimizer"]
    seen, n, experts, weight_bytes = set(), 0, 0, 0
    for chunk in model:
        for p in chunk.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n += p.numel()
            weight_bytes += p.numel() * p.element_size()
            if not getattr(p, "allreduce", True):
                experts += p.numel()
    grad_bytes = 0
    for chunk in model:
        for buf in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            grad_bytes += buf.grad_data.numel() * buf.grad_data.element_size()
    opt_bytes = 0
    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in opts:
        inner = opt.optimizer
        for st in inner.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.numel() > 1:
                    opt_bytes += v.numel() * v.element_size()
        for group in getattr(opt, "fp32_from_float16_groups", []) or []:
            for p in group:
                opt_bytes += p.numel() * p.element_size()
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            for p in group:
                opt_bytes += p.numel() * p.element_size()
    spec, layout = ModelShape.from_args(args), Layout.from_args(args)
    stage = mpu.get_pipeline_model_parallel_rank()
    est = rank_estimate(spec, layout, stage)
    rank = torch.distributed.get_rank()
    record = {
        "rank": rank, "stage": stage, "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "params": n, "expert_params": experts, "weight_bytes": weight_bytes,
        "grad_bytes": grad_bytes, "optimizer_bytes": opt_bytes,
        "step_flops": captured["flops"], "saved_bytes": captured["saved_bytes"],
        "tokens_per_step": args.global_batch_size * args.seq_length,
        "estimate": est,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
