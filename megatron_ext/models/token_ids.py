"""What a model that threads token ids to its layers does with them, on either path: the
deprecated GPT path (``models/gpt.py``, ``TokenIdsGPTModel``) and the hybrid path
(``models/hybrid.py``, ``TokenIdsHybridModel``).

The ids arrive as ``input_ids`` ``[b, s]`` (already sliced to this rank's context-parallel chunk
by the batch function) and become the block ``context`` ``[s, b]`` the token-indexed layers read.
Under sequence parallelism the ids stay whole: the MLP's column-parallel fc1 all-gathers the
sequence, so a token-indexed lookup after it covers the full local sequence.
"""

from __future__ import annotations

from typing import Optional

import torch

# Set on a micro-batch's device ids whose host copy was checked (``check_host_token_ids``).
_CHECKED = "_megatron_ext_ids_checked"


class TokenIdsMixin:
    """Mixed into an upstream language model (``GPTModel``, ``HybridModel``) before it."""

    def __init__(self, *args, table_vocab_size: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.table_vocab_size = table_vocab_size if table_vocab_size is not None else self.vocab_size

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Refuse ids outside the tables with a message instead of an index error deep inside.
        Ids whose host copy was checked (``check_host_token_ids``) are not read again; others
        are read back from their device, which on a GPU waits for every kernel queued before
        (once per micro-batch)."""
        if input_ids.numel() == 0 or getattr(input_ids, _CHECKED, False):
            return
        lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one host sync
        self._refuse_outside(lo, hi)

    def check_host_token_ids(self, input_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        """Check the micro-batch's ids on their host copy ``host_ids`` (``training/batch.py``:
        the data loader's, where this rank has it) and mark ``input_ids``, the device tensor
        this model's forward will receive, as checked: the forward then does not read the ids
        back from the GPU."""
        if host_ids.numel():
            self._refuse_outside(int(host_ids.min()), int(host_ids.max()))
        setattr(input_ids, _CHECKED, True)

    def _refuse_outside(self, lo: int, hi: int) -> None:
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

    def block_context(self, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """The checked ids as the block ``context`` ``[s, b]``; the managed tables' rows just
        bound are tied to it (``StemMLP.claim_rows``)."""
        if input_ids is None:
            raise RuntimeError(
                "this pipeline stage holds token-indexed layers but received no token ids: the "
                "batch function must give tokens to every stage (megatron_ext.training.batch)")
        self.check_token_ids(input_ids)
        context = input_ids.t().contiguous()
        for layer in self._row_claiming_layers():
            layer.claim_rows(context)
        return context
