"""A transformer layer that hands the token ids in the block's ``context`` to its MLP.

Extends ``megatron.core.transformer.transformer_layer.TransformerLayer``. Megatron passes nothing
but hidden states to an MLP, and ``TransformerBlock.forward`` has a fixed signature; its
``context`` argument (cross-attention memory, unused by GPT) is threaded through every layer and
is an argument of Megatron's full-recompute checkpoint. Carrying the ids there makes recomputed
micro-batches see their own ids under full recompute and pipeline parallelism (a model-level
"current ids" variable does not: with PP=2 and 1F1B it gave recomputes another micro-batch's ids).
"""

from __future__ import annotations

from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.transformer_layer import TransformerLayer


class TokenContextTransformerLayer(TransformerLayer):
    """TransformerLayer whose MLP receives ``context`` (the ``[s, b]`` token ids) as token ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.recompute_mlp:
            # Selective MLP recompute re-runs the MLP in backward, outside this layer's forward,
            # where the ids bound below are no longer visible.
            raise ValueError(
                "--recompute-modules mlp is not supported for layers with token-indexed MLPs "
                "(STEM); use --recompute-granularity full, or drop 'mlp' from --recompute-modules")

    def forward(self, *args, **kwargs):
        token_ids = kwargs.get("context")
        if token_ids is None:
            raise RuntimeError(
                "a STEM layer got no token ids: build the model with "
                "megatron_ext.models.gpt.TokenIdsGPTModel (or, on the hybrid path, "
                "megatron_ext.models.hybrid.TokenIdsHybridModel), which pass them as the block "
                "context")
        hidden_states, context = self._forward_attention(*args, **kwargs)
        with self.mlp.bind_token_ids(token_ids):
            output = self._forward_mlp(
                hidden_states,
                kwargs.get("inference_context", None),
                padding_mask=kwargs.get("padding_mask", None),
                packed_seq_params=kwargs.get("packed_seq_params", None),
            )
        return output, context


class TokenContextMLPLayer(TokenContextTransformerLayer, MLPLayer):
    """The hybrid path's MLP layer (a ``-`` of ``--hybrid-layer-pattern``) with a token-indexed
    MLP. Extends ``megatron.core.ssm.mlp_layer.MLPLayer`` (a TransformerLayer holding only
    ``pre_mlp_layernorm``, ``mlp`` and ``mlp_bda``); the ids come from the ``context`` that
    ``models/hybrid.py``'s ``TokenIdsHybridStack`` gives every layer, as above."""
