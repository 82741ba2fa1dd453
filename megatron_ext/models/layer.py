"""A transformer layer that hands the token ids in the block's ``context`` to its MLP.

Extends ``megatron.core.transformer.transformer_layer.TransformerLayer``. Megatron passes nothing
but hidden states to an MLP, and ``TransformerBlock.forward`` has a fixed signature; its
``context`` argument (cross-attention memory, unused by GPT) is threaded through every layer and
is an argument of Megatron's full-recompute checkpoint. Carrying the ids there makes recomputed
micro-batches see their own ids under full recompute and pipeline parallelism (a model-level
"current ids" variable does not: with PP=2 and 1F1B it gave recomputes another micro-batch's ids).
"""

from __future__ import annotations

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
                "megatron_ext.models.gpt.TokenIdsGPTModel, which passes them as the block context")
        hidden_states, context = self._forward_attention(*args, **kwargs)
        with self.mlp.bind_token_ids(token_ids):
            output = self._forward_mlp(
                hidden_states,
                kwargs.get("inference_context", None),
                padding_mask=kwargs.get("padding_mask", None),
                packed_seq_params=kwargs.get("packed_seq_params", None),
            )
        return output, context
