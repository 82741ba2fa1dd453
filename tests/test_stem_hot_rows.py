"""Token counts of an indexed dataset (whole, and the sampled count of start-up: its windows, the
blend's shares), the GPU tier's size and choice, and the critical-path counts of
benchmarks/stem_critical_path.py, each against a plain-Python reference."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from megatron_ext.stem.runtime import hot_rows
from tests_helpers import load_script


def _write_dataset(prefix: str, docs, dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_token_counts_match_a_counter(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    docs_a = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in (7, 31, 1, 200)]
    docs_b = [torch.randint(0, 50, (90,), generator=g).tolist()]
    _write_dataset(str(tmp_path / "a"), docs_a)
    _write_dataset(str(tmp_path / "b"), docs_b, dtype=np.int32)
    # Small chunks so that the chunked pass is exercised, not one read of the whole file.
    monkeypatch.setattr(hot_rows, "CHUNK_TOKENS", 13)
    counts = hot_rows.token_counts([str(tmp_path / "a"), str(tmp_path / "b")], vocab=64)
    expected = collections.Counter(t for doc in docs_a + docs_b for t in doc)
    assert counts.tolist() == [expected.get(i, 0) for i in range(64)]
    with pytest.raises(ValueError, match="token id 4"):
        hot_rows.token_counts([str(tmp_path / "a")], vocab=4)


@pytest.mark.parametrize("total,budget,window", [(1000, 0, 64), (1000, 1000, 64), (1000, 5000, 64),
                                                 (1000, 200, 64), (1000, 64, 64), (1000, 10, 64),
                                                 (1003, 500, 64), (10**6, 3 * 2**16, 2**16)])
def test_sampled_count_reads_evenly_spaced_windows(tmp_path, monkeypatch, total, budget, window):
    """With id = position, the counts show which tokens a count read: the whole dataset, or
    ceil(budget / window) disjoint runs of one length (budget tokens in all, rounded down), the
    first at the start, the last at the end, their starts evenly spaced (gaps differ by <= 1)."""
    monkeypatch.setattr(hot_rows, "COUNT_WINDOW", window)
    monkeypatch.setattr(hot_rows, "CHUNK_TOKENS", 97)  # windows read in several chunks
    prefix = str(tmp_path / "positions")
    _write_dataset(prefix, [list(range(total))], dtype=np.int32)
    got = hot_rows.count_dataset(prefix, vocab=total, max_tokens=budget)
    read = got.counts.numpy()
    assert got.total == total and set(np.unique(read)) <= {0, 1}
    assert got.counted == int(read.sum())
    if budget == 0 or budget >= total:
        assert got.counted == total
        return
    edges = np.flatnonzero(np.diff(np.concatenate([[0], read, [0]])))
    starts, stops = edges[0::2], edges[1::2]
    k = -(-budget // window)
    assert len(starts) == k, "windows merged or missing"
    widths = stops - starts
    assert (widths == budget // k).all() and got.counted == k * (budget // k) <= budget
    assert starts[0] == 0
    if k > 1:
        assert stops[-1] == total
        gaps = np.diff(starts)
        assert gaps.max() - gaps.min() <= 1


def test_count_budget_refused_below_zero():
    with pytest.raises(ValueError, match="token budget of -1"):
        hot_rows.count_windows(100, -1)
    from megatron_ext.stem.config import StemConfig

    with pytest.raises(ValueError, match="--stem-tier-count-tokens=-5"):
        StemConfig(placement="tiered", sharding="vocab", tier_count_tokens=-5)


def test_blend_frequencies_match_a_plain_reference(tmp_path):
    """Megatron's blend: with weights, dataset i gives weights[i] / sum of the training tokens;
    without, each in proportion to its size. Each id's share is the sum over the datasets of
    their share times its frequency there; a dataset with weight 0 is not read."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 10, (300,), generator=g).tolist()
    b = torch.randint(5, 15, (100,), generator=g).tolist()
    _write_dataset(str(tmp_path / "a"), [a[:120], a[120:]])
    _write_dataset(str(tmp_path / "b"), [b])
    _write_dataset(str(tmp_path / "bad"), [[99]])  # beyond the vocabulary: read only if weighted
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    ca, cb = collections.Counter(a), collections.Counter(b)
    vocab = 16

    got = hot_rows.training_frequencies(prefixes, [1.0, 3.0], vocab, max_tokens=0)
    ref = [0.25 * ca[i] / len(a) + 0.75 * cb[i] / len(b) for i in range(vocab)]
    torch.testing.assert_close(got.share, torch.tensor(ref, dtype=torch.float64))
    assert (got.counted, got.total, got.weighted) == (400, 400, True)

    got = hot_rows.training_frequencies(prefixes, None, vocab, max_tokens=0)
    ref = [(ca[i] + cb[i]) / 400 for i in range(vocab)]
    torch.testing.assert_close(got.share, torch.tensor(ref, dtype=torch.float64))
    assert not got.weighted

    got = hot_rows.training_frequencies(prefixes + [str(tmp_path / "bad")], [1.0, 3.0, 0.0],
                                        vocab, max_tokens=0)
    assert got.total == 401 and got.counted == 400
    with pytest.raises(ValueError, match="blend weights"):
        hot_rows.training_frequencies(prefixes, [1.0, -1.0], vocab, max_tokens=0)


def test_budget_shared_among_the_blend_by_share(tmp_path, monkeypatch):
    """A budget of 2 x 64 tokens over datasets with shares 3/4 and 1/4: 96 and 32 tokens, each
    at least one window (here 16 tokens)."""
    monkeypatch.setattr(hot_rows, "COUNT_WINDOW", 16)
    _write_dataset(str(tmp_path / "a"), [[1] * 1000])
    _write_dataset(str(tmp_path / "b"), [[2] * 1000])
    got = hot_rows.training_frequencies([str(tmp_path / "a"), str(tmp_path / "b")], [3.0, 1.0],
                                        vocab=4, max_tokens=128)
    assert got.counted == 96 + 32 and got.total == 2000
    torch.testing.assert_close(got.share, torch.tensor([0.0, 0.75, 0.25, 0.0],
                                                       dtype=torch.float64))


def test_sampled_tier_carries_the_tokens_of_the_exact_one(tmp_path, monkeypatch):
    """A Zipf(1) corpus of 2^20 tokens over 4096 ids (hot ids scattered over the vocabulary):
    the 10% tier chosen from 1/16 of the tokens (16 windows) carries within 0.01 of the share of
    tokens the tier chosen from every token does."""
    monkeypatch.setattr(hot_rows, "COUNT_WINDOW", 1 << 12)
    vocab, n = 4096, 1 << 20
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(vocab, generator=g)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    stream = perm[torch.multinomial(1.0 / ranks, n, replacement=True, generator=g)]
    prefix = str(tmp_path / "zipf")
    _write_dataset(prefix, [stream[i:i + 4096].tolist() for i in range(0, n, 4096)])
    exact = torch.bincount(stream, minlength=vocab).to(torch.float64)
    sampled = hot_rows.training_frequencies([prefix], None, vocab, max_tokens=n // 16)
    assert sampled.counted == n // 16
    rows = vocab // 10
    carried = exact[hot_rows.hot_mask(sampled.share, rows, vocab)].sum() / n
    best = exact[hot_rows.hot_mask(exact, rows, vocab)].sum() / n
    assert best - 0.01 <= carried <= best


@pytest.mark.parametrize("spec,rows", [("10%", 100), ("0.25", 250), ("250", 250), (0.5, 500),
                                       ("0", 0), ("1000", 1000), ("100%", 1000)])
def test_tier_size(spec, rows):
    assert hot_rows.parse_tier_size(spec, 1000) == rows


@pytest.mark.parametrize("spec", ["1001", "-1", "1.5", "ten", "120%"])
def test_tier_size_refused(spec):
    with pytest.raises(ValueError, match="GPU tier size"):
        hot_rows.parse_tier_size(spec, 1000)


def test_hottest_rows_in_count_then_id_order():
    counts = torch.tensor([3, 9, 3, 0, 9, 1])
    assert hot_rows.hottest(counts, 4).tolist() == [1, 4, 0, 2]
    assert hot_rows.hot_mask(counts, 2, vocab=8).tolist() == [
        False, True, False, False, True, False, False, False]
    assert hot_rows.hottest(counts, 0).numel() == 0


def _bench():
    return load_script("benchmarks/stem_critical_path.py", "stem_critical_path")


def test_critical_path_matches_a_set_reference():
    bench = _bench()
    vocab, mbs, tokens, d_ff = 40, 3, 11, 8
    stream = bench.zipf_stream(vocab, 6 * mbs * tokens + 5, 1.0, seed=3)
    hot = hot_rows.hot_mask(torch.bincount(stream, minlength=vocab), 6, vocab)
    got = bench.critical_path(stream, hot, mbs, tokens, d_ff)
    hot_set = {i for i in range(vocab) if hot[i]}
    steps = [[stream[(s * mbs + m) * tokens:(s * mbs + m + 1) * tokens].tolist()
              for m in range(mbs)] for s in range(6)]
    ref = collections.defaultdict(float)
    for prev, cur in zip(steps, steps[1:]):
        touched_prev = {t for mb in prev for t in mb}
        touched = {t for mb in cur for t in mb}
        waits = set(cur[0]) & touched_prev
        ref["critical_rows_host_only"] += len(waits)
        ref["critical_rows"] += len(waits - hot_set)
        ref["distinct_rows"] += len(touched)
        flat = [t for mb in cur for t in mb]
        ref["hit_rate"] += sum(t in hot_set for t in flat) / len(flat)
        ref["host_rows_fetched"] += sum(len(set(mb) - hot_set) for mb in cur)
        ref["host_rows_stepped"] += len(touched - hot_set)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value / 5), key
    assert got["steps"] == 5
    assert got["host_bytes_to_gpu"] == pytest.approx(got["host_rows_fetched"] * d_ff * 2)
    assert got["critical_rows"] < got["critical_rows_host_only"]  # the tier takes rows off
