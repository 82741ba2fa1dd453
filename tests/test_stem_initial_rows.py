"""A managed STEM table's initial rows drawn block by block (stem/initial_rows.py) against the full
master drawn at once with plain PyTorch and sliced, bit for bit: every TP column share, every
row kept or a rank's share of them, odd vocabularies and widths; the generator left where the
full draw leaves it; the fallback for an initialiser that is not blockwise-exact."""

import pytest
import torch
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

from megatron_ext.stem.initial_rows import (InitialRows, blockwise_is_exact, draw_rows,
                                            row_blocks)
from megatron_ext.stem.runtime.ownership import RowOwnership
from megatron_ext.stem.runtime.store import TableStore


def normal(std):
    return lambda t: torch.nn.init.normal_(t, mean=0.0, std=std)


def reference(vocab, width, tp_rank, tp_size, init, keep, seed):
    """The full master drawn at once, this TP rank's columns, the kept rows; and what the
    generator draws next."""
    torch.manual_seed(seed)
    master = torch.empty(vocab, width)
    init(master)
    after = torch.rand(5)
    part = width // tp_size
    values = master[:, tp_rank * part:(tp_rank + 1) * part]
    return (values if keep is None else values[keep]), after


SHAPES = [(777, 100, 16), (777, 100, 48), (4099, 64, 1024), (33, 7, 16), (10, 24, 16),
          (1000, 5, 32)]  # vocabulary, width, rows per block


@pytest.mark.parametrize("vocab,width,block_rows,tp_size",
                         [(*shape, tp) for shape in SHAPES for tp in (1, 2) if shape[1] % tp == 0])
@pytest.mark.parametrize("share", ["all", "interleaved", "contiguous"])
def test_blocks_draw_the_full_masters_values(vocab, width, block_rows, tp_size, share):
    init = normal(0.37)
    block_bytes = block_rows * width * 4
    for dp_rank, dp_size in ([(0, 1)] if share == "all" else [(0, 3), (2, 3)]):
        keep = None if share == "all" else \
            RowOwnership(vocab, dp_size, share).owned_ids(dp_rank)
        for tp_rank in range(tp_size):
            want, want_after = reference(vocab, width, tp_rank, tp_size, init, keep, seed=11)
            torch.manual_seed(11)
            drawn = draw_rows(vocab, width, tp_rank, tp_size, init, keep,
                              block_bytes=block_bytes)
            after = torch.rand(5)
            assert torch.equal(drawn.values, want)
            assert torch.equal(after, want_after)  # the later parameters draw the same numbers
            assert drawn.ids is keep or torch.equal(drawn.ids, keep)


def test_same_values_as_megatrons_cpu_initialisation():
    """What an ordinary STEM table gets (mlp.py: ``_initialize_affine_weight_cpu``)."""
    vocab, width, init = 300, 64, normal(0.02)
    for tp_rank in range(2):
        torch.manual_seed(5)
        table = torch.empty(vocab, width // 2)
        _initialize_affine_weight_cpu(table, vocab, width, width // 2, 1, init,
                                      params_dtype=torch.float32, rank=tp_rank, world_size=2,
                                      skip_set_tensor_parallel_attributes=True)
        torch.manual_seed(5)
        drawn = draw_rows(vocab, width, tp_rank, 2, init, None, block_bytes=16 * width * 4)
        assert torch.equal(drawn.values, table)


def test_drawn_a_block_at_a_time():
    """No tensor of the full master is made: the initialiser sees blocks of whole multiples of
    16 rows (the last one with the remainder), covering the vocabulary once, in order."""
    shapes = []

    def init(t):
        shapes.append(tuple(t.shape))
        torch.nn.init.normal_(t)

    draw_rows(1000, 64, 0, 1, init, torch.arange(0, 1000, 4), block_bytes=64 * 64 * 4)
    assert shapes[:3] == [(37, 24), (16, 24), (21, 24)]  # the check: at once, then in blocks
    shapes = shapes[3:]
    assert [r for r, _ in shapes] == [64] * 14 + [104]
    assert all(w == 64 for _, w in shapes)
    assert list(row_blocks(1000, 64, 64 * 64 * 4))[-1] == (896, 1000)
    assert list(row_blocks(10, 3, 1)) == [(0, 10)]
    assert list(row_blocks(40, 3, 16 * 3 * 4)) == [(0, 16), (16, 40)]


def test_an_initialiser_that_is_not_blockwise_falls_back_to_the_full_master(caplog):
    def one_value(t):  # one random number for the whole tensor: blocks would differ
        t.fill_(float(torch.rand(1)))

    assert not blockwise_is_exact(one_value)
    assert blockwise_is_exact(normal(1.0))
    keep = torch.tensor([1, 5, 6, 99])
    want, want_after = reference(100, 8, 1, 2, one_value, keep, seed=3)
    torch.manual_seed(3)
    with caplog.at_level("WARNING"):
        drawn = draw_rows(100, 8, 1, 2, one_value, keep, block_bytes=16 * 8 * 4)
    assert torch.equal(drawn.values, want) and torch.equal(torch.rand(5), want_after)
    assert "full [vocab, d_ff] master" in caplog.text


def test_without_initialisation_nothing_is_drawn():
    torch.manual_seed(9)
    want = torch.rand(3)
    torch.manual_seed(9)
    drawn = draw_rows(50, 4, 0, 1, normal(1.0), torch.tensor([2, 3]), initialize=False)
    assert drawn.values.shape == (2, 4) and torch.equal(torch.rand(3), want)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="sorted and distinct"):
        draw_rows(10, 4, 0, 1, normal(1.0), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="not divisible"):
        draw_rows(10, 5, 0, 2, normal(1.0), None)
    rows = InitialRows(torch.zeros(2, 4), torch.tensor([2, 7]))
    assert rows.rows(torch.tensor([7, 2])).tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="were not all drawn"):
        rows.rows(torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="were not all drawn"):
        rows.rows(torch.tensor([8]))


@pytest.mark.parametrize("placement", ["cpu", "tiered"])
def test_store_from_kept_rows_equals_store_from_full_table(placement):
    vocab, width = 203, 24
    table = torch.randn(vocab, width)
    base = RowOwnership(vocab, 2, "interleaved").owned_ids(1)
    owned = base if placement == "cpu" else torch.cat([base[5:9], base[:5], base[9:]])
    num_hot = 4 if placement == "tiered" else None
    full = TableStore(iter([table]), owned, placement, torch.device("cpu"), num_hot,
                      huge_pages=False)
    kept = TableStore(iter([InitialRows(table[base].clone(), base)]), owned, placement,
                      torch.device("cpu"), num_hot, huge_pages=False)
    for a, b in zip(full.shards, kept.shards):
        if placement == "tiered":
            assert torch.equal(a.hot, b.hot) and torch.equal(a.cold, b.cold)
            assert torch.equal(b.hot, table[owned[:num_hot]])
        else:
            assert torch.equal(a, b) and torch.equal(b, table[owned])


def test_benchmark_runs_and_checks_its_values(tmp_path):
    """benchmarks/stem_initial_rows.py on a small shape: both ways run and keep the same values
    (the benchmark exits non-zero if their checksums differ)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "stem_initial_rows.py"),
                    "--vocab", "3000", "--width", "256", "--dp", "2", "--tp", "2",
                    "--json", str(out)], check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["full"]["checksum"] == result["blocks"]["checksum"]
    assert result["blocks"]["kept_bytes"] == 2 * 1500 * 128 * 4
