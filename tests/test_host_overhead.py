"""The host's time per step in the benchmarks: benchmarks/common.py ``timed``'s ``host``, the
step benchmarks' ``host_ms`` and the runner's notes of it, benchmarks/host_overhead.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import common  # noqa: E402
import gpu_evidence  # noqa: E402


class Clock:
    """``time.perf_counter`` stood in: the step and the device sync each move it on by a known
    amount, so the timings are exact (no sleeps)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_timed_gives_the_host_time_before_the_device_sync(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    monkeypatch.setattr(common, "sync", lambda: setattr(clock, "now", clock.now + 3.0))
    host = iter([1.0, 2.0, 4.0])

    def step():  # the host's part: enqueueing forward and backward
        clock.now += next(host)

    times = common.timed(step, lambda: None, reps=2, warmup=1)
    # Each step: its host part, then the sync's 3 s (the device finishing); warm-up left out.
    assert list(times) == [5.0, 7.0] and times.host == [2.0, 4.0]


def test_alternate_timed_gives_each_runs_host_median():
    def side(step_s, host_s):
        def measure():
            t = common.StepTimes()
            t.extend(step_s)
            t.host.extend(host_s)
            return t
        return measure

    step, host = common.alternate_timed(
        {"dense": side([0.010, 0.012, 0.011], [0.004, 0.006, 0.005]),
         "moe": side([0.020], [0.009]), "plain": lambda: [0.001]}, 2)
    assert step == {"dense": [pytest.approx(11.0)] * 2, "moe": [pytest.approx(20.0)] * 2,
                    "plain": [pytest.approx(1.0)] * 2}
    # A side whose measure gives plain seconds (CUDA events) has no host times.
    assert host == {"dense": [pytest.approx(5.0)] * 2, "moe": [pytest.approx(9.0)] * 2}
    assert common.alternate({"plain": lambda: [0.001]}, 1) == {"plain": [pytest.approx(1.0)]}


def test_side_line_prints_the_census_or_the_compile_time():
    census = {"kernels": 767, "would_sync": ["a", "b"], "cuda_syncs": None}
    assert common.side_line("dense", 13, 68.6, 41.25, 1234567, "", census) == (
        "  dense        :       68.6 ms (host 41.2)  params 1,234,567  | kernels/step 767, "
        "flagged syncs 2")
    census["cuda_syncs"] = ["x"]
    assert common.side_line("sigma", 9, 5.0, None, 10, " (+1%)", census).endswith(
        "params 10 (+1%)  | kernels/step 767, flagged syncs 2, CUDA syncs 1")
    assert common.side_line("g+compiled", 13, 9.0, 2.0, 10, "", None, 12.34).endswith(
        "| compiled in 12.3 s (first two steps)")


def _rows(reader, tmp_path, result):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    return {r.metric: r for r in reader(str(path))}


def test_the_runner_shows_host_time_beside_step_time(tmp_path):
    step = {"step_ms": {"dense": 68.6, "dense-masked": 89.0},
            "host_ms": {"dense": 41.16, "dense-masked": 80.1},
            "overhead_pct": {"dense-masked": 29.7},
            "overhead_pct_runs": {"dense-masked": [29.0, 30.4]}}
    rows = _rows(gpu_evidence._rows_overhead("structmoe_step", "step", "triton"), tmp_path, step)
    assert rows["dense step"].note == "dense: host 41.16 of 68.60 ms (60%)"
    assert "89.00 ms; dense-masked: host 80.10 of 89.00 ms (90%)" in \
        rows["StructMoE (dense-masked) over dense"].note
    del step["host_ms"]  # a result of before host_ms: the notes as they were
    rows = _rows(gpu_evidence._rows_overhead("structmoe_step", "step", "triton"), tmp_path, step)
    assert rows["dense step"].note == "" and "host" not in \
        rows["StructMoE (dense-masked) over dense"].note

    sigma = {"ratio_sigma_vs_upstream": 1.01, "ratio_runs": [1.01, 1.012],
             "step_ms": {"sigma": 101.0, "upstream": 100.0},
             "host_ms": {"sigma": 30.0, "upstream": 25.0}}
    (row,) = _rows(gpu_evidence._rows_sigma, tmp_path, sigma).values()
    assert row.note.startswith("101.0 vs 100.0 ms; sigma: host 30.00 of 101.00 ms (30%); "
                               "upstream: host 25.00 of 100.00 ms (25%)")
    mlp = {"dense_ms": 3.0, "stem_torch_ms": 2.5, "stem_torch_speedup": 1.2,
           "host_ms": {"dense": 1.5, "stem_torch": 2.5}}
    rows = _rows(gpu_evidence._rows_stem_mlp, tmp_path, mlp)
    assert rows["dense SwiGLU fwd+bwd"].note == "dense: host 1.50 of 3.00 ms (50%)"
    assert "stem_torch: host 2.50 of 2.50 ms (100%)" in \
        rows["STEM MLP (torch) speed-up vs dense"].note


# -- benchmarks/host_overhead.py --------------------------------------------------------------

def test_host_overhead_benchmark_runs_and_counts_the_compat_calls(mcore_single_rank, tmp_path):
    import host_overhead

    out = tmp_path / "host.json"
    s = host_overhead.main(["--layers", "1", "--reps", "1", "--warmup", "0", "--repeats", "2",
                            "--backends", "grouped",
                            "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(s))
    for family, base, side in (("structmoe", "dense", "grouped"), ("sigma", "upstream", "sigma")):
        r = s[family]
        assert set(r["host_ms"]) == set(r["step_ms"]) and base in r["host_ms"] and side in \
            r["host_ms"]
        assert all(len(v) == 2 for v in r["extra_host_ms_per_layer_runs"].values())
        assert r["extra_host_ms_per_layer_runs"][side] == pytest.approx(
            [h - b for h, b in zip(r["host_ms_runs"][side], r["host_ms_runs"][base])])
        # On the CPU every torch call passes the CPU backend's mode: the routed side more.
        calls = r["compat_calls_per_step"]
        assert calls[side] > calls[base] > 0, calls
    # Its cost per call is measured (a timing: its sign is not asserted on a loaded machine).
    assert set(s["compat"]["est_ms_per_step"]) == {"structmoe", "sigma"}
    assert s["compat"]["est_ms_per_step"]["sigma"]["sigma"] == pytest.approx(
        s["sigma"]["compat_calls_per_step"]["sigma"] * s["compat"]["us_per_call"] / 1e3)
    # The runner's host_overhead step reads this JSON (tests/test_gpu_plan_smoke.py runs no
    # second one): each side's host time per step, each routed side's extra per layer over its
    # baseline, the worse of the two runs.
    step = {x.name: x for x in gpu_evidence.plan()}["host_overhead"]
    assert step.argv[1] == "benchmarks/host_overhead.py" and step.result == "host_overhead.json"
    rows = {r.metric: r for r in step.rows(str(out))}
    assert all(r.step == "host_overhead" and r.goal is None for r in rows.values())
    for family, base, side in (("structmoe", "dense", "grouped"), ("sigma", "upstream", "sigma")):
        for name in (base, side):
            host = rows[f"{family} {name}: host time per step"]
            assert host.value == s[family]["host_ms"][name] and host.unit == "ms"
            assert "of it the CPU backend's mode" in host.note
        extra = rows[f"{family} {side}: extra host time per layer over {base}"]
        assert extra.value == max(s[family]["extra_host_ms_per_layer_runs"][side])
        assert "worst of runs" in extra.note
    assert len(rows) == 6, sorted(rows)
