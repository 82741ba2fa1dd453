"""A transformer layer that hands the block's ``context`` (the token ids and the rows fetched for
them, ``models/token_ids.py`` ``TokenContext``) to its MLP as an argument.

Extends ``megatron.core.transformer.transformer_layer.TransformerLayer``. Megatron passes nothing
but hidden states to an MLP (``_forward_mlp`` calls ``self.mlp(x, padding_mask=...)``), and
``TransformerBlock.forward`` has a fixed signature; its ``context`` argument (cross-attention
memory, unused by GPT) is threaded through every layer and is an argument of Megatron's
full-recompute checkpoint. So this layer runs upstream's attention part and pre-MLP norm and
post-MLP residual (``_forward_attention``, ``_forward_pre_mlp_layernorm``,
``_forward_post_mlp``) and calls the MLP itself, as ``mlp(x, context=context)``: the MLP's one
entry. Carrying the ids and rows there makes recomputed micro-batches see their own under full
recompute and pipeline parallelism (a model-level "current ids" variable does not: with PP=2 and
1F1B it gave recomputes another micro-batch's ids).
"""

from __future__ import annotations

from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import nvtx_range_pop, nvtx_range_push


class TokenContextTransformerLayer(TransformerLayer):
    """TransformerLayer whose MLP receives the block ``context`` (the ``[s, b]`` token ids)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.recompute_mlp:
            # Selective MLP recompute re-runs the MLP in backward through upstream's
            # ``_forward_mlp``, which does not pass the context.
            raise ValueError(
                "--recompute-modules mlp is not supported for layers with token-indexed MLPs "
                "(STEM); use --recompute-granularity full, or drop 'mlp' from --recompute-modules")
        if self.config.mlp_chunks_for_training > 1:
            raise ValueError("--mlp-chunks-for-training > 1 is not supported for layers with "
                             "token-indexed MLPs (STEM): the ids would have to be chunked too")

    def forward(self, *args, **kwargs):
        context = kwargs.get("context")
        if context is None:
            raise RuntimeError(
                "a STEM layer got no token ids: build the model with "
                "megatron_ext.models.gpt.TokenIdsGPTModel (or, on the hybrid path, "
                "megatron_ext.models.hybrid.TokenIdsHybridModel), which pass them as the block "
                "context")
        hidden_states, context = self._forward_attention(*args, **kwargs)
        return self._forward_token_mlp(hidden_states, context), context

    def _forward_token_mlp(self, hidden_states, context):
        """Upstream's ``_forward_mlp`` for a dense MLP in training and evaluation (pre-MLP norm,
        residual, post-MLP bias-dropout-add), the MLP called with ``context``."""
        pre_mlp_layernorm_output = self._forward_pre_mlp_layernorm(hidden_states)
        if isinstance(pre_mlp_layernorm_output, tuple):  # (output, residual), as upstream
            pre_mlp_layernorm_output, residual = pre_mlp_layernorm_output
        else:
            residual = hidden_states
        if self.config.fp32_residual_connection:
            residual = residual.float()
        nvtx_range_push(suffix="mlp")
        mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output, context=context)
        nvtx_range_pop(suffix="mlp")
        return self._forward_post_mlp(mlp_output_with_bias, residual)


class TokenContextMLPLayer(TokenContextTransformerLayer, MLPLayer):
    """The hybrid path's MLP layer (a ``-`` of ``--hybrid-layer-pattern``) with a token-indexed
    MLP. Extends ``megatron.core.ssm.mlp_layer.MLPLayer`` (a TransformerLayer holding only
    ``pre_mlp_layernorm``, ``mlp`` and ``mlp_bda``); the ids come from the ``context`` that
    ``models/hybrid.py``'s ``TokenIdsHybridStack`` gives every layer, as above."""
