"""LayerNorm / RMSNorm for the local (non-Transformer-Engine) backend that supports sequence parallelism.

Megatron's ``WrappedTorchNorm`` (megatron.core.transformer.torch_norm) refuses
``--sequence-parallel``, and Megatron refuses TP together with MoE unless sequence parallelism is
on, so without Apex or Transformer Engine neither works. The maths of a norm does not change under
sequence parallelism; only its parameter gradients are partial sums over the sequence shard. Marking
the parameters ``sequence_parallel`` makes Megatron's ``finalize_model_grads`` all-reduce them over
the TP group, as it does for its own fused norms.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` as Megatron's ``WrappedTorchNorm`` does."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("--apply-layernorm-1p is not supported by the torch norm backend")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"--normalization={config.normalization}: LayerNorm or RMSNorm")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
