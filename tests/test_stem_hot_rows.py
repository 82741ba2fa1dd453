"""Token counts of an indexed dataset, the GPU tier's size and choice, and the critical-path counts
of benchmarks/stem_critical_path.py, each against a plain-Python reference."""

from __future__ import annotations

import collections
import importlib.util
import os

import numpy as np
import pytest
import torch

from megatron_ext.stem import hot_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    spec = importlib.util.spec_from_file_location(
        "stem_critical_path", os.path.join(ROOT, "benchmarks", "stem_critical_path.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
