"""The GPU evidence runner (scripts/gpu_evidence.sh, scripts/gpu_evidence.py) on the CPU: the plan
names every GPU benchmark with a limit, every command's flags parse with its own parser, a failing
or overlong step is recorded and the run goes on, and the report compares each number with its
goal."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_evidence  # noqa: E402
from tests_helpers import load_script  # noqa: E402


def _sh(*args, timeout=900):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_evidence.sh"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHON=sys.executable))


def test_print_only_names_every_benchmark(tmp_path):
    p = _sh(str(tmp_path / "res"), "--print-only")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for needle in ("benchmarks/stem_mlp.py", "benchmarks/structmoe_kernel.py",
                   "benchmarks/structmoe_step.py", "benchmarks/sigma_step.py",
                   "benchmarks/stem_placement.py", "benchmarks/stem_host_gather.py",
                   "benchmarks/stem_host_read.py",
                   "launch/scaling.py --preset stem_350m",
                   "launch/scaling.py --preset dense_350m", "scripts/isolated_pytest.py",
                   "tests/test_kernel_stem_gate.py", "--repeats 2"):
        assert needle in out, f"{needle!r} missing from the plan:\n{out}"
    # Every step shows its limit; nothing ran, so no results folder.
    assert out.count(" s] ") == len(gpu_evidence.plan())
    assert not (tmp_path / "res").exists()
    # The runner stops starting steps at the 9-minute mark by default (one device call: 10).
    assert "budget 9 min" in out


def test_every_command_parses(tmp_path):
    p = _sh(str(tmp_path / "res"), "--check-commands")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln[:3] in ("ok ", "BAD")]
    assert len(lines) == len(gpu_evidence.plan()), p.stdout
    assert all(ln.startswith("ok ") for ln in lines), p.stdout


def test_the_next_session_fits_the_lease_and_its_doc_is_the_runners(tmp_path, capsys):
    """docs/gpu_session.md quotes the next GPU session as ``--print-only`` prints it (calls,
    steps, expected seconds, commands), and its runner commands parse; each call's steps are
    expected inside its budget, its budget plus what comes before and after the steps inside its
    timeout (at most a device call's 600 s), and the start plus every call inside the lease
    with a minute to spare; issue 48's tests come first; every estimate names a plan step."""
    g = gpu_evidence
    by_name = {s.name: s for s in g.plan()}
    assert set(g.ESTIMATES) <= set(by_name)
    total = g.START_S
    for call in g.SESSION:
        assert set(call.steps) <= set(by_name), call.steps
        steps = sum(by_name[n].expected_s for n in call.steps)
        assert steps <= 60 * call.budget_min, (call.steps, steps, call.budget_min)
        assert 60 * call.budget_min + g.CALL_OVERHEAD_S + g.CALL_MARGIN_S <= call.timeout_s <= 600
        total += g.CALL_OVERHEAD_S + steps
    assert total <= g.LEASE_S - 60, total
    assert g.SESSION[0].steps[0] == "gpu_tests_first"
    assert g.main([str(tmp_path / "res"), "--print-only"]) == 0
    block = "\n".join(g.session_lines())
    assert block in capsys.readouterr().out
    doc = open(os.path.join(ROOT, "docs", "gpu_session.md")).read()
    assert block in doc, "docs/gpu_session.md does not quote the runner's plan:\n" + block
    commands = [ln.strip().rstrip("\\").strip() for ln in doc.splitlines()
                if ln.strip().startswith("bash scripts/gpu_evidence.sh")]
    assert len(commands) >= len(g.SESSION) + 1, commands  # the calls, and what to drop
    for line in commands:
        args = [a.replace("$OUT", str(tmp_path / "out"))
                for a in shlex.split(line, comments=True)[2:]]
        assert g.main(args + ["--print-only"]) == 0, line
    # Every test of the STEM-only subset is in the two gpu_tests steps.
    tested = g.GPU_TESTS_FIRST + g.GPU_TEST_FILES
    assert all(t in tested or t.split("::")[0] in tested for t in g.STEM_GPU_TESTS)


def test_a_call_runs_its_steps_under_its_budget(tmp_path, monkeypatch, no_device_info):
    """--call N is the session's call: its steps in its order, its budget unless one is given;
    --steps beside it is refused."""
    ran = []
    monkeypatch.setattr(gpu_evidence, "_run_step", lambda s, argv, log, limit, tick=None: (
        ran.append((s.name, limit)) or {"status": "ok", "seconds": 0.0, "limit_s": limit,
                                         "command": ""}))
    monkeypatch.setattr(gpu_evidence, "collect_rows", lambda results, steps, state:
                        state.__setitem__("rows", []))
    call = gpu_evidence.SESSION[1]
    assert gpu_evidence.main([str(tmp_path / "res"), "--call", "2"]) == 1  # no result files
    assert [n for n, _ in ran] == call.steps
    first = {s.name: s for s in gpu_evidence.plan()}[call.steps[0]]
    assert 60 * call.budget_min - 5 <= ran[0][1] <= min(first.limit_s, 60 * call.budget_min)
    with pytest.raises(SystemExit):
        gpu_evidence.main([str(tmp_path / "res"), "--call", "1", "--steps", "stem_mlp"])


def test_a_step_expected_past_the_budget_is_not_started(tmp_path, monkeypatch, no_device_info):
    """A step whose estimate is more than the budget has left is skipped (cut at the budget it
    would leave no number, and take the time of the steps after it); a test step is started
    whatever its estimate (each file it finishes is reported); a step without an estimate runs."""
    py = gpu_evidence.PY
    steps = [gpu_evidence.Step("long", "expected past the budget", [py, "-c", "pass"], 300,
                               kind="other", estimate_s=200),
             gpu_evidence.Step("tests", "a pytest step expected past it",
                               [py, "-c", "pass"], 300, kind="pytest", estimate_s=200),
             gpu_evidence.Step("short", "not timed", [py, "-c", "pass"], 300, kind="other")]
    monkeypatch.setattr(gpu_evidence, "plan", lambda: steps)
    res = tmp_path / "res"
    assert gpu_evidence.main([str(res), "--budget-min", "2"]) == 1
    state = json.loads((res / "evidence.json").read_text())
    assert state["steps"]["long"]["status"] == "skipped (budget)"
    assert state["steps"]["tests"]["status"] == "ok" and state["steps"]["short"]["status"] == "ok"


def test_check_commands_catches_a_bad_flag(tmp_path, monkeypatch):
    """The parse check can fail: a flag the benchmark does not have is reported."""
    bad = gpu_evidence.Step("stem_mlp", "with a flag stem_mlp.py lacks",
                            [gpu_evidence.PY, "benchmarks/stem_mlp.py", "--no-such-flag"], 10)
    assert gpu_evidence.check_commands([bad], sys.executable, str(tmp_path)) == 1


def _fake_plan(tmp):
    w = os.path.join(tmp, "writer.py")
    with open(w, "w") as f:
        f.write("import json, sys\n"
                "json.dump({'ratio_sigma_vs_upstream': 1.0075, 'ratio_runs': [1.005, 1.01],"
                " 'step_ms': {'sigma': 101.0, 'upstream': 100.0}}, open(sys.argv[1], 'w'))\n")
    py, res = gpu_evidence.PY, gpu_evidence.RES
    return [
        gpu_evidence.Step("fails", "exits 3", [py, "-c", "import sys; print('boom'); sys.exit(3)"],
                          30, kind="other"),
        gpu_evidence.Step("segfaults", "dies of SIGSEGV",
                          [py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                          30, kind="other"),
        gpu_evidence.Step("hangs", "sleeps past its limit",
                          [py, "-c", "import time; print('sleeping', flush=True); "
                                     "time.sleep(60)"], 2, kind="other"),
        gpu_evidence.Step("sigma_step", "writes a result", [py, w, f"{res}/sigma_step.json"],
                          30, "sigma_step.json", gpu_evidence._rows_sigma, kind="other"),
    ]


@pytest.fixture
def no_device_info(monkeypatch):
    """The fake plans' runs skip the device probe (a torch import: seconds on 2 cores)."""
    monkeypatch.setattr(gpu_evidence, "_device_info", lambda python: {"gpu": None})


def test_failures_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch, no_device_info):
    monkeypatch.setattr(gpu_evidence, "plan", lambda: _fake_plan(str(tmp_path)))
    res = tmp_path / "res"
    assert gpu_evidence.main([str(res)]) == 1  # the summary is written, and the exit says so
    state = json.loads((res / "evidence.json").read_text())
    assert state["steps"]["fails"]["status"] == "failed (exit 3)"
    assert "boom" in state["steps"]["fails"]["tail"]
    assert state["steps"]["segfaults"]["status"] == "crashed (SIGSEGV, exit -11)"
    assert state["steps"]["hangs"]["status"] == "timeout"
    assert state["steps"]["hangs"]["seconds"] < 30
    assert state["steps"]["sigma_step"]["status"] == "ok"
    (row,) = state["rows"]
    assert row["value"] == pytest.approx(1.0) and row["goal"] == 2.0 and row["met"] is True
    md = (res / "evidence.md").read_text()
    assert "| sigma_step | Sigma router step over upstream aux_loss | 1 % | <= 2 % | yes |" in md
    assert "| hangs | timeout |" in md
    assert "Not ok: fails (failed (exit 3)), segfaults (crashed (SIGSEGV, exit -11)), hangs " \
        "(timeout)" in md
    # A second call with --steps keeps what the first one left; its exit is about its own steps.
    assert gpu_evidence.main([str(res), "--steps", "sigma_step"]) == 0
    state = json.loads((res / "evidence.json").read_text())
    assert state["steps"]["fails"]["status"] == "failed (exit 3)" and len(state["rows"]) == 1
    assert gpu_evidence.main([str(res), "--steps", "fails"]) == 1


def test_a_step_without_its_goals_inputs_fails_the_run(tmp_path, monkeypatch, no_device_info):
    """A step that exits 0 but leaves no result, or one its reader cannot use, exits non-zero."""
    py, res = gpu_evidence.PY, gpu_evidence.RES
    steps = [gpu_evidence.Step("sigma_step", "writes nothing", [py, "-c", "pass"], 30,
                               "sigma_step.json", gpu_evidence._rows_sigma, kind="other"),
             gpu_evidence.Step("stem_mlp", "writes a file its reader cannot use",
                               [py, "-c", "import sys; open(sys.argv[1], 'w').write('{}')",
                                f"{res}/stem_mlp.json"], 30, "stem_mlp.json",
                               gpu_evidence._rows_stem_mlp, kind="other")]
    monkeypatch.setattr(gpu_evidence, "plan", lambda: steps)
    out = tmp_path / "res"
    assert gpu_evidence.main([str(out), "--steps", "sigma_step"]) == 1
    assert json.loads((out / "evidence.json").read_text())["steps"]["sigma_step"]["status"] == \
        "ok, but no result file"
    assert gpu_evidence.main([str(out), "--steps", "stem_mlp"]) == 1
    (row,) = json.loads((out / "evidence.json").read_text())["rows"]
    assert row["metric"] == "result unreadable" and row["met"] is False


def test_budget_skips_steps(tmp_path, monkeypatch, no_device_info):
    monkeypatch.setattr(gpu_evidence, "plan", lambda: _fake_plan(str(tmp_path)))
    res = tmp_path / "res"
    assert gpu_evidence.main([str(res), "--budget-min", "0.01"]) == 1  # asked for, not run
    state = json.loads((res / "evidence.json").read_text())
    assert {s["status"] for s in state["steps"].values()} == {"skipped (budget)"}


def test_goals_read_from_benchmark_results(tmp_path):
    """Each reader compares with its goal: met and missed both show."""
    (tmp_path / "stem_mlp.json").write_text(json.dumps({
        "dense_ms": 10.0, "stem_triton_speedup": 1.45, "stem_triton_speedup_runs": [1.44, 1.46],
        "stem_torch_speedup": 1.2, "stem_torch_speedup_runs": [1.2, 1.2],
        "gate_torch_ms": 2.0, "gate_triton_ms": 0.5}))
    rows = {r.metric: r for r in gpu_evidence._rows_stem_mlp(str(tmp_path / "stem_mlp.json"))}
    assert rows["STEM MLP (triton) speed-up vs dense"].met is True
    assert rows["STEM MLP (torch) speed-up vs dense"].met is None
    assert rows["lookup-and-gate alone, fused vs PyTorch"].value == pytest.approx(4.0)
    gate = rows["lookup-and-gate alone (fused) fwd+bwd"]  # one run: not judged
    assert gate.goal == 0.5 and gate.met is False and gate.incomplete
    s = json.loads((tmp_path / "stem_mlp.json").read_text())
    for runs, met in (([0.45, 0.49], True), ([0.45, 0.52], False)):  # the worse run decides
        (tmp_path / "stem_mlp.json").write_text(json.dumps(dict(s, gate_triton_ms_runs=runs)))
        rows = {r.metric: r for r in gpu_evidence._rows_stem_mlp(str(tmp_path / "stem_mlp.json"))}
        assert rows["lookup-and-gate alone (fused) fwd+bwd"].met is met
    (tmp_path / "sm.json").write_text(json.dumps({
        "layer_ms": {"dense": 10.0, "triton": 10.5, "grouped": 12.0},
        "overhead_pct": {"triton": 5.0, "grouped": 20.0},
        "overhead_pct_runs": {"triton": [5.0, 5.0], "grouped": [19.0, 21.0]}}))
    rows = gpu_evidence._rows_overhead("structmoe_kernel", "MLP", "triton")(
        str(tmp_path / "sm.json"))
    by = {r.metric: r for r in rows}
    assert by["StructMoE (triton) over dense"].met is False
    assert by["StructMoE, fastest backend (triton) over dense"].value == 5.0
    (tmp_path / "pl.json").write_text(json.dumps({
        "gpu": {"iteration_ms": 100.0},
        "cpu": {"iteration_ms": 320.0, "ratio_vs_gpu": 3.2, "ratios_per_repeat": [3.2, 3.1],
                "stem/optimizer-kernel-params": 45e6, "stem/optimizer-kernel-loop-seconds": 0.3},
        "gpu-sparse": {"iteration_ms": 90.0, "ratio_vs_gpu": 0.9, "ratio_vs_gpu_sparse": 1.0,
                       "ratios_per_repeat": [0.9, 0.9]},
        "tiered": {"iteration_ms": 102.0, "ratio_vs_gpu": 1.02, "ratio_vs_gpu_sparse": 1.133,
                   "ratios_per_repeat": [1.02, 1.02],
                   "trace": {"path": "/r/trace_1b_tiered.json.gz",
                             "summary": {"main_stream": {
                                 "idle_ms_per_step": 7.5,
                                 "idle_ms_per_step_during": {"stem/wait-read": 5.3,
                                                             "outside them": 2.2}}}}}}))
    by = {r.metric: r for r in gpu_evidence._rows_placement(str(tmp_path / "pl.json"))}
    assert by["cpu tables, step vs gpu tables"].met is False
    cpu_note = by["cpu tables, step vs gpu tables"].note
    assert "CPU row kernel 0.15 G params/s in its loops" in cpu_note
    assert "CPU row kernel" not in by["tiered tables, step vs gpu tables"].note  # none logged
    assert by["tiered tables, step vs gpu tables"].met is True
    idle = by["tiered tables, GPU main stream idle per step"]
    assert idle.value == 7.5 and "trace_1b_tiered.json.gz" in idle.note
    assert "stem/wait-read 5.3 ms; outside them 2.2 ms" in idle.note
    assert "gpu tables, GPU main stream idle per step" not in by  # no trace of that run
    assert by["tiered tables, step vs gpu-sparse tables"].value == pytest.approx(1.133)
    assert by["tiered tables, step vs gpu-sparse tables"].met is None  # reported, no goal
    assert by["gpu-sparse tables, step vs gpu tables"].value == pytest.approx(0.9)
    assert "gpu-sparse tables, step vs gpu-sparse tables" not in by
    assert "cpu tables, step vs gpu-sparse tables" not in by  # no ratio in its record
    (tmp_path / "ho.json").write_text(json.dumps({
        "ratio": 0.66, "ratio_cold": 0.84, "sparse_params_per_s": 0.9e9, "threads": 15,
        "kernel": "rowwise", "sparse_state_bytes_on_huge_pages": 2**30,
        "transparent_huge_pages": "madvise", "deepspeed_dense_params_per_s": 1.4e9,
        "deepspeed_dense_cold_params_per_s": 1.07e9, "dense_whole_table_params_per_s": 1.0e9}))
    rows = gpu_evidence._rows_host_optimizer(str(tmp_path / "ho.json"))
    assert [(r.value, r.met) for r in rows] == [(0.66, False), (0.84, True)]
    assert "1.07 G params/s there, 1.40 on its reused window, 1.00 over the whole table" in \
        rows[1].note
    (tmp_path / "hg.json").write_text(json.dumps({
        "rows": 2000, "width": 8192, "threads": 15,
        "ms": {"compiled bf16": 1.2, "compiled fp16": 1.8, "compiled fp32": 1.3,
               "owing, read as of now bf16": 2.5, "owing, catch-up in place + gather bf16": 3.1},
        "read_now_vs_catch_up_then_gather": 0.81,
        "bf16_vs_fp32_copy": 0.92, "fp16_vs_fp32_copy": 1.38,
        "bf16_torch_vs_compiled": 2.1, "fp16_torch_vs_compiled": 1.1,
        "bf16_4k_pages_vs_huge": 1.18, "shard_bytes_on_huge_pages": 500 * 2**20}))
    by = {r.metric: r for r in gpu_evidence._rows_host_gather(str(tmp_path / "hg.json"))}
    bf16 = by["host rows gathered and cast to bf16, vs its fp32 gather"]
    assert bf16.value == 0.92 and "1.20 ms for 2000 rows x 8192, 15 threads" in bf16.note
    assert by["host rows gathered and cast to fp16, vs its fp32 gather"].value == 1.38
    pages = by["bf16 gather from a shard on 4 KiB pages vs on huge pages (the store's)"]
    assert pages.value == 1.18 and "500 MiB of the shard on huge pages" in pages.note
    read = by["read of rows owing a catch-up, as of now vs catch-up in place then gather (bf16)"]
    assert read.value == 0.81 and "2.50 vs 3.10 ms" in read.note
    (tmp_path / "hr.json").write_text(json.dumps({
        "device": "NVIDIA H100", "rows": 3420, "width": 5632, "dtype": "bf16",
        "ms": {"staged": [4.0, 4.4], "direct": [2.0, 3.3]}, "ratios_per_run": [0.5, 0.75],
        "register_ms": 250.0, "shard_bytes": 2**30, "shard_bytes_on_huge_pages": 2**29}))
    read, register = gpu_evidence._rows_host_read(str(tmp_path / "hr.json"))
    assert read.value == 0.75 and read.goal is None and not read.incomplete  # the worse run
    assert "medians staged 4.200 ms, direct 2.650 ms; NVIDIA H100" in read.note
    assert register.value == 250.0 and "1.00 GiB, 0.50 GiB of it on huge pages" in register.note


def test_family_goals_are_judged_on_the_worse_of_alternating_runs(tmp_path):
    """stem_mlp, structmoe_kernel/structmoe_step and sigma_step give each ratio per run (A B B
    A): a goal met by the median and the better run but missed by the worse is not met; met in
    both runs is met; a result with one run (or from before the runs, no list) is not met and
    says so."""
    def read(reader, name, result):
        (tmp_path / name).write_text(json.dumps(result))
        return {r.metric: r for r in reader(str(tmp_path / name))}

    mlp = {"dense_ms": 3.3, "stem_torch_speedup": 1.23, "stem_triton_speedup": 1.41,
           "stem_triton_speedup_runs": [1.45, 1.38]}  # median 1.415 would meet 1.4
    row = read(gpu_evidence._rows_stem_mlp, "m.json", mlp)["STEM MLP (triton) speed-up vs dense"]
    assert row.value == pytest.approx(1.38) and row.met is False
    assert "worst of runs 1.450 / 1.380, median 1.415" in row.note
    mlp["stem_triton_speedup_runs"] = [1.45, 1.41]
    rows = read(gpu_evidence._rows_stem_mlp, "m.json", mlp)
    assert rows["STEM MLP (triton) speed-up vs dense"].met is True
    # The PyTorch path has no goal: one run of it is reported, not judged.
    assert rows["STEM MLP (torch) speed-up vs dense"].met is None
    del mlp["stem_triton_speedup_runs"]
    row = read(gpu_evidence._rows_stem_mlp, "m.json", mlp)["STEM MLP (triton) speed-up vs dense"]
    assert row.value == pytest.approx(1.41) and row.met is False and "one run" in row.note

    step = {"step_ms": {"dense": 68.6, "triton": 70.0, "dense-masked": 70.5},
            "overhead_pct": {"triton": 2.0, "dense-masked": 2.8},
            # triton's better run and median meet 3%, its worse does not; dense-masked meets it
            # in both: the fastest backend is the one whose worse run is the best
            "overhead_pct_runs": {"triton": [1.0, 3.5], "dense-masked": [2.6, 2.9]}}
    rows = read(gpu_evidence._rows_overhead("structmoe_step", "step", "triton"), "s.json", step)
    assert rows["StructMoE (triton) over dense"].value == pytest.approx(3.5)
    assert rows["StructMoE (triton) over dense"].met is False
    fastest = rows["StructMoE, fastest backend (dense-masked) over dense"]
    assert fastest.value == pytest.approx(2.9) and fastest.met is True
    step["overhead_pct_runs"] = {"triton": [3.5], "dense-masked": [2.9]}
    rows = read(gpu_evidence._rows_overhead("structmoe_step", "step", "triton"), "s.json", step)
    assert all(r.met is False and "one run" in r.note for m, r in rows.items() if r.goal)

    sigma = {"ratio_sigma_vs_upstream": 1.02, "ratio_runs": [1.015, 1.025],
             "step_ms": {"sigma": 734.0, "upstream": 719.6}}
    (row,) = read(gpu_evidence._rows_sigma, "g.json", sigma).values()
    assert row.value == pytest.approx(2.5) and row.met is False  # median +2.0% meets <= 2%
    sigma["ratio_runs"] = [1.015, 1.019]
    (row,) = read(gpu_evidence._rows_sigma, "g.json", sigma).values()
    assert row.value == pytest.approx(1.9) and row.met is True


def test_profile_rows_name_the_kernels_that_differ_most(tmp_path):
    """The profile step's reader: per family side its extra GPU time over the baseline with the
    three kernels that differ most in the note, its extra idle time and host blocking (the note
    names where); a benchmark that was not profiled is a row, not met, saying why."""
    from megatron_ext.tools import trace_summary

    def summary(kernels, idle, syncs):
        return {"steps": [{"step": 1, "ms": 10.0}], "main_stream": {"idle_ms_per_step": idle},
                "kernels": {"source": "gpu", "steps": 1, "ms_per_step": sum(kernels.values()),
                            "by_name": {k: {"count": 1.0, "ms": v} for k, v in kernels.items()}},
                "host_syncs": {"blocking_ms_per_step": sum(syncs.values()), "calls": {},
                               "sync_ops": {}, "by_op": {k: {"count": 1.0, "ms": v}
                                                         for k, v in syncs.items()}}}
    dense = summary({"gemm": 5.0, "gelu": 1.0}, 0.5, {})
    ours = summary({"gemm": 5.5, "gelu": 1.0, "topk": 0.8, "sort": 0.3, "cumsum": 0.1}, 1.7,
                   {"aten::_local_scalar_dense": 0.9})
    (tmp_path / "profile.json").write_text(json.dumps({
        "structmoe_step": {"status": "ok", "base": "dense",
                           "sides": {"dense": {"summary": dense, "trace": {"path": "/r/d.gz"}},
                                     "triton": {"summary": ours,
                                                "trace": {"path": "/r/trace_triton.json.gz"}}},
                           "diffs": {"triton": trace_summary.diff(dense, ours, top=3)}},
        "sigma_step": {"status": "timeout", "reason": "no profile within --timeout=150 s"}}))
    by = {r.metric: r for r in gpu_evidence._rows_profile(str(tmp_path / "profile.json"))}
    kernels = by["structmoe_step: triton over dense, GPU kernel time per step"]
    assert kernels.value == pytest.approx(1.7) and kernels.goal is None
    assert kernels.note.startswith("topk +0.800 ms; gemm +0.500 ms; sort +0.300 ms; step")
    assert "trace_triton.json.gz" in kernels.note
    idle = by["structmoe_step: triton over dense, GPU idle between kernels per step"]
    assert idle.value == pytest.approx(1.2) and idle.note == "0.50 -> 1.70 ms"
    sync = by["structmoe_step: triton over dense, host blocked in CUDA calls per step"]
    assert sync.value == pytest.approx(0.9)
    assert "in aten::_local_scalar_dense 0.90 ms (1x)" in sync.note
    failed = by["sigma_step: profiled"]
    assert failed.met is False and "timeout: no profile within --timeout=150 s" in failed.note


def test_placement_goals_are_judged_on_every_run_and_need_each_variant(tmp_path):
    """A ratio against its goal is judged on the worst of two or more runs (ABBA order); a variant
    that failed or ran out of time is a row that is not met and says why; one run is not met."""
    (tmp_path / "pl.json").write_text(json.dumps({
        "gpu": {"status": "ok", "iteration_ms": 100.0, "iteration_ms_repeats": [100.0, 110.0]},
        # median 1.03 would meet the goal (<= 1.03); the second run misses it
        "tiered": {"status": "ok", "iteration_ms": 101.0, "iteration_ms_repeats": [101.0, 115.5],
                   "ratios_per_repeat": [1.01, 1.05], "ratio_vs_gpu": 1.03},
        "cpu": {"status": "timeout", "reason": "no result within --timeout=180 s",
                "iteration_ms_repeats": [None, None], "ratios_per_repeat": [None, None]},
        "gpu-sparse": {"status": "failed", "reason": "repeat 2: ValueError: boom (exit 1)",
                       "iteration_ms": 90.0, "iteration_ms_repeats": [90.0, None],
                       "ratios_per_repeat": [0.9, None], "ratio_vs_gpu": 0.9},
    }))
    by = {r.metric: r for r in gpu_evidence._rows_placement(str(tmp_path / "pl.json"))}
    tiered = by["tiered tables, step vs gpu tables"]
    assert tiered.value == pytest.approx(1.05) and tiered.met is False
    assert "runs 1.010 / 1.050, median 1.030, spread 0.040" in tiered.note
    cpu = by["cpu tables, step vs gpu tables"]
    assert cpu.value is None and cpu.met is False
    assert "timeout: no result within --timeout=180 s" in cpu.note
    sparse = by["gpu-sparse tables, step vs gpu tables"]
    assert sparse.met is False and "failed: repeat 2: ValueError: boom (exit 1)" in sparse.note
    assert by["gpu tables, step"].met is None  # no goal, ran
    (tmp_path / "one.json").write_text(json.dumps({
        "gpu": {"status": "ok", "iteration_ms": 100.0, "iteration_ms_repeats": [100.0]},
        "tiered": {"status": "ok", "iteration_ms": 90.0, "iteration_ms_repeats": [90.0],
                   "ratios_per_repeat": [0.9], "ratio_vs_gpu": 0.9}}))
    (one,) = [r for r in gpu_evidence._rows_placement(str(tmp_path / "one.json"))
              if r.metric == "tiered tables, step vs gpu tables"]
    assert one.value == pytest.approx(0.9) and one.met is False and "one run" in one.note
    (tmp_path / "nogpu.json").write_text(json.dumps({
        "gpu": {"status": "failed", "reason": "RuntimeError: CUDA out of memory (exit 1)",
                "iteration_ms_repeats": [None, None]}}))
    (row,) = gpu_evidence._rows_placement(str(tmp_path / "nogpu.json"))
    assert row.metric == "gpu tables, step" and row.met is False
    assert "failed: RuntimeError: CUDA out of memory (exit 1)" in row.note


# Fake test files for the pytest steps: one with a pass, a failure and a skip; one that dies of
# SIGSEGV in its second test; one that hangs; one that passes; and one that only skips.
FAKE_TESTS = {
    "test_a.py": "import pytest\ndef test_ok():\n    pass\ndef test_fails():\n    assert 1 == 2\n"
                 "def test_skips():\n    pytest.skip('needs CUDA')\n",
    "test_b.py": "import os, signal\ndef test_before():\n    pass\ndef test_segfaults():\n"
                 "    os.kill(os.getpid(), signal.SIGSEGV)\ndef test_after():\n    pass\n",
    "test_c.py": "import time\ndef test_hangs():\n    time.sleep(60)\n",
    "test_d.py": "def test_ok():\n    pass\n",
    "test_e.py": "import pytest\npytestmark = pytest.mark.skip(reason='needs CUDA')\n"
                 "def test_x():\n    pass\ndef test_y():\n    pass\n",
}


def test_pytest_steps_survive_a_crash_and_an_all_skipped_step_is_not_met(
        tmp_path, monkeypatch, no_device_info):
    """A test that segfaults or hangs is named in the step's result and in evidence.md, the
    other files still run, and a step where every test skipped is not met."""
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    for name, text in FAKE_TESTS.items():
        (tests / name).write_text(text)
    by_name = {s.name: s for s in gpu_evidence.plan()}
    gpu, stem = by_name["gpu_tests"], by_name["stem_gpu_tests"]
    # The plan's own pytest steps, on the fake files (the per-test limit shortened; pytest's
    # start-up has at least a minute whatever it is).
    argv = [a for a in gpu.argv if not a.startswith("tests/")]
    argv[argv.index("--test-timeout") + 1] = "2"
    crashing = gpu_evidence.Step(gpu.name, gpu.what, argv + [
        str(tests / n) for n in ("test_a.py", "test_b.py", "test_c.py", "test_d.py")], 60,
        gpu.result, gpu.rows, kind="pytest")
    argv = [a for a in stem.argv if not a.startswith("tests/")]
    skipping = gpu_evidence.Step(stem.name, stem.what, argv + [str(tests / "test_e.py")], 60,
                                 stem.result, stem.rows, kind="pytest")
    monkeypatch.setattr(gpu_evidence, "plan", lambda: [crashing, skipping])
    res = tmp_path / "res"
    assert gpu_evidence.main([str(res)]) == 1
    state = json.loads((res / "evidence.json").read_text())
    assert state["steps"]["gpu_tests"]["status"] == "failed (exit 1)"
    result = json.loads((res / gpu.result).read_text())
    files = {os.path.basename(k): v for k, v in result["files"].items()}
    a, b, c, d = (files[f"test_{x}.py"] for x in "abcd")
    assert (a["passed"], a["failed"], a["skipped"], a["crashed"]) == (1, 1, 1, 0)
    assert [i.split("::")[1] for i in a["failed_ids"]] == ["test_fails"]
    assert (b["passed"], b["crashed"], b["not_run"]) == (1, 1, 1)
    assert b["crashed_in"].endswith("test_b.py::test_segfaults") and "SIGSEGV" in b["crash"]
    assert c["crashed_in"].endswith("test_c.py::test_hangs") and "timeout" in c["crash"]
    assert (d["passed"], d["failed"], d["crashed"]) == (1, 0, 0)  # ran after both
    md = (res / "evidence.md").read_text()
    row_b = [ln for ln in md.splitlines() if "test_b.py: failed, errored or crashed |" in ln]
    assert len(row_b) == 1 and "crashed in" in row_b[0] and "test_segfaults" in row_b[0] \
        and "**no**" in row_b[0]
    rows = {(r["step"], r["metric"]): r for r in state["rows"]}
    assert rows[("gpu_tests", "tests that passed")]["value"] == 3
    assert rows[("gpu_tests", "tests that passed")]["met"] is True
    # Every test of the second step skipped: no GPU or a missing package, not a success.
    assert state["steps"]["stem_gpu_tests"]["status"] != "ok"
    skipped = rows[("stem_gpu_tests", "tests that passed")]
    assert skipped["value"] == 0 and skipped["met"] is False
    assert "all 2 skipped" in skipped["note"] and "needs CUDA" in skipped["note"]


def test_a_pytest_step_stopped_from_outside_names_the_test_and_the_files_not_run(tmp_path):
    """The runner kills a test step at its limit, the isolating driver with it: its last record
    (written before its last pytest started) and that pytest's events still name the test it
    stopped in, and a file that never started is not read as met."""
    events = tmp_path / "part1.events.jsonl"
    events.write_text("\n".join(json.dumps(e) for e in [
        {"collected": [["tests/test_b.py::test_one", str(tmp_path / "tests/test_b.py")],
                       ["tests/test_b.py::test_two", str(tmp_path / "tests/test_b.py")]]},
        {"start": "tests/test_b.py::test_one"},
        {"report": "tests/test_b.py::test_one", "when": "call", "outcome": "passed"},
        {"finish": "tests/test_b.py::test_one"},
        {"start": "tests/test_b.py::test_two"}]) + "\n")
    (tmp_path / "gpu_tests.json").write_text(json.dumps({
        "status": "running",
        "paths": {"tests/test_b.py": str(tmp_path / "tests/test_b.py"),
                  "tests/test_c.py": str(tmp_path / "tests/test_c.py")},
        "parts": [{"args": ["tests/test_b.py", "tests/test_c.py"], "events": str(events),
                   "exit": None}]}))
    rows = {r.metric: r for r in gpu_evidence._rows_pytest(str(tmp_path / "gpu_tests.json"))}
    b = rows["tests/test_b.py: failed, errored or crashed"]
    assert b.value == 1 and b.met is False
    assert "crashed in test_two (stopped from outside" in b.note
    c = rows["tests/test_c.py: failed, errored or crashed"]
    assert c.value is None and c.met is False and "no test of it ran" in c.note


def test_wheel_script_lists_pinned_packages():
    """The wheel script fetches exact pins from requirements.txt (checked without the network)."""
    text = open(os.path.join(ROOT, "scripts", "gpu_wheels.sh")).read()
    assert "--no-deps" in text and "--python-version 3.12" in text
    pins = open(os.path.join(ROOT, "requirements.txt")).read()
    packages = text.split("PACKAGES=(", 1)[1].split(")", 1)[0].split()
    assert "megatron-core" in packages
    for name in packages:
        assert f"\n{name}==" in "\n" + pins, f"{name} has no exact pin"


# A device call ends at its timeout whatever runs: SIGTERM (the tool's exit 124), or SIGKILL
# (137). The runner is then the process stopped, not a step; only what is under the call's $OUT
# comes back. A driver runs the runner's main on a fake plan in its own process, so that the
# test can stop it as the device would.
_DRIVER = """
import sys
sys.path.insert(0, {scripts!r})
import gpu_evidence as g
g.BUNDLE_EVERY_S = 0.3
g._device_info = lambda python: {{"gpu": None}}
py, res = g.PY, g.RES
g.plan = lambda: [
    g.Step("sigma_step", "writes a result", [py, {writer!r}, res + "/sigma_step.json"], 30,
           "sigma_step.json", g._rows_sigma, kind="other"),
    g.Step("sleeps", "runs past the call's end",
           [py, "-c", "import time; print('sleeping', flush=True); time.sleep(60)"], 120,
           kind="other")]
sys.exit(g.main(sys.argv[1:]))
"""


def _stopped_call(tmp_path, sig):
    """The runner on the fake plan with ``--bundle``, sent ``sig`` once the sleeping step has
    written its first line; its exit status, the results folder and the bundle folder."""
    import tarfile
    import time
    (tmp_path / "plan").mkdir()
    _fake_plan(str(tmp_path / "plan"))  # writes writer.py
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER.format(scripts=os.path.join(ROOT, "scripts"),
                                     writer=str(tmp_path / "plan" / "writer.py")))
    res, out = tmp_path / "res", tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(driver), str(res), "--bundle", str(out)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    log = res / "logs" / "sleeps.log"
    while time.time() < deadline and p.poll() is None and not (
            log.exists() and "sleeping" in log.read_text()):
        time.sleep(0.1)
    time.sleep(1.0)  # a periodic bundle (every 0.3 s here) has the sleeping step's log
    p.send_signal(sig)
    output = p.communicate(timeout=60)[0]
    with tarfile.open(out / "results.tar.gz") as tar:
        members = {m.name: tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    return p.returncode, output, res, out, members


def test_a_call_stopped_at_its_timeout_keeps_every_finished_step(tmp_path):
    """SIGTERM: the runner stops the step in flight, records it, and writes the report and the
    bundle: the finished step's JSON and row, the stopped step's log."""
    import signal
    rc, output, res, out, members = _stopped_call(tmp_path, signal.SIGTERM)
    assert rc == 1, output
    md = (out / "evidence.md").read_text()
    assert "| sigma_step | ok |" in md and "| sigma_step | Sigma router step over upstream" in md
    assert "| sleeps | stopped (SIGTERM) |" in md, md
    state = json.loads((out / "evidence.json").read_text())
    assert state["steps"]["sleeps"]["status"] == "stopped (SIGTERM)"
    assert "sleeping" in state["steps"]["sleeps"]["tail"]
    assert "sigma_step.json" in members and "logs/sleeps.log" in members
    assert "sleeping" in members["logs/sleeps.log"]
    # Every file the device brings back: at most 8, in the folder itself, plain names.
    names = sorted(os.listdir(out))
    assert len(names) <= 8 and all(gpu_evidence._BUNDLE_NAME.fullmatch(n) for n in names), names


def test_a_call_killed_at_its_timeout_keeps_the_last_bundle(tmp_path):
    """SIGKILL: nothing runs after it, and the bundle written after the finished step and
    refreshed while the next one ran is what comes back."""
    import signal
    rc, output, res, out, members = _stopped_call(tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    md = (out / "evidence.md").read_text()
    assert "| sigma_step | ok |" in md and "| sigma_step | Sigma router step over upstream" in md
    assert "| sleeps | running |" in md  # in flight when the call ended
    assert json.loads(members["sigma_step.json"])["ratio_runs"] == [1.005, 1.01]
    assert "sleeping" in members["logs/sleeps.log"]  # the step in flight, as far as it got


def test_the_bundle_fits_what_a_device_call_brings_back(tmp_path):
    """At most 8 files, each under the size asked for (here 200 kB for 16 MiB), in the folder
    itself with plain names; the packages left out; traces packed into archives of their own;
    what does not fit named in bundle.txt; an archive a smaller bundle no longer needs removed."""
    import tarfile
    res, out = tmp_path / "res", tmp_path / "out"
    for rel, size, text in [("evidence.md", 0, "# GPU evidence\n"), ("evidence.json", 0, "{}"),
                            ("logs/stem_mlp.log", 0, "x" * 50_000),  # compresses
                            ("stem_mlp.json", 0, "{}"), (".site/torch/big.so", 500_000, None),
                            ("work/run/corpus.bin", 150_000, None),
                            ("work/run/other.bin", 120_000, None)] + [
            (f"profile/b{i}/trace_side.json.gz", 80_000, None) for i in range(7)] + [
            ("profile/huge/trace_side.json.gz", 250_000, None)]:
        path = res / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size) if text is None else text.encode())
    left = gpu_evidence.bundle(str(res), str(out), file_bytes=200_000)
    names = sorted(os.listdir(out))
    assert names == ["bundle.txt", "evidence.json", "evidence.md", "results.tar.gz",
                     "traces-1.tar", "traces-2.tar", "traces-3.tar"], names
    assert all(os.path.getsize(out / n) <= 200_000 for n in names)
    with tarfile.open(out / "results.tar.gz") as tar:
        members = sorted(tar.getnames())
    # The two binaries do not fit beside each other: the larger goes.
    assert members == ["logs/stem_mlp.log", "stem_mlp.json", "work/run/other.bin"], members
    traces = []
    for i in (1, 2, 3):
        with tarfile.open(out / f"traces-{i}.tar") as tar:
            traces += tar.getnames()
    assert len(traces) == 6 and len(set(traces)) == 6  # two of 80 kB per archive
    manifest = (out / "bundle.txt").read_text()
    for name in ("work/run/corpus.bin", "profile/huge/trace_side.json.gz"):
        assert any(x.startswith(name) for x in left) and name in manifest, (name, left)
    assert len(left) == 3 and "no archive left" in manifest and ".site" not in manifest
    # Fewer traces later: the third archive of the earlier bundle goes.
    for i in range(3, 7):
        os.remove(res / f"profile/b{i}/trace_side.json.gz")
    gpu_evidence.bundle(str(res), str(out), file_bytes=200_000)
    assert "traces-3.tar" not in os.listdir(out) and "traces-2.tar" in os.listdir(out)


def test_every_step_fits_one_device_call():
    """A device call runs at most 600 s, of which about CALL_OVERHEAD_S come before the first
    step and CALL_MARGIN_S after the last: every step's expected seconds, and its limit, fit
    inside what is left (the runner's default budget of 9 minutes), and no step is expected to
    outlive its own limit (stem_placement's six trainings: about 600 s against 540 until
    2026-11-28)."""
    g = gpu_evidence
    room = 600 - g.CALL_OVERHEAD_S - g.CALL_MARGIN_S
    for s in g.plan():
        assert s.expected_s <= s.limit_s <= room, (s.name, s.expected_s, s.limit_s, room)


def test_stem_placement_stands_for_its_pieces(tmp_path, capsys):
    """``--steps stem_placement`` (docs and notes of before 2026-11-28) runs its pieces, each
    a run of the benchmark with the baselines its ratios need; --skip takes the name too."""
    g = gpu_evidence
    by_name = {s.name: s for s in g.plan()}
    pieces = g.GROUPS["stem_placement"]
    assert "stem_placement" not in by_name and set(pieces) <= set(by_name)
    assert g.main([str(tmp_path / "res"), "--steps", "stem_placement", "--print-only"]) == 0
    out = capsys.readouterr().out
    assert [ln.split(" s] ")[1].split()[0] for ln in out.splitlines() if " s] " in ln] == pieces
    assert g.main([str(tmp_path / "res"), "--steps", "stem_placement,host_read",
                   "--skip", "stem_placement", "--print-only"]) == 0
    assert [ln.split(" s] ")[1].split()[0] for ln in capsys.readouterr().out.splitlines()
            if " s] " in ln] == ["host_read"]
    placement = load_script("benchmarks/stem_placement.py", "stem_placement_bench")
    def option(name, flag):
        return by_name[name].argv[by_name[name].argv.index(flag) + 1]

    judged = set()
    for name in pieces + ["stem_placement_cpu"]:
        variants = option(name, "--variants").split(",")
        # Every ratio's baseline in the same run: each flag's, and gpu for the goals, judged
        # where gpu and the variant train twice.
        assert all(placement.BASELINES[v] in variants
                   for v in variants if v in placement.BASELINES), name
        if "gpu" in variants and option(name, "--repeats") == "2":
            judged |= set(variants) & set(g.PLACEMENT_GOALS)
    assert judged == set(g.PLACEMENT_GOALS)
    ran = {v for name in pieces for v in option(name, "--variants").split(",")}
    assert ran == {"gpu", "tiered", "gpu-sparse", *placement.BASELINES}, ran


def test_a_variant_is_judged_against_its_own_baseline_in_the_same_run(tmp_path):
    """benchmarks/stem_placement.py gives tiered-direct, tiered-gpu-step and
    gpu-sparse-gpu-step their ratio to the variant they change by one flag, per repeat, where
    that trained in the run; the runner reads it, and without the gpu variant in the run gives
    each variant's step time instead of ratios to it."""
    placement = load_script("benchmarks/stem_placement.py", "stem_placement_bench")
    results = {
        "tiered": {"status": "ok", "iteration_ms": 100.0, "iteration_ms_repeats": [100.0, 120.0]},
        "tiered-direct": {"status": "ok", "iteration_ms": 95.0,
                          "iteration_ms_repeats": [90.0, 114.0]},
        "gpu-sparse-gpu-step": {"status": "failed", "reason": "RuntimeError: boom (exit 1)",
                                "iteration_ms_repeats": [None, None]}}
    path = tmp_path / "direct.json"
    placement.write_results(results, str(path))
    direct = results["tiered-direct"]
    assert direct["baseline"] == "tiered"
    assert direct["ratios_per_repeat_vs_baseline"] == pytest.approx([0.9, 0.95])
    assert direct["ratio_vs_baseline_worst"] == pytest.approx(0.95)
    assert "baseline" not in results["gpu-sparse-gpu-step"]  # gpu-sparse did not train here
    assert "ratio_vs_gpu" not in direct and "ratio_vs_gpu_sparse" not in direct
    by = {r.metric: r for r in gpu_evidence._rows_placement(str(path), "stem_placement_direct")}
    assert set(by) == {"tiered tables, step", "tiered-direct tables, step",
                       "gpu-sparse-gpu-step tables, step",
                       "tiered-direct tables, step vs tiered tables"}, sorted(by)
    row = by["tiered-direct tables, step vs tiered tables"]
    assert row.value == pytest.approx(0.95) and row.goal is None and not row.incomplete
    assert "runs 0.900 / 0.950" in row.note and "95.0 vs 100.0 ms" in row.note
    failed = by["gpu-sparse-gpu-step tables, step"]
    assert failed.met is False and "failed: RuntimeError: boom (exit 1)" in failed.note
    # One run of each, gpu-sparse beside tiered: each kernel variant against its own baseline,
    # gpu-sparse-gpu-step once (not again as a ratio to gpu-sparse), tiered against gpu-sparse.
    results = {"gpu-sparse": {"iteration_ms": 80.0, "iteration_ms_repeats": [80.0]},
               "gpu-sparse-gpu-step": {"iteration_ms": 76.0, "iteration_ms_repeats": [76.0]},
               "tiered": {"iteration_ms": 100.0, "iteration_ms_repeats": [100.0]},
               "tiered-gpu-step": {"iteration_ms": 98.0, "iteration_ms_repeats": [98.0]}}
    placement.write_results(results, str(tmp_path / "step.json"))
    by = {r.metric: r for r in gpu_evidence._rows_placement(str(tmp_path / "step.json"))}
    assert by["gpu-sparse-gpu-step tables, step vs gpu-sparse tables"].value == \
        pytest.approx(0.95)
    assert by["tiered-gpu-step tables, step vs tiered tables"].value == pytest.approx(0.98)
    assert "one run" in by["tiered-gpu-step tables, step vs tiered tables"].note
    assert by["tiered tables, step vs gpu-sparse tables"].value == pytest.approx(1.25)
    assert sum(m.startswith("gpu-sparse-gpu-step tables, step vs") for m in by) == 1
    assert not any("vs gpu tables" in m for m in by)


class _FakeCuda:
    """``torch.cuda``'s memory counters stood in: a side's step allocates what it is told, on
    top of what is resident."""

    def __init__(self, resident):
        self.allocated = self.peak = resident

    def step(self, gib):
        self.peak = max(self.peak, self.allocated + gib)

    def reset_peak_memory_stats(self):
        self.peak = self.allocated


def test_peak_gpu_memory_is_each_sides_own(monkeypatch):
    """benchmarks/gpu_memory.py: the peak counter is reset before each side's timing, so a
    side's peak is its own step's on top of what is resident, the highest of its runs; on the
    CPU nothing is measured and the JSON's fields are null."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_memory

    fake = _FakeCuda(resident=10 * gpu_memory.GIB)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(gpu_memory.torch.cuda, name, getattr(fake, name, lambda: None))
    monkeypatch.setattr(gpu_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_memory.torch.cuda, "memory_allocated", lambda: fake.allocated)
    monkeypatch.setattr(gpu_memory.torch.cuda, "max_memory_allocated", lambda: fake.peak)
    memory = gpu_memory.PeakMemory()
    steps = {"big": iter([30, 20]), "small": iter([5, 6])}
    measure = memory.track({name: (lambda name=name: fake.step(next(steps[name]) *
                                                             gpu_memory.GIB) or [1.0])
                            for name in steps})
    for name in ("big", "small", "small", "big"):  # ABBA
        assert measure[name]() == [1.0]
    assert memory.summary() == {"peak_gpu_gib": {"big": 40.0, "small": 16.0},
                                "resident_gpu_gib": {"big": 10.0, "small": 10.0}}
    assert memory.line("small") == "  peak GPU 16.0 GiB (10.0 resident)"
    monkeypatch.setattr(gpu_memory.torch.cuda, "is_available", lambda: False)
    cpu = gpu_memory.PeakMemory()
    assert cpu.track({"a": lambda: [2.0]})["a"]() == [2.0]
    assert cpu.summary() == {"peak_gpu_gib": None, "resident_gpu_gib": None}
    assert cpu.line("a") == ""


def test_the_runner_reports_the_step_benchmarks_peak_gpu_memory(tmp_path):
    """structmoe_step's and sigma_step's peak GPU memory (the 4 x 4096 step's, counted at about
    40-50 GB before it was measured): one row, the largest side's, every side in its note;
    none for a CPU result (null) or one from before the field."""
    step = {"layer_ms": None, "step_ms": {"dense": 600.0, "grouped": 800.0},
            "overhead_pct": {"grouped": 33.3}, "overhead_pct_runs": {"grouped": [33.0, 33.6]},
            "peak_gpu_gib": {"dense": 38.5, "grouped": 41.25},
            "resident_gpu_gib": {"dense": 17.0, "grouped": 17.0}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(step))
    rows = gpu_evidence._rows_overhead("structmoe_step_16k", "step", None)(str(path))
    (mem,) = [r for r in rows if r.unit == "GiB"]
    assert mem.value == 41.25 and mem.goal is None and mem.step == "structmoe_step_16k"
    assert mem.note == "grouped; dense 38.5 (17.0 resident), grouped 41.2 (17.0 resident)"
    for peak in (None, "absent"):
        s = dict(step)
        if peak is None:
            s["peak_gpu_gib"] = s["resident_gpu_gib"] = None
        else:
            del s["peak_gpu_gib"]
        path.write_text(json.dumps(s))
        assert not [r for r in gpu_evidence._rows_overhead("structmoe_step", "step", None)(
            str(path)) if r.unit == "GiB"]
    path.write_text(json.dumps({"ratio_sigma_vs_upstream": 1.01, "ratio_runs": [1.01, 1.01],
                                "step_ms": {"sigma": 101.0, "upstream": 100.0},
                                "peak_gpu_gib": {"sigma": 12.0, "upstream": 11.5}}))
    mem = gpu_evidence._rows_sigma(str(path))[-1]
    assert (mem.step, mem.value, mem.note) == ("sigma_step", 12.0,
                                               "sigma; sigma 12.0, upstream 11.5")
