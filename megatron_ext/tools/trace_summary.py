"""What a PyTorch profiler trace of training steps says about the GPU waiting for the host.

Megatron writes the trace with ``--profile --use-pytorch-profiler --profile-step-start A
--profile-step-end B`` (``<tensorboard dir>/../torch_profile/rank-<r>.json.gz``, Chrome's trace
format); ``benchmarks/stem_placement.py --profile VARIANTS`` does so for its variants. This module
reduces such a trace to a few numbers, so that a short GPU lease brings back what the timeline
shows even when the trace itself cannot travel:

* the profiled steps (``ProfilerStep#N`` annotations) and their wall time;
* per CUDA stream: busy time (the union of its kernels, copies and fills), kernel time, and copies
  by direction (time and bytes);
* the main stream (the one with the most kernel time): how long it sat idle between its first and
  last event, per step, and its longest gaps with the kernel that ran after each (what the GPU was
  waiting to run). With managed STEM tables an idle main stream is the GPU waiting for rows or for
  the training thread;
* the host's blocking CUDA calls (stream, event and device synchronisations, synchronous copies),
  per thread, the thread that launched the most kernels (the training thread) marked: the
  training thread waiting for the GPU;
* the main stream's idle time per step by the training thread's STEM range it fell in (below),
  and outside them: which part of a fetch the GPU was waiting for;
* the managed STEM tables' own ranges (``stem/...``: ``start-fetch``, ``wait-read`` and
  ``finish-fetch`` on the training thread; ``read-rows``, ``step-rows-read``, ``table-step`` and
  ``wait-grads`` on the tables' worker, recorded with ``--ext-profile-all-threads``), per thread:
  how often and how long;
* CUDA's synchronisation events (``--ext-profile-all-threads`` on a GPU: PyTorch's
  ``enable_cuda_sync_events``), per stream: stream waits (and on which stream), event and stream
  synchronisations, count and time.

    python -m megatron_ext.tools.trace_summary TRACE.json[.gz] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from typing import Dict, Iterable, List, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime calls that block the calling thread until the GPU has done something.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                  "cudaMemcpy", "cudaMemcpy2D")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def load_events(path: str) -> List[dict]:
    """The ``traceEvents`` of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def union_us(intervals: Iterable[Tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _copy_kind(name: str) -> str:
    for kind in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
        if kind in name:
            return kind
    return "other"


def summarize(events: List[dict], top_gaps: int = 5) -> Dict[str, object]:
    """The numbers of the module docstring, times in milliseconds."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    steps = sorted(((int(m.group(1)), float(e["ts"]), float(e["dur"]))
                    for e in complete if e.get("cat") in ("user_annotation", "cpu_op")
                    for m in [_STEP.match(str(e.get("name", "")))] if m),
                   key=lambda s: s[1])
    gpu = [e for e in complete if e.get("cat") in GPU_CATEGORIES]
    streams: Dict[str, dict] = {}
    for e in gpu:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        s = streams.setdefault(stream, {"events": [], "kernel_us": 0.0, "copies": {}})
        start, dur = float(e["ts"]), float(e["dur"])
        s["events"].append((start, start + dur, str(e.get("name", ""))))
        if e["cat"] == "kernel":
            s["kernel_us"] += dur
        elif e["cat"] == "gpu_memcpy":
            kind = _copy_kind(str(e.get("name", "")))
            c = s["copies"].setdefault(kind, {"ms": 0.0, "bytes": 0})
            c["ms"] += dur / 1e3
            c["bytes"] += int(e.get("args", {}).get("bytes", 0) or 0)
    out_streams = {}
    for name, s in streams.items():
        out_streams[name] = {"busy_ms": union_us((a, b) for a, b, _ in s["events"]) / 1e3,
                             "kernel_ms": s["kernel_us"] / 1e3,
                             "copies": s["copies"], "events": len(s["events"])}
    summary: Dict[str, object] = {
        "steps": [{"step": n, "ms": dur / 1e3} for n, _, dur in steps],
        "streams": out_streams,
    }
    if streams:
        main = max(streams, key=lambda k: streams[k]["kernel_us"])
        events_main = sorted(streams[main]["events"])
        span = events_main[-1][1] - events_main[0][0]
        busy = out_streams[main]["busy_ms"] * 1e3
        gaps, idle, reach = [], [], events_main[0][1]
        for start, end, name in events_main[1:]:
            if start > reach:
                gaps.append((start - reach, name))
                idle.append((reach, start))
            reach = max(reach, end)
        gaps.sort(key=lambda g: -g[0])
        n_steps = max(len(steps), 1)
        summary["main_stream"] = {
            "stream": main, "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": (span - busy) / 1e3, "idle_ms_per_step": (span - busy) / 1e3 / n_steps,
            "longest_gaps": [{"ms": g / 1e3, "next": name[:120]} for g, name in gaps[:top_gaps]],
        }
    blocking: Dict[str, Dict[str, float]] = {}
    launches: Dict[str, int] = {}
    for e in complete:
        if e.get("cat") != "cuda_runtime":
            continue
        tid = str(e.get("tid"))
        if e.get("name") in BLOCKING_CALLS:
            per = blocking.setdefault(tid, {})
            per[e["name"]] = per.get(e["name"], 0.0) + float(e["dur"]) / 1e3
        elif str(e.get("name", "")).startswith("cudaLaunchKernel"):
            launches[tid] = launches.get(tid, 0) + 1
    summary["host_blocking_ms"] = blocking
    # Which host thread is which: the trace's thread names, and the thread that launched the
    # most kernels (the training thread; the tables' worker launches the GPU tier's few).
    names = {str(e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    summary["threads"] = {tid: {"name": names.get(tid, ""), "kernel_launches": n}
                          for tid, n in sorted(launches.items(), key=lambda kv: -kv[1])}
    if launches:
        summary["launching_thread"] = max(launches, key=launches.get)
    ranges: Dict[str, dict] = {}
    spans: Dict[str, list] = {}  # per thread: (start, end, name) of its STEM ranges
    for e in complete:
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation" and name.startswith("stem/"):
            tid = str(e.get("tid"))
            per = ranges.setdefault(tid, {"name": names.get(tid, ""), "ranges": {}})["ranges"]
            r = per.setdefault(name, {"count": 0, "ms": 0.0})
            r["count"] += 1
            r["ms"] += float(e["dur"]) / 1e3
            start = float(e["ts"])
            spans.setdefault(tid, []).append((start, start + float(e["dur"]), name))
    summary["stem_ranges"] = ranges
    # The main stream's idle time by what the training thread was in meanwhile (its STEM
    # ranges; a starved GPU waits for the launches the thread is not making): the ranges on that
    # thread follow each other, so the overlaps add up.
    if streams and launches:
        during: Dict[str, float] = {}
        for a, b in idle:
            for c, d, name in spans.get(summary["launching_thread"], []):
                overlap = min(b, d) - max(a, c)
                if overlap > 0:
                    during[name] = during.get(name, 0.0) + overlap
        total = sum(b - a for a, b in idle)
        per_step = {k: v / 1e3 / n_steps for k, v in sorted(during.items())}
        per_step["outside them"] = max(total - sum(during.values()), 0.0) / 1e3 / n_steps
        summary["main_stream"]["idle_ms_per_step_during"] = per_step
    sync: Dict[str, dict] = {}
    for e in complete:
        if e.get("cat") != "cuda_sync":
            continue
        args = e.get("args", {})
        per = sync.setdefault(str(args.get("stream", e.get("tid"))), {})
        r = per.setdefault(str(e.get("name", "")), {"count": 0, "ms": 0.0, "waits_on": {}})
        r["count"] += 1
        r["ms"] += float(e["dur"]) / 1e3
        if "wait_on_stream" in args:
            other = str(args["wait_on_stream"])
            r["waits_on"][other] = r["waits_on"].get(other, 0) + 1
    summary["cuda_sync"] = sync
    return summary


def _thread_label(tid: str, name: str) -> str:
    """``host thread TID (NAME)``; PyTorch's traces name threads ``thread TID (NAME)`` already."""
    if name.startswith(f"thread {tid}"):
        return "host " + name
    return f"host thread {tid}" + (f" ({name})" if name else "")


def describe(summary: Dict[str, object]) -> List[str]:
    """Lines for a log."""
    lines = []
    steps = summary.get("steps", [])
    if steps:
        lines.append("profiled steps: " + ", ".join(f"#{s['step']} {s['ms']:.1f} ms"
                                                   for s in steps))
    main = summary.get("main_stream")
    if main:
        lines.append(f"main stream {main['stream']}: busy {main['busy_ms']:.1f} of "
                     f"{main['span_ms']:.1f} ms, idle {main['idle_ms_per_step']:.1f} ms per step"
                     + "; longest gaps: " + "; ".join(f"{g['ms']:.2f} ms before {g['next']}"
                                                     for g in main["longest_gaps"]))
    during = (main or {}).get("idle_ms_per_step_during")
    if during:
        lines.append("main stream idle per step while the training thread was in: " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in during.items()))
    for name, s in sorted(summary.get("streams", {}).items(), key=lambda kv: -kv[1]["busy_ms"]):
        copies = ", ".join(f"{k} {c['ms']:.1f} ms {c['bytes'] / 2**20:.1f} MiB"
                           for k, c in sorted(s["copies"].items()))
        lines.append(f"stream {name}: busy {s['busy_ms']:.1f} ms, kernels {s['kernel_ms']:.1f} ms"
                     + (f", copies: {copies}" if copies else ""))
    threads = summary.get("threads", {})
    for tid, calls in summary.get("host_blocking_ms", {}).items():
        info = threads.get(tid, {})
        label = _thread_label(tid, info.get("name", ""))
        if tid == summary.get("launching_thread"):
            label += f" [launches most kernels: {info['kernel_launches']}]"
        lines.append(f"{label} blocked in " + ", ".join(
            f"{k} {v:.1f} ms" for k, v in sorted(calls.items())))
    for tid, per in summary.get("stem_ranges", {}).items():
        label = _thread_label(tid, per["name"])
        lines.append(f"{label} STEM ranges: " + ", ".join(
            f"{k} {r['ms']:.1f} ms ({r['count']}x)" for k, r in sorted(per["ranges"].items())))
    for stream, per in sorted(summary.get("cuda_sync", {}).items()):
        lines.append(f"stream {stream} synchronisation: " + ", ".join(
            f"{k} {r['ms']:.2f} ms ({r['count']}x"
            + (", on stream " + "/".join(sorted(r["waits_on"])) if r["waits_on"] else "") + ")"
            for k, r in sorted(per.items())))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    summary = summarize(load_events(args.trace))
    print("\n".join(describe(summary)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
