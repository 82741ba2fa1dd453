"""GPT model that threads the token ids of this rank to token-indexed layers.

Extends ``megatron.core.models.gpt.GPTModel``: the ids arrive as ``input_ids`` ``[b, s]`` (already
sliced to this rank's context-parallel chunk by the batch function) and are passed to the
transformer block as ``extra_block_kwargs={"context": ids [s, b]}``. Under sequence parallelism
the ids stay whole: the MLP's column-parallel fc1 all-gathers the sequence, so a token-indexed
lookup after it covers the full local sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel



class TokenIdsGPTModel(GPTModel):
    """``GPTModel`` whose decoder layers can read the token ids from the block ``context``."""

    def __init__(self, *args, table_vocab_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.table_vocab_size = table_vocab_size if table_vocab_size is not None else self.vocab_size

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Refuse ids outside the tables with a message instead of an index error deep inside."""
        if input_ids.numel() == 0:
            return
        lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one host sync
        if lo < 0 or hi >= self.table_vocab_size:
            raise ValueError(
                f"token id {lo if lo < 0 else hi} is outside the STEM tables (vocab size "
                f"{self.table_vocab_size}): the data was tokenized with another tokenizer, or "
                "--vocab-size/--padded-vocab-size does not match it")

    def _row_claiming_layers(self):
        """Token-indexed MLPs of this model chunk that tie rows bound per micro-batch to the
        block context (``claim_rows(context)``: STEM's managed tables, ``stem/mlp.py``)."""
        if not hasattr(self, "_claiming"):
            self._claiming = [m for m in self.modules() if callable(getattr(m, "claim_rows", None))]
        return self._claiming

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                runtime_gather_output=None, **kwargs):
        if input_ids is None:
            raise RuntimeError(
                "this pipeline stage holds token-indexed layers but received no token ids: the "
                "batch function must give tokens to every stage (megatron_ext.training.batch)")
        self.check_token_ids(input_ids)
        extra_block_kwargs = dict(extra_block_kwargs or {})
        context = input_ids.t().contiguous()
        extra_block_kwargs["context"] = context
        for layer in self._row_claiming_layers():
            layer.claim_rows(context)
        return super().forward(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs, runtime_gather_output=runtime_gather_output,
            **kwargs)
