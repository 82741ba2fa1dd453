"""The tables' host worker beside a training thread that holds the GIL, and what shows where the
CPU table step's time goes (``stem/runtime/worker.py``, ``kernels/row_adam_cpu.py``,
``stem/runtime/optimizer.py``).

* The worker lowers the process's GIL switch interval when it starts (``--stem-gil-switch-ms``),
  never raises it, and 0 leaves Python's own; checked in fresh interpreters, since the worker
  and the interval are the process's.
* The row kernel's sparse step returns the seconds of its row loop, and ``RowAdamW`` sums the
  parameters, loop and call seconds for the tables' stats.
* ``team_cpus`` sees a team started from a thread whose CPU mask was narrowed to one CPU, and
  the start-up line warns about it.
* ``benchmarks/stem_worker_schedule.py --training-thread python`` runs the chunked schedule with
  the worker's switch interval and with Python's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_worker_start_lowers_the_switch_interval_to_its_own():
    out = _python("""
        import sys
        from megatron_ext.stem.runtime import worker
        before = sys.getswitchinterval()
        worker.HostWorker().submit(lambda: None).result()
        print(before, sys.getswitchinterval())
    """)
    before, after = map(float, out.split())
    assert before == pytest.approx(0.005)
    assert after == pytest.approx(0.0002)


@pytest.mark.parametrize("preset, setting, expected", [
    (None, 0.0, 0.005),      # 0: Python's own
    (1e-4, 2e-4, 1e-4),      # a shorter one set before stays
    (None, 1e-3, 1e-3),      # the flag's value
])
def test_switch_interval_setting(preset, setting, expected):
    out = _python(f"""
        import sys
        from megatron_ext.stem.runtime import worker
        if {preset!r} is not None:
            sys.setswitchinterval({preset!r})
        worker.HostWorker({setting!r}).submit(lambda: None).result()
        print(sys.getswitchinterval())
    """)
    assert float(out) == pytest.approx(expected)


def test_switch_interval_set_after_the_worker_started_applies_at_once():
    out = _python("""
        import sys
        from megatron_ext.stem.runtime import worker
        host = worker.HostWorker(0.0)
        host.submit(lambda: None).result()
        first = sys.getswitchinterval()
        host.set_switch_interval(5e-5)
        print(first, sys.getswitchinterval())
    """)
    first, then = map(float, out.split())
    assert first == pytest.approx(0.005) and then == pytest.approx(5e-5)


def test_negative_switch_interval_is_refused():
    from megatron_ext.stem.runtime import worker

    host = worker.HostWorker()
    before = host.switch_interval_s
    with pytest.raises(ValueError, match="switch interval"):
        host.set_switch_interval(-1e-3)
    assert host.switch_interval_s == before  # the refused value was not kept
    with pytest.raises(ValueError, match="switch interval"):
        worker.HostWorker(-1e-3)


def _kernel():
    from megatron_ext_kernels import row_adam_cpu

    kernel = row_adam_cpu.load()
    if kernel is None:
        pytest.skip("no C++ compiler for the row kernel")
    return kernel


def test_sparse_step_reports_its_parameters_and_loop_time():
    _kernel()
    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW

    g = torch.Generator().manual_seed(0)
    shard = torch.randn(300, 48, generator=g)
    adam = RowAdamW([shard], mode="sparse")
    assert adam.kernel == "rowwise"
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    rows = torch.tensor([3, 7, 100, 299])
    for _ in range(2):  # the second steps rows that owe nothing, the first fresh ones
        plan = adam.begin_step(hyper)
        adam.step_rows(0, rows, torch.randn(4, 48, generator=g), plan)
    params, loop, call = adam.kernel_times.take()
    assert params == 2 * 4 * 48
    assert 0.0 < loop <= call
    assert adam.kernel_times.take() == (0, 0.0, 0.0)


def test_clock_window_is_made_when_the_clock_steps():
    """The row steps' and reads' window is made by the thread that steps the clock, so the
    worker only looks it up."""
    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowClock

    clock = RowClock()
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 5):
        clock.advance(step, hyper)
        assert step in clock._windows
        window = clock._windows[step]
        clock._windows.pop(step)
        assert torch.equal(clock._window(step), window)  # the same bits made again


def _team_in_thread(kernel, threads, cpus=None):
    out = {}

    def probe():
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        out["team"] = kernel.team_cpus(threads, 2000)
        out["mask"] = len(os.sched_getaffinity(0))

    t = threading.Thread(target=probe)  # a fresh thread: a team (pool) of its own
    t.start()
    t.join()
    return out["team"], out["mask"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU masks")
def test_team_started_from_a_narrowed_thread_is_seen_and_warned_about():
    kernel = _kernel()
    from megatron_ext.stem.runtime.report import describe_team

    cpus = sorted(os.sched_getaffinity(0))
    team, mask = _team_in_thread(kernel, 2, {cpus[0]})
    assert mask == 1 and len(team) == 2
    assert all(a == 1 and c == cpus[0] for c, a in team)
    line = describe_team(team, mask, {"OMP_PROC_BIND": "close", "PATH": "/bin"})
    assert "2 threads on 1 CPUs, each allowed 1" in line
    assert "OMP_PROC_BIND=close" in line and "PATH" not in line
    assert "fewer CPUs than threads" in line
    if len(cpus) >= 2:
        team, mask = _team_in_thread(kernel, 2)
        assert all(a == len(cpus) for _, a in team)
        line = describe_team(team, mask, {})
        assert f"each allowed {len(cpus)}" in line and "fewer CPUs" not in line


def test_worker_schedule_benchmark_with_a_python_training_thread(tmp_path):
    out = tmp_path / "gil.json"
    p = subprocess.run([sys.executable, "benchmarks/stem_worker_schedule.py", "--rows", "512",
                        "--width", "64", "--tokens", "256", "--compute-ms", "3", "--steps", "3",
                        "--skip", "1", "--training-thread", "python", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["training_thread"] == "python"
    assert summary["owed step, chunks"]["gil_switch_ms"] == pytest.approx(0.2)
    assert summary["owed step, chunks, Python's switch"]["gil_switch_ms"] == pytest.approx(5.0)
    # The printed ratio is the two chunked schedules' step times: the worker's interval over
    # Python's (not their inverse, not another pair), each run's interval as applied.
    ours, pythons = (summary[k]["step_ms"] for k in ("owed step, chunks",
                                                     "owed step, chunks, Python's switch"))
    assert ours > 0 and pythons > 0
    assert summary["ratio_worker_switch_vs_python"] == round(ours / pythons, 4)
    assert "the worker's GIL switch interval vs Python's" in p.stdout
