"""The profile of a family benchmark's step against its baseline's, on the CPU: ``profile_sides``
(``benchmarks/common.py``) traces two sides with PyTorch's profiler and the summary of
``megatron_ext/tools/trace_summary.py`` says where the extra time goes, per kernel (per operator on
the CPU), the rows adding up to the difference of the totals; a hand-made GPU trace checks the
kernel table, the host's synchronisations by the operator that made them and the idle time's
difference by hand; a trace over the size limit keeps its GPU timeline or is dropped. The runner's
``profile`` step on the real benchmarks (tiny shapes): tests/test_gpu_plan_smoke.py."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from megatron_ext.tools import trace_summary
from tests_helpers import load_script

common = load_script("benchmarks/common.py", "bench_common")


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}


def test_profile_sides_on_the_cpu_says_where_the_extra_time_goes(tmp_path):
    """``ours`` does the baseline's work, one more matmul and an ``.item()`` per step: the diff
    shows one more ``aten::mm`` launch per step, the synchronising operator, and its rows add up
    to the difference of the totals."""
    a = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, 64)

    def base_step():
        (a @ b).sum().backward()

    def ours_step():
        y = (a @ b) @ b
        y.sum().backward()
        y[0, 0].item()

    def reset():
        a.grad = None

    out = common.profile_sides({"base": (base_step, reset), "ours": (ours_step, reset)},
                               "base", str(tmp_path), warmup=1, steps=3, info={"shape": "toy"})
    assert json.loads((tmp_path / "profile.json").read_text()) == json.loads(json.dumps(out))
    assert out["activities"] == ["CPU"] and out["shape"] == "toy"
    for side in ("base", "ours"):
        trace = out["sides"][side]["trace"]
        assert trace["path"] == str(tmp_path / f"trace_{side}.json.gz") and trace["kept"] == "whole"
        # The kept trace reads back into the same summary.
        again = trace_summary.summarize(trace_summary.load_events(trace["path"]))
        s = out["sides"][side]["summary"]
        assert again["kernels"]["by_name"].keys() == s["kernels"]["by_name"].keys()
        assert again["kernels"]["ms_per_step"] == pytest.approx(s["kernels"]["ms_per_step"])
        assert len(s["steps"]) == 3  # the profiler's warm-up step is not in the trace
        assert s["kernels"]["source"] == "cpu operators' self time"
        assert {"kernels", "host_syncs", "steps"} <= set(s)
        assert not (tmp_path / f"trace_{side}.json").exists()  # only the gzipped one
    ours = out["sides"]["ours"]["summary"]
    assert ours["host_syncs"]["sync_ops"]["aten::_local_scalar_dense"]["count"] == 1
    assert out["sides"]["base"]["summary"]["host_syncs"]["sync_ops"] == {}
    # Self times add up to the time in operators: no more than the steps took.
    assert 0 < ours["kernels"]["ms_per_step"] <= trace_summary._mean_step_ms(ours)
    d = out["diffs"]["ours"]
    assert set(out["diffs"]) == {"ours"}
    assert sum(r["diff_ms"] for r in d["rows"]) == pytest.approx(d["total"]["diff_ms"], abs=1e-9)
    assert d["total"]["diff_ms"] == pytest.approx(
        ours["kernels"]["ms_per_step"]
        - out["sides"]["base"]["summary"]["kernels"]["ms_per_step"], abs=1e-9)
    (mm,) = [r for r in d["rows"] if r["name"] == "aten::mm"]
    # Forward: one more mm; backward: a's gradient through two products instead of one.
    assert mm["ours_count"] - mm["base_count"] == 2
    table = "\n".join(trace_summary.describe_diff(d, "base", "ours"))
    assert "| aten::mm |" in table and "**all**" in table


def test_a_baseline_that_is_not_a_side_is_refused(tmp_path):
    with pytest.raises(ValueError, match="baseline 'dense' is not among the sides"):
        common.profile_sides({"ours": (lambda: None, lambda: None)}, "dense", str(tmp_path), 0, 1)


def test_self_times_of_nested_operators_add_up_to_their_union():
    ops = [_x("cpu_op", "A", 0, 100), _x("cpu_op", "B", 10, 30), _x("cpu_op", "C", 20, 10),
           _x("cpu_op", "D", 50, 10), _x("cpu_op", "A", 200, 50, tid=2)]
    assert trace_summary._self_times_us(ops) == {"A": [2, 110.0], "B": [1, 20.0],
                                                 "C": [1, 10.0], "D": [1, 10.0]}


GPU_TRACE = [
    _x("user_annotation", "ProfilerStep#1", 0, 1000, tid=11),
    _x("user_annotation", "ProfilerStep#2", 1000, 1000, tid=11),
    _x("kernel", "gemm", 100, 300, tid=7, stream=7),
    _x("kernel", "gemm", 1100, 300, tid=7, stream=7),
    _x("kernel", "gather", 500, 100, tid=7, stream=7),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 700, 10, tid=7, stream=7, bytes=4),
    # An .item(): the blocking call inside _local_scalar_dense inside item.
    _x("cpu_op", "aten::item", 600, 200, tid=11),
    _x("cpu_op", "aten::_local_scalar_dense", 610, 180, tid=11),
    _x("cuda_runtime", "cudaMemcpyAsync", 620, 5, tid=11),
    _x("cuda_runtime", "cudaStreamSynchronize", 630, 150, tid=11),
    # The benchmark's own end-of-step wait, and a call outside any operator.
    _x("user_annotation", "benchmark/end-of-step-sync", 1500, 400, tid=11),
    _x("cuda_runtime", "cudaDeviceSynchronize", 1510, 380, tid=11),
    _x("cuda_runtime", "cudaStreamSynchronize", 1950, 20, tid=11),
]


def test_kernels_and_host_syncs_of_a_gpu_trace():
    s = trace_summary.summarize(GPU_TRACE)
    k = s["kernels"]
    assert k["source"] == "gpu" and k["steps"] == 2
    assert list(k["by_name"]) == ["gemm", "gather", "Memcpy DtoH (Device -> Pageable)"]
    assert k["by_name"]["gemm"] == {"count": 1.0, "ms": pytest.approx(0.3)}
    assert k["ms_per_step"] == pytest.approx((600 + 100 + 10) / 2 / 1e3)
    h = s["host_syncs"]
    assert h["calls"] == {"cudaDeviceSynchronize": {"count": 0.5, "ms": pytest.approx(0.19)},
                          "cudaStreamSynchronize": {"count": 1.0, "ms": pytest.approx(0.085)}}
    assert h["by_op"] == {
        "benchmark/end-of-step-sync": {"count": 0.5, "ms": pytest.approx(0.19)},
        "aten::_local_scalar_dense": {"count": 0.5, "ms": pytest.approx(0.075)},
        "(no operator)": {"count": 0.5, "ms": pytest.approx(0.01)}}
    assert h["blocking_ms_per_step"] == pytest.approx(0.275)
    assert h["sync_ops"] == {"aten::_local_scalar_dense": {"count": 0.5, "ms": pytest.approx(0.09)}}
    text = "\n".join(trace_summary.describe(s))
    assert "top by GPU time per step (all: 0.35 ms): gemm 0.300 ms (1x)" in text
    assert "in aten::_local_scalar_dense 0.07 ms (0.5x)" in text


def test_diff_against_a_baseline_by_hand():
    base = trace_summary.summarize(GPU_TRACE)
    # Ours: the same, its gathers 250 us longer each and one more small kernel a step; the idle
    # time between the main stream's kernels changes with them.
    ours_trace = [dict(e) for e in GPU_TRACE if e["name"] != "gather"] + [
        _x("kernel", "gather", 500, 350, tid=7, stream=7),
        _x("kernel", "sort", 1450, 20, tid=7, stream=7),
        _x("kernel", "sort", 1480, 20, tid=7, stream=7)]
    ours = trace_summary.summarize(ours_trace)
    d = trace_summary.diff(base, ours, top=1)
    assert d["rows"][0] == {"name": "gather", "base_ms": pytest.approx(0.05),
                            "ours_ms": pytest.approx(0.175), "diff_ms": pytest.approx(0.125),
                            "base_count": 0.5, "ours_count": 0.5}
    rest = d["rows"][1]  # sort (+0.02 ms), gemm and the copy unchanged: one row
    assert rest["rest"] == 3 and rest["diff_ms"] == pytest.approx(0.02)
    assert sum(r["diff_ms"] for r in d["rows"]) == pytest.approx(d["total"]["diff_ms"], abs=1e-12)
    assert d["total"]["diff_ms"] == pytest.approx(0.145)
    # Main stream: base busy 100-400, 500-600, 700-710, 1100-1400 over 100..1400: idle 590 us;
    # ours busy 100-400, 500-850 (the copy within), 1100-1400, 1450-1470, 1480-1500 over
    # 100..1500: idle 410 us; two steps.
    assert d["main_stream_idle"] == {"base_ms": pytest.approx(0.295),
                                     "ours_ms": pytest.approx(0.205),
                                     "diff_ms": pytest.approx(-0.09)}
    assert d["step"]["diff_ms"] == 0.0 and d["host_blocking"]["diff_ms"] == 0.0
    lines = trace_summary.describe_diff(d, "dense", "stem")
    assert lines[0].startswith("| kernel | dense ms | stem ms | difference ms |")
    assert "| gather | 0.050 | 0.175 | +0.125 | 0 / 0 |" in lines
    assert "| **all** | 0.355 | 0.500 | **+0.145** | |" in lines
    assert "main stream idle" in lines[-1] and "(-0.09)" in lines[-1]


def test_trace_summary_command_with_a_baseline(tmp_path, capsys):
    for name, events in (("base", GPU_TRACE), ("ours", GPU_TRACE[:4])):
        with gzip.open(tmp_path / f"{name}.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
    trace_summary.main([str(tmp_path / "ours.json.gz"), "--baseline",
                        str(tmp_path / "base.json.gz"), "--json", str(tmp_path / "s.json")])
    d = json.loads((tmp_path / "s.json").read_text())["diff_vs_baseline"]
    assert d["total"]["diff_ms"] == pytest.approx(-0.055)  # the gather and the copy
    assert "| **all** |" in capsys.readouterr().out


def test_a_trace_over_the_limit_keeps_its_gpu_timeline_or_is_dropped(tmp_path):
    rng = random.Random(0)
    events = [_x("cpu_op", "%032x" % rng.getrandbits(128), i, 1) for i in range(4000)] + \
        GPU_TRACE[:6] + [{"ph": "M", "name": "thread_name", "tid": 11, "args": {"name": "main"}}]

    def raw(name):
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": events}))
        return str(path)

    kept = common.keep_trace(raw("whole.json"), events, limit_mb=1.0)
    assert kept["kept"] == "whole" and not (tmp_path / "whole.json").exists()
    assert len(trace_summary.load_events(kept["path"])) == len(events)
    slim = common.keep_trace(raw("slim.json"), events, limit_mb=0.05)
    assert slim["kept"].startswith("GPU timeline only") and slim["mb"] <= 0.05
    names = [e["name"] for e in trace_summary.load_events(slim["path"])]
    assert names == ["ProfilerStep#1", "ProfilerStep#2", "gemm", "gemm", "gather",
                     "Memcpy DtoH (Device -> Pageable)", "thread_name"]
    dropped = common.keep_trace(raw("dropped.json"), events, limit_mb=0.0001)
    assert dropped["path"] is None and dropped["kept"].startswith("dropped:")
    assert not list(tmp_path.glob("dropped.json*"))


def test_runs_alternate_and_ratios_are_per_run():
    order = []

    def side(name, values):
        it = iter(values)

        def measure():
            order.append(name)
            return next(it)
        return measure

    # Seconds per timed step; each run's median, in ms, and each run's own ratio.
    runs = common.alternate({"dense": side("dense", [[0.010, 0.012, 0.011], [0.020, 0.021]]),
                             "stem": side("stem", [[0.008], [0.018, 0.016]])}, 2)
    assert order == ["dense", "stem", "stem", "dense"]
    assert runs == {"dense": [pytest.approx(11.0), pytest.approx(20.5)],
                    "stem": [pytest.approx(8.0), pytest.approx(17.0)]}
    speedup = common.run_ratios(runs, "dense", lambda t, d: d / t)
    assert speedup == {"stem": [pytest.approx(11 / 8), pytest.approx(20.5 / 17)]}
    assert common.run_order(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
