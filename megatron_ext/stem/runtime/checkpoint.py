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
exchange (``stem/runtime/exchange.py``), on load it pushes them to their owners. So a checkpoint written
with one DP size, ownership, sharding or placement loads into any other.

Optimizer state (``StemTablesOptimizer``): the Adam moments use the same blocks under
``optimizer.state.exp_avg.<key>`` / ``optimizer.state.exp_avg_sq.<key>`` (the names Megatron's
optimizer gives a parameter's moments), with, in the common state, the mode, the iteration count
and the running weight-decay product. The sparse optimizer's rows and moments are saved brought up
to date (``row_adam.LazyRows``), so on load every row is current at the saved iteration, with the
iteration each row last had a gradient (``optimizer.state.stem_row_touched.<key>``, ``[vocab]``:
its catch-up's eps depends on it). Sparse states of the earlier lazy-Adam semantics (per-row step
counts, ``stem_row_steps``) lack that tensor and are refused before loading
(``check_optimizer_state``): resume them with ``--no-load-optim``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_ext.checkpoint_manifest import CheckpointError, resolve_checkpoint_dir
from megatron_ext.checkpoint_reader import MegatronCheckpoint
from megatron_ext.stem.runtime.store import gather_rows
from megatron_ext.stem.runtime.tiers import full_tensor, write_back

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


def gather_blocks(tables, sources: Sequence[torch.Tensor]
                  ) -> List[Tuple[int, List[torch.Tensor]]]:
    """Rows of this rank's checkpoint blocks from ``sources`` (per-shard ``[owned, w]`` tensors of
    ``tables``, which the caller read whole after waiting for the worker), fetched from their
    owners. Collective over the data-parallel group. Returns ``[(block, [rows per source])]``."""
    blocks = my_blocks(tables.vocab_size, tables.dp_rank, tables.dp_size)
    ids = torch.cat([r for _, r in blocks]) if blocks else torch.empty(0, dtype=torch.long)
    exchange = tables.exchange
    route = exchange.route(ids)
    cpu = torch.device("cpu")
    dtype = sources[0].dtype
    served = gather_rows([s.to(dtype) for s in sources], route.requested,
                         exchange.serve_device(cpu), dtype)
    rows = exchange.send_rows(route, served, [s.shape[1] for s in sources], cpu, dtype)
    out, start = [], 0
    for b, r in blocks:
        out.append((b, [x[start: start + r.numel()] for x in rows]))
        start += r.numel()
    return out


def scatter_blocks(tables, loaded: Dict[int, List[torch.Tensor]],
                   targets: Sequence[torch.Tensor]) -> None:
    """Write loaded checkpoint blocks (``{block: [rows per target]}``, this rank's blocks) into
    the owners' ``targets`` (per-shard ``[owned, w]`` or ``[owned]`` tensors, which the caller
    read after waiting for the worker). Collective over the data-parallel group."""
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


# -- the model's tables (StemMLP.sharded_state_dict / _load_from_state_dict) ---------------------
def table_blocks(tables, index: int) -> List[Tuple[int, torch.Tensor]]:
    """``[(block, rows)]``: layer ``index``'s rows of this rank's checkpoint blocks, with every
    update applied and every row brought up to date. Collective over the data-parallel group."""
    tables.worker.wait()
    return [(block, rows) for block, (rows,) in gather_blocks(tables, [tables.store.read(index)])]


def load_table(tables, index: int, loaded: Dict[int, torch.Tensor]) -> None:
    """Write this rank's loaded blocks (``{block: rows}``) of layer ``index``'s table into the
    owners' stores. Collective over the data-parallel group."""
    tables.worker.wait()
    target = tables.store.read(index)  # the shard itself unless tiered
    scatter_blocks(tables, {b: [rows] for b, rows in loaded.items()}, [target])
    tables.store.write(index, target)


# -- the tables' optimizer state (StemTablesOptimizer) ---------------------------------------------
TOUCHED = "stem_row_touched"
LAZY_ADAM_STEPS = "stem_row_steps"  # the lazy-Adam sparse state's per-row step counts (not read)


def _optimizer_sources(optimizer):
    """Per chunk: its tables and, per name, the per-shard tensors saved under that name."""
    out = []
    for t, adam in zip(optimizer.tables, optimizer.row_adams):
        sources = {"exp_avg": adam.exp_avg, "exp_avg_sq": adam.exp_avg_sq}
        if any(layer.dtype != torch.float32 for layer in t.layers):
            sources["fp32_param"] = t.store.shards  # the master copy of a 16-bit model
        if optimizer.mode == "sparse":
            sources[TOUCHED] = adam.lazy.touched
        out.append((t, sources))
    return out


def optimizer_state(optimizer) -> dict:
    """The tables' moments (and the fp32 rows of a 16-bit model) in the table checkpoint's row
    blocks, keyed ``optimizer.state.<name>.<table key>``, with the mode, the iteration count and
    the decay product as common state. Needs the model's ``sharded_state_dict`` built first (its
    blocks' keys). Collective over the data-parallel group."""
    # The scalars are common state, which torch_dist saves from global rank 0 alone; that rank
    # may hold no tables (a pipeline stage, or an interleaved chunk set, without STEM layers), so
    # every rank gives them: the iteration clock runs on every rank alike.
    common = {"mode": optimizer.mode, "step_count": optimizer.step_count,
              "decay_product": optimizer.decay_product, "tensors": {}}
    if not optimizer.tables:
        return common
    optimizer.drain()
    optimizer.materialize()
    tensors = {}
    for t, sources in _optimizer_sources(optimizer):
        for blocks in t.checkpoint_blocks:
            if blocks is None:
                raise RuntimeError("the model's sharded_state_dict must be built before the "
                                   "STEM table optimizer's")
        for name in sources:
            # Tiered shards are read as one host copy of their two halves (full_tensor). The
            # per-row iterations travel as a float64 column (exact up to 2^53).
            dtype = torch.float64 if name == TOUCHED else torch.float32
            whole = [full_tensor(x).to(dtype) for x in sources[name]]
            whole = [x.unsqueeze(1) if x.dim() == 1 else x for x in whole]
            for block, per_layer in gather_blocks(t, whole):
                for layer, blocks, rows in zip(t.layers, t.checkpoint_blocks, per_layer):
                    model_block = blocks[block]
                    key = f"optimizer.state.{name}.{model_block.key}"
                    data = rows[:, 0].clone() if name == TOUCHED else rows
                    tensors[f"{key}.block{block}"] = block_sharded_tensor(
                        key, data, block, layer.vocab_size, _prepend_offsets(model_block),
                        layer.tp_rank, layer.tp_size)
    common["tensors"] = tensors
    return common


def load_optimizer_state(optimizer, saved: dict) -> None:
    """Load what ``optimizer_state`` saved into the owners' optimizer state (any DP size,
    ownership, placement). Collective over the data-parallel group."""
    if not optimizer.tables:
        return
    optimizer.drain()
    if saved.get("mode") != optimizer.mode:
        raise ValueError(f"the checkpoint's STEM table optimizer is --stem-optimizer "
                         f"{saved.get('mode')}, this run's is {optimizer.mode}: resume with the "
                         "same mode or pass --no-load-optim")
    optimizer.step_count = int(saved["step_count"])
    tensors = saved["tensors"]
    for t in optimizer.tables:  # --stem-host-read direct: the loads below write host rows in
        t.store.wait_reads()  # place, past the store, after any read still queued
    for t, sources in _optimizer_sources(optimizer):
        for name, targets in sources.items():
            per_block = {}
            for k, blocks in enumerate(t.checkpoint_blocks):
                for block, model_block in blocks.items():
                    key = f"optimizer.state.{name}.{model_block.key}.block{block}"
                    per_block.setdefault(block, [None] * len(t.layers))[k] = tensors[key]
            # Tiered shards load into a host copy, then back into their two halves.
            whole = [full_tensor(x) for x in targets]
            scatter_blocks(t, per_block, whole)
            for x, w in zip(targets, whole):
                write_back(x, w)
    if optimizer.mode == "sparse":  # rows were saved up to date
        for t in optimizer.tables:
            t.store.lazy.reset(optimizer.step_count, float(saved["decay_product"]))


def _prepend_offsets(sharded_tensor) -> tuple:
    """The ``sharded_offsets`` (layer axes prepended by the block) a ShardedTensor was built with."""
    p = sharded_tensor.prepend_axis_num
    return tuple((axis, sharded_tensor.global_offset[axis], sharded_tensor.axis_fragmentations[axis])
                 for axis in range(p))


_TABLE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.table$")
_ROW_STATE = re.compile(rf"^optimizer\.state\.({TOUCHED}|{LAZY_ADAM_STEPS})\.decoder\.layers\.")


@dataclasses.dataclass(frozen=True)
class SavedTables:
    """The STEM tables a checkpoint holds: saved layer index (``decoder.layers.<i>``: a GPT
    layer, or a pattern position for a hybrid-path checkpoint) -> global ``[vocab, d_ff]``, and
    the ``--hybrid-layer-pattern`` of the run that saved it (None: the GPT path)."""

    path: str
    shapes: Dict[int, Tuple[int, ...]]
    hybrid_layer_pattern: Optional[str]
    # The per-row tensors of the tables' optimizer state it holds (``TOUCHED``, or the earlier
    # lazy-Adam ``stem_row_steps``); empty for a dense or ordinary table's state.
    row_state: frozenset = frozenset()


def saved_tables(load_dir: str, step: Optional[int] = None) -> Optional[SavedTables]:
    """The tables of the checkpoint upstream's loader will read, from its metadata and args (no
    tensor is read); None where there is none to check (no checkpoint, not ``torch_dist``:
    Megatron's loader reports it)."""
    try:
        path, _ = resolve_checkpoint_dir(load_dir, step)
        ck = MegatronCheckpoint(path)
    except CheckpointError:
        return None
    shapes = {int(m.group(1)): ck.shape(key) for key in ck.tensor_keys()
              for m in [_TABLE.match(key)] if m}
    row_state = frozenset(m.group(1) for key in ck.metadata.state_dict_metadata
                          for m in [_ROW_STATE.match(key)] if m)
    return SavedTables(ck.dir, shapes, getattr(ck.args, "hybrid_layer_pattern", None) or None,
                       row_state)


def check_optimizer_state(saved: SavedTables, mode: str, load_optim: bool) -> None:
    """Refuse, before upstream's loader runs, a sparse optimizer state of the earlier lazy-Adam
    semantics (per-row step counts, no per-row last-gradient iteration) for a sparse run that
    loads the optimizer: its moments mean something else and the tensor the catch-up needs is
    not there."""
    if mode == "sparse" and load_optim and LAZY_ADAM_STEPS in saved.row_state and \
            TOUCHED not in saved.row_state:
        raise ValueError(
            f"STEM table checkpoint {saved.path}: its sparse table optimizer state is of the "
            "earlier lazy-Adam semantics (per-row step counts, optimizer.state."
            f"{LAZY_ADAM_STEPS}); --stem-optimizer sparse now brings untouched rows up to date "
            "as AdamW does and needs each row's last iteration with a gradient "
            f"(optimizer.state.{TOUCHED}). Resume with --no-load-optim (the tables' rows load, "
            "their moments start anew)")


def check_table_shapes(saved: SavedTables, expected: Dict[int, Tuple[int, int]],
                       token_ids: int | None = None) -> None:
    """Refuse, with the shapes and the flags that set them, a checkpoint whose STEM tables do not
    fit this model's ``[vocab, d_ff]`` (``expected``: saved layer index -> shape): ``d_ff`` must
    be equal; the (padded) vocabulary may differ, as the padding depends on the TP size, as long
    as the checkpoint has a row for each of the tokenizer's ``token_ids`` ids."""
    for layer, shape in expected.items():
        if layer not in saved.shapes:
            continue
        key, found = f"decoder.layers.{layer}.mlp.table", tuple(saved.shapes[layer])
        needed_rows = shape[0] if token_ids is None else min(shape[0], token_ids)
        if found[1:] != tuple(shape[1:]) or found[0] < needed_rows or (
                token_ids is None and found[0] != shape[0]):
            raise ValueError(
                f"STEM table checkpoint {saved.path}: {key} has shape [vocab, d_ff] = "
                f"{list(found)}, but this model's tables are {list(shape)} (padded vocabulary "
                "size from --vocab-size/the tokenizer and --make-vocab-size-divisible-by, d_ff "
                "from --ffn-hidden-size); load it with the model it was trained with")
