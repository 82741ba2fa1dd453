"""Helpers shared by the benchmarks: device sync, Megatron DDP wrapping, a timing loop, runs in
alternating order (A B B A) with each run's own ratios, and a profile of each side's step."""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


def corpus(prefix: str, vocab=None):
    """The token ids of an indexed dataset (``.bin`` read whole, int64) and its vocabulary
    (``vocab``, else the data-prep manifest's beside it); a clear exit when it is not there."""
    import json
    import os

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not os.path.exists(prefix + ".bin"):
        raise SystemExit(f"no tokenized corpus at {prefix}: run launch/main_job.py (its data "
                         "step) or pass --data-prefix")
    if vocab is None:
        with open(os.path.join(os.path.dirname(prefix), "manifest.json")) as f:
            vocab = int(json.load(f)["tokenizer_vocab_size"])
    dtype = IndexedDataset(prefix).index.dtype
    ids = np.asarray(np.memmap(prefix + ".bin", dtype=dtype, mode="r")).astype(np.int64)
    return torch.from_numpy(ids), vocab


# StructMoE sides of the step and kernel benchmarks: "<backend>[+pad<N>][+compiled]".
COMPILED = "+compiled"  # --structmoe-compile routed
PADDED = "+pad"  # D'_ff stored as a multiple of N (--structmoe-ffn-pad-to N)


def structmoe_side(name: str) -> Tuple[str, int, str]:
    """``(backend, ffn_pad_to, compile)`` of a StructMoE side's name, e.g.
    ``dense-masked+pad128+compiled`` -> ``("dense-masked", 128, "routed")``."""
    parts = name.split("+")
    pad = next((int(p[3:]) for p in parts[1:] if p.startswith("pad")), 1)
    return parts[0], pad, "routed" if name.endswith(COMPILED) else "none"


def padded_sides(backends: Sequence[str], pad_to: Optional[int]) -> List[str]:
    """The ``<backend>+pad<N>`` sides of ``--pad-to N`` (none for N of 1 or none)."""
    return [f"{b}{PADDED}{pad_to}" for b in backends] if pad_to and pad_to > 1 else []


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wrap_ddp(module):
    """Megatron's ``DistributedDataParallel`` around ``module`` as in training (gradients land
    in ``main_grad`` buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)


class StepTimes(list):
    """Seconds of each timed step, synchronized (what the device took to finish it), and in
    ``host`` the seconds of the same steps until ``step()`` returned, before the sync: the
    host's time to run the step's Python and enqueue its kernels (forward and backward), waits
    in the step's own synchronisations included. On the CPU the two are equal; on CUDA, a
    ``host`` close to the step's time says the device keeps pace with the host (the step is
    host-bound), and the difference is how long the device still runs after the host is done."""

    def __init__(self):
        super().__init__()
        self.host: List[float] = []


def timed(step: Callable[[], None], reset: Callable[[], None], reps: int,
          warmup: int) -> StepTimes:
    """Seconds of ``reps`` calls of ``step`` after ``warmup`` untimed ones, with the host's
    share of each (:class:`StepTimes`); ``reset`` runs before each call, outside the timing
    (e.g. zeroing the grad buffer, done once per global batch in training)."""
    times = StepTimes()
    for i in range(warmup + reps):
        reset()
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            times.host.append(t1 - t0)
    return times


def compile_seconds(step: Callable[[], None], reset: Callable[[], None]) -> float:
    """Seconds of the first two calls of ``step`` (with their resets), in which a side with
    compiled regions (``--<family>-compile``) compiles them (the second call: whatever the first
    one's state makes Dynamo compile again): reported apart from the timed steps, which follow
    as warm-up and measurement. On a side without compiled regions: two ordinary steps."""
    t0 = time.perf_counter()
    for _ in range(2):
        reset()
        step()
        sync()
    return time.perf_counter() - t0


def run_order(names: Sequence[str], repeats: int) -> List[Tuple[int, str]]:
    """``(run, side)`` in the order they are measured: every other run in the reverse order
    (A B, B A, ...), so that a drift of the machine linear in time weighs on every side alike
    (``launch/main_job.py --repeats`` does the same)."""
    return [(rep, name) for rep in range(repeats)
            for name in (list(names) if rep % 2 == 0 else list(names)[::-1])]


def alternate(measure: Dict[str, Callable[[], List[float]]],
              repeats: int) -> Dict[str, List[float]]:
    """Each side's ``measure()`` (seconds of its timed steps) once per run, ``repeats`` runs in
    :func:`run_order`: per side, the median of each run in milliseconds, in run order."""
    return alternate_timed(measure, repeats)[0]


def alternate_timed(measure: Dict[str, Callable[[], List[float]]], repeats: int
                    ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """:func:`alternate`, and beside it per side the median of each run's host times in
    milliseconds (:class:`StepTimes`'s ``host``; a side whose ``measure`` gives none has
    none)."""
    out: Dict[str, List[float]] = {name: [0.0] * repeats for name in measure}
    host: Dict[str, List[float]] = {}
    for rep, name in run_order(list(measure), repeats):
        times = measure[name]()
        out[name][rep] = 1e3 * statistics.median(times)
        if getattr(times, "host", None):
            host.setdefault(name, [0.0] * repeats)[rep] = 1e3 * statistics.median(times.host)
    return out, host


def run_ratios(run_ms: Dict[str, List[float]], base: str,
               fn: Callable[[float, float], float] = lambda ours, base: ours / base
               ) -> Dict[str, List[float]]:
    """Per side other than ``base``, each run's ``fn(side, base)`` of the two sides' times in
    that run (default their ratio): a ratio is judged per run, never of pooled times."""
    return {name: [fn(t, b) for t, b in zip(times, run_ms[base])]
            for name, times in run_ms.items() if name != base}


def medians(per_run: Dict[str, List[float]]) -> Dict[str, float]:
    return {name: statistics.median(v) for name, v in per_run.items()}


def side_line(name: str, width: int, ms: float, host_ms: Optional[float], params: int,
              extra: str = "", census: Optional[dict] = None,
              compile_s: Optional[float] = None) -> str:
    """One side of a step benchmark, as structmoe_step and sigma_step print it: its step time
    and host time (:class:`StepTimes`), parameters, ``extra`` (e.g. its overhead over the
    baseline), then the op recorder's census (``host_syncs.census``: kernels per step and
    syncs), or for a compiled side (no census) its compile seconds."""
    host = f" (host {host_ms:.1f})" if host_ms is not None else ""
    line = f"  {name:{width}s}: {ms:10.1f} ms{host}  params {params:,}{extra}  | "
    if census is None:
        return line + f"compiled in {compile_s:.1f} s (first two steps)"
    syncs = (f", CUDA syncs {len(census['cuda_syncs'])}"
             if census["cuda_syncs"] is not None else "")
    return (line + f"kernels/step {census['kernels']}, flagged syncs "
            f"{len(census['would_sync'])}{syncs}")


def add_run_args(parser, gpu_reps: int, cpu_reps: int) -> None:
    """The flags every step benchmark takes: dtype, repetitions, warm-up, alternating runs, JSON
    output."""
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"timed steps per side and run; default: {gpu_reps} on GPU, "
                             f"{cpu_reps} on CPU")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of every side, every other one in the reverse order (A B B "
                             "A); each ratio is given per run and a goal is judged on the worse")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.set_defaults(_gpu_reps=gpu_reps, _cpu_reps=cpu_reps)


def add_profile_args(parser) -> None:
    """``--profile DIR``: trace each side's step instead of timing it (:func:`profile_sides`)."""
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="instead of timing: trace --profile-steps steps of each side after "
                             "the warm-up with PyTorch's profiler; DIR gets trace_<side>.json.gz "
                             "and profile.json (each side's summary, and per side where its "
                             "extra time over the baseline goes, per kernel)")
    parser.add_argument("--profile-steps", type=int, default=3)


class RunSetup:
    """Single-rank Megatron state and the run settings resolved from :func:`add_run_args`."""

    def __init__(self, args, quiet: bool = True):
        import logging
        import warnings

        from megatron_ext.compat.standalone import init_single_rank

        if quiet:
            warnings.filterwarnings("ignore")
            logging.getLogger("megatron").setLevel(logging.WARNING)
        init_single_rank()
        gpu = torch.cuda.is_available()
        self.dtype_name = args.dtype or ("bf16" if gpu else "fp32")
        self.dtype = torch.bfloat16 if self.dtype_name == "bf16" else torch.float32
        self.reps = args.reps or (args._gpu_reps if gpu else args._cpu_reps)
        self.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
        self.device = torch.device("cuda" if gpu else "cpu")
        self.json_path = args.json
        self.repeats = args.repeats
        if self.repeats < 1:
            raise SystemExit(f"--repeats={self.repeats} must be at least 1")
        self.profile_dir = getattr(args, "profile", None)
        self.profile_steps = getattr(args, "profile_steps", 3)
        if self.profile_dir and self.profile_steps < 1:
            raise SystemExit(f"--profile-steps={self.profile_steps} must be at least 1")

    def write_json(self, summary) -> None:
        write_json(summary, self.json_path)


def write_json(summary, path) -> None:
    """``summary`` as indented JSON at ``path`` (nothing without a path)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


def report_json(summary, path) -> None:
    """The summary as the last line of the output (one JSON object), and at ``path``."""
    import json

    print(json.dumps(summary))
    write_json(summary, path)


# The line that names a failure: an exception's ("ValueError: ...") or argparse's ("x.py: error:
# ..."); torchrun's own report of the failure, after it, is cut first.
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b.*?:|: error:")
_TORCHRUN_REPORT = ("ChildFailedError", "distributed/elastic/", "distributed.elastic.")


def failure_reason(log: str, rc: int) -> str:
    """One line saying why a command failed, and its exit status."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    cut = next((i for i, ln in enumerate(lines) if any(t in ln for t in _TORCHRUN_REPORT)),
               len(lines))
    lines = lines[:cut] or lines
    errors = [ln for ln in lines if _ERROR_LINE.search(ln)]
    said = (errors or lines or ["no output"])[-1]
    return f"{said[:300]} (exit {rc})"


# What comes back from a GPU lease is limited in size: a trace larger than this (gzipped) keeps
# only its GPU timeline, and is dropped if that is still larger (its summary stays).
TRACE_LIMIT_MB = 20.0


def keep_trace(raw: str, events: List[dict], limit_mb: float = TRACE_LIMIT_MB) -> Dict[str, object]:
    """The exported trace ``raw`` (a ``.json``) gzipped beside it, the ``.json`` removed; over
    ``limit_mb``, rewritten with the GPU's events, the steps and the host's blocking calls only
    (what the timeline of the GPU needs); over it still, dropped. Says which."""
    import gzip
    import json

    from megatron_ext.tools.trace_summary import BLOCKING_CALLS, GPU_CATEGORIES

    path = raw + ".gz"
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        dst.write(src.read())
    os.remove(raw)
    kept = "whole"
    if os.path.getsize(path) > limit_mb * 2**20:
        slim = [e for e in events if e.get("ph") == "M" or e.get("cat") in GPU_CATEGORIES
                or str(e.get("name", "")).startswith("ProfilerStep#")
                or e.get("name") in BLOCKING_CALLS]
        with gzip.open(path, "wt", compresslevel=6) as f:
            json.dump({"traceEvents": slim}, f)
        kept = "GPU timeline only (the whole trace was over the size limit)"
    size = os.path.getsize(path) / 2**20
    if size > limit_mb:
        os.remove(path)
        return {"path": None, "kept": f"dropped: {size:.1f} MB over {limit_mb:g} MB"}
    return {"path": path, "kept": kept, "mb": round(size, 2)}


def profile_sides(sides: Dict[str, Tuple[Callable[[], None], Callable[[], None]]], base: str,
                  out_dir: str, warmup: int, steps: int, info: Optional[dict] = None,
                  limit_mb: float = TRACE_LIMIT_MB) -> Dict[str, object]:
    """Each side's ``(step, reset)`` traced by PyTorch's profiler (CPU, and CUDA where there is
    a GPU) for ``steps`` steps after ``warmup`` untimed ones and one step for the profiler's own
    warm-up, as :func:`timed` runs them (``reset`` then ``step`` then a synchronisation, each
    step one ``ProfilerStep``); ``out_dir`` gets ``trace_<side>.json.gz`` and ``profile.json``:
    each side's summary (``megatron_ext/tools/trace_summary.py``: kernels by time, GPU idle time,
    host synchronisations) and, per side other than ``base``, where its time differs from the
    baseline's, per kernel (:func:`trace_summary.diff`). The profile is returned and printed."""
    import json

    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from megatron_ext.tools import trace_summary

    if base not in sides:
        raise ValueError(f"baseline {base!r} is not among the sides {list(sides)}")
    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    result: Dict[str, object] = {"base": base, "steps": steps, "warmup": warmup,
                                 "activities": [str(a).split(".")[-1] for a in activities],
                                 **(info or {}), "sides": {}, "diffs": {}}
    for name, (step, reset) in sides.items():
        for _ in range(warmup):
            reset()
            step()
        sync()
        with profile(activities=activities,
                     schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
            for _ in range(1 + steps):
                # Named so that the summary tells the benchmark's own work and waits apart.
                with record_function("benchmark/reset"):
                    reset()
                step()
                with record_function("benchmark/end-of-step-sync"):
                    sync()
                prof.step()
        raw = os.path.join(out_dir, f"trace_{name}.json")
        prof.export_chrome_trace(raw)
        del prof
        events = trace_summary.load_events(raw)
        summary = trace_summary.summarize(events)
        trace = keep_trace(raw, events, limit_mb)
        del events
        result["sides"][name] = {"trace": trace, "summary": summary}
        print(f"{name}: trace {trace['path'] or trace['kept']}", flush=True)
        for line in trace_summary.describe(summary):
            print("  " + line, flush=True)
    for name, entry in result["sides"].items():
        if name == base:
            continue
        d = trace_summary.diff(result["sides"][base]["summary"], entry["summary"])
        result["diffs"][name] = d
        print(f"{name} vs {base}, per step:", flush=True)
        for line in trace_summary.describe_diff(d, base, name):
            print("  " + line, flush=True)
    path = os.path.join(out_dir, "profile.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)
    return result
