"""Each CPU preset trains with the command docs/cpu_backend.md gives, nothing added.

The command is read from the document itself (its one ``torchrun ... --preset stem_cpu`` line),
so the page and the test cannot drift apart; every ``*_cpu`` preset under ``launch/presets`` is
run with it, each in a launch of its own as torchrun would start it (a fresh process per rank).
"""

from __future__ import annotations

import os
import re
import shlex

import pytest

from multirank import PRETRAIN, ROOT, launch_ranks

DOC = os.path.join(ROOT, "docs", "cpu_backend.md")


def documented_command():
    """The doc's command line for ``stem_cpu``, split as a shell would."""
    with open(DOC) as f:
        lines = [line.strip() for line in f
                 if line.startswith("torchrun ") and "--preset stem_cpu" in line]
    assert len(lines) == 1, f"{DOC}: expected one torchrun command for stem_cpu, found {lines}"
    return shlex.split(lines[0])


def cpu_presets():
    from megatron_ext.training.presets import available_presets

    return [name for name in available_presets() if name.endswith("_cpu")]


@pytest.mark.parametrize("interval,points", [(None, 1), (4, 10 // 4 + 1)])
def test_an_unset_eval_interval_counts_only_the_final_evaluation(monkeypatch, interval, points):
    """megatron-core's default ``eval_interval=None`` ("evaluation will not run during
    training"): the validation samples are those of the evaluation at the end, and the args keep
    None for the training loop; a given interval counts as upstream counts it."""
    import argparse

    from megatron.training import global_vars, training

    from megatron_ext.compat import upstream_fixes

    for name in ("get_train_valid_test_num_samples", "build_train_valid_test_data_loaders"):
        monkeypatch.setattr(training, name, getattr(training, name))  # restored after the test
    upstream_fixes.install(["unset_eval_interval"])
    args = argparse.Namespace(train_samples=None, train_iters=10, global_batch_size=8,
                              full_validation=False, skip_train=False, eval_interval=interval,
                              start_eval_at_iter=None, eval_iters=3,
                              phase_transition_iterations=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert training.get_train_valid_test_num_samples() == (80, points * 3 * 8, 3 * 8)
    assert args.eval_interval == interval


def test_the_document_names_every_cpu_preset():
    with open(DOC) as f:
        text = f.read()
    assert cpu_presets() and all(f"`{name}`" in text for name in cpu_presets()), cpu_presets()


@pytest.mark.multirank  # launches training ranks (tests/multirank.py)
def test_each_cpu_preset_trains_as_documented():
    """The command trains its 3 iterations and, as no --eval-interval is given, evaluates only at
    the end (Megatron's meaning of an unset interval: ``megatron_ext/compat/upstream_fixes.py``;
    without that fix every preset failed after building the model, TypeError on None)."""
    argv = documented_command()
    assert argv[:3] == ["torchrun", "--nproc_per_node=2", "launch/pretrain.py"], argv
    flags = argv[3:]
    assert "--eval-interval" not in flags
    iters = int(flags[flags.index("--train-iters") + 1])
    failures = []
    for name in cpu_presets():
        preset_flags = [name if a == "stem_cpu" else a for a in flags]
        status, log = launch_ranks([PRETRAIN, *preset_flags], nproc=2)
        evaluated = [re.search(rf"validation loss at iteration {iters} on {split} set \| "
                               r"lm loss value: ([0-9.E+-]+)", log) for split in ("validation",
                                                                                   "test")]
        if status != 0 or not all(evaluated) or "Traceback" in log:
            failures.append(f"{name}: exit status {status}\n{log[-3000:]}")
    assert not failures, "\n\n".join(failures)
