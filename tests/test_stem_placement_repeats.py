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


def test_no_repeats_is_refused():
    p = subprocess.run([sys.executable, "benchmarks/stem_placement.py", "--repeats", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--repeats=0 must be at least 1" in p.stderr
