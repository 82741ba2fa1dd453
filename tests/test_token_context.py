"""The one door of token-indexed layers: the block ``context`` (``models/token_ids.py``
``TokenContext``) carries a micro-batch's ids and the rows fetched for them through Megatron's
full-recompute checkpoint, so a recomputed layer reads its own micro-batch's rows although other
micro-batches' contexts were made in between (pipeline schedules), and the row gradients of the
recompute land on that micro-batch's leaves."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.models.token_ids import FetchedRows, TokenContext, split_context


def _context(ids, rows, layer=3):
    unique, inverse = torch.unique(ids, return_inverse=True)
    leaf = rows[unique].clone().requires_grad_(True)
    return TokenContext(ids, FetchedRows(inverse, {layer: leaf})), leaf


def test_detach_keeps_the_rows_and_other_ops_give_plain_tensors():
    ids = torch.tensor([[1, 4], [4, 2]])
    context, leaf = _context(ids, torch.randn(6, 3))
    detached = context.detach()
    assert isinstance(detached, TokenContext) and detached.fetched is context.fetched
    assert torch.equal(detached.ids, ids) and type(detached.ids) is torch.Tensor
    for derived in (context.t(), context + 0, context.view(-1), context[0]):
        assert type(derived) is torch.Tensor  # no rows ride along on derived tensors
    same = context.view_as(context)  # what autograd returns for an input given back as output
    assert isinstance(same, TokenContext) and same.fetched is context.fetched
    assert split_context(ids) == (ids, None)
    got_ids, fetched = split_context(context)
    assert torch.equal(got_ids, ids) and fetched.of_layer(3)[0] is leaf
    with pytest.raises(RuntimeError, match="no fetched STEM rows for layer 5"):
        fetched.of_layer(5)


def test_recompute_reads_its_own_micro_batch_rows(mcore_single_rank):
    """Two micro-batches through Megatron's ``tensor_parallel.checkpoint`` (the full-recompute
    path of ``megatron.core.recompute``), both forwards before both backwards (as 1F1B's warm-up
    orders them): each recompute sees its own rows, and the leaves' gradients equal those of the
    same computation without the checkpoint."""
    from megatron.core import tensor_parallel

    g = torch.Generator().manual_seed(0)
    table = torch.randn(8, 4, generator=g)
    seen = []

    def layer(hidden, context):
        ids, fetched = split_context(context)
        rows, inverse = fetched.of_layer(3)
        seen.append((torch.is_grad_enabled(), rows))
        return hidden * torch.nn.functional.embedding(inverse, rows), context

    def chunk(hidden, context):  # a chunk of two layers, the context given back as Megatron does
        for _ in range(2):
            hidden, context = layer(hidden, context)
        return hidden, context

    micro = []
    for m in range(2):
        ids = torch.randint(0, 8, (5, 2), generator=g)
        hidden = torch.randn(5, 2, 4, generator=g, requires_grad=True)
        micro.append((ids, hidden))
    leaves, outs = [], []
    for ids, hidden in micro:  # both forwards first
        context, leaf = _context(ids, table)
        # Two checkpointed chunks, the second given the first's context output (an autograd
        # function's output: a view of its input).
        out, context = tensor_parallel.checkpoint(chunk, False, hidden, context)
        out, _ = tensor_parallel.checkpoint(chunk, False, out, context)
        leaves.append(leaf)
        outs.append(out)
    for out in reversed(outs):
        out.square().sum().backward()
    recomputed = [rows for grad_on, rows in seen if grad_on]
    assert recomputed == [leaves[1]] * 4 + [leaves[0]] * 4  # each recompute read its own leaf
    for (ids, hidden), leaf in zip(micro, leaves):
        context, ref = _context(ids, table)
        out, context = chunk(hidden.detach(), context)
        out, _ = chunk(out, context)
        out.square().sum().backward()
        torch.testing.assert_close(leaf.grad, ref.grad)  # the order of the sums differs
