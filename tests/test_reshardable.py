"""A distributed-optimizer checkpoint in Megatron's default format (``dp_reshardable``) resumes
at another layout with Adam's state, through the command the start-up refusal names
(``megatron_ext/tools/reshardable.py``: the checkpoint re-saved at its own layout in the fully
reshardable format, no training step).

A Sigma model saved at EP=2 resumes at EP=1, a STEM model saved at TP=1 resumes at TP=2: from
step 4 of a 6-step run, the uninterrupted run's losses (1e-5; the layouts give the same losses,
``test_parallel_sigma.py``, ``test_parallel_stem.py``), and not those of the same resume with
Adam's state started afresh (``--no-load-optim``): the check sees the optimizer state. Without the
conversion the resume is refused at start-up (``check_bucket_layout_resume``), and the command
is taken from that refusal's line, as a user would.

fp32, CPU, gloo, 2 ranks.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess

import pytest

from megatron_ext.checkpoint_manifest import read_manifest, verify
from megatron_ext.tools import reshardable
from multirank import ROOT, Launches, assert_close_curves, require_ok
from rank_server import run_python
from test_parallel_sigma import A2A, EP2, SIGMA
from test_parallel_stem import STEM
from test_start_refusals import parse

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

ITERS = ["--train-iters", "6"]
DOPT = ["--use-distributed-optimizer"]  # Megatron's default format: dp_reshardable
TP2 = ["--tensor-model-parallel-size", "2"]
# Each model: its flags, the layout it is saved at, the layout it resumes at.
MODELS = {"sigma": (SIGMA + A2A, EP2, []), "stem": (STEM, [], TP2)}


def refused_command(flags, load):
    """The command of the start-up refusal of a resume of ``load`` with ``flags`` (2 ranks)."""
    from megatron_ext.training.preflight import check_bucket_layout_resume

    with pytest.raises(ValueError) as error:
        check_bucket_layout_resume(parse([*flags, "--load", load], world_size=2))
    found = re.search(r"`(python -m megatron_ext\.tools\.reshardable [^`]*)`", str(error.value))
    assert found, str(error.value)
    assert f"resume with --load {load}_reshardable;" in str(error.value)
    assert found.group(1).endswith(f"--save {load}_reshardable --ckpt-step 4")
    return shlex.split(found.group(1))[1:]  # after "python"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshardable")
    saved = {name: str(tmp / f"{name}_ck") for name in MODELS}
    first = Launches(str(tmp))
    for name, (flags, at, _) in MODELS.items():
        first.add(f"{name}_ref", flags + at + ITERS + DOPT + ["--save", saved[name],
                                                             "--save-interval", "4"])
    r = first.run()
    r["converted"] = {}
    for name, (flags, _, to) in MODELS.items():
        require_ok(r[f"{name}_ref"])
        argv = refused_command(flags + to + ITERS + DOPT + ["--ckpt-step", "4"], saved[name])
        r["converted"][name] = run_python(argv, ROOT, timeout=900)
    second = Launches(str(tmp))
    for name, (flags, _, to) in MODELS.items():
        resume = flags + to + ITERS + DOPT + ["--load", saved[name] + "_reshardable"]
        second.add(f"{name}_resumed", resume)
        second.add(f"{name}_fresh_adam", resume + ["--no-load-optim"])
    r.update(second.run())
    r["saved"] = saved
    return r


@pytest.mark.parametrize("name", list(MODELS))
def test_the_refusals_command_converts_the_checkpoint(runs, name):
    proc = runs["converted"][name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("reshardable: ")]
    load = runs["saved"][name]
    assert lines[0].startswith(f"reshardable: {load}/iter_0000004: iteration 4, saved by 2 ranks")
    assert lines[0].endswith("in Megatron's bucket layout (dp_reshardable)")
    assert lines[-1].startswith(f"reshardable: wrote {load}_reshardable (iteration 4, optimizer "
                                "state fully_reshardable)")
    folder, iteration, common = reshardable.saved_state(load + "_reshardable", None)
    assert (iteration, reshardable.optimizer_sharding(common)) == (4, "fully_reshardable")
    assert read_manifest(folder) is not None and verify(folder) is not None
    assert os.listdir(os.path.dirname(load)).count(os.path.basename(load) + "_reshardable") == 1
    assert not [f for f in os.listdir(os.path.dirname(load)) if "reshardable." in f]  # no leftovers


@pytest.mark.parametrize("name", list(MODELS))
def test_resumed_at_another_layout_with_adams_state(runs, name):
    """Steps 5-6 are the uninterrupted run's; with Adam's state afresh step 6 is not (step 5's
    loss is computed before the first step of the resumed run)."""
    ref = require_ok(runs[f"{name}_ref"])
    resumed = require_ok(runs[f"{name}_resumed"])
    fresh = require_ok(runs[f"{name}_fresh_adam"])
    assert sorted(resumed.losses) == [5, 6]
    assert_close_curves(resumed, ref, [5, 6])
    assert abs(fresh.losses[6] - ref.losses[6]) > 1e-3, (fresh.losses, ref.losses)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_flags_rebuilt_from_the_saved_args_give_them_back(runs, name):
    """What the conversion run is started with: every saved arg comes back (the training state
    the load sets aside), and the layout is the saved one."""
    folder, _, common = reshardable.saved_state(runs["saved"][name], None)
    flags, differ = reshardable.training_flags(common["args"])
    assert differ == []
    at = MODELS[name][1]
    assert " ".join(at) in " ".join(flags)
    assert "--save" not in flags and "--load" not in flags


# ---------------------------------------------------------------------------------------------
# refusals, in one line, before anything is launched


@pytest.fixture
def checkpoint(tmp_path, mcore_single_rank):
    """A torch_dist checkpoint at iteration 4 holding only a common state: args of a 2-rank run
    and the content metadata Megatron's save writes (as test_expert_parallel_resume's)."""
    from megatron.core import dist_checkpointing

    def save(sharding="dp_reshardable", dist_opt=True, no_save_optim=False):
        root = tmp_path / f"ck_{sharding}_{dist_opt}_{no_save_optim}"
        (root / "iter_0000004").mkdir(parents=True)
        args = argparse.Namespace(world_size=2, use_distributed_optimizer=dist_opt,
                                  no_save_optim=no_save_optim, tensor_model_parallel_size=1,
                                  pipeline_model_parallel_size=1)
        metadata = {"distrib_optim_sharding_type": sharding} if dist_opt else {}
        dist_checkpointing.save({"args": args, "iteration": 4}, str(root / "iter_0000004"),
                                content_metadata=metadata)
        (root / "latest_checkpointed_iteration.txt").write_text("4")
        return str(root)

    return save


@pytest.mark.parametrize("kind,words", [
    (dict(sharding="fully_reshardable"), "in the fully_reshardable format already, which resumes "
                                         "at any layout: resume from it as it is"),
    (dict(dist_opt=False), "was saved without --use-distributed-optimizer"),
    (dict(no_save_optim=True), "holds no optimizer state (--no-save-optim)"),
])
def test_a_checkpoint_that_resumes_anywhere_is_not_converted(checkpoint, tmp_path, kind, words):
    load = checkpoint(**kind)
    with pytest.raises(reshardable.ReshardError, match=re.escape(words)) as error:
        reshardable.convert(load, str(tmp_path / "out"))
    assert str(error.value).startswith(f"--load={load}: ")
    assert not (tmp_path / "out").exists()


def test_an_existing_save_directory_is_refused(checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(reshardable.ReshardError) as error:
        reshardable.convert(checkpoint(), str(out))
    assert str(error.value) == (f"--save={out}: exists and is not empty; name a new directory "
                                "(nothing is written into an existing one)")
    assert os.listdir(out) == ["keep"]


def test_no_checkpoint_is_one_line(tmp_path, capsys):
    assert reshardable.main(["--load", str(tmp_path), "--save", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"reshardable: --load={tmp_path}: ")


def test_a_failed_conversion_run_is_one_line_and_writes_nothing(checkpoint, tmp_path,
                                                                monkeypatch):
    """The ranks' refusal is the line (its log kept beside --save); neither --save nor the
    temporary folder stays."""
    out = tmp_path / "out"
    monkeypatch.setattr(reshardable, "training_flags", lambda saved, extra: (["--x"], []))

    def ranks_refuse(cmd, stdout, **kwargs):
        work = cmd[cmd.index("--ckpt-convert-save") + 1]
        os.makedirs(os.path.join(work, "torch_dist", "iter_0000004"))  # a save begun
        stdout.write("Megatron's table\nmegatron-ext: --data-path=/gone: no such file\n"
                     "torchrun's summary\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(reshardable.subprocess, "run", ranks_refuse)
    with pytest.raises(reshardable.ReshardError) as error:
        reshardable.convert(checkpoint(), str(out), device="cpu")
    log = f"{out}.reshardable.log"
    assert str(error.value) == ("the conversion run failed (status 1): megatron-ext: "
                                f"--data-path=/gone: no such file (log: {log})")
    assert sorted(os.listdir(tmp_path)) == ["ck_dp_reshardable_True_False",
                                            "out.reshardable.log"]
