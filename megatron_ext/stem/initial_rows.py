"""A managed STEM table's initial values, drawn a block of rows at a time and kept only for the
rows this rank will own.

Every placement starts from the same numbers: the values an ordinary STEM table gets from
Megatron's CPU initialisation (``_initialize_affine_weight_cpu``: the full-width ``[vocab, F]``
master drawn with the default generator, this TP rank's columns copied out). Drawn that way, a
managed table costs each rank, at start-up, the full ``[vocab, F]`` master plus its
``[vocab, F/tp]`` columns for every STEM layer of the chunk, whatever its share of the rows: on
Llama-3.2-1B's shape (vocabulary 128,256, d_ff 8,192, two STEM layers) 12.6 GB on every rank, so
100 GB on a node of 8 ranks, for tables of which each rank keeps 1.1 GB at DP=8.

``draw_rows`` draws the same master in blocks of rows, one after the other from the same
generator, and keeps this TP rank's columns of the rows asked for. A block costs 32 MiB; what
stays is the kept rows. The values are those of the full draw bit for bit, and the generator ends
where the full draw leaves it (the later parameters' values are unchanged too): PyTorch's CPU
``normal_`` fills a tensor with uniforms in order, then transforms them in groups of 16 in place
(the last, partial group redrawn at the end), so blocks whose sizes are multiples of 16 values
(every block but the last has a multiple of 16 rows) and are at least 16 values long draw the
same numbers. That is a property of the implementation, not a documented contract: each call
checks it on a small table first (``blockwise_is_exact``) and draws the full master when it
does not hold (another PyTorch, another initialiser), as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

BLOCK_BYTES = 32 << 20  # one block of the full-width master


@dataclass
class InitialRows:
    """Drawn rows of a table: ``values[k]`` is global row ``ids[k]`` (``ids`` sorted); ``ids``
    None: every row, ``values`` is the whole ``[vocab, F/tp]``."""
    values: torch.Tensor
    ids: Optional[torch.Tensor] = None

    def rows(self, wanted: torch.Tensor) -> torch.Tensor:
        """Positions in ``values`` of the global rows ``wanted``; a row that was not drawn is
        refused (the rows kept at the draw and the rows the rank owns must agree)."""
        wanted = wanted.to(torch.long)
        if self.ids is None:
            return wanted
        pos = torch.searchsorted(self.ids, wanted).clamp_(max=max(self.ids.numel() - 1, 0))
        if wanted.numel() and (self.ids.numel() == 0 or not torch.equal(self.ids[pos], wanted)):
            raise RuntimeError(
                "STEM table: the rows this rank owns were not all drawn for it at model build "
                f"({self.ids.numel()} rows kept there, {wanted.numel()} owned); the data-parallel "
                "layout at model build and at the tables' set-up must agree")
        return pos


def row_blocks(vocab: int, width: int, block_bytes: int = BLOCK_BYTES
               ) -> Iterator[Tuple[int, int]]:
    """``[start, stop)`` of the blocks of the draw: a multiple of 16 rows each, the remainder
    joined to the last block, so every block holds a multiple of 16 values or ends the table,
    and none is shorter than 16 rows unless the table is."""
    rows = max(16, (block_bytes // (4 * max(width, 1))) // 16 * 16)
    start = 0
    while start < vocab:
        stop = start + rows
        if vocab - stop < rows:  # the remainder joins this block
            stop = vocab
        yield start, stop
        start = stop


def blockwise_is_exact(init_method: Callable[[torch.Tensor], object]) -> bool:
    """Whether ``init_method`` draws the same values block by block as at once (on a 37 x 24
    table in blocks of 16 and 21 rows), leaving the generator in the same state. The default
    generator's state is restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261127)
        whole = torch.empty(37, 24)
        init_method(whole)
        after = torch.rand(4)
        torch.manual_seed(20261127)
        parts = []
        for start, stop in row_blocks(37, 24, block_bytes=16 * 24 * 4):
            part = torch.empty(stop - start, 24)
            init_method(part)
            parts.append(part)
        return torch.equal(torch.cat(parts), whole) and torch.equal(torch.rand(4), after)


def draw_rows(vocab: int, width: int, tp_rank: int, tp_size: int,
              init_method: Callable[[torch.Tensor], object], keep: Optional[torch.Tensor],
              initialize: bool = True, block_bytes: int = BLOCK_BYTES) -> InitialRows:
    """The ``[vocab, width]`` fp32 master drawn with ``init_method`` (the default generator),
    its columns of TP rank ``tp_rank`` of ``tp_size`` (``_initialize_affine_weight_cpu``,
    stride 1), kept for the sorted global rows ``keep`` (None: every row). ``initialize``
    False: the rows' memory only (``--no-initialization``: a checkpoint fills them)."""
    if width % tp_size:
        raise ValueError(f"STEM table width {width} is not divisible by the TP size {tp_size}")
    part = width // tp_size
    cols = slice(tp_rank * part, (tp_rank + 1) * part)
    if keep is not None:
        keep = keep.to(torch.long)
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("draw_rows: the rows to keep must be sorted and distinct")
    rows = vocab if keep is None else keep.numel()
    values = torch.empty(rows, part, dtype=torch.float32)
    if not initialize:
        return InitialRows(values, keep)
    if not blockwise_is_exact(init_method):
        logger.warning("STEM tables: this PyTorch's initialiser does not draw the same values "
                       "block by block; drawing each table's full [vocab, d_ff] master at once")
        master = torch.empty(vocab, width, dtype=torch.float32)
        init_method(master)
        values.copy_(master[:, cols] if keep is None else master[keep][:, cols])
        return InitialRows(values, keep)
    done = 0
    for start, stop in row_blocks(vocab, width, block_bytes):
        block = torch.empty(stop - start, width, dtype=torch.float32)
        init_method(block)
        if keep is None:
            values[start:stop] = block[:, cols]
            continue
        lo, hi = (int(x) for x in torch.searchsorted(keep, torch.tensor([start, stop])))
        values[done:done + hi - lo] = block[keep[lo:hi] - start][:, cols]
        done += hi - lo
    return InitialRows(values, keep)
