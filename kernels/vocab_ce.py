"""Fused vocab-parallel cross entropy: Megatron-Core's ``vocab_parallel_cross_entropy`` (the loss
of every GPT and hybrid model, ``megatron/core/tensor_parallel/cross_entropy.py``) without its
fp32 copies of the logits.

Upstream (without Transformer Engine, whose Triton cross entropy needs TE itself) casts the
``[s, b, V/tp]`` logits to fp32, subtracts the max, exponentiates and normalises in place, and
keeps that fp32 softmax for the backward, which scales it in place: at 4 x 4096 tokens and a
128256 vocabulary, 8.4 GB kept and, counted op by op, about 126 GB of memory traffic per step
for 4.2 GB of bf16 logits. Here (Triton kernels in ``_vocab_ce_triton.py``):

* forward: one pass over the logits in their dtype gives per row the shard's max, the sum of
  ``exp(x - max)`` (online, rescaled as the max grows) and the target's logit where the target
  is in the shard; under tensor parallelism the shards' maxima are all-reduced (MAX), then each
  shard's sum rescaled to the global max and the sums and target logits all-reduced (SUM) in one
  call, as upstream's two all-reduces; ``loss = max + log(sum) - target_logit``. Kept for the
  backward: the logits as they came (no copy) and the per-row log-sum-exp;
* backward: one pass writes ``(exp(x - lse) - onehot(target)) * grad_loss`` in the logits' dtype.

About 13 GB of traffic at that shape, counted (read 4.2 GB forward; read 4.2 GB and write 4.2 GB
backward), and 4.2 GB kept instead of 8.4 GB. Not yet measured on a GPU. Differences to upstream
are rounding only (the same formula with the sums in another order; fp32 throughout, the
gradient rounded once to the logits' dtype, to nearest); label smoothing is not supported
(Megatron's language models do not pass it; ``vocab_parallel_cross_entropy`` keeps upstream's
path for it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_ext_kernels._triton_runtime import available, kernels

MAX_BLOCK = 4096  # columns per program iteration; a vocabulary shard is walked in such blocks


def _kernels():
    return kernels("_vocab_ce_triton")


def _block(n_cols: int) -> int:
    return min(MAX_BLOCK, 1 << max(4, (n_cols - 1).bit_length()))


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp_group):
        n_cols = logits.shape[-1]
        x = logits.reshape(-1, n_cols)
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1)
        if t.numel() != x.shape[0]:
            raise ValueError(f"cross entropy: {t.numel()} targets for {x.shape[0]} rows of logits")
        rows = x.shape[0]
        row_max = torch.empty(rows, device=x.device, dtype=torch.float32)
        row_sum = torch.empty_like(row_max)
        target_logit = torch.empty_like(row_max)
        size = _group_size(tp_group)
        rank = dist.get_rank(tp_group) if size > 1 else 0
        vocab_start = rank * n_cols  # Megatron's VocabUtility: equal shards in rank order
        if rows:
            _kernels().ce_forward[(rows,)](x, x.stride(0), t, row_max, row_sum, target_logit,
                                           n_cols, vocab_start, BLOCK=_block(n_cols))
        if size > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            sums = torch.cat([row_sum * torch.exp(row_max - global_max), target_logit])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
            row_sum, target_logit = sums[:rows], sums[rows:]
            row_max = global_max
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(x, t, lse)
        ctx.vocab_start = vocab_start
        ctx.shape = logits.shape
        return (lse - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, t, lse = ctx.saved_tensors
        grad = torch.empty_like(x)
        g = grad_loss.reshape(-1)
        if not g.is_contiguous():
            g = g.contiguous()
        if x.shape[0]:
            _kernels().ce_backward[(x.shape[0],)](x, x.stride(0), grad, grad.stride(0), t, lse, g,
                                                  x.shape[1], ctx.vocab_start,
                                                  BLOCK=_block(x.shape[1]))
        return grad.view(ctx.shape), None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                       tp_group=None) -> torch.Tensor:
    """``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target,
    tp_group=tp_group)`` without label smoothing: ``logits [s, b, V/tp]`` (this rank's shard of
    the vocabulary), ``target [s, b]`` (ids in the whole vocabulary); the loss ``[s, b]`` in
    fp32."""
    if not available():
        raise RuntimeError("the fused cross entropy needs Triton and a CUDA device (or "
                           "TRITON_INTERPRET=1 on the CPU)")
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cross entropy: targets of {target.dtype}; expected integer ids")
    return FusedVocabParallelCrossEntropy.apply(logits, target, tp_group)


def reference(logits: torch.Tensor, target: torch.Tensor,
              tp_group: Optional[object] = None) -> torch.Tensor:
    """Plain PyTorch on the whole vocabulary (one rank): ``logsumexp - target logit`` in fp32,
    written for the tests."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1) - x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
