"""Row ownership of vocab-sharded STEM tables: every row has exactly one owner, local indices are
dense per owner, and the load measurement counts what it says."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.runtime.ownership import SCHEMES, RowOwnership, load_per_rank


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("vocab,world", [(10, 3), (12, 4), (7, 7), (1000, 8)])
def test_partition(scheme, vocab, world):
    own = RowOwnership(vocab, world, scheme)
    ids = torch.arange(vocab)
    owners, local = own.owner(ids), own.local_index(ids)
    for rank in range(world):
        mine = own.owned_ids(rank)
        assert mine.numel() == own.num_owned(rank)
        assert torch.equal(owners[mine], torch.full_like(mine, rank))
        assert torch.equal(local[mine], torch.arange(mine.numel()))  # dense, in shard order
    assert sorted(torch.cat([own.owned_ids(r) for r in range(world)]).tolist()) == ids.tolist()
    sizes = [own.num_owned(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_schemes_differ_as_documented():
    assert RowOwnership(10, 3, "contiguous").owned_ids(0).tolist() == [0, 1, 2, 3]
    assert RowOwnership(10, 3, "interleaved").owned_ids(0).tolist() == [0, 3, 6, 9]


def test_load_counts():
    own = RowOwnership(8, 2, "contiguous")  # rank 0: 0..3, rank 1: 4..7
    batches = torch.tensor([[0, 0, 1, 5], [2, 6, 6, 7]])
    load = load_per_rank(own, batches)
    assert load["lookups"] == [0.5, 0.5]
    assert load["unique_rows"] == [(2 + 1) / 2, (1 + 2) / 2]
    assert load["imbalance"] == 1.0


def test_bad_input():
    with pytest.raises(ValueError, match="--stem-row-ownership='random'"):
        RowOwnership(10, 2, "random")
    with pytest.raises(ValueError, match="cannot shard a 2-row"):
        RowOwnership(2, 4)
