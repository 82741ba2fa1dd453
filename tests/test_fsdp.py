"""Megatron-FSDP (``--use-megatron-fsdp``: parameters, gradients and Adam's state sharded over
the data-parallel ranks) trains every family as DDP does: the same losses and gradient norms
(1e-5) for 3 steps, on 2 gloo ranks. What it does not do (megatron-core 0.19.2) is refused at
start-up in one line (``preflight.check_fully_sharded``; docs/scaling.md, "Megatron-FSDP").

The runs give no ``CUDA_DEVICE_MAX_CONNECTIONS`` (the entry point leaves it unset for
Megatron-FSDP, which refuses 1) and no ``--no-gradient-reduce-div-fusion`` (a CPU backend
default: gloo has no PREMUL_SUM)."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

from megatron_ext.training.preflight import check_fully_sharded
from multirank import (TINY_GPT, Launches, assert_close_curves, assert_close_scalars,
                       require_ok)

FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
ITERS = ["--train-iters", "3"]
STEPS = [1, 2, 3]
SIGMA = ["--model-family", "sigma", "--num-experts", "32", "--moe-ffn-hidden-size", "16",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--sigma-lbl", "global", "--sigma-lbl-coeff", "0.01",
         "--moe-token-dispatcher-type", "alltoall"]
FAMILIES = {
    "gpt": [],
    "structmoe": ["--model-family", "structmoe", "--structmoe-num-experts", "4",
                  "--structmoe-rank", "4", "--structmoe-topk", "2"],
    # STEM's tables as model parameters (sharded by FSDP) ...
    "stem_gpu": ["--model-family", "stem", "--stem-layers", "1,3"],
    # ... and managed by STEM's run: rows on the host and a GPU tier, its own optimizer.
    "stem_tiered": ["--model-family", "stem", "--stem-layers", "1,3",
                    "--stem-table-placement", "tiered", "--stem-table-sharding", "vocab",
                    "--stem-gpu-tier", "25%"],
    "sigma": SIGMA,  # EP=1: the experts sharded over both ranks
    # EP=2 leaves each expert one data-parallel rank: allowed with one micro-batch per step
    # (check_fully_sharded refuses more).
    "sigma_ep2": SIGMA + ["--expert-model-parallel-size", "2", "--global-batch-size", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    launches = Launches(str(tmp))
    # One launch. The FSDP trainings first: a DDP training's entry point sets
    # CUDA_DEVICE_MAX_CONNECTIONS=1 in the process, which the next ones would inherit.
    for name, flags in FAMILIES.items():
        launches.add(f"{name}_fsdp", TINY_GPT + flags + ITERS + FSDP)
    for name, flags in FAMILIES.items():
        launches.add(f"{name}_ddp", TINY_GPT + flags + ITERS)
    return launches.run()


@pytest.mark.multirank
@pytest.mark.parametrize("family", list(FAMILIES))
def test_megatron_fsdp_trains_as_ddp(runs, family):
    fsdp, ddp = require_ok(runs[f"{family}_fsdp"]), require_ok(runs[f"{family}_ddp"])
    assert re.search(r"use_megatron_fsdp \.+ True", fsdp.log)
    assert not re.search(r"use_megatron_fsdp \.+ True", ddp.log)
    assert_close_curves(fsdp, ddp, STEPS)
    # A wrong gradient shows in its norm at the step it is made (the expert gradients of
    # sigma at EP=2 with 4 micro-batches: 2e-6 apart at step 1, losses 2e-5 apart at step 3).
    assert_close_scalars(fsdp, ddp, "grad-norm", STEPS, rel=1e-6)


def fsdp_args(**kw):
    """Megatron's arguments after validation for a 2-rank Sigma run at EP=2, one micro-batch of
    1 sample per rank and step (DP=2), with Megatron-FSDP."""
    base = dict(use_megatron_fsdp=True, use_torch_fsdp2=False, save=None, load=None,
                num_experts=32, model_family="sigma", calculate_per_token_loss=False,
                world_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, data_parallel_size=2, context_parallel_size=1,
                global_batch_size=2, micro_batch_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


def refusal(args, cpu_backend=True) -> str:
    with pytest.raises(ValueError) as exc:
        check_fully_sharded(args, cpu_backend=cpu_backend)
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_expert_gradients_accumulated_in_place_are_refused():
    """One expert data-parallel rank (EP=2 of 2 ranks) with DP=2 and more than one micro-batch
    per step: refused, naming the flag, the family and the batch that works."""
    check_fully_sharded(fsdp_args(), cpu_backend=True)  # one micro-batch: trains as DDP
    text = refusal(fsdp_args(global_batch_size=8))
    assert text.startswith("--use-megatron-fsdp with --expert-model-parallel-size 2 "
                           "(--model-family sigma)")
    assert "DP=2 accumulates 4 micro-batches" in text and "--global-batch-size 2" in text
    # Experts with two data-parallel ranks (EP=2 of 4): sharded, accumulated apart (4-rank
    # CPU run: the losses of 4 steps equal DDP's).
    check_fully_sharded(fsdp_args(world_size=4, data_parallel_size=4, global_batch_size=8),
                        cpu_backend=True)
    # EP=1 (every expert on both ranks), DDP, a loss summed per token (no division): free.
    check_fully_sharded(fsdp_args(expert_model_parallel_size=1, global_batch_size=8), True)
    check_fully_sharded(fsdp_args(use_megatron_fsdp=False, global_batch_size=8), True)
    check_fully_sharded(fsdp_args(calculate_per_token_loss=True, global_batch_size=8), True)
    # Under TP=2 on 4 ranks at EP=2 (expert-TP 1): two expert data-parallel ranks, free;
    # at EP=4 one, refused.
    tp2 = dict(world_size=4, data_parallel_size=2, global_batch_size=8)
    check_fully_sharded(fsdp_args(**tp2), True)
    assert "DP=2 accumulates 4" in refusal(fsdp_args(expert_model_parallel_size=4, **tp2))


def test_fsdp_checkpoints_are_refused():
    for flag in ("save", "load"):
        text = refusal(fsdp_args(num_experts=None, **{flag: "/ck"}), cpu_backend=False)
        assert text.startswith(f"--use-megatron-fsdp with --{flag} /ck: ")
        assert "--use-distributed-optimizer" in text
    check_fully_sharded(fsdp_args(use_megatron_fsdp=False, save="/ck", load="/ck"), False)


def test_torch_fsdp2_is_refused_on_the_cpu_backend_only():
    args = fsdp_args(use_megatron_fsdp=False, use_torch_fsdp2=True)
    assert refusal(args).startswith("--use-torch-fsdp2 needs CUDA")
    check_fully_sharded(args, cpu_backend=False)


def test_device_connections_are_left_unset_for_megatron_fsdp_even_from_a_preset(monkeypatch,
                                                                               tmp_path):
    """The entry point sets CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's requirement for TP/CP)
    unless the flags, a preset's included, ask for Megatron-FSDP, which refuses 1; a value the
    user set wins either way."""
    from megatron_ext.training.entry import set_device_connections
    from megatron_ext.training.presets import expand_argv

    preset = tmp_path / "fsdp.json"
    preset.write_text(json.dumps({"flags": {"model-family": "gpt", "use-megatron-fsdp": True}}))
    for flags, want in ((["--model-family", "gpt"], "1"),
                        (expand_argv(["--preset", str(preset)]), None),
                        (["--use-megatron-fsdp"], None)):
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        set_device_connections(flags)
        assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == want, flags
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    set_device_connections(["--model-family", "gpt"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
