"""Core attention of the local backend through PyTorch's fused scaled-dot-product attention.

Replaces ``megatron.core.transformer.dot_product_attention.DotProductAttention`` (upstream's
local core attention, the ``core_attention`` of ``get_gpt_layer_local_spec``) where Transformer
Engine is absent: upstream's computes the ``[b, heads, s, s]`` scores and probabilities in full
(baddbmm, softmax, bmm), which does not fit at sequence 4096 on one GPU; here
``torch.nn.functional.scaled_dot_product_attention`` picks the flash or memory-efficient kernel on
a GPU (its own flash kernel on the CPU), and never holds the score matrix for backward.

Same constructor, forward signature and layout as upstream's (``[sq, b, np, hn]`` query,
``[sk, b, ng, hn]`` key/value, ``[sq, b, np * hn]`` out), the same per-partition heads under TP
and the same effective softmax scale. What upstream's supports and this one does not is refused
in one line: context parallelism (upstream's local attention refuses it too), sliding-window
attention, the off-by-one/learnable softmax, packed sequences and attention bias.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide, log_single_rank

FLAG = "--ext-core-attention"
logger = logging.getLogger(__name__)


class SDPAttention(MegatronModule):
    """Drop-in for upstream's ``DotProductAttention`` (see the module's docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        if config.context_parallel_size > 1:
            raise ValueError(f"{FLAG} sdpa: --context-parallel-size "
                             f"{config.context_parallel_size} is not supported (needs Transformer "
                             f"Engine); use --context-parallel-size 1")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise ValueError(f"{FLAG} sdpa: --window-size {config.window_size} is not supported; "
                             f"use {FLAG} unfused")
        if config.softmax_type != "vanilla":
            raise ValueError(f"{FLAG} sdpa: --softmax-type {config.softmax_type} is not "
                             f"supported; use {FLAG} unfused")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask,
                                  AttnMaskType.padding):
            raise ValueError(f"{FLAG} sdpa: attention mask type {attn_mask_type.name} is not "
                             f"supported; use {FLAG} unfused")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        # Per attention head and per partition values, as upstream's.
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=['tp'])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # Upstream scales the scores by softmax_scale / layer_number and its softmax multiplies
        # them by layer_number again (apply_query_key_layer_scaling guards fp16 scores against
        # overflow): the softmax sees softmax_scale * q.k either way. The fused kernel computes
        # in fp32 internally, so only that effective scale is needed.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        if layer_number == 1:  # once per model: which attention a run used shows in its log
            log_single_rank(logger, logging.INFO,
                            f"core attention: torch scaled_dot_product_attention ({FLAG} sdpa; "
                            f"scale {self.softmax_scale:.6g}, dropout {self.dropout_p})")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise ValueError(f"{FLAG} sdpa: packed sequences are not supported; use "
                             f"--transformer-impl transformer_engine")
        if attention_bias is not None:
            raise ValueError(f"{FLAG} sdpa: an attention bias is not supported; use "
                             f"{FLAG} unfused")
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        # [s, b, n, hn] -> [b, n, s, hn], the layout the fused kernels take.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition

        mask, causal = None, False
        if attention_mask is not None:
            # Upstream fills the scores where the mask is True (attention_mask_func); the fused
            # kernel keeps the positions where its boolean mask is True. Any mask (EOD resets,
            # padding) is exact this way, but leaves the flash kernel for the memory-efficient
            # one: with --no-create-attention-mask-in-dataloader a causal model takes flash.
            mask = ~attention_mask.to(torch.bool)
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"{FLAG} sdpa: causal attention of {sq} queries over {sk} keys "
                                 f"without a mask is not supported; use {FLAG} unfused")
            causal = True
        if groups > 1 and mask is not None:
            # Upstream's own expansion (repeat_interleave): the masked kernels take no GQA.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                scale=self.softmax_scale, enable_gqa=groups > 1 and mask is None)

        # Upstream's dropout draws from the model-parallel generator unless sequence parallel
        # (each TP rank drops within its own heads); the same here. Its random stream differs
        # from upstream's (the kernel draws its own mask).
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
