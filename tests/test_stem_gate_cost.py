"""benchmarks/stem_gate_cost.py: the lookup-and-gate's cost model, on runs worked out by hand."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import stem_gate_cost as cost  # noqa: E402


def test_makespan_starts_programs_in_order_as_slots_free():
    assert cost.makespan([3, 1, 1, 1], 2) == 3  # 1, 1, 1 run one after another beside the 3
    assert cost.makespan([1, 1, 1, 3], 2) == 4  # the long one starts at 1, when a slot frees


def test_walk_and_chunk_designs_on_hand_counted_runs():
    # Sorted positions 0-19 (row a), 20-22 (b), 23-31 (c): with chunks of 16, only a crosses
    # an edge (chunks 0 and 1: two partial rows, its carry covers one chunk).
    runs = torch.tensor([20, 3, 9])
    chunk = cost.chunk_design(runs, n_cols=256, chunk=16, block_f=128, span=8)
    assert chunk["programs"] == 2 * 2 and chunk["partial_rows"] == 2
    assert chunk["max_steps"] == 3 + 2 + 2 * 1 + 1
    # Two programs: rows a and c on program 0 (3 + 2 * 5 + 1 and 3 + 2 * 3 + 1), b on 1.
    walk = cost.walk_design(runs, n_cols=256, programs=2, rows=4, block_f=1024)
    assert walk["max_steps"] == 14 + 10 and walk["steps"] == [24, 6]


def test_zipf_ids_put_hundreds_of_tokens_on_one_row():
    """The benchmark's ids at its shape: the skew the chunked backward is for."""
    m = cost.model(cost.draw_ids("zipf", 50304, 8192), 5632, 2, 3e12, latencies=(1.0,))
    assert 500 < m["longest_run"] < 900 and 3000 < m["distinct_rows"] < 3800
    t = m["latency_bound_ms"]["1.0us"]
    assert t["chunk_bwd"] < t["walk_bwd"] / 3
