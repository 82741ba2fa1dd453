"""A family defined inside tests/ (``tests/plugins/gelu_family.py``) trains through
``launch/pretrain.py`` with ``--ext-plugin``, nothing changed outside the test: its flag parses,
its check runs, its MLP is built, its hooks are called (``start_run`` once, ``model_state`` per model
chunk, ``before_forward`` per micro-batch), and since its GELU MLP is Megatron's own non-gated MLP,
its losses are those of ``--model-family gpt`` without ``--swiglu`` (same modules, same seed),
bit for bit."""

from __future__ import annotations

import json
import os

import pytest

from multirank import TINY_GPT, Launches, assert_teardown_left_only_the_default_group, require_ok

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
GELU = [f for f in TINY_GPT if f != "--swiglu"] + ["--train-iters", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family_plugin")
    env = {"PYTHONPATH": PLUGINS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launches = Launches(str(tmp))
    report = str(tmp / "gelu_calls.json")
    launches.add("gelu", GELU + ["--ext-plugin", "gelu_family", "--model-family", "gelu",
                                 "--gelu-report", report], env=env)
    launches.add("gpt_gelu", GELU + ["--model-family", "gpt"], env=env)
    launches.add("gelu_swiglu", TINY_GPT + ["--train-iters", "1", "--ext-plugin", "gelu_family",
                                            "--model-family", "gelu"], env=env, alone=True)
    r = launches.run()
    return r, report


def test_a_family_from_a_plugin_trains_with_its_hooks(runs):
    r, report = runs
    gelu = require_ok(r["gelu"])
    assert sorted(gelu.losses) == [1, 2, 3, 4] and gelu.losses[4] < gelu.losses[1]
    calls = json.load(open(report))
    # global batch 8 = 2 ranks x 2 micro-batches x 2 sequences: 2 micro-batches per step
    assert calls == {"start_run": 1, "model_state": 1, "before_forward": 4 * 2}


def test_its_losses_are_the_non_gated_gpt_ones(runs):
    r, _ = runs
    gelu, gpt = require_ok(r["gelu"]), require_ok(r["gpt_gelu"])
    assert gelu.curve([1, 2, 3, 4]) == gpt.curve([1, 2, 3, 4])


def test_its_own_check_stops_a_bad_command(runs):
    r, _ = runs
    bad = r["gelu_swiglu"]
    assert bad.returncode != 0
    assert "megatron-ext: --model-family=gelu is the non-gated GELU MLP: drop --swiglu" in bad.log


def test_teardown_frees_every_training(runs):
    """The launches' plugin family's trainings are each freed at their teardown with their process
    groups."""
    r, _ = runs
    assert_teardown_left_only_the_default_group([r["gelu"], r["gpt_gelu"]])  # gelu_swiglu fails
