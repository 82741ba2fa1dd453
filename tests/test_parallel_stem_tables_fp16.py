"""fp16 with managed STEM tables: Megatron's dynamic loss scaler unscales the table gradients, and
an overflow skips the table step with the model's. Ordinary table vs (cpu, vocab, dense), both
DP=2 (the loss is divided by the micro-batch count before the fp16 backward, so whether an
iteration overflows depends on the layout), from an initial loss scale of 2^26, which overflows
for the first iterations: both runs must skip the same iterations (same loss-scale curve) and then
train to the same losses."""

from __future__ import annotations

import pytest

from multirank import TINY_GPT, require_ok, torchrun_many

pytestmark = pytest.mark.multirank  # launches training ranks (tests/multirank.py)

FP16 = TINY_GPT + ["--model-family", "stem", "--stem-layers", "1,3", "--train-iters", "10",
                   "--fp16", "--initial-loss-scale", "67108864", "--hysteresis", "1",
                   "--loss-scale-window", "1000",
                   # fp32 gradient buffers: whether an iteration overflows is then decided by the
                   # fp16 backward pass alone (the managed tables sum their gradients in fp32).
                   "--accumulate-allreduce-grads-in-fp32"]


# fp16 arithmetic: the two layouts round differently (measured on the CPU: at most 9.1e-6 relative
# over the steps not skipped); table gradients left scaled would be off by the loss scale (2^20).
GRAD_NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("stem_tables_fp16"))
    return torchrun_many(tmp, [("ordinary", FP16),
                               ("managed", FP16 + ["--stem-table-placement", "cpu",
                                                   "--stem-table-sharding", "vocab"])])


def test_skipped_steps_and_losses_match(runs):
    ordinary, managed = require_ok(runs["ordinary"]), require_ok(runs["managed"])
    scale_o = [v for _, v in ordinary.scalars["loss-scale"]]
    scale_m = [v for _, v in managed.scalars["loss-scale"]]
    assert scale_o == scale_m
    assert scale_o[0] < 67108864 and len(set(scale_o)) > 1  # overflows happened, then settled
    steps = range(1, 11)
    assert ordinary.losses[10] < ordinary.losses[1]  # it trains after the skips
    for i in steps:  # fp16 arithmetic: the two layouts round differently
        assert abs(ordinary.losses[i] - managed.losses[i]) <= 2e-4 * abs(ordinary.losses[i])


def test_table_gradients_are_unscaled(runs):
    """The gradient norm Megatron logs (the tables' share included: ``get_grad_norm``) is the
    ordinary table's at every step that was not skipped. Adam is nearly blind to a constant
    factor on a gradient, so the losses alone would not show table gradients left scaled by the
    loss scale (2^26 at first); the norm, which clipping uses, does."""
    ordinary, managed = require_ok(runs["ordinary"]), require_ok(runs["managed"])
    norm_o, norm_m = (dict(run.scalars["grad-norm"]) for run in (ordinary, managed))
    assert sorted(norm_o) == sorted(norm_m) and len(norm_o) >= 4  # the same steps not skipped
    for step, norm in norm_o.items():
        assert abs(norm_m[step] - norm) <= GRAD_NORM_RTOL * norm, (step, norm_m[step], norm)
