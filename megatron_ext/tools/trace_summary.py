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
  synchronisations, count and time;
* per kernel name, GPU time and launches per step (``kernels``; a trace without GPU events, as
  on the CPU: each operator's self time, its own time less that of the operators it called);
* the host's synchronisations per step (``host_syncs``): the blocking CUDA calls by name and by
  the operator or range they were made in (``aten::_local_scalar_dense`` is an ``.item()``,
  ``aten::_to_copy`` a ``.cpu()``), and the operators that wait for the GPU by their nature
  (``SYNC_OPS``), whatever the device;
* against a baseline's trace (:func:`diff`, ``--baseline``): where the extra time goes, per
  kernel name the difference in milliseconds per step (the largest first, the rest in one row,
  so that the rows add up to the difference of the totals), and the difference of the step
  time, of the main stream's idle time and of the host's blocking time.

    python -m megatron_ext.tools.trace_summary TRACE.json[.gz] [--json OUT]
    python -m megatron_ext.tools.trace_summary TRACE.json.gz --baseline BASE.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from typing import Dict, Iterable, List, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime calls that block the calling thread until the GPU has done something.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                  "cudaMemcpy", "cudaMemcpy2D")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# Operators that wait for the GPU to know a value or a size (on a CUDA tensor): ``.item()``,
# ``bool()`` and ``.tolist()`` end in ``_local_scalar_dense``; the others size their output from
# the data.
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
            "aten::unique_consecutive", "aten::masked_select")
# Kernel names longer than this are cut (template arguments); names equal so far are one row.
NAME_CHARS = 160


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


def thread_names(events) -> Dict[str, str]:
    """Each host thread's name from the trace's metadata. PyTorch's traces can name one thread
    twice, once with its own OS name and once with the process's (``thread N (stem-worker)``
    and ``thread N (python)``, seen in a rank forked from the suite's rank server,
    2026-11-28): a thread's own name wins over the process's, whichever comes last."""
    process = {str(e.get("pid")): str(e.get("args", {}).get("name", ""))
               for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    names: Dict[str, str] = {}
    for e in events:
        if e.get("ph") != "M" or e.get("name") != "thread_name":
            continue
        tid, name = str(e.get("tid")), str(e.get("args", {}).get("name", ""))
        generic = name.endswith(f"({process.get(str(e.get('pid')), 'python')})")
        if tid not in names or not generic:
            names[tid] = name
    return names


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
    names = thread_names(events)
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
    n_steps = max(len(steps), 1)
    summary["kernels"] = kernel_table(complete, n_steps)
    summary["host_syncs"] = host_syncs(complete, n_steps)
    return summary


def _per_step(table: Dict[str, List[float]], n_steps: int) -> Dict[str, dict]:
    """``{name: [count, us]}`` to ``{name: {"count", "ms"}}`` per step, the largest first."""
    return {name: {"count": c / n_steps, "ms": us / 1e3 / n_steps}
            for name, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])}


def _self_times_us(ops: List[dict]) -> Dict[str, List[float]]:
    """``{name: [count, self us]}`` of operators, self time being an operator's own time less
    that of the operators it called on its thread (they nest: a stack per thread), so that the
    self times add up to the time the thread spent in operators at all."""
    by_tid: Dict[str, list] = {}
    for e in ops:
        start = float(e["ts"])
        by_tid.setdefault(str(e.get("tid")), []).append(
            (start, start + float(e["dur"]), str(e.get("name", ""))[:NAME_CHARS]))
    out: Dict[str, List[float]] = {}

    def close(frame):
        end, start, name, children = frame
        entry = out.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += max(end - start - children, 0.0)

    for intervals in by_tid.values():
        stack: List[list] = []  # [end, start, name, children's us]
        for start, end, name in sorted(intervals, key=lambda t: (t[0], -t[1])):
            while stack and start >= stack[-1][0]:
                close(stack.pop())
            if stack:  # a child: its time (clipped to its parent's end) is not the parent's own
                stack[-1][3] += min(end, stack[-1][0]) - start
            stack.append([end, start, name, 0.0])
        while stack:
            close(stack.pop())
    return out


def kernel_table(complete: List[dict], n_steps: int) -> Dict[str, object]:
    """Per kernel name (kernels, copies and fills, names cut at ``NAME_CHARS``): launches and
    milliseconds per step, and their total. Without GPU events (a CPU trace) the same of each
    operator's self time."""
    gpu = [e for e in complete if e.get("cat") in GPU_CATEGORIES]
    if gpu:
        table: Dict[str, List[float]] = {}
        for e in gpu:
            entry = table.setdefault(str(e.get("name", ""))[:NAME_CHARS], [0, 0.0])
            entry[0] += 1
            entry[1] += float(e["dur"])
        source = "gpu"
    else:
        table = _self_times_us([e for e in complete if e.get("cat") == "cpu_op"])
        source = "cpu operators' self time"
    by_name = _per_step(table, n_steps)
    return {"source": source, "steps": n_steps,
            "ms_per_step": sum(r["ms"] for r in by_name.values()), "by_name": by_name}


def host_syncs(complete: List[dict], n_steps: int) -> Dict[str, object]:
    """The host waiting for the GPU, per step: its blocking CUDA calls by name (``calls``) and by
    the innermost operator or range around each on its thread (``by_op``: who asked), and the
    operators of ``SYNC_OPS`` (``sync_ops``: they wait on a GPU; on the CPU they show where a
    GPU run would)."""
    blocking = [e for e in complete
                if e.get("cat") == "cuda_runtime" and e.get("name") in BLOCKING_CALLS]
    calls: Dict[str, List[float]] = {}
    for e in blocking:
        entry = calls.setdefault(str(e["name"]), [0, 0.0])
        entry[0] += 1
        entry[1] += float(e["dur"])
    around: Dict[str, list] = {}
    for e in complete:
        if e.get("cat") in ("cpu_op", "user_annotation") and not _STEP.match(
                str(e.get("name", ""))):
            start = float(e["ts"])
            around.setdefault(str(e.get("tid")), []).append(
                (start, start + float(e["dur"]), str(e.get("name", ""))))
    starts: Dict[str, List[float]] = {}
    for tid, ranges in around.items():
        ranges.sort(key=lambda r: (r[0], -r[1]))  # of two with one start, the inner one last
        starts[tid] = [r[0] for r in ranges]
    by_op: Dict[str, List[float]] = {}
    for e in blocking:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        tid = str(e.get("tid"))
        ranges = around.get(tid, [])
        # Ranges on a thread nest: the latest-starting one that still holds the call is the
        # innermost.
        inner = next((ranges[i][2] for i in range(bisect.bisect_right(starts.get(tid, []), start)
                                                   - 1, -1, -1) if ranges[i][1] >= end), None)
        entry = by_op.setdefault(inner or "(no operator)", [0, 0.0])
        entry[0] += 1
        entry[1] += float(e["dur"])
    ops: Dict[str, List[float]] = {}
    for e in complete:
        if e.get("cat") == "cpu_op" and e.get("name") in SYNC_OPS:
            entry = ops.setdefault(str(e["name"]), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e["dur"])
    per_call = _per_step(calls, n_steps)
    return {"blocking_ms_per_step": sum(r["ms"] for r in per_call.values()),
            "calls": per_call, "by_op": _per_step(by_op, n_steps),
            "sync_ops": _per_step(ops, n_steps)}


def _mean_step_ms(summary: Dict[str, object]) -> float:
    steps = summary.get("steps") or []
    return sum(s["ms"] for s in steps) / len(steps) if steps else 0.0


def diff(base: Dict[str, object], ours: Dict[str, object], top: int = 12) -> Dict[str, object]:
    """Where ``ours`` spends more (or less) time per step than ``base`` (two :func:`summarize`
    results of the same work): per kernel name (operator self time on the CPU) the milliseconds
    per step of both and their difference, the ``top`` largest differences first and every other
    name in one last row, so the rows' differences add up to that of the totals (``total``);
    then the step, the main stream's idle time and the host's blocking calls, per step."""
    kb, ko = base["kernels"]["by_name"], ours["kernels"]["by_name"]
    rows = []
    for name in set(kb) | set(ko):
        b, o = kb.get(name, {}), ko.get(name, {})
        rows.append({"name": name, "base_ms": b.get("ms", 0.0), "ours_ms": o.get("ms", 0.0),
                     "diff_ms": o.get("ms", 0.0) - b.get("ms", 0.0),
                     "base_count": b.get("count", 0.0), "ours_count": o.get("count", 0.0)})
    rows.sort(key=lambda r: (-abs(r["diff_ms"]), r["name"]))
    shown, rest = rows[:top], rows[top:]
    if rest:
        shown.append({"name": f"the {len(rest)} other names", "rest": len(rest),
                      **{k: sum(r[k] for r in rest) for k in ("base_ms", "ours_ms", "diff_ms",
                                                              "base_count", "ours_count")}})

    def pair(b: float, o: float) -> Dict[str, float]:
        return {"base_ms": b, "ours_ms": o, "diff_ms": o - b}

    out: Dict[str, object] = {
        "source": ours["kernels"]["source"], "rows": shown,
        "total": pair(base["kernels"]["ms_per_step"], ours["kernels"]["ms_per_step"]),
        "step": pair(_mean_step_ms(base), _mean_step_ms(ours)),
        "host_blocking": pair(base["host_syncs"]["blocking_ms_per_step"],
                              ours["host_syncs"]["blocking_ms_per_step"]),
    }
    if base.get("main_stream") and ours.get("main_stream"):
        out["main_stream_idle"] = pair(base["main_stream"]["idle_ms_per_step"],
                                       ours["main_stream"]["idle_ms_per_step"])
    return out


def describe_diff(d: Dict[str, object], base: str = "baseline", ours: str = "ours") -> List[str]:
    """:func:`diff` as a markdown table (milliseconds per step) and a line of the rest."""
    what = "kernel" if d["source"] == "gpu" else "operator (self time)"
    lines = [f"| {what} | {base} ms | {ours} ms | difference ms | launches {base} / {ours} |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        lines.append(f"| {r['name'][:100]} | {r['base_ms']:.3f} | {r['ours_ms']:.3f} | "
                     f"{r['diff_ms']:+.3f} | {r['base_count']:.0f} / {r['ours_count']:.0f} |")
    t = d["total"]
    lines.append(f"| **all** | {t['base_ms']:.3f} | {t['ours_ms']:.3f} | "
                 f"**{t['diff_ms']:+.3f}** | |")
    rest = [f"step {d['step']['base_ms']:.2f} -> {d['step']['ours_ms']:.2f} ms "
            f"({d['step']['diff_ms']:+.2f})"]
    if "main_stream_idle" in d:
        i = d["main_stream_idle"]
        rest.append(f"main stream idle {i['base_ms']:.2f} -> {i['ours_ms']:.2f} ms "
                    f"({i['diff_ms']:+.2f})")
    h = d["host_blocking"]
    rest.append(f"host blocked in CUDA calls {h['base_ms']:.2f} -> {h['ours_ms']:.2f} ms "
                f"({h['diff_ms']:+.2f})")
    lines.append("per step: " + "; ".join(rest))
    return lines


def _thread_label(tid: str, name: str) -> str:
    """``host thread TID (NAME)``; PyTorch's traces name threads ``thread TID (NAME)`` already."""
    if name.startswith(f"thread {tid}"):
        return "host " + name
    return f"host thread {tid}" + (f" ({name})" if name else "")


def describe(summary: Dict[str, object], top_kernels: int = 5) -> List[str]:
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
    kernels = summary.get("kernels")
    if kernels and kernels["by_name"]:
        lines.append(f"top by {'GPU time' if kernels['source'] == 'gpu' else kernels['source']}"
                     f" per step (all: {kernels['ms_per_step']:.2f} ms): " + "; ".join(
                         f"{k[:80]} {r['ms']:.3f} ms ({r['count']:g}x)"
                         for k, r in list(kernels["by_name"].items())[:top_kernels]))
    syncs = summary.get("host_syncs")
    if syncs and (syncs["calls"] or syncs["sync_ops"]):
        lines.append("host synchronisations per step: " + "; ".join(
            [f"{k} {r['ms']:.2f} ms ({r['count']:g}x)" for k, r in syncs["calls"].items()]
            + [f"in {k} {r['ms']:.2f} ms ({r['count']:g}x)" for k, r in syncs["by_op"].items()]
            + [f"{k} {r['count']:g}x" for k, r in syncs["sync_ops"].items()]))
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
    parser.add_argument("--baseline", default=None,
                        help="a trace of the baseline's same work: print where the extra time "
                             "goes, per kernel name")
    args = parser.parse_args(argv)
    summary = summarize(load_events(args.trace))
    print("\n".join(describe(summary)))
    if args.baseline:
        d = diff(summarize(load_events(args.baseline)), summary)
        print("\n".join(describe_diff(d)))
        summary["diff_vs_baseline"] = d
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
