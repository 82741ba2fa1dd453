"""``benchmarks/stem_placement.py --repeats R``: the variants train R times in ABBA order and each
gets the median of its repeats' own ratios to the gpu variant (a repeat where either failed is
left out), as ``launch/main_job.py --repeats`` does for the main job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests_helpers import ROOT, load_script

placement = load_script("benchmarks/stem_placement.py", "stem_placement_bench")


def test_repeats_alternate_the_order():
    assert placement.run_order(["gpu", "tiered"], 3) == [
        (0, "gpu"), (0, "tiered"), (1, "tiered"), (1, "gpu"), (2, "gpu"), (2, "tiered")]
    assert placement.run_order(["gpu", "cpu", "tiered"], 1) == [
        (0, "gpu"), (0, "cpu"), (0, "tiered")]


def test_ratio_is_the_median_of_each_repeats_own_ratio(tmp_path):
    results = {
        "gpu": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0, 200.0, 110.0, None]},
        # pooled medians would give 160 / 110 = 1.45; the repeats' own ratios 1.6, 0.8, 1.0
        "tiered": {"iteration_ms": 160.0, "iteration_ms_repeats": [160.0, 160.0, 110.0, 90.0]},
        "cpu": {},  # no run of it worked: not written
    }
    path = tmp_path / "r.json"
    placement.write_results(results, str(path))
    assert results["tiered"]["ratios_per_repeat"] == [1.6, 0.8, 1.0, None]
    assert results["tiered"]["ratio_vs_gpu"] == pytest.approx(1.0)
    assert results["gpu"]["ratio_vs_gpu"] == 1.0
    written = json.loads(path.read_text())
    assert sorted(written) == ["gpu", "tiered"]
    assert written["tiered"]["ratio_vs_gpu"] == pytest.approx(1.0)


def test_one_repeat_gives_the_plain_ratio():
    results = {"gpu": {"iteration_ms": 80.0, "iteration_ms_repeats": [80.0]},
               "tiered": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0]}}
    placement.write_results(results, None)
    assert results["tiered"]["ratio_vs_gpu"] == pytest.approx(1.25)


def test_ratios_against_the_sparse_gpu_baseline():
    """With ``gpu-sparse`` (every row on the GPU, the host variants' optimizer) each variant also
    gets its ratio to that, per repeat and their median; without it, none."""
    results = {"gpu": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0, 100.0, 100.0]},
               "gpu-sparse": {"iteration_ms": 80.0, "iteration_ms_repeats": [80.0, 50.0, 90.0]},
               "tiered": {"iteration_ms": 90.0, "iteration_ms_repeats": [90.0, 100.0, 81.0]}}
    placement.write_results(results, None)
    assert results["tiered"]["ratios_per_repeat_vs_gpu_sparse"] == pytest.approx([1.125, 2.0, 0.9])
    assert results["tiered"]["ratio_vs_gpu_sparse"] == pytest.approx(1.125)
    assert results["tiered"]["ratio_vs_gpu"] == pytest.approx(0.9)
    assert results["gpu-sparse"]["ratio_vs_gpu"] == pytest.approx(0.8)
    alone = {"gpu": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0]},
             "tiered": {"iteration_ms": 90.0, "iteration_ms_repeats": [90.0]}}
    placement.write_results(alone, None)
    assert "ratio_vs_gpu_sparse" not in alone["tiered"]


def test_gpu_sparse_puts_every_row_in_the_gpu_tier():
    flags = placement.VARIANTS["gpu-sparse"]
    assert flags[flags.index("--stem-gpu-tier") + 1] == "100%"
    assert flags[flags.index("--stem-optimizer") + 1] == "sparse"
    assert placement.VARIANTS["tiered"][:-1] == flags[:-1]  # only the tier's size differs


def test_no_repeats_is_refused():
    p = subprocess.run([sys.executable, "benchmarks/stem_placement.py", "--repeats", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--repeats=0 must be at least 1" in p.stderr
