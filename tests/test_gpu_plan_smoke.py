"""Every benchmark the GPU evidence runner (``scripts/gpu_evidence.py``) runs on a lease runs here,
on the CPU: the step's own command with flags for a tiny shape appended (argparse keeps the last
value), and its result file read by the runner's reader for that step. A benchmark broken since
the last lease, or a reader that no longer matches its benchmark's output, fails here instead of
in the lease's minutes (``benchmarks/stem_worker_schedule.py`` unpacked the optimizer's step
tasks as pairs after they became triples, and failed at its first step from e159412 until
2026-11-26; no test ran it). ``launch/scaling.py``'s steps are covered by
``tests/test_scaling_harness.py`` (a 2-rank CPU sweep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_evidence  # noqa: E402

# Per step: flags that shrink it to a CPU-sized run of the same code.
TINY = {
    "stem_mlp": ["--hidden", "64", "--ffn", "128", "--vocab", "256", "--tokens", "64",
                 "--reps", "2", "--warmup", "1"],
    "structmoe_kernel": ["--hidden", "64", "--ffn", "128", "--experts", "4", "--rank", "8",
                         "--tokens", "64", "--reps", "2", "--warmup", "1", "--cpu-smoke"],
    "structmoe_step": ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128",
                       "--experts", "4", "--rank", "8", "--seq", "32", "--micro-batch", "1",
                       "--vocab", "256", "--reps", "2", "--warmup", "1"],
    # The same models at 4 sequences per micro-batch, as the step runs them at 4 x 4096 tokens
    # (dense-masked, D'_ff as it is and padded), here 4 x 8; the compiled sides left out (on the CPU
    # their C++ compile costs tens of seconds more): structmoe_step's run has them, and the
    # routed path they compile sees the tokens flattened, whatever the micro-batch.
    "structmoe_step_16k": ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128",
                           "--experts", "4", "--rank", "8", "--seq", "8", "--micro-batch", "4",
                           "--vocab", "256", "--reps", "2", "--warmup", "1"],
    "sigma_step": ["--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2",
                   "--experts", "8", "--expert-ffn", "32", "--seq", "32", "--micro-batch", "1",
                   "--vocab", "256", "--reps", "2", "--warmup", "1"],
    # Each family benchmark's profile against its baseline, at the driver's own tiny shapes.
    "profile": ["--shape", "tiny", "--steps", "2"],
    # The STEM tables' goal step: its two variants, the tiered one traced as there; one repeat
    # of the plan's two (each is a training; the ABBA order and the failure records are
    # tested in tests/test_stem_placement_repeats.py).
    "stem_placement_base": ["--shape", "tiny", "--iters", "6", "--skip", "4",
                            "--variants", "gpu,tiered", "--profile", "tiered", "--repeats", "1"],
    # The same benchmark and reader with other variants: its flags are parsed by
    # tests/test_gpu_evidence.py::test_every_command_parses, no second tiny training here (the
    # new variants need CUDA; their ratios to their baselines are read in
    # tests/test_gpu_evidence.py).
    "stem_placement_direct": None,
    "stem_placement_gpu_step": None,
    "stem_placement_cpu": None,
    # Run at a one-layer shape by tests/test_host_overhead.py, which reads its JSON with this
    # step's reader: no second run here.
    "host_overhead": "tests/test_host_overhead.py",
    "optimizer_step": ["--reps", "2", "--warmup", "1"],  # dense_cpu's parameters by default
    "moe_experts": ["--experts", "8", "--hidden", "64", "--ffn", "32", "--tokens", "64",
                    "--reps", "1", "--warmup", "1"],
    # sigma_step's benchmark and reader with --moe-grouped-gemm: its own tiny run (the flag
    # builds other experts).
    "sigma_step_grouped": ["--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2",
                           "--experts", "8", "--expert-ffn", "32", "--seq", "32",
                           "--micro-batch", "1", "--vocab", "256", "--reps", "2", "--warmup",
                           "1"],
    # The kernels under Triton's interpreter (conftest sets it without CUDA), fp32.
    "cross_entropy": ["--tokens", "16", "--vocab", "64", "--reps", "1", "--warmup", "1"],
    # The kernel under Triton's interpreter, fp32.
    "rope": ["--seq", "8", "--heads", "4", "--groups", "2", "--head-dim", "8", "--reps", "1",
             "--warmup", "1"],
    "host_optimizer": ["--vocab", "512", "--d-ff", "64", "--tokens", "256", "--reps", "2"],
    "host_gather": ["--shard-rows", "64", "--width", "40", "--rows", "20", "--reps", "2"],
    # The direct read under Triton's interpreter on the CPU (conftest sets it without CUDA).
    "host_read": ["--shard-rows", "64", "--width", "40", "--rows", "20", "--reps", "2",
                  "--warmup", "1"],
    # launch/first_runs.py: the CPU pair, a tiny corpus, fixed iterations (the time budget's
    # check needs CUDA).
    "first_runs": ["--runs", "dense_cpu,stem_cpu", "--iters", "3", "--warmup-iters", "1",
                   "--micro-batch-size", "2", "--corpus-vocab", "512", "--corpus-tokens",
                   "100000",
                   "--peak-tflops", "1"],  # no GEMM benchmark for the peak
    "stem_worker_schedule": ["--rows", "512", "--width", "64", "--tokens", "256",
                             "--compute-ms", "2", "--steps", "3", "--skip", "1"],
    "stem_catchup_ops": ["--rows", "600", "--width", "32", "--read-rows", "64",
                         "--step-rows", "200", "--reps", "2", "--grad-reps", "1",
                         "--warmup-steps", "1"],
}


# The family benchmarks' compiled sides (``--compiled``: on by default on a GPU only) run in the
# same tiny runs, and their readers give these rows (metric names as the readers write them),
# compile seconds in the notes: what a GPU lease would otherwise find broken in its minutes.
COMPILED_ROWS = {
    "stem_mlp": ["STEM MLP (compiled) speed-up vs dense",
                 "lookup-and-gate alone (PyTorch, compiled) fwd+bwd",
                 "lookup-and-gate alone, compiled vs PyTorch"],
    "structmoe_kernel": ["StructMoE (dense-masked+compiled) over dense",
                         "StructMoE (grouped+compiled) over dense",
                         "StructMoE (dense-masked+pad128) over dense",
                         "StructMoE (dense-masked+pad128+compiled) over dense"],
    "structmoe_step": ["StructMoE (dense-masked+compiled) over dense",
                       "StructMoE (grouped+compiled) over dense",
                       "StructMoE (dense-masked+pad128) over dense",
                       "StructMoE (dense-masked+pad128+compiled) over dense"],
    "sigma_step": ["Sigma router step, compiled (--sigma-compile router), over upstream"],
    "sigma_step_grouped": ["Sigma router step, compiled (--sigma-compile router), over upstream "
                           "(grouped experts)"],
}


def _benchmark_steps():
    return [s for s in gpu_evidence.plan()
            if s.kind == "python" and s.argv[1].startswith(("benchmarks/", "launch/first_runs"))]


def _reader(step):
    return getattr(step.rows, "func", step.rows)  # a reader bound to its step's name


def test_every_benchmark_step_has_a_tiny_run():
    """A benchmark step added to the plan needs its tiny flags here, or runs the script and
    reader of a step that has them."""
    steps = _benchmark_steps()
    names = {s.name for s in steps}
    assert names == set(TINY), f"plan's benchmark steps {sorted(names)} vs tiny runs {sorted(TINY)}"
    tried = {(s.argv[1], _reader(s)) for s in steps if isinstance(TINY[s.name], list)}
    for s in steps:
        if isinstance(TINY[s.name], str):  # run elsewhere, read there by this step's reader
            text = open(os.path.join(ROOT, TINY[s.name])).read()
            assert s.argv[1] in text and f'["{s.name}"]' in text and "step.rows(" in text, s.name
            continue
        assert (s.argv[1], _reader(s)) in tried, f"{s.name}: no tiny run of its script and reader"


@pytest.mark.parametrize("step", [s for s in _benchmark_steps()
                                  if isinstance(TINY[s.name], list)], ids=lambda s: s.name)
def test_benchmark_step_runs_and_its_result_reads(step, tmp_path):
    argv = gpu_evidence._expand(step.argv, sys.executable, str(tmp_path)) + TINY[step.name]
    if step.name in COMPILED_ROWS:
        argv.append("--compiled")
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    rows = step.rows(str(tmp_path / step.result))
    assert rows and all(r.step == step.name for r in rows), rows
    assert all(r.value is not None for r in rows), rows
    if step.name in ("stem_mlp", "structmoe_step", "sigma_step", "sigma_step_grouped"):
        # Each side's host time per step (benchmarks/common.py StepTimes), in its row's note.
        host = json.loads((tmp_path / step.result).read_text())["host_ms"]
        notes = " ".join(r.note for r in rows)
        assert host and all(f"{side}: host " in notes for side in host), (host, notes)
    if step.name in ("structmoe_step", "structmoe_step_16k", "sigma_step", "sigma_step_grouped"):
        # Peak GPU memory per side (benchmarks/gpu_memory.py): null on the CPU, and no row.
        result = json.loads((tmp_path / step.result).read_text())
        assert result["peak_gpu_gib"] is None and result["resident_gpu_gib"] is None
        assert not [r for r in rows if r.unit == "GiB"]
    if step.name in COMPILED_ROWS:
        by_metric = {r.metric: r for r in rows}
        for metric in COMPILED_ROWS[step.name]:
            assert metric in by_metric, (metric, sorted(by_metric))
        assert any("compiled in" in r.note for r in rows), rows
    if step.name == "profile":  # every family profiled; each side's differences add up
        result = json.loads((tmp_path / step.result).read_text())
        assert set(result) == {"structmoe_step", "stem_mlp", "sigma_step"}
        for r in result.values():
            assert r["status"] == "ok" and r["diffs"], r
            for side, d in r["diffs"].items():
                assert sum(x["diff_ms"] for x in d["rows"]) == pytest.approx(
                    d["total"]["diff_ms"], abs=1e-9)
                summary = r["sides"][side]["summary"]
                assert {"steps", "kernels", "host_syncs"} <= set(summary)
                assert len(summary["steps"]) == 2
                assert os.path.exists(r["sides"][side]["trace"]["path"])
    if step.name == "structmoe_step_16k":  # 4 sequences a step; the goal on the fastest alone
        result = json.loads((tmp_path / step.result).read_text())
        assert result["tokens"] == 32 and set(result["overhead_pct"]) == {
            "dense-masked", "dense-masked+pad128"}
        assert [r.metric for r in rows if r.goal == 3.0] == [
            next(r.metric for r in rows if r.metric.startswith("StructMoE, fastest backend"))]
    if step.name == "stem_placement_base":  # a goal is judged on two runs: one is not met
        (tiered,) = [r for r in rows if r.metric == "tiered tables, step vs gpu tables"]
        assert tiered.met is False and "one run" in tiered.note
