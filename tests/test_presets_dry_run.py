"""Every preset under ``launch/presets`` runs its dry run as shipped (``launch/pretrain.py
--dry-run --preset NAME``, only the world size given): the README promises the numbers "for any
preset". In this process, through the dry run's function entry, as the entry point calls it
(``training/entry.py``: the expanded flags, then ``training/dry_run.main``); each call leaves the
process as it found it, so they can follow one another."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.training import dry_run
from megatron_ext.training.presets import PRESET_DIR, available_presets, expand_argv

PRESETS = sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def run_dry(capsys, *flags):
    raw = ["--dry-run", *flags]
    rc = dry_run.main(expand_argv(raw), raw)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_every_json_file_there_is_a_preset():
    assert len(PRESETS) >= 10 and available_presets() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_dry_run_of_the_preset_as_shipped(capsys, name):
    from megatron.training import global_vars

    env = dict(os.environ)
    rc, out, err = run_dry(capsys, "--preset", name, "--dry-run-world-size", "8")
    assert rc == 0, err[-2000:]
    assert f"(preset {name}), 8 ranks" in out.splitlines()[0]
    assert "parameters" in out and "memory per rank" in out
    # Nothing left behind for the next call: Megatron's globals, the rank variables, argv.
    assert global_vars._GLOBAL_ARGS is None
    assert dict(os.environ) == env


def test_sigma_dry_run_needs_no_training_length(capsys, tmp_path):
    """The issue's command: a fraction-of-training switch (--sigma-sparsify-at 0.9) needs no
    --train-iters in a dry run, and the numbers are those of a run that gives one (the schedule's
    top-k at the start, the target's after the switch)."""
    flags = ["--preset", "sigma_moe_tiny", "--dry-run-world-size", "8", "--micro-batch-size", "1"]
    rc, out, err = run_dry(capsys, *flags, "--dry-run-json", str(tmp_path / "a.json"))
    assert rc == 0, err[-2000:]
    assert "active after the top-k switch" in out
    rc, _, err = run_dry(capsys, *flags, "--train-iters", "1000", "--dry-run-json",
                         str(tmp_path / "b.json"))
    assert rc == 0, err[-2000:]
    without, with_iters = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert without == with_iters
    assert without["active_params"] > without["active_params_target"]


def test_grouped_experts_dry_run_plans_for_gpus(capsys, tmp_path):
    """``--moe-grouped-gemm`` (torch grouped experts without TE, models/grouped_experts.py): a dry
    run on a machine without a GPU plans for GPUs, so upstream's compute-capability check does not
    stop it (it did, "Unsupported compute capability for GroupedGEMM kernels", until
    2026-11-28); the numbers are the sequential experts' (same parameters, same memory)."""
    flags = ["--preset", "sigma_moe_tiny", "--dry-run-world-size", "8", "--micro-batch-size", "1",
             "--expert-model-parallel-size", "8"]
    rc, _, err = run_dry(capsys, *flags, "--dry-run-json", str(tmp_path / "a.json"))
    assert rc == 0, err[-2000:]
    rc, _, err = run_dry(capsys, *flags, "--moe-grouped-gemm", "--dry-run-json",
                         str(tmp_path / "b.json"))
    assert rc == 0, err[-2000:]
    sequential, grouped = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert grouped == sequential
