"""Batch function: every pipeline stage that holds token-indexed layers receives the tokens.

Megatron's GPT batch function (``megatron.core.utils.get_batch_on_this_tp_rank``) gives tokens only
to the first pipeline stage and labels only to the last. A stage in the middle that holds a STEM
layer needs the ids too, so this function broadcasts the batch from TP rank 0 to the TP group on
every stage that asks for it, then slices it for context parallelism with upstream's
``get_batch_on_this_cp_rank``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_batch_on_this_cp_rank

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
           "position_ids": torch.int64, "attention_mask": torch.bool}


def stage_needs_batch(vp_stage: Optional[int], token_layers_here: bool) -> bool:
    ignore_virtual = vp_stage is None
    first = mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    return first or last or token_layers_here


class HostTokenGroup:
    """A gloo copy of this rank's tensor-parallel group, over which TP rank 0 sends the tokens'
    host copy to its peers (``broadcast_batch``), so that no TP rank reads the GPU's copy back
    (which waits for every queued kernel). Megatron keeps gloo copies of the data-parallel groups
    only. One per training (the trainer's session owns it and closes it)."""

    def __init__(self):
        self.tp_group = None  # Megatron's group it copies
        self.group = None

    def make(self) -> None:
        """Collective over every rank: each calls it once per training, after Megatron made its
        groups and before the first batch (the model provider does, for families that read
        host tokens). Nothing with one TP rank, or when made already for Megatron's group."""
        tp_group = mpu.get_tensor_model_parallel_group()
        if mpu.get_tensor_model_parallel_world_size() == 1 or self.tp_group is tp_group:
            return
        self.close()
        dist = torch.distributed
        mine = dist.get_process_group_ranks(tp_group)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rank = dist.get_rank()
        for ranks in sorted({tuple(r) for r in every}):  # the same order on every rank
            group = dist.new_group(list(ranks), backend="gloo")
            if rank in ranks:
                self.tp_group, self.group = tp_group, group

    def of(self, tp_group):
        """The copy of ``tp_group`` (Megatron's current group), or None when not made for it."""
        return self.group if self.tp_group is tp_group else None

    def close(self) -> None:
        """Destroy the copy (a training's end: the next one makes its own)."""
        group, self.tp_group, self.group = self.group, None, None
        if group is not None:
            torch.distributed.destroy_process_group(group)


def broadcast_batch(data_iterator, micro_batch_size: int, seq_length: int,
                    with_attention_mask: bool, host_tokens: bool = False,
                    host_group: Optional[HostTokenGroup] = None) -> Dict[str, torch.Tensor]:
    """TP rank 0 reads the next sample batch; the other TP ranks receive it. The batch's
    ``host_tokens`` are the tokens on the host: TP rank 0's from the data loader; with
    ``host_tokens`` the other TP ranks receive them over the gloo TP group when there is one
    (``host_group``, made by the model provider), else they have None."""
    keys = KEYS + (("attention_mask",) if with_attention_mask else ())
    group = mpu.get_tensor_model_parallel_group()
    src = mpu.get_tensor_model_parallel_src_rank()
    device = torch.cuda.current_device()
    if mpu.get_tensor_model_parallel_rank() == 0:
        if data_iterator is None:
            raise RuntimeError("TP rank 0 of a stage that needs data has no data iterator")
        data = next(data_iterator)
        batch = {k: data[k].to(device=device, dtype=_DTYPES[k], non_blocking=True) for k in keys}
        # The ids as the data loader gave them, on the host: what token-indexed tables route
        # without reading the GPU copy back (which would wait for every queued kernel).
        batch["host_tokens"] = data["tokens"].to(torch.int64).contiguous()
    else:
        shapes = {k: (micro_batch_size, seq_length) for k in KEYS}
        shapes["attention_mask"] = (micro_batch_size, 1, seq_length, seq_length)
        batch = {k: torch.empty(shapes[k], dtype=_DTYPES[k], device=device) for k in keys}
        batch["host_tokens"] = None  # received below when asked for (over the gloo TP group)
    if mpu.get_tensor_model_parallel_world_size() > 1:
        for k in keys:
            torch.distributed.broadcast(batch[k], src, group=group)
        host_group = host_group.of(group) if host_group is not None else None
        if host_tokens and host_group is not None:
            if batch["host_tokens"] is None:
                batch["host_tokens"] = torch.empty(micro_batch_size, seq_length,
                                                   dtype=torch.int64)
            torch.distributed.broadcast(batch["host_tokens"], src, group=host_group)
    if not with_attention_mask:
        batch["attention_mask"] = None
    return batch


def get_batch(data_iterator, args, vp_stage: Optional[int] = None,
              token_layers_here: bool = False, host_tokens: bool = False,
              host_group: Optional[HostTokenGroup] = None):
    """Returns ``tokens, labels, loss_mask, attention_mask, position_ids`` for this rank, and with
    ``host_tokens`` a sixth item: the tokens on the host where this rank has them without
    waiting for the GPU (TP rank 0, and the other TP ranks over ``host_group`` once made; not
    with context parallelism), else None."""
    if not stage_needs_batch(vp_stage, token_layers_here):
        return (None,) * (6 if host_tokens else 5)
    batch = broadcast_batch(data_iterator, args.micro_batch_size, args.seq_length,
                            args.create_attention_mask_in_dataloader, host_tokens, host_group)
    host = batch.pop("host_tokens")
    batch["cu_seqlens"] = None
    if mpu.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=mpu.get_context_parallel_group())
        host = None  # the slice of this CP rank is on the GPU
    out = (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
           batch["position_ids"])
    return out + (host,) if host_tokens else out
