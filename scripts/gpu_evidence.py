"""Every GPU number of the project from one command: the plan, its runner and its report.

Run through ``scripts/gpu_evidence.sh`` (which installs the wheels first); this module is the part
that needs no shell. Each step of :func:`plan` is one command with a wall-clock limit. A step that
fails, crashes or runs out of time is recorded (return code or signal, last lines of its log) and
the run goes on; the exit status is 1 when a step of this call did not end "ok" or left a goal
without its number (no result file, one its reader cannot use, a variant that did not finish),
after the report is written. The test steps run pytest through ``scripts/isolated_pytest.py``: a
test that crashes or hangs is named, and the files after it still run.
Results accumulate in the results folder: ``evidence.json`` (every step's status and every ratio
against its goal), ``evidence.md`` (the same as a markdown table) and ``logs/<step>.log``. A
second call with ``--steps`` adds its steps to what an earlier call left there, so a run split
over several short GPU leases still ends in one report.

    python scripts/gpu_evidence.py RESULTS [--steps a,b] [--skip a,b] [--budget-min 9]
    python scripts/gpu_evidence.py RESULTS --print-only        # the plan, nothing run
    python scripts/gpu_evidence.py RESULTS --check-commands    # every command's flags parse
"""

from __future__ import annotations

import argparse
import collections
import csv
import datetime
import functools
import json
import os
import re
import selectors
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import isolated_pytest  # noqa: E402  (beside this script, not a package)
PY = "{python}"  # replaced by the interpreter running the plan
RES = "{results}"  # replaced by the results folder


@dataclass
class Row:
    """One measured number against its goal (``goal`` None: reported, no goal)."""

    step: str
    metric: str
    value: Optional[float]
    unit: str
    goal: Optional[float] = None
    better: str = "higher"  # "higher": value >= goal meets it; "lower": value <= goal
    note: str = ""
    # What the number stands for did not run whole (a variant failed, one run where a goal needs
    # two): not met, whatever the value; the note says why.
    incomplete: bool = False

    @property
    def met(self) -> Optional[bool]:
        if self.incomplete:
            return False
        if self.goal is None:
            return None
        if self.value is None:  # a goal without its number is not met
            return False
        return self.value >= self.goal if self.better == "higher" else self.value <= self.goal


@dataclass
class Step:
    name: str
    what: str
    argv: List[str]
    limit_s: int
    result: Optional[str] = None  # file (under the results folder) the step writes
    rows: Optional[Callable[[str], List[Row]]] = None  # reads the result file
    kind: str = "python"  # "python": argv[1] is a script with argparse; "pytest"; "other"
    # Seconds the step is expected to take on one H100/H200, from the last measured run where
    # there is one (ESTIMATES), else its limit: what --print-only adds up against the budget.
    estimate_s: Optional[int] = None

    @property
    def expected_s(self) -> int:
        return self.estimate_s if self.estimate_s is not None else self.limit_s


# ----------------------------------------------------------------------------- result readers

def _load(path: str):
    with open(path) as f:
        return json.load(f)


def _per_run(step: str, metric: str, runs: Optional[List[Optional[float]]],
             single: Optional[float], unit: str, goal: Optional[float], better: str,
             note: str = "") -> Row:
    """A number the benchmark measured in alternating runs (A B B A; ``runs``, each run's own):
    the worst run's, judged against ``goal``; with one run (or a result of before 2026-11-28,
    ``single`` only) a goal is not met: one run decides nothing near it."""
    known = [x for x in (runs if runs else [single]) if x is not None]
    value, spread = _runs(known, better)
    short = goal is not None and len(known) < 2
    parts = [note] if note else []
    if short:
        parts.append("one run: a goal is judged on two or more (--repeats 2)")
    if len(known) > 1:
        parts.append(spread)
    return Row(step, metric, value, unit, goal, better, note="; ".join(parts), incomplete=short)


def _host(s: dict, side: str, step_ms: Optional[float]) -> str:
    """The side's host time per step beside its step time (the benchmarks' ``host_ms``, since
    2026-11-28: until the step returned, before the device sync): near 100% the device keeps
    pace with the host, the step is host-bound. Empty for a result without it."""
    host = (s.get("host_ms") or {}).get(side)
    if host is None or not step_ms:
        return ""
    return f"{side}: host {host:.2f} of {step_ms:.2f} ms ({100.0 * host / step_ms:.0f}%)"


def _notes(*parts: str) -> str:
    """A row's note from its parts, the empty ones left out (a result without the field)."""
    return "; ".join(x for x in parts if x)


def _peak_memory(step: str, s: dict) -> List[Row]:
    """The step benchmarks' peak GPU memory (``peak_gpu_gib`` per side, since 2026-11-28: its
    timed steps with every side's model resident; null on the CPU): one row, the largest
    side's, every side's in the note. None for a result without it."""
    peak = s.get("peak_gpu_gib")
    if not peak:
        return []
    resident = s.get("resident_gpu_gib") or {}
    top = max(peak, key=peak.get)
    return [Row(step, "peak GPU memory, the largest side's step (every model resident)",
                peak[top], "GiB", better="lower", note=f"{top}; " + ", ".join(
                    f"{k} {v:.1f}" + (f" ({resident[k]:.1f} resident)" if k in resident else "")
                    for k, v in peak.items()))]


def _rows_host_overhead(path: str) -> List[Row]:
    """``benchmarks/host_overhead.py``: per family, each side's host time per step at a shape
    where compute is ~0, and each side's extra host time per layer over its family's baseline
    (worst of the alternating runs); reported, no goals: how much of the family benchmarks'
    steps the host alone would take."""
    s = _load(path)
    step, rows = "host_overhead", []
    compat = (s.get("compat") or {}).get("est_ms_per_step") or {}
    for family in ("structmoe", "sigma"):
        r = s.get(family)
        if r is None:
            continue
        base = r["base"]
        for side, host in r["host_ms"].items():
            note = f"step {r['step_ms'][side]:.2f} ms"
            if side in compat.get(family, {}):  # the CPU backend's mode, never on a GPU
                note += f"; about {compat[family][side]:.2f} ms of it the CPU backend's mode"
            rows.append(Row(step, f"{family} {side}: host time per step", host, "ms",
                            better="lower", note=note))
            if side == base:
                continue
            rows.append(_per_run(step, f"{family} {side}: extra host time per layer over {base}",
                                 r["extra_host_ms_per_layer_runs"][side],
                                 r["extra_host_ms_per_layer"][side], "ms", None, "lower",
                                 note=f"host x{r['host_ratio'][side]:.3f} {base}'s, "
                                      f"{s['layers']} layers"))
    return rows


def _rows_stem_mlp(path: str) -> List[Row]:
    s = _load(path)
    rows = [Row("stem_mlp", "dense SwiGLU fwd+bwd", s["dense_ms"], "ms",
                note=_host(s, "dense", s["dense_ms"]))]
    compile_s = s.get("compile_s") or {}
    notes = {"triton": "ideal 1.5x", "torch": "PyTorch path",
             "compiled": "PyTorch path, --stem-compile gate"}
    for k in ("triton", "torch", "compiled"):
        if f"stem_{k}_speedup" in s:
            note = _notes(notes[k], _host(s, f"stem_{k}", s.get(f"stem_{k}_ms")),
                          f"compiled in {compile_s['stem_compiled']:.1f} s"
                          if k == "compiled" and "stem_compiled" in compile_s else "")
            rows.append(_per_run("stem_mlp", f"STEM MLP ({k}) speed-up vs dense",
                                 s.get(f"stem_{k}_speedup_runs"), s[f"stem_{k}_speedup"], "x",
                                 1.4 if k == "triton" else None, "higher", note=note))
    if "gate_triton_ms" in s:
        # Issue 50's goal for the memory-bound lookup-and-gate: about 0.7 GB of HBM traffic at
        # this shape, 0.25 ms at 3 TB/s; at most 0.5 ms forward + backward.
        rows.append(_per_run("stem_mlp", "lookup-and-gate alone (fused) fwd+bwd",
                             s.get("gate_triton_ms_runs"), s["gate_triton_ms"], "ms", 0.5,
                             "lower", note="Zipf ids"))
    if "gate_triton_ms" in s and "gate_torch_ms" in s:
        rows.append(Row("stem_mlp", "lookup-and-gate alone, fused vs PyTorch",
                        s["gate_torch_ms"] / s["gate_triton_ms"], "x",
                        note=f"{s['gate_triton_ms']:.3f} vs {s['gate_torch_ms']:.3f} ms"))
    if "gate_compiled_ms" in s:  # --stem-compile gate: the same goal, the PyTorch path compiled
        rows.append(_per_run("stem_mlp", "lookup-and-gate alone (PyTorch, compiled) fwd+bwd",
                             s.get("gate_compiled_ms_runs"), s["gate_compiled_ms"], "ms", 0.5,
                             "lower", note="Zipf ids, --stem-compile gate"))
        if "gate_torch_ms" in s:
            rows.append(Row("stem_mlp", "lookup-and-gate alone, compiled vs PyTorch",
                            s["gate_torch_ms"] / s["gate_compiled_ms"], "x",
                            note=f"{s['gate_compiled_ms']:.3f} vs {s['gate_torch_ms']:.3f} ms"))
    return rows


def _rows_overhead(step: str, what: str, goal_backend: Optional[str]):
    def read(path: str) -> List[Row]:
        s = _load(path)
        times = s.get("layer_ms") or s.get("step_ms")
        runs = s.get("overhead_pct_runs") or {}
        rows = [Row(step, f"dense {what}", times["dense"], "ms",
                    note=_host(s, "dense", times["dense"]))]
        per_backend = {}
        for name, pct in s["overhead_pct"].items():
            # A "<backend>+compiled" side: --structmoe-compile routed, its compile time apart.
            compiled = (s.get("compile_s") or {}).get(name)
            per_backend[name] = _per_run(step, f"StructMoE ({name}) over dense", runs.get(name),
                                         pct, "%", 3.0 if name == goal_backend else None,
                                         "lower", note=_notes(
                                             f"{times[name]:.2f} ms",
                                             _host(s, name, times[name]),
                                             f"compiled in {compiled:.1f} s"
                                             if compiled is not None else ""))
            rows.append(per_backend[name])
        if per_backend:
            # The fastest is the one whose worse run is the best.
            best = min(per_backend, key=lambda n: per_backend[n].value)
            rows.append(_per_run(step, f"StructMoE, fastest backend ({best}) over dense",
                                 runs.get(best), s["overhead_pct"][best], "%", 3.0, "lower"))
        return rows + _peak_memory(step, s)
    return read


def _rows_sigma(path: str, step: str = "sigma_step") -> List[Row]:
    s = _load(path)
    experts = " (grouped experts)" if s.get("moe_grouped_gemm") else ""
    rows = [_per_run(step, f"Sigma router step over upstream aux_loss{experts}",
                     [100.0 * (r - 1.0) for r in s.get("ratio_runs") or []],
                     100.0 * (s["ratio_sigma_vs_upstream"] - 1.0), "%", 2.0, "lower",
                     note=_notes(
                         f"{s['step_ms']['sigma']:.1f} vs {s['step_ms']['upstream']:.1f} ms",
                         _host(s, "sigma", s["step_ms"]["sigma"]),
                         _host(s, "upstream", s["step_ms"]["upstream"])))]
    if "ratio_compiled_vs_upstream" in s:  # --sigma-compile router (benchmarks/sigma_step.py)
        rows.append(_per_run(
            step, f"Sigma router step, compiled (--sigma-compile router), over upstream{experts}",
            [100.0 * (r - 1.0) for r in s.get("ratio_compiled_runs") or []],
            100.0 * (s["ratio_compiled_vs_upstream"] - 1.0), "%", 2.0, "lower",
            note=_notes(
                f"{s['step_ms']['sigma_compiled']:.1f} ms",
                _host(s, "sigma_compiled", s["step_ms"]["sigma_compiled"]),
                f"compiled in {s['compile_s']['sigma_compiled']:.1f} s")))
    return rows + _peak_memory(step, s)


def _rows_profile(path: str) -> List[Row]:
    """``benchmarks/profile_families.py``'s profiles: per family side against its baseline,
    the difference per step of the GPU's kernel time (on the CPU: operators' self time; the
    note names the three kernels that differ most, with milliseconds), of the main stream's
    idle time and of the host's blocking CUDA calls (the note: in which operators). Reported,
    no goal; a benchmark that was not profiled is a row that says why."""
    step, rows = "profile", []
    for bench, r in _load(path).items():
        if r.get("status") != "ok":
            rows.append(Row(step, f"{bench}: profiled", None, "", note=f"{r.get('status')}: "
                            f"{r.get('reason', '')}", incomplete=True))
            continue
        base = r["base"]
        for side, d in r["diffs"].items():
            what = "GPU kernel time" if d["source"] == "gpu" else "operators' self time (CPU)"
            trace = r["sides"][side]["trace"]
            top = [x for x in d["rows"] if "rest" not in x][:3]
            note = "; ".join(f"{x['name'][:70]} {x['diff_ms']:+.3f} ms" for x in top) + (
                f"; step {d['step']['base_ms']:.2f} -> {d['step']['ours_ms']:.2f} ms; trace "
                f"{os.path.basename(trace['path']) if trace.get('path') else trace['kept']}")
            rows.append(Row(step, f"{bench}: {side} over {base}, {what} per step",
                            d["total"]["diff_ms"], "ms", note=note))
            idle = d.get("main_stream_idle")
            if idle:
                rows.append(Row(step, f"{bench}: {side} over {base}, GPU idle between kernels "
                                "per step", idle["diff_ms"], "ms",
                                note=f"{idle['base_ms']:.2f} -> {idle['ours_ms']:.2f} ms"))
            blocking = d["host_blocking"]
            by_op = r["sides"][side]["summary"]["host_syncs"]["by_op"]
            rows.append(Row(step, f"{bench}: {side} over {base}, host blocked in CUDA calls per "
                            "step", blocking["diff_ms"], "ms",
                            note=f"{blocking['base_ms']:.2f} -> {blocking['ours_ms']:.2f} ms"
                            + ("; in " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['count']:g}x)"
                                                   for k, v in list(by_op.items())[:3])
                               if by_op else "")))
    return rows


PLACEMENT_GOALS = {"cpu": 1.05, "tiered": 1.03}


def _runs(ratios: List[Optional[float]], better: str = "lower") -> Tuple[Optional[float], str]:
    """The worst of the repeats' ratios (the highest, or the lowest where higher is better),
    and a note with every run's, their median and spread. A goal is judged on the worst: met
    means met in every run (two runs of the same code gave 0.932x and 1.091x on 2026-11-27)."""
    known = [x for x in ratios if x is not None]
    if not known:
        return None, "no ratio"
    worst = max(known) if better == "lower" else min(known)
    return worst, (f"worst of runs {' / '.join(f'{x:.3f}' for x in known)}, median "
                   f"{statistics.median(known):.3f}, spread {max(known) - min(known):.3f}")


def _rows_placement(path: str, step: str = "stem_placement") -> List[Row]:
    """``benchmarks/stem_placement.py``'s variants: with the gpu variant in the run, each one's
    step against it (the goals: ``PLACEMENT_GOALS``); without it (the pieces that compare one
    flag), each one's step time; and a variant of the benchmark's ``BASELINES`` against the
    variant it changes by one flag, where both trained in the run (reported: what decides that
    flag's default). A variant that failed is a row not met, whichever of these it is."""
    s = _load(path)
    rows = []
    with_gpu = "gpu" in s
    gpu_ok = s.get("gpu", {}).get("status", "ok") == "ok"
    for name, r in s.items():
        status = r.get("status", "ok")  # results of 2026-11-27 and before held no status
        failed = "" if status == "ok" else f"{status}: {r.get('reason', '')}; "
        idle = (r.get("trace") or {}).get("summary", {}).get("main_stream")
        if idle:  # two profiled steps: the GPU waiting for the host
            during = idle.get("idle_ms_per_step_during") or {}
            rows.append(Row(step, f"{name} tables, GPU main stream idle per step",
                            idle["idle_ms_per_step"], "ms",
                            note=f"trace {os.path.basename(r['trace']['path'])}" + "".join(
                                f"; {k} {v:.1f} ms" for k, v in during.items())))
        if name == "gpu" or not with_gpu:
            rows.append(Row(step, f"{name} tables, step", r.get("iteration_ms"), "ms",
                            note=failed.rstrip("; "), incomplete=bool(failed)))
        if name == "gpu":
            continue
        if with_gpu:
            rows.append(_placement_vs_gpu(step, name, r, failed, gpu_ok))
        sparse = r.get("ratios_per_repeat_vs_gpu_sparse") or [r.get("ratio_vs_gpu_sparse")]
        if name != "gpu-sparse" and r.get("baseline") != "gpu-sparse" and any(
                x is not None for x in sparse):
            # gpu steps whole tables with Megatron's dense Adam; gpu-sparse has the host
            # variants' optimizer with every row on the GPU: this ratio is the host rows' cost.
            worst, runs = _runs(sparse)
            rows.append(Row(step, f"{name} tables, step vs gpu-sparse tables",
                            worst, "x", note=failed + "every row on the GPU, the same sparse "
                            f"row-wise AdamW; {runs}", incomplete=bool(failed)))
        base = r.get("baseline")
        if base:  # the same run's baseline, one flag changed (benchmarks/stem_placement.py)
            known = [x for x in r.get("ratios_per_repeat_vs_baseline") or [] if x is not None]
            worst, runs = _runs(known)
            base_ms = s[base].get("iteration_ms")
            rows.append(Row(step, f"{name} tables, step vs {base} tables", worst, "x",
                            better="lower", note=failed + (
                                "one run; " if len(known) == 1 else "") + runs + (
                                f"; {r['iteration_ms']:.1f} vs {base_ms:.1f} ms"
                                if "iteration_ms" in r and base_ms is not None else ""),
                            incomplete=bool(failed) or not known))
    return rows


def _placement_vs_gpu(step: str, name: str, r: dict, failed: str, gpu_ok: bool) -> Row:
    """A variant's step against the gpu variant's in the same run, judged on the worst repeat
    against its goal where it has one."""
    goal = PLACEMENT_GOALS.get(name)
    # Results of the first 2026-11-27 runs held one ratio, no per-repeat list.
    worst, runs = _runs(r.get("ratios_per_repeat") or [r.get("ratio_vs_gpu")])
    short = ""
    if not failed and goal is not None and len(
            [x for x in r.get("ratios_per_repeat") or [worst] if x is not None]) < 2:
        short = "one run: a goal is judged on two or more (--repeats 2); "
    if not gpu_ok:
        runs += " (the gpu variant did not finish)"
    details = "" if "iteration_ms" not in r else (
        f"; {r['iteration_ms']:.1f} ms, CPU optimizer "
        f"{1e3 * r.get('stem/optimizer-seconds', float('nan')):.1f} ms "
        "(waiting for its gradients "
        f"{1e3 * r.get('stem/optimizer-seconds-grad-wait', float('nan')):.1f}), fetch exposed "
        f"{1e3 * r.get('stem/fetch-seconds-exposed', float('nan')):.1f} ms, rows from host "
        f"{r.get('stem/fetch-bytes-from-host', float('nan')) / 2**20:.0f} MiB/step"
        + _kernel_rate(r))
    return Row(step, f"{name} tables, step vs gpu tables", worst, "x", goal, "lower",
               note=failed + short + runs + details, incomplete=bool(failed or short))


def _kernel_rate(r: dict) -> str:
    """The CPU row kernel's rate inside the run (its row loops), to hold against the
    host_optimizer step's rate of the same kernel alone; empty where the run logged none."""
    params = r.get("stem/optimizer-kernel-params") or 0.0
    loop = r.get("stem/optimizer-kernel-loop-seconds") or 0.0
    if not (params > 0 and loop > 0):  # also NaN
        return ""
    return f", CPU row kernel {params / loop / 1e9:.2f} G params/s in its loops"


def _rows_optimizer_step(path: str) -> List[Row]:
    """``benchmarks/optimizer_step.py``: megatron-core's fallbacks without Apex/TE against ours,
    per part of the optimizer step; the value is the worse run's ratio (ours / upstream)."""
    s = _load(path)
    what = {"adam": "torch AdamW step, fused (ours) over torch's default (upstream)",
            "norm": "gradient norm, torch._foreach_norm (ours) over upstream's stand-in",
            "clip": "clipped gradients' scaling, ours over upstream's stand-in",
            "step": "the three together, ours over upstream's fallbacks"}
    rows = []
    for part, text in what.items():
        p = s["parts"][part]
        rows.append(Row("optimizer_step", f"{text}, {s['preset']}", max(p["ratio_runs"]), "x",
                        None, "lower",
                        note=f"upstream {p['upstream_median_ms']:.2f} ms, ours "
                             f"{p['ours_median_ms']:.2f} ms (medians of {s['repeats']} runs); "
                             f"{s['parameters'] / 1e9:.2f} B parameters in {s['tensors']} "
                             f"tensors" + ("" if s["fused_adam"] else "; ours not fused here")))
    return rows


def _rows_moe_experts(path: str) -> List[Row]:
    """``benchmarks/moe_experts.py``: the grouped experts over upstream's SequentialMLP, the
    worse run's ratio."""
    s = _load(path)
    return [Row("moe_experts", f"grouped experts over SequentialMLP, fwd+bwd, {s['experts']} "
                f"experts of {s['ffn']}, H {s['hidden']}, {s['tokens']} tokens ({s['routing']}), "
                f"{s['dtype']}", max(s["ratio_runs"]), "x", None, "lower",
                note=f"sequential {s['median_ms']['sequential']:.2f} ms, grouped "
                     f"{s['median_ms']['grouped']:.2f} ms (medians of {s['repeats']} runs); "
                     f"GEMM paths {s['gemm_paths']}; outputs differ by at most "
                     f"{s['max_output_diff']:.3g}")]


def _rows_cross_entropy(path: str) -> List[Row]:
    """``benchmarks/cross_entropy.py``: the fused loss over upstream's, the worse run's ratio."""
    s = _load(path)
    peak = s.get("peak_gib_above_logits") or {}
    mem = (f"; peak above the logits: upstream {peak['upstream']:.2f} GiB, fused "
           f"{peak['fused']:.2f} GiB" if peak else "")
    return [Row("cross_entropy", f"fused cross entropy over upstream's, fwd+bwd, {s['tokens']} "
                f"tokens x vocab {s['vocab']}, {s['dtype']}", max(s["ratio_runs"]), "x", None,
                "lower", note=f"upstream {s['median_ms']['upstream']:.2f} ms, fused "
                              f"{s['median_ms']['fused']:.2f} ms (medians of {s['repeats']} "
                              f"runs){mem}")]


def _rows_rope(path: str) -> List[Row]:
    """``benchmarks/rope.py``: the fused RoPE over upstream's unfused one, the worse run's
    ratio."""
    s = _load(path)
    err = s["max_error"]
    return [Row("rope", f"fused RoPE over upstream's unfused, fwd+bwd of one layer's queries and "
                f"keys, {s['seq']} x {s['micro_batch']} tokens, {s['heads']}/{s['groups']} "
                f"heads of {s['head_dim']}, {s['dtype']}", max(s["ratio_runs"]), "x", None,
                "lower", note=f"upstream {s['median_ms']['upstream']:.3f} ms, fused "
                              f"{s['median_ms']['fused']:.3f} ms (medians of {s['repeats']} "
                              f"runs); max error vs float64: upstream {err['upstream']:.3g}, "
                              f"fused {err['fused']:.3g}")]


def _rows_host_optimizer(path: str) -> List[Row]:
    s = _load(path)
    return [Row("host_optimizer", "sparse CPU AdamW over DeepSpeed dense CPU Adam, this host",
                s["ratio"], "x", 0.8, "higher",
                note=f"{s['sparse_params_per_s'] / 1e9:.2f} G params/s, {s['threads']} threads, "
                     f"{s['kernel']}, {(s['sparse_state_bytes_on_huge_pages'] or 0) / 2**30:.1f} "
                     f"GiB of the state on huge pages (THP {s['transparent_huge_pages']})"),
            Row("host_optimizer", "sparse CPU AdamW over DeepSpeed dense CPU Adam on a window "
                "moving through a table-sized state (as training walks it), this host",
                s["ratio_cold"], "x", 0.8, "higher",
                note=f"DeepSpeed {s['deepspeed_dense_cold_params_per_s'] / 1e9:.2f} G params/s "
                     f"there, {s['deepspeed_dense_params_per_s'] / 1e9:.2f} on its reused window, "
                     f"{s['dense_whole_table_params_per_s'] / 1e9:.2f} over the whole table")]


def _rows_host_gather(path: str) -> List[Row]:
    s = _load(path)
    ms = s["ms"]
    return [Row("host_gather", f"host rows gathered and cast to {name}, vs its fp32 gather",
                s[f"{name}_vs_fp32_copy"], "x",
                note=f"{ms[f'compiled {name}']:.2f} ms for {s['rows']} rows x {s['width']}, "
                     f"{s['threads']} threads; torch {s[f'{name}_torch_vs_compiled']:.2f}x that")
            for name in ("bf16", "fp16")] + [
        Row("host_gather", "bf16 gather from a shard on 4 KiB pages vs on huge pages (the "
            "store's)", s["bf16_4k_pages_vs_huge"], "x",
            note=f"{s['shard_bytes_on_huge_pages'] / 2**20:.0f} MiB of the shard on huge pages"),
        Row("host_gather", "read of rows owing a catch-up, as of now vs catch-up in place then "
            "gather (bf16)", s["read_now_vs_catch_up_then_gather"], "x",
            note=f"{ms['owing, read as of now bf16']:.2f} vs "
                 f"{ms['owing, catch-up in place + gather bf16']:.2f} ms")]


def _rows_host_read(path: str) -> List[Row]:
    """``benchmarks/stem_host_read.py``: the direct read over the staged one in each run (no
    goal: the number decides ``--stem-host-read``'s default), and the shard's registration."""
    s = _load(path)
    staged, direct = (statistics.median(s["ms"][k]) for k in ("staged", "direct"))
    rows = [_per_run("host_read", f"direct read of host rows (GPU kernel over the bus) vs staged "
                     f"(CPU gather + copy), {s['rows']} rows x {s['width']} fp32 -> "
                     f"{s['dtype']}", s["ratios_per_run"], None, "x", None, "lower",
                     note=f"medians staged {staged:.3f} ms, direct {direct:.3f} ms; "
                          f"{s['device']}")]
    if s.get("register_ms") is not None:
        rows.append(Row("host_read", "cudaHostRegister of a host shard (start-up, per shard)",
                        s["register_ms"], "ms",
                        note=f"{s['shard_bytes'] / 2**30:.2f} GiB, "
                             f"{(s.get('shard_bytes_on_huge_pages') or 0) / 2**30:.2f} GiB "
                             "of it on huge pages"))
    return rows


def _rows_worker_schedule(path: str) -> List[Row]:
    s = _load(path)
    chunks = s["owed step, chunks"]
    return [Row("stem_worker_schedule", "host step: chunks vs one task (step time)",
                s["ratio_chunks_vs_one_task"], "x", note=f"fetch waited "
                f"{' / '.join(f'{w:.0f}' for w in chunks['fetch_waited_ms'])} ms per "
                f"micro-batch; {chunks['vs_compute']:.3f}x the compute")]


def _rows_catchup_ops(path: str) -> List[Row]:
    """``benchmarks/stem_catchup_ops.py``: the tiered read with a table step owed, and the
    gradient path after backward per layer count (the split and staging on the training thread,
    the owed step on the worker), GPU tier on the GPU; the ops per phase (counted on ``meta``)
    in the notes. No goals: what issue 50's fewer launches are worth."""
    s = _load(path)
    rows = []
    if "tiered" in s:
        t = s["tiered"]
        rows.append(Row("stem_catchup_ops", "tiered read with the table step owed (micro-batch 0)",
                        t["read_ms"], "ms", better="lower",
                        note=f"{t['total'].get('device', 0)} GPU-tier ops, "
                             f"{t['total'].get('host', 0)} host ops"))
    for key in sorted(k for k in s if k.startswith("grads_")):
        r, layers = s[key], key.split("_")[1]
        ops = r["ops"]

        def dev(phase):
            return ops.get(phase, {}).get("device", 0)

        for kernel, t in r.get("times", {}).items():
            if kernel == "torch":
                rows.append(Row("stem_catchup_ops", f"{layers} layers: gradients split and "
                                "staged", t["split_ms"], "ms", better="lower",
                                note=f"{dev('grads: split')} + {dev('grads: staging to host')} "
                                     f"device ops; {t['device']}"))
            rows.append(Row("stem_catchup_ops", f"{layers} layers: the owed table step, GPU "
                            f"tier's step {kernel}", t["step_ms"], "ms", better="lower",
                            note=(f"{dev('step: GPU tier')} GPU-tier ops in {r['chunks']} "
                                  "chunks; " if kernel == "torch" else "one kernel per chunk; ")
                            + t["device"]))
    return rows


def _scaling_row(path: str) -> Dict[str, str]:
    with open(path) as f:
        rows = [r for r in csv.DictReader(f)]
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r.get("tokens_per_s_per_gpu")]
    if not ok:
        raise ValueError(f"{path}: no layout finished")
    return ok[0]


def _rows_scaling(preset: str):
    def read(path: str) -> List[Row]:
        r = _scaling_row(path)
        rows = [Row(f"scaling_{preset}", f"{preset} tokens/s/GPU",
                    float(r["tokens_per_s_per_gpu"]), "tok/s")]
        if r.get("mfu"):
            rows.append(Row(f"scaling_{preset}", f"{preset} MFU", 100 * float(r["mfu"]), "%",
                            note=f"peak {r.get('peak_tflops')} TFLOP/s ({r.get('peak_source')})"))
        other = "dense_350m" if preset == "stem_350m" else None
        other_csv = os.path.join(os.path.dirname(os.path.dirname(path)), f"scaling_{other}",
                                 "scaling.csv") if other else None
        if other_csv and os.path.exists(other_csv):
            d = _scaling_row(other_csv)
            rows.append(Row(f"scaling_{preset}", "STEM-350M vs dense-350M tokens/s",
                            float(r["tokens_per_s_per_gpu"]) / float(d["tokens_per_s_per_gpu"]),
                            "x", 1.0, "higher", note="STEM does fewer FLOPs per token"))
        return rows
    return read


def _rows_first_runs(path: str) -> List[Row]:
    """``launch/first_runs.py``'s summary: per run its tokens/s, MFU and peak memory (a run that
    did not finish: one row saying how, not met), per pair its ratio against the issue's goal."""
    s = _load(path)
    step, rows = "first_runs", []
    for r in s["runs"]:
        if r["status"] != "ok":
            rows.append(Row(step, f"{r['run']}: trained", None, "", note=f"{r['status']}: "
                            f"{r.get('error', '')}", incomplete=True))
            continue
        note = (f"{r['measured_iters']} measured iterations of {r['tokens_per_iteration']} "
                f"tokens, final loss {r['loss_final']}")
        rows += [Row(step, f"{r['run']} tokens/s", r["tokens_per_s_per_gpu"], "tok/s", note=note),
                 Row(step, f"{r['run']} MFU", None if r.get("mfu") is None else 100 * r["mfu"],
                     "%", note=f"peak {s['peak_tflops']} TFLOP/s ({s['peak_source']})"),
                 Row(step, f"{r['run']} peak memory", r["peak_mem_gib"], "GiB",
                     note=r.get("peak_mem_metric", ""))]
    for p in s["pairs"]:
        mfu = p["metric"] == "mfu"
        value = p["ratio"] if not mfu or p["ratio"] is None else 100 * p["ratio"]
        goal = p["goal"] if not mfu or p["goal"] is None else 100 * p["goal"]
        rows.append(Row(step, f"{p['pair']} {p['metric']}", value, "%" if mfu else "x", goal,
                        "higher" if p["better"] == "higher" else "lower", note=p["note"],
                        incomplete=bool(p["goal"] is not None and p["ratio"] is None)))
    return rows


def _rows_pytest(path: str, step: str = "gpu_tests") -> List[Row]:
    """Per test file, its failed, errored and crashed tests (goal none), naming them and the
    test a crash or hang stopped in; in all, the tests that passed (goal: at least one; a step
    where every test skipped ran nothing on a GPU: no GPU, or a package missing)."""
    result = isolated_pytest.load(path)
    rows = []
    for name, f in result["files"].items():
        if not (f.get("collected") or f["errors"] or f["crashed"]):
            rows.append(Row(step, f"{name}: failed, errored or crashed", None, "tests", 0,
                            "lower", note="no test of it ran: the step stopped before it, or "
                                          "none was collected", incomplete=True))
            continue
        note = f"{f['passed']} passed, {f['skipped']} skipped"
        if f["crashed"]:
            note += (f"; crashed in {f['crashed_in'].split('::')[-1]} ({f['crash']}), "
                     f"{f['not_run']} of the file's tests not run after it")
        if f["failed_ids"]:
            note += "; failed: " + ", ".join(i.split("::", 1)[-1] for i in f["failed_ids"])
        rows.append(Row(step, f"{name}: failed, errored or crashed",
                        f["failed"] + f["errors"] + f["crashed"], "tests", 0, "lower", note=note))
    for problem in result["problems"]:
        rows.append(Row(step, "pytest itself", None, "", note=problem, incomplete=True))
    t = result["totals"]
    note = f"{t['skipped']} skipped"
    if not t["passed"]:
        reasons = collections.Counter()
        for f in result["files"].values():
            reasons.update(f["skip_reasons"])
        note = (f"nothing passed: all {t['skipped']} skipped (no GPU, or a package missing): " +
                "; ".join(f"{why} ({n})" for why, n in reasons.most_common(3)))
    rows.append(Row(step, "tests that passed", t["passed"], "tests", 1, "higher", note=note))
    return rows


# ----------------------------------------------------------------------------- the plan

# Single-process tests with a CUDA path (they run on the GPU when one is there) and the tests
# marked gpu, in two steps. Multi-rank tests are gloo/CPU tests and stay in CI.
# First, what issue 48 needs before anything else: the file whose row-kernel refusal died of
# SIGSEGV on an H100's host (2026-11-27), the refusals' own tests (a team of 16 threads, another
# thread holding the GIL: that host has 16 cores, the development machine 2), and the files with
# CUDA paths written since that run (the rows' GPU step kernel, direct host reads, the gradient
# path's split). Run first and apart, they report even if the longer step after them is cut.
GPU_TESTS_FIRST = [
    "tests/test_row_kernel_refusals.py", "tests/test_stem_row_adam.py",
    "tests/test_row_adam_gpu.py", "tests/test_host_rows.py", "tests/test_stem_grad_split.py",
    "tests/test_host_read_order.py",
    # The fused cross entropy's Triton kernels compiled (2026-11-28; its TP=2 training runs on
    # the CPU only).
    "tests/test_vocab_ce.py::test_cuda_kernels_compile_and_give_upstreams_numbers",
    # The fused RoPE's Triton kernel compiled, at dense_1b's attention (2026-11-28).
    "tests/test_rope.py::test_cuda_kernel_compiles_and_gives_upstreams_numbers",
    # The torch grouped experts in bf16 (torch._grouped_mm on sm90) and --ext-adam-impl auto's
    # fused AdamW on the GPU (2026-11-28).
    "tests/test_grouped_experts.py::test_cuda_bf16_grouped_experts_match_sequential",
    "tests/test_adam_impl.py::test_auto_is_fused_on_the_gpu_and_gives_torchs_fused_adamw",
]
# Then the rest: the kernels, lookup, prefetch, tiers, compat, TE, and the compiled regions
# against eager on CUDA in bf16 and fp32 (Inductor's Triton kernels). With the first step, every
# test of ``stem_gpu_tests`` too (its one test outside these files is named here).
GPU_TEST_FILES = [
    "tests/test_kernel_stem_gate.py", "tests/test_kernel_structmoe.py",
    "tests/test_stem_lookup.py", "tests/test_stem_tables_prefetch.py", "tests/test_compat.py",
    "tests/test_te_backend.py", "tests/test_stem_mlp.py", "tests/test_structmoe_routed.py",
    "tests/test_stem_tiers.py",
    "tests/test_stem_layers.py::test_block_context_of_host_checked_ids_does_not_wait_for_the_gpu",
    "tests/test_compiled_regions.py",
]


# The STEM tables' tests that run on a GPU only (streams, events, pinned copies): a minute,
# where ``gpu_tests`` takes three, for a lease too short for every file.
STEM_GPU_TESTS = [
    "tests/test_stem_tables_prefetch.py::test_worker_side_stream_work_is_seen_after_wait",
    "tests/test_stem_tables_prefetch.py::test_worker_task_after_an_event_skips_later_gpu_work",
    "tests/test_stem_tables_prefetch.py::test_fetch_from_host_ids_does_not_wait_for_the_gpu",
    "tests/test_stem_tiers.py::test_gpu_tier_step_queues_without_waiting_for_the_gpu",
    "tests/test_stem_tiers.py::test_host_tier_gradients_leave_the_gpu_beside_the_current_stream",
    "tests/test_stem_tiers.py::test_first_rows_of_the_host_tier_gradients_land_first",
    "tests/test_stem_layers.py::test_block_context_of_host_checked_ids_does_not_wait_for_the_gpu",
    "tests/test_host_rows.py::test_gpu_reads_a_registered_huge_page_shard_and_refuses_a_pageable_one",
    "tests/test_host_rows.py::test_gpu_store_registers_its_host_shards",
    "tests/test_stem_grad_split.py::test_gradient_path_queues_without_waiting_for_the_gpu",
    "tests/test_row_adam_gpu.py::test_kernel_gives_the_reference_bits_on_the_gpu",
    "tests/test_host_read_order.py::"
    "test_gpu_direct_read_returns_the_rows_before_a_host_write_made_at_once",
]


def _pytest_step(name: str, what: str, tests: List[str], limit: int) -> Step:
    """pytest through ``scripts/isolated_pytest.py``: a test that crashes or makes no progress
    for 180 s (the row kernels' first build takes about a minute) is named, and the files after
    it run in a new pytest; JUnit reports under ``RES/<name>/``."""
    return Step(name, what,
                [PY, "scripts/isolated_pytest.py", "--json", f"{RES}/{name}.json",
                 "--junit-dir", f"{RES}/{name}", "--test-timeout", "180", *tests],
                limit, f"{name}.json", lambda path: _rows_pytest(path, name), kind="pytest")


def _placement_step(name: str, what: str, variants: List[str]) -> Step:
    """``benchmarks/stem_placement.py`` at the 1B shape, 20 iterations (the median of the last
    12), each training cut at 180 s; its work folder and JSON named for the step."""
    return Step(name, what,
                [PY, "benchmarks/stem_placement.py", "--iters", "20", "--skip", "8",
                 "--timeout", "180", *variants,
                 "--out", f"{RES}/work/{name}", "--json", f"{RES}/{name}.json"],
                480, f"{name}.json", functools.partial(_rows_placement, step=name))


# A name that stands for several steps, in this order (``--steps``, ``--skip``): until
# 2026-11-28 ``stem_placement`` was one step of six trainings (gpu, tiered, gpu-sparse, twice),
# past one device call; its pieces each fit one.
GROUPS = {"stem_placement": ["stem_placement_base", "stem_placement_direct",
                             "stem_placement_gpu_step"]}


def plan() -> List[Step]:
    steps = [
        _pytest_step("gpu_tests_first", "pytest: the row kernels (the SIGSEGV's file, the "
                     "refusals on this host) and the CUDA tests new since the last GPU run",
                     GPU_TESTS_FIRST, 240),
        _pytest_step("gpu_tests", "pytest: the other GPU-marked tests and single-process tests "
                     "with a CUDA path (kernels, compiled regions)", GPU_TEST_FILES, 480),
        _pytest_step("stem_gpu_tests", "pytest: the STEM tables' GPU-only tests (streams, "
                     "pinned copies)", STEM_GPU_TESTS, 120),
        Step("stem_mlp", "STEM MLP (fused kernel, PyTorch path) vs dense SwiGLU, 1B shape, bf16",
             [PY, "benchmarks/stem_mlp.py", "--json", f"{RES}/stem_mlp.json"],
             240, "stem_mlp.json", _rows_stem_mlp),
        Step("structmoe_kernel", "StructMoE MLP per routed backend vs dense SwiGLU MLP",
             [PY, "benchmarks/structmoe_kernel.py", "--pad-to", "128",
              "--json", f"{RES}/structmoe_kernel.json"],
             240, "structmoe_kernel.json", _rows_overhead("structmoe_kernel", "MLP", "triton")),
        # With dense-masked's D'_ff stored as 6656 (--structmoe-ffn-pad-to 128, the same
        # model), eager and compiled: whether the unaligned 6618 is what costs the +29.7%.
        Step("structmoe_step", "StructMoE 0.9B GPT step vs dense, per routed backend",
             [PY, "benchmarks/structmoe_step.py", "--pad-to", "128",
              "--json", f"{RES}/structmoe_step.json"],
             300, "structmoe_step.json", _rows_overhead("structmoe_step", "step", "triton")),
        # Issue 50, capability 2: the same models at 4 x 4096 tokens per step. Memory, counted:
        # the loss upcasts the 16384 x 128256 logits (4.2 GB in bf16) to fp32 (8.4 GB, kept for
        # backward as the softmax; Megatron's vocab_parallel_cross_entropy), and five models of
        # 0.89 B parameters hold bf16 weights and gradient buffers (18 GB); with about 1.2 GB
        # of activations per layer at this size (SDPA attention: no [s, s] scores) the step
        # needs about 40-50 GB of an H100's 80. triton is left out (+143.8% at 2048 tokens,
        # H100, 2026-11-27: it cannot be the fastest), and so is grouped (+40.3% there, its
        # permutation as linear in the tokens as dense-masked's extra FLOPs): dense-masked with
        # D'_ff as it is and stored as 6656 (--structmoe-ffn-pad-to 128), each eager and
        # compiled; 5 timed steps per side and run (a step is about 8x the 2048-token one).
        Step("structmoe_step_16k", "StructMoE 0.9B GPT step vs dense at 4 x 4096 tokens, "
             "dense-masked with D'_ff as it is and padded",
             [PY, "benchmarks/structmoe_step.py", "--micro-batch", "4", "--seq", "4096",
              "--backends", "dense-masked", "--pad-to", "128", "--reps", "5",
              "--json", f"{RES}/structmoe_step_16k.json"],
             300, "structmoe_step_16k.json",
             _rows_overhead("structmoe_step_16k", "step", None)),
        Step("sigma_step", "Sigma router with global LBL vs upstream aux_loss, 8 layers",
             [PY, "benchmarks/sigma_step.py", "--layers", "8", "--seq", "4096",
              "--json", f"{RES}/sigma_step.json"],
             300, "sigma_step.json", _rows_sigma),
        # The same with --moe-grouped-gemm: both sides' experts as torch grouped GEMMs
        # (models/grouped_experts.py) instead of upstream's SequentialMLP; the router's share
        # of a step whose experts no longer launch a GEMM per expert.
        Step("sigma_step_grouped", "Sigma router with global LBL vs upstream aux_loss, 8 "
             "layers, grouped experts (--moe-grouped-gemm)",
             [PY, "benchmarks/sigma_step.py", "--layers", "8", "--seq", "4096",
              "--moe-grouped-gemm", "--json", f"{RES}/sigma_step_grouped.json"],
             300, "sigma_step_grouped.json",
             functools.partial(_rows_sigma, step="sigma_step_grouped")),
        # The experts alone at Sigma-MoE-Tiny's layer: upstream's SequentialMLP against the
        # grouped experts, same weights and tokens, in one process.
        Step("moe_experts", "MoE experts fwd+bwd: SequentialMLP vs torch grouped GEMMs "
             "(--moe-grouped-gemm), 96 experts of 768, H 1536, 4096 tokens, bf16",
             [PY, "benchmarks/moe_experts.py", "--json", f"{RES}/moe_experts.json"],
             120, "moe_experts.json", _rows_moe_experts),
        # Where the families' extra time goes: three steps of each side of structmoe_step,
        # stem_mlp and sigma_step (same shapes) under PyTorch's profiler, one process each.
        Step("profile", "PyTorch profiler: each family benchmark's step and its baseline's, "
             "traces and the per-kernel difference",
             [PY, "benchmarks/profile_families.py", "--out", f"{RES}/profile",
              "--timeout", "150", "--json", f"{RES}/profile.json"],
             360, "profile.json", _rows_profile),
        # The host's time per step at a shape where compute is ~0, per family and side: held
        # against the family steps' step_ms and host_ms, how much of them the host alone takes.
        Step("host_overhead", "host time per step at a tiny shape (compute ~0): dense vs each "
             "StructMoE backend, upstream's aux-loss router vs Sigma",
             [PY, "benchmarks/host_overhead.py", "--json", f"{RES}/host_overhead.json"],
             120, "host_overhead.json", _rows_host_overhead),
        # Issue 51: the optimizer's share of a step without Apex/TE, megatron-core's fallbacks
        # (torch's default AdamW, a host read per gradient tensor in the norm) against the
        # plugin's (--ext-adam-impl auto: fused; compat/upstream_fixes.py), dense_1b's
        # parameters, in one process.
        Step("optimizer_step", "optimizer step without Apex/TE: upstream's fallbacks vs ours "
             "(fused AdamW, norm and clip on the device), dense_1b's parameters",
             [PY, "benchmarks/optimizer_step.py", "--json", f"{RES}/optimizer_step.json"],
             120, "optimizer_step.json", _rows_optimizer_step),
        # Issue 51: the loss without Transformer Engine, upstream's fp32 vocab-parallel cross
        # entropy against the fused kernels (--ext-cross-entropy fused), 4 x 4096 tokens of
        # the 1B presets' vocabulary: its speed decides --ext-cross-entropy auto.
        Step("cross_entropy", "the loss's cross entropy: upstream's vs the fused kernels, "
             "4 x 4096 tokens, vocab 128256, bf16, fwd+bwd",
             [PY, "benchmarks/cross_entropy.py", "--json", f"{RES}/cross_entropy.json"],
             120, "cross_entropy.json", _rows_cross_entropy),
        # Issue 51: the attention's RoPE without Transformer Engine, Megatron's unfused ops
        # against the fused kernel (--ext-rope fused) at dense_1b's attention: its speed decides
        # --ext-rope auto.
        Step("rope", "the attention's RoPE: upstream's unfused ops vs the fused kernel, "
             "dense_1b's queries and keys, 2 x 4096 tokens, bf16, fwd+bwd",
             [PY, "benchmarks/rope.py", "--json", f"{RES}/rope.json"],
             90, "rope.json", _rows_rope),
        # Issue 50, capability 5, the STEM tables in training, in pieces of four 1B trainings
        # (about 100 s each on an H100, 70 s on an H200): the six of one step took about 600 s,
        # past a device call's 10 minutes. Each ratio's baseline trains in the same piece
        # (benchmarks/stem_placement.py BASELINES), never taken from another piece's run.
        # The goal (tiered <= 1.03x gpu) in two runs of each in ABBA order: one run's ratio
        # moved by 0.16 between two runs of the same code (2026-11-27); two steps of each
        # traced.
        _placement_step("stem_placement_base", "STEM tables on the GPU vs tiered, in training, "
                        "two runs each, two steps of each traced",
                        ["--repeats", "2", "--variants", "gpu,tiered",
                         "--profile", "gpu,tiered"]),
        # --stem-host-read direct against the staged read it replaces, two runs each.
        _placement_step("stem_placement_direct", "STEM tiered tables, host rows read by a GPU "
                        "kernel (direct) vs staged, in training, two runs each",
                        ["--repeats", "2", "--variants", "tiered,tiered-direct"]),
        # --stem-gpu-step triton against the torch ops, with 10% and with every row in the GPU
        # tier, one run each (four trainings); tiered against gpu-sparse in the same run (the
        # host rows' cost, like for like).
        _placement_step("stem_placement_gpu_step", "STEM tables: the GPU tier's step in one "
                        "kernel vs torch ops, tiered and gpu-sparse, in training, one run each",
                        ["--repeats", "1", "--variants",
                         "gpu-sparse,gpu-sparse-gpu-step,tiered,tiered-gpu-step"]),
        # Every row in host memory (goal: cpu <= 1.05x gpu), two runs each: four trainings,
        # about 400 s on an H100, past the 360 s limit it had until 2026-11-28.
        _placement_step("stem_placement_cpu", "STEM tables on the GPU vs host memory, in "
                        "training, two runs each", ["--repeats", "2", "--variants", "gpu,cpu"]),
        # The GPU machine's host: the CPU AdamW (0.26 G row-params/s inside the tiered run of
        # 2026-11-24) and the worker's schedule at the 1B shape's host tier (DP=8 share).
        Step("host_optimizer", "sparse CPU AdamW vs DeepSpeed dense CPU Adam, this host",
             [PY, "benchmarks/stem_optimizer.py", "--vocab", "128256", "--d-ff", "8192",
              "--json", f"{RES}/host_optimizer.json"],
             180, "host_optimizer.json", _rows_host_optimizer),
        # The host side of a fetch: rows cast to the wire dtype into the staging buffer (until
        # 2026-11-26 the bf16 gather took 3.1x the fp32 one's time on the development machine,
        # the fp16 gather 1.3x).
        Step("host_gather", "host rows gathered and cast to the wire dtype, this host",
             [PY, "benchmarks/stem_host_gather.py", "--json", f"{RES}/host_gather.json"],
             120, "host_gather.json", _rows_host_gather),
        # --stem-host-read: the store's staged read against the GPU kernel reading the
        # registered host shard, at the 1B shape (a 50304 x 5632 fp32 shard, 3420 Zipf rows).
        Step("host_read", "host rows to the GPU: staged (CPU gather + copy) vs direct (GPU "
             "kernel over the bus), 1B shape, two runs",
             [PY, "benchmarks/stem_host_read.py", "--json", f"{RES}/host_read.json"],
             120, "host_read.json", _rows_host_read),
        Step("stem_worker_schedule", "host worker: the table step in chunks vs as one task",
             [PY, "benchmarks/stem_worker_schedule.py", "--rows", "16032", "--width", "8192",
              "--compute-ms", "100", "--json", f"{RES}/stem_worker_schedule.json"],
             180, "stem_worker_schedule.json", _rows_worker_schedule),
        # Issue 50, capability 5: a read with the table step owed and the gradient path after
        # backward (split by tier, staged, the owed step) at 2 and 4 layers, GPU tier on the
        # GPU; their launches counted on the meta device (2026-11-28, CPU: 140 GPU-tier ops
        # for the owed step at 2 layers, 986 before).
        Step("stem_catchup_ops", "STEM tiered: a read with the step owed and the gradient "
             "path (2, 4 layers), times and ops",
             [PY, "benchmarks/stem_catchup_ops.py", "--json", f"{RES}/stem_catchup_ops.json"],
             240, "stem_catchup_ops.json", _rows_catchup_ops),
    ]
    # Micro-batches of 2: without Transformer Engine attention is unfused (the [b, heads, s, s]
    # scores in memory); 8 ran out of an H100's 80 GB on 2026-11-24.
    for preset in ("dense_350m", "stem_350m"):
        steps.append(Step(
            f"scaling_{preset}", f"{preset}: one GPU, 20 iterations (tokens/s, MFU)",
            [PY, "launch/scaling.py", "--preset", preset, "--gpus", "1",
             "--layouts", "tp1ep1pp1dp1", "--iters", "20", "--warmup-iters", "3",
             "--micro-batch-size", "2", "--out", f"{RES}/scaling_{preset}"],
            300, f"scaling_{preset}/scaling.csv", _rows_scaling(preset)))
    # Issue 51's first runs, one after another on one GPU from the main job's corpus: each
    # stops 85 s after its start (about 35-55 s of training after a 1B model's start-up), so
    # five runs and the corpus build take about 8.5 minutes of the 9 (the summary is written
    # after each run: a limit reached in the last leaves the others').
    steps.append(Step(
        "first_runs", "dense_1b, stem_1b tiered, dense_structmoe_0p9b, structmoe_0p9b, "
        "Sigma-MoE-Tiny 6 layers: tokens/s, MFU, memory, loss, the pairs' ratios",
        [PY, "launch/first_runs.py", "--run-seconds", "85", "--micro-batch-size", "4",
         "--out", f"{RES}/first_runs"],
        540, "first_runs/first_runs.json", _rows_first_runs))
    for s in steps:
        s.estimate_s = ESTIMATES.get(s.name)
    return steps


# Seconds a step is expected to take on one H100: its last measured run (device, date, the log
# it is read from), plus what was added since, guessed and said so; a step without one counts
# its limit. The family benchmarks time as many steps since their runs alternate (2026-11-28)
# as before; their compiled sides (since 2026-11-28) are not in any measured run: a guess of
# 30 s for a process's first compile (Dynamo, AOT autograd, Inductor's Triton kernels, cold
# caches) and 15 s for each one after it, plus their timed steps.
ESTIMATES = {
    # Guess: a pytest start with CUDA (about 20 s), the row kernels' build (a plain C library
    # since the SIGSEGV's fix; as a torch extension it took 42.6 s inside the first test that
    # needed it, docs/results/gpu_2026-11-27_h200/logs/stem_gpu_tests.xml) and about 150
    # tests.
    "gpu_tests_first": 100,
    # The ten files of 2026-11-27 reached 81% of their tests in 192.8 s on an H100 before the
    # SIGSEGV (docs/results/gpu_2026-11-27c_h100/run2_gpu_tests.log; the 231 s written here
    # until 2026-11-28 was that whole device call, wheels and device probe included): about
    # 240 s for all ten, of which test_stem_row_adam.py, now in gpu_tests_first, took its share
    # and the extension's build; plus test_compiled_regions.py's 13 CUDA cases, each a cold
    # compile (guess: 120 s).
    "gpu_tests": 330,
    "stem_gpu_tests": 100,  # 95.8 s and 85.6 s, H200, 2026-11-27 (evidence.json, both leases)
    "stem_mlp": 55,  # 22.7 s, H100, 2026-11-27c (run1.log); + the compiled MLP's compile (guess)
    # 27.1 s, H100, 2026-11-24 (run6_evidence.json); + three compiled sides and the padded
    # eager one (guess).
    "structmoe_kernel": 90,
    # 43.5 s, H100, 2026-11-27c (run1.log); + three compiled models' steps and compiles
    # (guess), the padded model in place of the alignment check's.
    "structmoe_step": 110,
    # Counted from structmoe_step's 68.6 ms dense step (H100, 2026-11-27c): about 8x the tokens
    # and 1.1x the FLOPs per token (attention at 4096), about 0.6 s a dense step and 0.8 s a
    # StructMoE one; five models of (3 + 5) x 2 timed and warm-up steps and one census step
    # each (about 90 s), their builds and the process's start (about 30 s), two compiles at
    # this shape (guess: 45 s).
    "structmoe_step_16k": 160,
    # 58.2 s, H100, 2026-11-27c (run1.log); + the compiled side: 27 steps of about 0.75 s and
    # its compile (guess).
    "sigma_step": 110,
    # Not yet timed on a GPU: three start-ups (about 10 s each), the timing steps' model
    # builds, 1 + 3 profiled steps per side and the traces' export; 47 s on this project's
    # 2-core CPU (load about 8) at the tiny shapes (2026-11-28); + the padded StructMoE side
    # (guess: 10 s).
    "profile": 160,
    # Not yet timed on a GPU (guess): a start-up with torch and Megatron (about 15 s), four
    # StructMoE and two Sigma models of 8 tiny layers, each timed (50 + 3) x 2 steps at a few
    # to a few tens of ms (about 15 s), triton's routing kernels' first compile (about 20 s).
    "host_overhead": 60,
    # Not yet timed on a GPU (guess): a start-up with torch and Megatron (about 15 s), 1.50 B
    # fp32 parameters, gradients and two optimizers' moments (36 GB) drawn, 3 parts x 2 sides
    # x 2 runs x 12 calls of up to about 50 ms (about 10 s).
    "optimizer_step": 40,
    # Not yet timed on a GPU (guess): a start-up with torch and Megatron (about 15 s), two
    # Triton compiles (about 5 s), 2 x 2 x 12 calls of about 5-50 ms.
    "cross_entropy": 30,
    # Not yet timed on a GPU (guess): a start-up with torch and Megatron (about 15 s), one
    # Triton compile each way (about 5 s), 2 x 2 x 23 calls of about 1-3 ms.
    "rope": 25,
    # Not yet timed on a GPU (guess): sigma_step's 110 s less the experts' share of its steps.
    "sigma_step_grouped": 100,
    # Not yet timed on a GPU (guess): a start-up (about 15 s), two sets of 96 experts of
    # Sigma-MoE-Tiny's layer (0.68 B bf16 parameters with gradients, about 5 GB) and
    # 2 x 2 x 13 passes of about 5-50 ms.
    "moe_experts": 40,
    # Four 1B trainings each. On an H100 three trainings took about 300 s (2026-11-27c: run
    # 1's 507 s less its two runner calls, stem_mlp 22.7 s, structmoe_step 43.5 s, sigma_step
    # 58.2 s and about 40 s before each call's first step): about 100 s a training, its start
    # and the corpus included. On an H200 two profiled of three took 205.9 s (2026-11-27b,
    # evidence.json) and two unprofiled 143 s (README): the profiler adds no time seen there;
    # 20 s are left for the two traces' export and summary (guess). About 280 s each there.
    "stem_placement_base": 420,
    "stem_placement_direct": 400,
    "stem_placement_gpu_step": 400,
    "stem_placement_cpu": 400,
    "host_optimizer": 90,  # 81.1 s, H200, 2026-11-27 (run2_evidence.json)
    "first_runs": 510,  # the runs' --run-seconds 85 each and the corpus
}


# The next GPU session (docs/gpu_session.md; ``--print-only`` prints it): 15 device-minutes,
# start and idle time included, each call at most 10 minutes. A call runs
# ``gpu_evidence.sh /tmp/ev --call N --bundle "$OUT"``: the call's steps, in order of what they
# answer, under a budget that ends them inside the call's timeout.
LEASE_S = 900
# The machine's start and the transfers of a lease: 42 s and 54 s beyond its calls' own seconds
# in the two leases of 2026-11-27 (H200: 805 s for calls of 355 + 260 + 148 s; 678 s for
# 481 + 143 s; docs/results/gpu_2026-11-27*_h200/README.md). The device's notes say a start can
# take a minute or more: the plan leaves a margin for it.
START_S = 60
# Per call, before its first step: the wheels' install, the import check and the device probe
# (38 s on an H100, 2026-11-27c: a 231 s call whose one step took 192.8 s; 37 s on an H200,
# 2026-11-27: 355 s for steps of 95.8 + 221.8 s).
CALL_OVERHEAD_S = 40
# After the last step: the report and the bundle.
CALL_MARGIN_S = 20


@dataclass
class Call:
    """One device call of the next GPU session: its steps in order, the device's ``timeout_s``
    for the call, and what it answers."""

    steps: List[str]
    timeout_s: int
    answers: str

    @property
    def budget_min(self) -> float:
        """The runner's budget: the call's timeout less what comes before the first step and
        after the last."""
        return round((self.timeout_s - CALL_OVERHEAD_S - CALL_MARGIN_S) / 60.0, 2)


SESSION = [
    # 40 s of slack in its budget for the guesses among its estimates; if call 1 takes all of
    # its 510 s, call 2 still has its 330 of the lease's 900 after a 60 s start.
    Call(["gpu_tests_first", "stem_mlp", "structmoe_step", "structmoe_step_16k"], 510,
         "issue 48 capabilities 1-2 (the SIGSEGV's file on the host it died on, the refusals "
         "with 16 threads, the CUDA tests new since); issue 50 capabilities 2-3 (StructMoE at "
         "2048 and at 4 x 4096 tokens per step, with D'_ff as it is and stored aligned, STEM's MLP, "
         "each compiled side's speed)"),
    Call(["sigma_step", "profile"], 330,
         "issue 50 capabilities 4 and 1 (Sigma's router and its compiled side; each family's "
         "profile: where the extra time goes)"),
]


def session_lines() -> List[str]:
    """The next GPU session as ``--print-only`` prints it and docs/gpu_session.md quotes it."""
    by_name = {s.name: s for s in plan()}
    lines = [f"Next GPU session (docs/gpu_session.md): {LEASE_S} device-seconds; about {START_S} "
             "s to start the machine and move files, then each call, at once, on the warm "
             "machine:"]
    total = START_S
    for i, call in enumerate(SESSION, 1):
        steps = sum(by_name[n].expected_s for n in call.steps)
        expected = CALL_OVERHEAD_S + steps
        total += expected
        lines += [f"call {i}: timeout_s {call.timeout_s}, budget {call.budget_min:g} min, "
                  f"expected {expected} s ({CALL_OVERHEAD_S} s before the first step, steps "
                  f"{steps} s): " + ", ".join(f"{n} {by_name[n].expected_s} s"
                                              for n in call.steps),
                  f"  bash scripts/gpu_evidence.sh /tmp/ev --call {i} --bundle \"$OUT\"",
                  f"  answers {call.answers}"]
    lines.append(f"expected {total} of the lease's {LEASE_S} s")
    return lines


def _expand(argv: List[str], python: str, results: str) -> List[str]:
    return [a.replace(PY, python).replace(RES, results) for a in argv]


# ----------------------------------------------------------------------------- running

def _device_info(python: str) -> Dict[str, object]:
    code = ("import json, torch, sys\n"
            "d = {'python': sys.version.split()[0], 'torch': torch.__version__,"
            " 'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0)"
            " if torch.cuda.is_available() else None}\n"
            "try:\n import triton; d['triton'] = triton.__version__\n"
            "except Exception as e: d['triton'] = None\n"
            "try:\n import megatron.core as m; d['megatron_core'] = m.__version__\n"
            "except Exception as e: d['megatron_core'] = None\n"
            # Without importing them (seconds of a lease): the CPU baseline's package and the
            # JIT builds' tool (host_optimizer; the row kernels).
            "import importlib.metadata as md, shutil\n"
            "try:\n d['deepspeed'] = md.version('deepspeed')\n"
            "except Exception: d['deepspeed'] = None\n"
            "d['ninja'] = shutil.which('ninja')\n"
            "print(json.dumps(d))\n")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # recorded, not fatal
        info = {"error": repr(e)}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except Exception:
        info["nvidia_smi"] = None
    return info


# A signal that stops the runner itself (SIGTERM: the device call's timeout, exit 124), set by
# its handler and read between lines of a step's output: the step in flight is stopped and
# recorded, and the report and the bundle are written before the runner exits.
_STOPPED: Dict[str, Optional[int]] = {"signal": None}


def _on_stop(signum, frame) -> None:
    _STOPPED["signal"] = signum


def _run_step(step: Step, argv: List[str], log_path: str, limit: int,
              tick: Optional[Callable[[float], None]] = None) -> Dict[str, object]:
    """Run one step in its own process group; kill the group at its limit, or when the runner
    is told to stop. ``tick(seconds so far)`` runs every ``BUNDLE_EVERY_S`` meanwhile."""
    t0 = time.time()
    stopped = None
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        timed_out = False
        deadline = t0 + limit
        next_tick = t0 + BUNDLE_EVERY_S
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if _STOPPED["signal"] is not None:
                stopped = _STOPPED["signal"]
            elif time.time() > deadline:
                timed_out = True
            if stopped is not None or timed_out:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            if tick is not None and time.time() >= next_tick:
                tick(time.time() - t0)
                next_tick = time.time() + BUNDLE_EVERY_S
            if sel.select(timeout=min(1.0, BUNDLE_EVERY_S)):
                line = proc.stdout.readline()
                if not line:
                    break
                log.write(line)
                log.flush()
                sys.stdout.write(f"  | {line}")
                sys.stdout.flush()
        rc = proc.wait()
        # Children left behind (torchrun workers) go with the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if stopped is not None:
        status = f"stopped ({signal.Signals(stopped).name})"
    elif timed_out:
        status = "timeout"
    elif rc < 0:  # killed by a signal: a segmentation fault, an abort
        status = f"crashed ({isolated_pytest.signal_name(rc)})"
    else:
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    return {"status": status, "seconds": round(time.time() - t0, 1), "limit_s": limit,
            "command": shlex.join(argv)}


# ----------------------------------------------------------------------------- the bundle

# What one device call brings back is what its command left under $OUT: at most 8 files of at
# most 16 MiB, in the folder itself or two below, named in letters, digits, '.', '_' and '-'
# (/work/.library/device/README.md), and nothing when the call is killed before a copy at its
# end. ``--bundle DIR`` keeps DIR a copy of the results that fits: rewritten after every step
# and every BUNDLE_EVERY_S while one runs, each file written beside and renamed into place, so
# a call killed at any moment leaves the last whole copy.
BUNDLE_EVERY_S = 60.0
BUNDLE_FILES = 8
BUNDLE_FILE_BYTES = 15 * 2 ** 20  # under 16 MiB with room for the archive's own headers
_BUNDLE_NAME = re.compile(r"[A-Za-z0-9._-]+")
_PARTIAL = "partial.tmp"  # the one file being written; renamed into place when whole


def _write_atomic(path: str, write: Callable[[object], None], mode: str = "w") -> None:
    """``write(file)`` into a file beside ``path``, then renamed onto it: a reader (or a kill)
    sees the old file or the new one, never half of one."""
    partial = os.path.join(os.path.dirname(path), _PARTIAL)
    with open(partial, mode) as f:
        write(f)
    os.replace(partial, path)


def _results_files(results: str) -> List[Tuple[str, str, int]]:
    """(path, name in the archive, bytes) of every file under the results folder but the
    installed packages (``.site``)."""
    found = []
    for folder, dirs, files in os.walk(results):
        rel_folder = os.path.relpath(folder, results)
        dirs[:] = sorted(d for d in dirs if not (rel_folder == "." and d == ".site")
                         and d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path) and name != _PARTIAL:
                found.append((path, os.path.normpath(os.path.join(rel_folder, name)),
                              os.path.getsize(path)))
    return found


def bundle(results: str, dest: str, file_bytes: int = BUNDLE_FILE_BYTES) -> List[str]:
    """Write into ``dest``: ``evidence.md`` and ``evidence.json``; ``results.tar.gz``, every
    file of the results folder but the packages and the traces, smallest first while the
    archive stays under ``file_bytes``; ``traces-N.tar``, the already-compressed files (the
    profiler's ``*.gz`` traces), packed into as many archives as the file count allows; and
    ``bundle.txt``, what each holds and what was left out and why. Returns what was left out."""
    os.makedirs(dest, exist_ok=True)
    import tarfile

    manifest, left_out = [], []
    for name in ("evidence.md", "evidence.json"):
        src = os.path.join(results, name)
        if os.path.exists(src):
            with open(src, "rb") as f:
                data = f.read()
            _write_atomic(os.path.join(dest, name), lambda out: out.write(data), "wb")
    files = [f for f in _results_files(results)
             if f[1] not in ("evidence.md", "evidence.json")]
    plain = sorted((f for f in files if not f[1].endswith(".gz")), key=lambda f: f[2])
    packed = sorted((f for f in files if f[1].endswith(".gz")), key=lambda f: -f[2])

    # Every plain file, smallest first; while the archive is over its size, the largest left
    # goes (a log compresses tenfold, a binary not at all: only writing it tells).
    keep = [f for f in plain if f[2] <= 8 * file_bytes]
    left_out += [f"{a} ({n} bytes): over {8 * file_bytes} bytes" for _, a, n in plain
                 if n > 8 * file_bytes]
    partial = os.path.join(dest, _PARTIAL)
    while True:
        with tarfile.open(partial, mode="w:gz") as tar:
            for path, arc, _ in keep:
                tar.add(path, arcname=arc)
        if os.path.getsize(partial) <= file_bytes or not keep:
            break
        _, arc, n = keep.pop()
        left_out.append(f"{arc} ({n} bytes): results.tar.gz full")
    os.replace(partial, os.path.join(dest, "results.tar.gz"))
    manifest.append(f"results.tar.gz: {len(keep)} files")

    def tar_bytes(members: List[Tuple[str, str, int]]) -> int:
        # A header and the data in 512-byte blocks per file, two end blocks, and the whole
        # padded to tarfile's 10240-byte records.
        raw = sum(512 + -(-m[2] // 512) * 512 for m in members) + 1024
        return -(-raw // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    # The rest of the file count, less evidence.md, evidence.json, results.tar.gz, bundle.txt
    # and the partial file, for archives of traces (first fit, largest first).
    bins: List[List[Tuple[str, str, int]]] = []
    for f in packed:
        if tar_bytes([f]) > file_bytes:
            left_out.append(f"{f[1]} ({f[2]} bytes): over {file_bytes} bytes alone")
            continue
        for b in bins:
            if tar_bytes(b + [f]) <= file_bytes:
                b.append(f)
                break
        else:
            if len(bins) < BUNDLE_FILES - 5:
                bins.append([f])
            else:
                left_out.append(f"{f[1]} ({f[2]} bytes): no archive left")
    for i, b in enumerate(bins, 1):
        def write_traces(out, b=b) -> None:
            with tarfile.open(fileobj=out, mode="w") as tar:
                for path, arc, _ in b:
                    tar.add(path, arcname=arc)
        _write_atomic(os.path.join(dest, f"traces-{i}.tar"), write_traces, "wb")
        manifest.append(f"traces-{i}.tar: " + ", ".join(arc for _, arc, _ in b))
    for name in os.listdir(dest):  # archives of an earlier bundle that this one did not need
        number = name[len("traces-"):-len(".tar")]
        if name.startswith("traces-") and name.endswith(".tar") and number.isdigit() and \
                int(number) > len(bins):
            os.remove(os.path.join(dest, name))
    text = "\n".join([f"bundle of {results} at {datetime.datetime.now().isoformat()}",
                      *manifest, "left out:" if left_out else "nothing left out",
                      *(f"  {x}" for x in left_out)]) + "\n"
    _write_atomic(os.path.join(dest, "bundle.txt"), lambda out: out.write(text))
    return left_out


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def report(results: str, state: Dict[str, object], steps: List[Step]) -> str:
    """evidence.md: one table of every ratio against its goal, then each step's status."""
    lines = [f"# GPU evidence ({state.get('date', '')})", ""]
    dev = state.get("device", {})
    lines.append("Device: " + ", ".join(f"{k} {v}" for k, v in dev.items()))
    bad = [f"{s.name} ({state['steps'][s.name]['status']})" for s in steps
           if s.name in state.get("steps", {}) and state["steps"][s.name]["status"] != "ok"]
    if bad:
        lines += ["", "Not ok: " + ", ".join(bad)]
    lines += ["", "| step | metric | value | goal | met | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in state.get("rows", []):
        goal = "" if r["goal"] is None else (">= " if r["better"] == "higher" else "<= ") + \
            f"{r['goal']:g} {r['unit']}"
        met = {True: "yes", False: "**no**", None: ""}[r["met"]]
        value = "n/a" if r["value"] is None else f"{r['value']:.4g} {r['unit']}"
        lines.append(f"| {r['step']} | {r['metric']} | {value} | {goal} | {met} | {r['note']} |")
    lines += ["", "| step | status | seconds | limit | command |", "| --- | --- | --- | --- | --- |"]
    for s in steps:
        st = state.get("steps", {}).get(s.name)
        if st is None:
            lines.append(f"| {s.name} | not run | | {s.limit_s} | |")
        else:
            lines.append(f"| {s.name} | {st['status']} | {st['seconds']} | {st['limit_s']} | "
                         f"`{st['command']}` |")
    text = "\n".join(lines) + "\n"
    _write_atomic(os.path.join(results, "evidence.md"), lambda f: f.write(text))
    return text


def collect_rows(results: str, steps: List[Step], state: Dict[str, object]) -> None:
    rows = []
    for s in steps:
        path = os.path.join(results, s.result) if s.result else None
        if not (s.rows and path and os.path.exists(path)):
            continue
        try:
            rows += [dict(vars(r), met=r.met) for r in s.rows(path)]
        except Exception as e:  # a result file the reader cannot use is recorded
            rows.append(dict(vars(Row(s.name, "result unreadable", None, "", note=repr(e),
                                      incomplete=True)), met=False))
    state["rows"] = rows


_PARSE_SHIM = """
import argparse, json, os, runpy, sys, traceback
class Parsed(Exception):
    pass
orig = argparse.ArgumentParser.parse_args
def parse(self, *a, **k):
    orig(self, *a, **k)
    raise Parsed()
argparse.ArgumentParser.parse_args = parse
for i, argv in enumerate(json.loads(sys.argv[1])):
    print(f"@@ {i} START", flush=True)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        status = "NEVER-PARSED"
    except Parsed:
        status = "PARSED-OK"
    except SystemExit as exc:
        status = f"EXIT {exc.code}"
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        status = "ERROR"
    finally:
        sys.path.pop(0)
    sys.stdout.flush(); sys.stderr.flush()
    print(f"@@ {i} {status}", flush=True)
"""


def check_commands(steps: List[Step], python: str, results: str) -> int:
    """Parse every command's flags with its own parser, running nothing else. The Python
    steps are parsed one after the other in one process (each start-up imports torch)."""
    bad = 0
    scripts = [(s, _expand(s.argv, python, results)) for s in steps if s.kind == "python"]
    outcome: Dict[int, Tuple[bool, str]] = {}
    if scripts:
        p = subprocess.run([python, "-c", _PARSE_SHIM, json.dumps([a[1:] for _, a in scripts])],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        logs: Dict[int, List[str]] = {}
        current = None
        for line in p.stdout.splitlines():
            if line.startswith("@@ "):
                _, i, status = line.split(" ", 2)
                current = int(i)
                if status != "START":
                    outcome[current] = (status == "PARSED-OK", "\n".join(logs.get(current, [])))
                continue
            if current is not None:
                logs.setdefault(current, []).append(line)
        for i in range(len(scripts)):
            if i not in outcome:  # the process died in it
                outcome[i] = (False, (p.stdout + p.stderr)[-3000:])
            elif not outcome[i][0]:
                outcome[i] = (False, outcome[i][1] + "\n" + p.stderr[-3000:])
    results_by_step = {id(s): outcome[i] for i, (s, _) in enumerate(scripts)}
    for s in steps:
        argv = _expand(s.argv, python, results)
        if s.kind == "python":
            ok, log = results_by_step[id(s)]
        elif s.kind == "pytest":
            cmd = argv + ["--collect-only"]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            ok, log = p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        else:
            continue
        print(f"{'ok ' if ok else 'BAD'} {s.name}: {shlex.join(argv)}")
        if not ok:
            bad += 1
            print(log[-3000:])
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="results folder (created; earlier results there are kept)")
    p.add_argument("--steps", default=None,
                   help="comma list of steps to run, in this order (default: all, plan order); "
                        "a group's name (" + ", ".join(GROUPS) + ") stands for its steps")
    p.add_argument("--call", type=int, default=None, choices=range(1, len(SESSION) + 1),
                   help="the next GPU session's call N (docs/gpu_session.md): its steps, and "
                        "its budget unless --budget-min is given")
    p.add_argument("--skip", default="", help="comma list of steps to leave out")
    p.add_argument("--budget-min", type=float, default=None,
                   help="start no step past this many minutes, nor one expected to end past "
                        "them (default 9, or the call's)")
    p.add_argument("--bundle", default=None, metavar="DIR",
                   help="keep DIR (the device call's $OUT) a copy of the results within what a "
                        "call brings back, rewritten after every step and every "
                        f"{BUNDLE_EVERY_S:g} s: evidence.md, evidence.json, results.tar.gz, "
                        "traces-N.tar, bundle.txt")
    p.add_argument("--print-only", action="store_true", help="print the plan, run nothing")
    p.add_argument("--check-commands", action="store_true",
                   help="parse every step's flags with its own parser, run nothing else")
    p.add_argument("--python", default=sys.executable)
    opts = p.parse_args(argv)
    if opts.call is not None and opts.steps is not None:
        p.error("--call N runs that call's steps: give --steps or --call, not both")
    call = SESSION[opts.call - 1] if opts.call is not None else None
    budget_min = opts.budget_min if opts.budget_min is not None else (
        call.budget_min if call is not None else 9.0)

    steps = plan()
    names = [s.name for s in steps]
    chosen = call.steps if call is not None else (opts.steps.split(",") if opts.steps
                                                  else names)

    def expand(asked: List[str]) -> List[str]:  # a group's name stands for its steps
        return [x for n in asked for x in GROUPS.get(n, [n])]

    chosen, skip = expand(chosen), expand([n for n in opts.skip.split(",") if n])
    unknown = [n for n in chosen + skip if n not in names]
    if unknown:
        p.error(f"unknown steps {unknown}; the plan has {', '.join(names)}; groups: "
                + ", ".join(f"{g} ({', '.join(v)})" for g, v in GROUPS.items()))
    by_name = {s.name: s for s in steps}
    todo = [by_name[n] for n in chosen if n not in skip]  # in the order asked for
    results = os.path.abspath(opts.results)

    if opts.print_only:
        total = 0
        for s in todo:
            total += s.limit_s
            about = f"about {s.estimate_s} s" if s.estimate_s is not None else "not timed"
            print(f"[{s.limit_s:4d} s] {s.name} ({about}): {s.what}\n         "
                  f"{shlex.join(_expand(s.argv, opts.python, results))}")
        expected = sum(s.expected_s for s in todo)
        print(f"{len(todo)} steps, limits add up to {total / 60:.1f} min, expected "
              f"{expected / 60:.1f} min (a step not timed counts its limit; budget "
              f"{budget_min:g} min)" + (", over the budget: some will be skipped"
                                        if expected > 60 * budget_min else ""))
        if call is None and opts.steps is None:
            print("\n" + "\n".join(session_lines()))
        return 0
    if opts.check_commands:
        return check_commands(todo, opts.python, results)

    _STOPPED["signal"] = None
    before = signal.signal(signal.SIGTERM, _on_stop)
    try:
        return _run(opts, results, steps, todo, budget_min)
    finally:
        signal.signal(signal.SIGTERM, before)


def _run(opts, results: str, steps: List[Step], todo: List[Step], budget_min: float) -> int:
    os.makedirs(os.path.join(results, "logs"), exist_ok=True)
    state_path = os.path.join(results, "evidence.json")
    state = _load(state_path) if os.path.exists(state_path) else {}
    state["date"] = datetime.date.today().isoformat()
    state["device"] = _device_info(opts.python)
    state.setdefault("steps", {})

    def save() -> str:
        collect_rows(results, steps, state)
        text = json.dumps(state, indent=2)
        _write_atomic(state_path, lambda f: f.write(text))
        md = report(results, state, steps)
        if opts.bundle:
            bundle(results, opts.bundle)
        return md

    print(f"[gpu-evidence] {state['device']}", flush=True)
    save()  # the device, and what earlier calls left, before the first step
    t_start = time.time()
    for i, s in enumerate(todo, 1):
        if _STOPPED["signal"] is not None:
            break
        elapsed = time.time() - t_start
        left = 60 * budget_min - elapsed
        # A step that cannot end inside the budget is not started: cut at the budget it would
        # leave no number. Test steps are the exception: each file they finish is reported.
        too_long = s.kind != "pytest" and s.estimate_s is not None and s.estimate_s > left
        if left < min(60, s.limit_s) or too_long:
            state["steps"][s.name] = {"status": "skipped (budget)", "seconds": 0,
                                      "limit_s": s.limit_s, "command": ""}
            print(f"[gpu-evidence] {i}/{len(todo)} {s.name}: skipped, {left:.0f} s left of the "
                  f"{budget_min:g} min budget" + (f", about {s.estimate_s} s expected"
                                                  if too_long else ""), flush=True)
            continue
        argv = _expand(s.argv, opts.python, results)
        # A step gets its own limit or what is left of the budget, whichever is less.
        limit = int(min(s.limit_s, left))
        print(f"[gpu-evidence] {i}/{len(todo)} {s.name} (limit {limit} s, "
              f"{elapsed / 60:.1f} min so far): {s.what}", flush=True)
        log_path = os.path.join(results, "logs", f"{s.name}.log")

        def tick(seconds: float, s=s, argv=argv, limit=limit, log_path=log_path) -> None:
            # The step in flight as far as it got: what a call killed now brings back.
            state["steps"][s.name] = {"status": "running", "seconds": round(seconds, 1),
                                      "limit_s": limit, "command": shlex.join(argv),
                                      "tail": _tail(log_path)}
            save()

        st = _run_step(s, argv, log_path, limit, tick=tick)
        if st["status"] == "ok" and s.result and not os.path.exists(
                os.path.join(results, s.result)):
            st["status"] = "ok, but no result file"
        state["steps"][s.name] = st
        print(f"[gpu-evidence] {s.name}: {st['status']} in {st['seconds']} s", flush=True)
        if st["status"] != "ok":
            st["tail"] = _tail(log_path)
        save()
    if _STOPPED["signal"] is not None:
        print(f"[gpu-evidence] stopped by {signal.Signals(_STOPPED['signal']).name}: the steps "
              "after it not run", flush=True)
    print(save())
    return _exit_status(state, todo, results)


def _exit_status(state: Dict[str, object], todo: List[Step], results: str) -> int:
    """1 when a step of this call did not end "ok" (failed, crashed, timed out, skipped for the
    budget, no result file) or one of its goals lacks its number; a number that misses its goal
    is a finding, in the report, not a failure of the run."""
    mine = {s.name for s in todo}
    failed = [f"{n} ({st['status']})" for n, st in state["steps"].items()
              if n in mine and st["status"] != "ok"]
    missing = [f"{r['step']}: {r['metric']}" for r in state["rows"] if r["step"] in mine and (
        r.get("incomplete") or (r["goal"] is not None and r["value"] is None))]
    if failed:
        print(f"[gpu-evidence] steps not ok: {', '.join(failed)} (logs under {results}/logs)")
    if missing:
        print(f"[gpu-evidence] goals without their numbers: {'; '.join(missing)}")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
