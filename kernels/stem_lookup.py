"""Table row lookup whose backward touches only the looked-up rows.

``F.embedding``'s backward materialises a dense ``[vocab, F]`` gradient (1.1 GB for one table at
the paper's 1B shape) and Megatron's DDP then adds all of it into ``main_grad``. Like Megatron's
gradient-accumulation fusion for linear layers
(``megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication``), this
lookup adds the row gradients straight into ``table.main_grad`` when DDP has set one up (an
``index_add_`` over the batch's rows), marks ``grad_added_to_main_grad`` and returns an
uninitialised dummy gradient so DDP's backward hook still fires. Without ``main_grad`` (a bare
module) it returns the ordinary dense gradient.
"""

from __future__ import annotations

import torch


class TableLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_ids)
        ctx.table = table
        return torch.nn.functional.embedding(token_ids, table)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (token_ids,) = ctx.saved_tensors
        table = ctx.table
        ids = token_ids.reshape(-1)
        grad_rows = grad_rows.reshape(ids.numel(), -1)
        main_grad = getattr(table, "main_grad", None)
        if main_grad is not None:
            main_grad.index_add_(0, ids, grad_rows.to(main_grad.dtype))
            table.grad_added_to_main_grad = True
            # Never read: DDP's hook skips it because grad_added_to_main_grad is set.
            grad_table = torch.empty(table.shape, dtype=table.dtype, device=table.device)
        else:
            grad_table = torch.zeros(table.shape, dtype=grad_rows.dtype, device=grad_rows.device)
            grad_table.index_add_(0, ids, grad_rows)
        return grad_table, None


def lookup_rows(table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``table[token_ids]`` with the row-sparse backward described above."""
    return TableLookup.apply(table, token_ids)
