"""The family benchmarks' compiled sides (``--compiled``: on by default on a GPU only, so the
runner's tiny CPU runs in tests/test_gpu_plan_smoke.py leave them out) run at the same tiny
shapes on the CPU, and the runner's readers (``scripts/gpu_evidence.py``) turn them into their
rows, compile seconds in the notes: what a GPU lease would otherwise find broken in its minutes.
Numbers mean nothing here; about 10 s per benchmark, most of it Inductor's C++ compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_gpu_plan_smoke import ROOT, TINY, gpu_evidence

# Per step: the rows of its compiled sides (metric names as the readers write them).
COMPILED_ROWS = {
    "stem_mlp": ["STEM MLP (compiled) speed-up vs dense",
                 "lookup-and-gate alone (PyTorch, compiled) fwd+bwd",
                 "lookup-and-gate alone, compiled vs PyTorch"],
    "structmoe_kernel": ["StructMoE (dense-masked+compiled) over dense",
                         "StructMoE (grouped+compiled) over dense"],
    "structmoe_step": ["StructMoE (dense-masked+compiled) over dense",
                       "StructMoE (grouped+compiled) over dense"],
    "sigma_step": ["Sigma router step, compiled (--sigma-compile router), over upstream"],
}
STEPS = [s for s in gpu_evidence.plan() if s.name in COMPILED_ROWS]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_compiled_sides_run_and_read(step, tmp_path):
    extra = ["--backends", "dense-masked", "grouped"] if step.name == "structmoe_kernel" else []
    argv = gpu_evidence._expand(step.argv, sys.executable, str(tmp_path)) + TINY[step.name] + \
        extra + ["--compiled"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    rows = {r.metric: r for r in step.rows(str(tmp_path / step.result))}
    for metric in COMPILED_ROWS[step.name]:
        assert metric in rows and rows[metric].value is not None, (metric, sorted(rows))
    assert any("compiled in" in r.note for r in rows.values()), rows
