"""A resume of a checkpoint of another model is refused for the model, before the model is built
and before the learning-rate schedule is compared: the schedule's line came first and advised
--override-opt_param-scheduler, after which the model's refusal came, once the model was built
(tried: a stem_cpu checkpoint resumed by dense_cpu, structmoe_cpu and sigma_cpu)."""

from __future__ import annotations

import copy

import pytest

from test_start_refusals import schedule_args, scheduler_state
from tests_helpers import refusal


@pytest.fixture
def saved_stem(tmp_path, mcore_single_rank):
    """A torch_dist checkpoint at iteration 3 whose common state holds the args of a STEM run
    of TINY_GPT's shape and the scheduler of ``--train-iters 3`` (what Megatron's save writes
    there; no tensor is needed by the checks)."""
    from megatron.core import dist_checkpointing

    args = schedule_args(["--train-iters", "3"])
    state = scheduler_state(args)
    saved = copy.deepcopy(args)
    saved.model_family = "stem"
    folder = tmp_path / "ck" / "iter_0000003"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"opt_param_scheduler": state, "iteration": 3, "args": saved},
                            str(folder))
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("3")
    return str(tmp_path / "ck")


@pytest.mark.parametrize("extra,refused", [
    # another model and another schedule: the model is named, not the schedule
    (["--train-iters", "6"], "--model-family: stem in the checkpoint, gpt in this run"),
    (["--train-iters", "3"], "--model-family: stem in the checkpoint, gpt in this run"),
    (["--train-iters", "3", "--hidden-size", "96"],
     "--model-family: stem in the checkpoint, gpt in this run; --hidden-size: 64 in the "
     "checkpoint, 96 in this run"),
    # the flags that skip the schedule's check do not skip the model's
    (["--train-iters", "6", "--no-load-optim"], "--model-family: stem"),
    # the same model: the schedule's line as before
    (["--train-iters", "6", "--model-family", "stem"], "learning-rate schedule differs"),
    (["--train-iters", "3", "--model-family", "stem"], None),
])
def test_another_model_is_refused_before_the_schedule(saved_stem, extra, refused):
    from megatron_ext.training.preflight import check_resume

    text = refusal(check_resume, schedule_args(["--load", saved_stem, *extra]))
    if refused is None:
        assert text is None
        return
    assert text is not None and refused in text
    assert text.startswith(f"--load={saved_stem}: ")
    if "--model-family" in refused:
        assert "schedule" not in text
        assert "holds another model than this run builds" in text
