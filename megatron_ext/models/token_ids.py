"""What a model that threads token ids to its layers does with them, on either path: the
deprecated GPT path (``models/gpt.py``, ``TokenIdsGPTModel``) and the hybrid path
(``models/hybrid.py``, ``TokenIdsHybridModel``).

The ids arrive as ``input_ids`` ``[b, s]`` (already sliced to this rank's context-parallel chunk
by the batch function) and become the block ``context`` ``[s, b]`` the token-indexed layers read:
a ``TokenContext``, which also carries what a runtime fetched for the micro-batch (STEM's managed
tables: ``FetchedRows``), handed to the model's forward as ``token_rows``. Under sequence
parallelism the ids stay whole: the MLP's column-parallel fc1 all-gathers the sequence, so a
token-indexed lookup after it covers the full local sequence.

A model built with ``token_tables`` (a builder: ``token_tables(model)`` -> the runtime of its
token-indexed tables, or None) keeps that runtime as ``self.token_tables``; the runtime's rows are
not parameters, so the model hands it to its layers' ``sharded_state_dict`` through the
``metadata`` argument (key ``TOKEN_TABLES``) and gives it the loaded row blocks before
``load_state_dict`` reads the rest (``take_loaded``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple

import torch

# The key of the runtime of a model's token-indexed tables in the ``metadata`` its
# ``sharded_state_dict`` passes down to every module (Megatron's protocol passes that dict to
# every ``sharded_state_dict`` call below the model).
TOKEN_TABLES = "megatron_ext_token_tables"


class FetchedRows:
    """What a token-indexed runtime fetched for one micro-batch (STEM's managed tables,
    ``stem/runtime/tables.py``): the index ``inverse`` ``[s, b]`` of each token into the micro-batch's
    unique rows, and those rows of each token-indexed layer by its layer number (global,
    1-based: ``TransformerLayer.layer_number``). The rows are leaves whose gradients the
    runtime collects after backward; the layers only read them."""

    __slots__ = ("inverse", "rows")

    def __init__(self, inverse: torch.Tensor, rows: Mapping[int, torch.Tensor]):
        self.inverse = inverse
        self.rows = dict(rows)

    def of_layer(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rows, inverse)`` of one layer."""
        rows = self.rows.get(layer_number)
        if rows is None:
            raise RuntimeError(f"no fetched STEM rows for layer {layer_number}: the fetch "
                               f"covered layers {sorted(self.rows)}")
        if rows.shape[0] and self.inverse.numel() == 0:
            raise RuntimeError("fetched STEM rows without their token index")
        return rows, self.inverse


class TokenContext(torch.Tensor):
    """The block ``context`` of a token-indexed model: the ids ``[s, b]`` of this rank's chunk
    (a ``torch.long`` tensor), and ``fetched`` (a ``FetchedRows``, or None where the layers
    need the ids alone).

    Why a tensor subclass: Megatron passes ``context`` to every layer, and its full-recompute
    checkpoint (``megatron.core.recompute.checkpointed_forward`` -> ``tensor_parallel.checkpoint``)
    takes it as an argument, saves it with ``ctx.save_for_backward`` (tensors only), hands the
    recompute in backward ``detach_variable``'s ``x.detach()`` of it, and returns the context the
    layers gave back as an output of the autograd function, which autograd makes a view of the
    input (``view_as``, in C++). So the value has to be a tensor, and the rows must survive
    ``detach`` and views. A wrapper subclass (as ``DTensor`` is) sees those through
    ``__torch_dispatch__``: ``detach``, ``alias`` and ``view`` of the whole context keep the rows;
    every other operation gives a plain tensor of the ids. With pipeline schedules, where other
    micro-batches run between a forward and its recompute, the recompute so reads its own
    micro-batch's rows."""

    fetched: Optional[FetchedRows]
    _ids: torch.Tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, ids: torch.Tensor, fetched: Optional[FetchedRows] = None):
        context = torch.Tensor._make_wrapper_subclass(
            cls, ids.shape, strides=ids.stride(), storage_offset=ids.storage_offset(),
            dtype=ids.dtype, device=ids.device, requires_grad=False)
        context._ids = ids
        context.fetched = fetched
        return context

    # The operations that give the same context again (the ids unchanged, so the same rows).
    _KEEP = (torch.ops.aten.detach.default, torch.ops.aten.alias.default,
             torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in args if isinstance(a, TokenContext))
        plain = [a._ids if isinstance(a, TokenContext) else a for a in args]
        plain_kwargs = {k: v._ids if isinstance(v, TokenContext) else v for k, v in kwargs.items()}
        out = func(*plain, **plain_kwargs)
        if func in cls._KEEP and isinstance(out, torch.Tensor) and out.shape == first.shape:
            return TokenContext(out, first.fetched)
        return out

    def __repr__(self) -> str:
        return f"TokenContext({self._ids!r}, fetched={self.fetched is not None})"

    @property
    def ids(self) -> torch.Tensor:
        """The ids as a plain tensor."""
        return self._ids


def wrapped_attr(model, name: str, default=None):
    """``name`` of the model inside Megatron's wrappers (DDP, Float16Module: each holds the next
    as ``module``), or ``default`` when no level has it (a plain ``GPTModel``: no token ids, no
    tables). ``megatron.core.utils.get_attr_wrapped_model`` raises there instead."""
    while not hasattr(model, name):
        if not hasattr(model, "module"):
            return default
        model = model.module
    return getattr(model, name)


def split_context(context) -> Tuple[Optional[torch.Tensor], Optional[FetchedRows]]:
    """``(ids, fetched)`` of a layer's ``context``: a ``TokenContext``, or plain ids (a layer
    run on its own, as the tests do)."""
    if isinstance(context, TokenContext):
        return context.ids, context.fetched
    return context, None


class TokenIdsMixin:
    """Mixed into an upstream language model (``GPTModel``, ``HybridModel``) before it."""

    # A stage whose layers read the ids (the hybrid model answers per chunk).
    needs_token_ids = True

    def __init__(self, *args, table_vocab_size: Optional[int] = None,
                 token_tables: Optional[Callable[[Any], Any]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.table_vocab_size = table_vocab_size if table_vocab_size is not None else self.vocab_size
        # The runtime of the model's managed token-indexed tables (STEM: stem/runtime/tables.py
        # ``StemTables``), built from the model's layers once they exist; None without.
        self.token_tables = token_tables(self) if token_tables is not None else None

    def check_token_ids(self, input_ids: torch.Tensor, checked: bool = False) -> None:
        """Refuse ids outside the tables with a message instead of an index error deep inside.
        ``checked``: the forward step checked the micro-batch's host copy already
        (``check_host_token_ids``); otherwise the ids are read back from their device, which on
        a GPU waits for every kernel queued before (once per micro-batch)."""
        if input_ids.numel() == 0 or checked:
            return
        lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one host sync
        self._refuse_outside(lo, hi)

    def check_host_token_ids(self, host_ids: torch.Tensor) -> None:
        """Check a micro-batch's ids on their host copy (``training/batch.py``: the data
        loader's, where this rank has it); the forward step then passes
        ``token_ids_checked=True`` and the forward does not read the ids back from the GPU."""
        if host_ids.numel():
            self._refuse_outside(int(host_ids.min()), int(host_ids.max()))

    def _refuse_outside(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.table_vocab_size:
            raise ValueError(
                f"token id {lo if lo < 0 else hi} is outside the STEM tables (vocab size "
                f"{self.table_vocab_size}): the data was tokenized with another tokenizer, or "
                "--vocab-size/--padded-vocab-size does not match it")

    def block_context(self, input_ids: Optional[torch.Tensor],
                      token_rows: Optional[FetchedRows] = None,
                      token_ids_checked: bool = False) -> TokenContext:
        """The checked ids as the block ``context`` ``[s, b]``, with the rows fetched for them
        (``token_rows``, from the forward step; None for ordinary tables)."""
        if input_ids is None:
            raise RuntimeError(
                "this pipeline stage holds token-indexed layers but received no token ids: the "
                "batch function must give tokens to every stage (megatron_ext.training.batch)")
        if token_rows is None and self.token_tables is not None:
            raise RuntimeError(
                "a model with managed STEM tables ran without its micro-batch's rows: the "
                "forward step fetches them (the family's take_batch) and passes token_rows")
        self.check_token_ids(input_ids, token_ids_checked)
        return TokenContext(input_ids.t().contiguous(), token_rows)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """Upstream's, with the runtime of the managed tables passed down in ``metadata``
        (``TOKEN_TABLES``): their layers' rows are saved by it (``stem/runtime/checkpoint.py``)."""
        if self.token_tables is not None:
            metadata = {**(metadata or {}), TOKEN_TABLES: self.token_tables}
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Upstream's, after the runtime of the managed tables took its row blocks out of
        ``state_dict`` and wrote them to their owners (collective over data parallelism)."""
        if self.token_tables is not None:
            state_dict = self.token_tables.take_loaded(state_dict)
        return super().load_state_dict(state_dict, strict=strict)
