"""``benchmarks/stem_placement.py --repeats R``: the variants train R times in ABBA order and each
gets the median of its repeats' own ratios to the gpu variant (a repeat where either failed is
left out), as ``launch/main_job.py --repeats`` does for the main job."""

from __future__ import annotations

import json
import os
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
    }
    path = tmp_path / "r.json"
    placement.write_results(results, str(path))
    assert results["tiered"]["ratios_per_repeat"] == [1.6, 0.8, 1.0, None]
    assert results["tiered"]["ratio_vs_gpu"] == pytest.approx(1.0)
    assert results["gpu"]["ratio_vs_gpu"] == 1.0
    written = json.loads(path.read_text())
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


def test_a_failed_variant_is_written_and_says_so(tmp_path):
    """A variant whose runs all failed (or timed out) is a record in the JSON with its status
    and reason, not left out."""
    results = {"gpu": {"status": "ok", "iteration_ms": 100.0,
                       "iteration_ms_repeats": [100.0, 110.0]},
               "tiered": {"status": "timeout", "reason": "no result within --timeout=180 s",
                          "iteration_ms_repeats": [None, None]}}
    path = tmp_path / "r.json"
    placement.write_results(results, str(path))
    written = json.loads(path.read_text())
    assert written["tiered"]["status"] == "timeout"
    assert written["tiered"]["reason"] == "no result within --timeout=180 s"
    assert written["tiered"]["ratios_per_repeat"] == [None, None]
    assert "ratio_vs_gpu" not in written["tiered"]


def test_every_run_is_recorded_and_a_failure_fails_the_benchmark(tmp_path):
    """``measure`` trains each variant in ABBA order; a run that fails or times out is in the
    variant's ``runs``, its status and reason, the JSON is rewritten after each run, and the
    benchmark's exit names what did not finish."""
    order = []

    def run(name, rep):
        order.append((rep, name))
        if name == "tiered" and rep == 1:
            raise placement.RunFailed("failed", "ValueError: bad flag (exit 1)")
        if name == "cpu":
            raise placement.RunFailed("timeout", "no result within --timeout=5 s")
        return {"iteration_ms": {"gpu": 100.0, "tiered": 102.0}[name] * (1 + rep / 10)}

    path = tmp_path / "r.json"
    results = placement.measure(["gpu", "tiered", "cpu"], 2, run, str(path))
    assert order == placement.run_order(["gpu", "tiered", "cpu"], 2)
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(results))
    tiered, cpu = written["tiered"], written["cpu"]
    assert tiered["status"] == "failed"
    assert tiered["reason"] == "repeat 2: ValueError: bad flag (exit 1)"
    assert [r["status"] for r in tiered["runs"]] == ["ok", "failed"]
    assert tiered["iteration_ms"] == pytest.approx(102.0)  # its run that worked
    assert tiered["ratios_per_repeat"] == [pytest.approx(1.02), None]
    assert cpu["status"] == "timeout" and "iteration_ms" not in cpu
    assert written["gpu"]["status"] == "ok"
    assert placement.unfinished(results) == [
        "tiered (failed: repeat 2: ValueError: bad flag (exit 1))",
        "cpu (timeout: repeat 1: no result within --timeout=5 s)"]
    assert placement.unfinished({"gpu": results["gpu"]}) == []


def test_repeats_give_every_ratio_their_worst_and_spread():
    results = {"gpu": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0, 100.0]},
               "tiered": {"iteration_ms": 93.2, "iteration_ms_repeats": [93.2, 109.1]}}
    placement.write_results(results, None)
    t = results["tiered"]
    assert t["ratio_vs_gpu"] == pytest.approx(1.0115)  # the median
    assert t["ratio_vs_gpu_worst"] == pytest.approx(1.091)
    assert t["ratio_vs_gpu_spread"] == pytest.approx(0.159)


def test_failure_reason_is_the_error_line_not_torchruns_report():
    log = ("some output\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           "ValueError: --stem-gpu-tier=200% must be at most 100%\n"
           "E1128 12:00:00 torch/distributed/elastic/multiprocessing/api.py failed "
           "(exitcode: 1)\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
           "============================================================\n"
           "launch/pretrain.py FAILED\n------------------------------------------------------\n"
           "  exitcode  : 1 (pid: 12)\n"
           "============================================================\n")
    assert placement.failure_reason(log, 1) == \
        "ValueError: --stem-gpu-tier=200% must be at most 100% (exit 1)"
    assert placement.failure_reason("pretrain.py: error: unrecognized arguments: --x\n", 2) == \
        "pretrain.py: error: unrecognized arguments: --x (exit 2)"
    assert placement.failure_reason("", -9) == "no output (exit -9)"


def test_a_run_past_its_timeout_is_stopped():
    rc, log = placement.run_logged(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        timeout=2)
    assert rc is None and "started" in log


def test_variants_that_time_out_are_rows_and_the_benchmark_fails(tmp_path):
    """The benchmark itself: variants that outlive ``--timeout`` are in the JSON with their
    status, the exit is non-zero and names them, and the GPU runner's rows for them are not
    met."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_evidence

    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "benchmarks/stem_placement.py", "--shape", "tiny",
                        "--iters", "6", "--skip", "4", "--variants", "gpu,tiered",
                        "--timeout", "1", "--out", str(tmp_path / "work"), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "not every run finished: gpu (timeout: no result within --timeout=1 s); tiered " \
        "(timeout: no result within --timeout=1 s)" in p.stderr
    written = json.loads(out.read_text())
    assert {n: r["status"] for n, r in written.items()} == {"gpu": "timeout", "tiered": "timeout"}
    rows = {r.metric: r for r in gpu_evidence._rows_placement(str(out))}
    assert rows["gpu tables, step"].met is False
    tiered = rows["tiered tables, step vs gpu tables"]
    assert tiered.value is None and tiered.met is False and "timeout" in tiered.note


def test_every_variant_is_a_stem_configuration_the_flags_accept():
    """Each variant's flags parse with the plugin's flags and give a valid STEM configuration
    (what needs CUDA, as --stem-gpu-step triton, is refused later, on the device's side)."""
    from tests_helpers import parse_tiny_args

    from megatron_ext.stem.family import config_from_args

    for name, flags in placement.VARIANTS.items():
        config = config_from_args(parse_tiny_args(["--model-family", "stem", *flags]))
        assert config.gpu_step == ("triton" if name.endswith("gpu-step") else "torch"), name
