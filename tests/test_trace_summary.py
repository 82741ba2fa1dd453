"""The profiler-trace summary (``megatron_ext/tools/trace_summary.py``) on a hand-made trace whose
numbers are worked out by hand, and its interval union against a unit-grid count."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from megatron_ext.tools import trace_summary


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": args}


TRACE = [
    _x("user_annotation", "ProfilerStep#5", 0, 1000),
    _x("user_annotation", "ProfilerStep#6", 1000, 1000),
    _x("gpu_user_annotation", "ProfilerStep#6", 1000, 1000, tid=7, stream=7),  # not a step
    _x("kernel", "k1", 100, 200, tid=7, stream=7),
    _x("kernel", "k2", 250, 150, tid=7, stream=7),   # overlaps k1: busy [100, 400)
    _x("kernel", "k2b", 260, 20, tid=7, stream=7),   # within k2
    _x("kernel", "k3", 600, 100, tid=7, stream=7),
    _x("kernel", "k4", 1500, 400, tid=7, stream=7),
    _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 350, 100, tid=20, stream=20, bytes=1000),
    _x("kernel", "small", 460, 10, tid=20, stream=20),
    _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1950, 50, tid=20, stream=20, bytes=500),
    _x("cuda_runtime", "cudaStreamSynchronize", 500, 30, tid=11),
    _x("cuda_runtime", "cudaLaunchKernel", 540, 4, tid=11),             # does not block
    _x("cuda_runtime", "cudaLaunchKernel", 560, 4, tid=11),
    _x("cuda_runtime", "cudaLaunchKernel", 580, 4, tid=12),
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 12, "args": {"name": "worker"}},
    _x("cuda_runtime", "cudaEventSynchronize", 900, 5, tid=12),
    {"ph": "i", "name": "marker", "ts": 10},                            # not a complete event
    # The tables' ranges (record_function), on the training thread and the worker (named as
    # PyTorch names threads), and CUDA's synchronisation events.
    _x("user_annotation", "stem/wait-read", 300, 40, tid=11),
    _x("user_annotation", "stem/wait-read", 700, 60, tid=11),
    _x("user_annotation", "stem/start-fetch", 450, 100, tid=11),
    _x("user_annotation", "other/range", 0, 5, tid=11),                 # not the tables'
    _x("cpu_op", "stem/op", 0, 5, tid=11),                              # not a range
    _x("user_annotation", "stem/table-step", 800, 120, tid=13),
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 13,
     "args": {"name": "thread 13 (stem-worker)"}},
    # The same thread named again with the process's name (a forked rank's trace, 2026-11-28):
    # its own name stays.
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 13, "args": {"name": "thread 13 (python)"}},
    _x("cuda_sync", "Stream Wait Event", 420, 30, tid=7, stream=7, wait_on_stream=20),
    _x("cuda_sync", "Stream Wait Event", 1400, 100, tid=7, stream=7, wait_on_stream=20),
    _x("cuda_sync", "Event Sync", 900, 8, tid=20, stream=20),
]


def test_hand_made_trace():
    s = trace_summary.summarize(TRACE)
    assert s["steps"] == [{"step": 5, "ms": 1.0}, {"step": 6, "ms": 1.0}]
    main = s["main_stream"]
    assert main["stream"] == "7"
    # busy [100,400) + [600,700) + [1500,1900) = 800 us of the 1800 us from 100 to 1900
    assert main["span_ms"] == pytest.approx(1.8)
    assert main["busy_ms"] == pytest.approx(0.8)
    assert main["idle_ms"] == pytest.approx(1.0)
    assert main["idle_ms_per_step"] == pytest.approx(0.5)
    assert [(round(g["ms"], 6), g["next"]) for g in main["longest_gaps"]] == [(0.8, "k4"),
                                                                              (0.2, "k3")]
    side = s["streams"]["20"]
    assert side["busy_ms"] == pytest.approx(0.16)
    assert side["kernel_ms"] == pytest.approx(0.01)
    assert side["copies"]["HtoD"] == {"ms": pytest.approx(0.1), "bytes": 1000}
    assert side["copies"]["DtoH"] == {"ms": pytest.approx(0.05), "bytes": 500}
    assert s["streams"]["7"]["kernel_ms"] == pytest.approx(0.87)
    assert s["host_blocking_ms"] == {"11": {"cudaStreamSynchronize": pytest.approx(0.03)},
                                     "12": {"cudaEventSynchronize": pytest.approx(0.005)}}
    assert s["launching_thread"] == "11"
    assert s["threads"] == {"11": {"name": "", "kernel_launches": 2},
                            "12": {"name": "worker", "kernel_launches": 1}}
    text = "\n".join(trace_summary.describe(s))
    assert "idle 0.5 ms per step" in text and "0.80 ms before k4" in text
    assert "host thread 11 [launches most kernels: 2] blocked in cudaStreamSynchronize" in text
    assert "host thread 12 (worker) blocked in cudaEventSynchronize" in text
    # Idle [400, 600) and [700, 1500): 100 us in start-fetch, 60 in wait-read (the training
    # thread's: the worker's table-step at [800, 920) is not counted), 840 outside; two steps.
    assert main["idle_ms_per_step_during"] == {"stem/start-fetch": pytest.approx(0.05),
                                               "stem/wait-read": pytest.approx(0.03),
                                               "outside them": pytest.approx(0.42)}
    assert ("main stream idle per step while the training thread was in: stem/start-fetch "
            "0.05 ms, stem/wait-read 0.03 ms, outside them 0.42 ms") in text
    assert s["stem_ranges"] == {
        "11": {"name": "", "ranges": {"stem/start-fetch": {"count": 1, "ms": pytest.approx(0.1)},
                                      "stem/wait-read": {"count": 2, "ms": pytest.approx(0.1)}}},
        "13": {"name": "thread 13 (stem-worker)",
               "ranges": {"stem/table-step": {"count": 1, "ms": pytest.approx(0.12)}}}}
    assert s["cuda_sync"] == {
        "7": {"Stream Wait Event": {"count": 2, "ms": pytest.approx(0.13),
                                    "waits_on": {"20": 2}}},
        "20": {"Event Sync": {"count": 1, "ms": pytest.approx(0.008), "waits_on": {}}}}
    assert ("host thread 11 STEM ranges: stem/start-fetch 0.1 ms (1x), stem/wait-read 0.1 ms "
            "(2x)") in text
    assert "host thread 13 (stem-worker) STEM ranges: stem/table-step 0.1 ms (1x)" in text
    assert "stream 7 synchronisation: Stream Wait Event 0.13 ms (2x, on stream 20)" in text
    assert "stream 20 synchronisation: Event Sync 0.01 ms (1x)" in text


def test_union_against_a_unit_grid():
    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for _ in range(rng.randint(0, 12)):
            a = rng.randint(0, 60)
            intervals.append((a, a + rng.randint(0, 15)))
        covered = {t for a, b in intervals for t in range(a, b)}
        assert trace_summary.union_us(intervals) == len(covered)


def test_reads_plain_and_gzipped_traces(tmp_path, capsys):
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps({"traceEvents": TRACE}))
    with gzip.open(packed, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert trace_summary.load_events(str(plain)) == trace_summary.load_events(str(packed))
    out = tmp_path / "summary.json"
    trace_summary.main([str(packed), "--json", str(out)])
    assert json.loads(out.read_text())["main_stream"]["stream"] == "7"
    assert "main stream 7" in capsys.readouterr().out
