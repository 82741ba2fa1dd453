"""Distributed checkpoints (``torch_dist``) of managed STEM tables and their optimizer state.

Extends Megatron's ``sharded_state_dict`` protocol (``megatron.core.dist_checkpointing``): a
managed table is saved under the *same* checkpoint key and global shape as an ordinary STEM
parameter (``decoder.layers.<i>.mlp.table``, ``[vocab, d_ff]``, columns split over TP), so the
checkpoint layout does not depend on the placement, the sharding, the row ownership or the
data-parallel size, and ordinary and managed runs read each other's model weights.

Layout: the vocabulary is cut into ``N`` equal row blocks (``N`` = the largest divisor of the
vocabulary size that is at most 64, independent of the DP size), i.e. a regular fragmentation
``N x tp`` of the global table. Data-parallel rank ``d`` writes (and on load reads) the blocks
``b`` with ``b % dp == d``: on save it fetches those rows from their owners with the table
exchange (``stem/exchange.py``), on load it pushes them to their owners. So a checkpoint written
with one DP size, ownership, sharding or placement loads into any other.

Optimizer state (``StemTablesOptimizer``): the Adam moments use the same blocks under
``optimizer.state.exp_avg.<key>`` / ``optimizer.state.exp_avg_sq.<key>`` (the names Megatron's
optimizer gives a parameter's moments); the sparse optimizer adds its per-row step counts
(``optimizer.state.stem_row_steps.<key>``, ``[vocab]``) and, in the common state, the mode, the
iteration count and the running weight-decay product. Rows are saved with all the decay they owe
applied, so on load every row's decay mark is the saved product.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

MAX_BLOCKS = 64


def num_blocks(vocab: int) -> int:
    """The number of equal row blocks the checkpoint cuts a ``vocab``-row table into."""
    return max(n for n in range(1, min(MAX_BLOCKS, vocab) + 1) if vocab % n == 0)


def my_blocks(vocab: int, dp_rank: int, dp_size: int) -> List[Tuple[int, torch.Tensor]]:
    """``(block index, global row ids)`` of the blocks this data-parallel rank writes/reads."""
    n = num_blocks(vocab)
    size = vocab // n
    return [(b, torch.arange(b * size, (b + 1) * size)) for b in range(dp_rank, n, dp_size)]


def block_sharded_tensor(key: str, data: torch.Tensor, block: int, vocab: int,
                         sharded_offsets: tuple, tp_rank: int, tp_size: int):
    """A ``ShardedTensor`` for rows block ``block`` of the global ``[vocab, F]`` table (or of a
    ``[vocab]`` per-row vector when ``data`` is 1-D: replicated over TP, written by TP rank 0)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    p = len(sharded_offsets)
    offsets = [(p, block, num_blocks(vocab))]
    replica = 0
    if data.dim() == 2:
        offsets.append((p + 1, tp_rank, tp_size))
    else:
        replica = tp_rank
    # The vocabulary axis is padded per TP size (--make-vocab-size-divisible-by x TP), so the
    # global row count may differ between the run that saved and the run that loads: as for
    # Megatron's word embeddings (VocabParallelEmbedding.sharded_state_dict), the rows both have
    # are read and the others start at zero (they are padding: no token id reaches them).
    return ShardedTensor.from_rank_offsets(key, data, *sharded_offsets, *offsets,
                                           replica_id=replica, prepend_axis_num=p,
                                           allow_shape_mismatch=True)


def gather_blocks(tables, sources: Sequence[torch.Tensor], catch_up: bool
                  ) -> List[Tuple[int, List[torch.Tensor]]]:
    """Rows of this rank's checkpoint blocks from ``sources`` (per-shard ``[owned, w]`` tensors of
    ``tables``, fetched from their owners; ``catch_up``: apply owed decay to table rows first).
    Collective over the data-parallel group. Returns ``[(block, [rows per source])]``."""
    blocks = my_blocks(tables.vocab_size, tables.dp_rank, tables.dp_size)
    ids = torch.cat([r for _, r in blocks]) if blocks else torch.empty(0, dtype=torch.long)
    tables.drain()  # a table step may still run in the background
    route = tables.exchange.route(ids)
    if catch_up and tables.read_hook is not None and route.rows_out:
        served = torch.unique(route.requested)
        for i in range(len(tables.shards)):
            tables.read_hook(i, served)
    dtype = sources[0].dtype
    rows = tables.exchange.fetch(route, [s.to(dtype) for s in sources], torch.device("cpu"))
    out, start = [], 0
    for b, r in blocks:
        out.append((b, [x[start: start + r.numel()] for x in rows]))
        start += r.numel()
    return out


def scatter_blocks(tables, loaded: Dict[int, List[torch.Tensor]],
                   targets: Sequence[torch.Tensor]) -> None:
    """Write loaded checkpoint blocks (``{block: [rows per target]}``, this rank's blocks) into
    the owners' ``targets`` (per-shard ``[owned, w]`` or ``[owned]`` tensors). Collective over the
    data-parallel group."""
    blocks = my_blocks(tables.vocab_size, tables.dp_rank, tables.dp_size)
    if sorted(loaded) != [b for b, _ in blocks]:
        raise RuntimeError(f"STEM checkpoint: expected blocks {[b for b, _ in blocks]}, "
                           f"loaded {sorted(loaded)}")
    ids = torch.cat([r for _, r in blocks]) if blocks else torch.empty(0, dtype=torch.long)
    columns = [t.view(t.shape[0], -1) for t in targets]
    widths = [c.shape[1] for c in columns]
    values = [torch.cat([loaded[b][k].reshape(-1, widths[k]).double() for b, _ in blocks])
              if blocks else torch.zeros(0, widths[k], dtype=torch.float64)
              for k in range(len(targets))]
    tables.drain()
    route = tables.exchange.route(ids)
    device = tables.exchange.device
    rows, summed = tables.exchange.push(route, [v.to(device) for v in values])
    if tables.ownership is not None:  # vocab sharding: every owned row comes from one block
        expected = tables.owned_ids.numel()
        if rows.numel() != expected:
            raise RuntimeError(f"STEM checkpoint: {rows.numel()} of this rank's {expected} "
                               "rows were loaded")
    rows = rows.cpu()
    for column, value in zip(columns, summed):
        column[rows.to(column.device)] = value.to(column.device, column.dtype)


def check_table_shapes(load_dir: str, expected: Dict[str, Tuple[int, int]],
                       step: int | None = None, token_ids: int | None = None) -> None:
    """Refuse, with the shapes and the flags that set them, a checkpoint whose STEM tables do not
    fit this model's ``[vocab, d_ff]`` (``expected``: checkpoint key -> shape): ``d_ff`` must be
    equal; the (padded) vocabulary may differ, as the padding depends on the TP size, as long as
    the checkpoint has a row for each of the tokenizer's ``token_ids`` ids."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import read_metadata

    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return  # nothing to load (Megatron says so itself)
    iteration, release = read_metadata(tracker)
    if step:
        iteration, release = step, False
    name = "release" if release else f"iter_{iteration:07d}"
    path = os.path.join(load_dir, name)
    if not os.path.isdir(path):
        return
    try:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception:  # not a torch_dist checkpoint: Megatron's loader reports it
        return
    for key, shape in expected.items():
        if key not in metadata:
            continue
        found = tuple(metadata[key].global_shape)
        needed_rows = shape[0] if token_ids is None else min(shape[0], token_ids)
        if found[1:] != tuple(shape[1:]) or found[0] < needed_rows or (
                token_ids is None and found[0] != shape[0]):
            raise ValueError(
                f"STEM table checkpoint {path}: {key} has shape [vocab, d_ff] = "
                f"{list(found)}, but this model's tables are {list(shape)} (padded vocabulary "
                "size from --vocab-size/the tokenizer and --make-vocab-size-divisible-by, d_ff "
                "from --ffn-hidden-size); load it with the model it was trained with")


def install_shape_check() -> None:
    """Check STEM table shapes before ``pretrain`` loads a checkpoint (wraps
    ``megatron.training.training.load_checkpoint``)."""
    from megatron.training import training

    upstream = training.load_checkpoint
    if getattr(upstream, "_stem_checked", False):
        return

    def load_checkpoint(model, *args, **kwargs):
        from megatron.training import get_args

        from megatron_ext.stem.mlp import StemMLP

        margs = get_args()
        load_dir = getattr(margs, "load", None)
        if load_dir:
            expected = {}
            for chunk in model:
                for name, module in chunk.named_modules():
                    if isinstance(module, StemMLP) and module.layer_number is not None:
                        key = f"decoder.layers.{module.layer_number - 1}.mlp.table"
                        expected[key] = (module.vocab_size, module.config.ffn_hidden_size)
            from megatron.training import get_tokenizer

            tokenizer = get_tokenizer()
            check_table_shapes(load_dir, expected, getattr(margs, "ckpt_step", None),
                               getattr(tokenizer, "vocab_size", None))
        return upstream(model, *args, **kwargs)

    load_checkpoint._stem_checked = True
    training.load_checkpoint = load_checkpoint
