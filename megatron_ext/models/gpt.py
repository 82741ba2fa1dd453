"""GPT model that threads the token ids of this rank to token-indexed layers.

Extends ``megatron.core.models.gpt.GPTModel``: the ids (``models/token_ids.py``) are passed to
the transformer block as ``extra_block_kwargs={"context": ids [s, b]}`` (a ``TokenContext``,
with the rows the forward step fetched for them: ``token_rows``).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

from megatron_ext.models.token_ids import TokenIdsMixin


class TokenIdsGPTModel(TokenIdsMixin, GPTModel):
    """``GPTModel`` whose decoder layers can read the token ids from the block ``context``."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, token_rows=None, token_ids_checked=False,
                **kwargs):
        extra_block_kwargs = dict(extra_block_kwargs or {})
        extra_block_kwargs["context"] = self.block_context(input_ids, token_rows,
                                                           token_ids_checked)
        return super().forward(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs, runtime_gather_output=runtime_gather_output,
            **kwargs)
