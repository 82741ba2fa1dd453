"""A checkpoint saved at one expert-parallel size resumes at another, optimizer state included
(``compat/upstream_fixes.py``, ``optimizer_state_across_expert_parallel_sizes``), or is refused
before the model is built where it cannot (``training/preflight.py``,
``check_bucket_layout_resume``: a distributed-optimizer state in Megatron's bucket layout).

With expert parallelism Megatron builds a ChainedOptimizer of a dense and an expert optimizer,
without it one optimizer. The trainings that resume EP=2 -> EP=1 and EP=1 -> EP=2 and continue
the uninterrupted run's losses are in ``tests/test_parallel_sigma.py``; here, upstream's own
optimizers load a state dict as ``dist_checkpointing.load`` hands it to them (the saved common
state nested by the saved chain's index, the tensors in this run's layout).
"""

from __future__ import annotations

import argparse
import functools
import os

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.optimizer import (ChainedOptimizer, FP32Optimizer,
                                               MegatronOptimizer)

from megatron_ext.compat import upstream_fixes
from multirank import PRETRAIN, ROOT, TINY_GPT
from rank_server import run_python
from test_start_refusals import parse

# Megatron's param group fields (optimizer/__init__.py _get_param_groups), by kind.
DENSE = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": 1e-3,
         "min_lr": 1e-4, "default_config": True, "is_expert_parallel": False}
NO_WD = dict(DENSE, wd_mult=0.0)
EXPERT = dict(DENSE, is_expert_parallel=True)


def megatron_fp32_optimizer(groups):
    """Upstream's FP32Optimizer over torch's Adam with ``groups`` (its ``__init__`` asks for a
    CUDA tensor, the loss scale, which loading never reads)."""
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, torch.optim.Adam(groups, lr=1e-3), config=None)
    return opt


def trained(layout):
    """Three parameters (a weight, a norm, an expert) optimized by ``layout``'s optimizers:
    ``ep2`` a chain of the dense and the expert optimizer, ``ep1`` one optimizer (the expert's
    parameter in the dense group). Two Adam steps with fixed gradients."""
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(shape))
              for name, shape in (("dense", (3, 2)), ("norm", (2,)), ("expert", (2, 3)))}
    if layout == "ep2":
        optimizers = [megatron_fp32_optimizer([dict(DENSE, params=[params["dense"]]),
                                               dict(NO_WD, params=[params["norm"]])]),
                      megatron_fp32_optimizer([dict(EXPERT, params=[params["expert"]])])]
    else:
        optimizers = [megatron_fp32_optimizer([
            dict(DENSE, params=[params["dense"], params["expert"]]),
            dict(NO_WD, params=[params["norm"]])])]
    for step in range(2):
        for p in params.values():
            p.grad = torch.full_like(p, 0.1 * (step + 1)) + p.detach()
        for opt in optimizers:
            opt.optimizer.step()
    for opt in optimizers:  # the learning rate the scheduler left in the groups
        for group in opt.optimizer.param_groups:
            group["lr"] = 7e-4
    return params, ChainedOptimizer(optimizers)


def param_states(params, chain):
    out = {}
    for opt in chain.chained_optimizers:
        for name, p in params.items():
            if p in opt.optimizer.state:
                out[name] = {k: v.clone() for k, v in opt.optimizer.state[p].items()}
    return out


def as_loaded(saved_params, saved_chain, params, chain):
    """The state dict ``load_checkpoint`` passes to ``chain.load_state_dict``: what
    ``dist_checkpointing.load`` makes of a checkpoint of ``saved_chain``: its common state
    (param groups without ``params``, the step) nested as that chain saved it, merged with this
    run's layout, whose tensors (found under the parameters' names) are keyed by this run's
    parameter ids and whose groups' ``params`` are this run's."""
    def common(opt):
        sd = opt.state_dict()
        step = MegatronOptimizer._extract_common_per_param_step(sd)
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in sd["param_groups"]],
                "state": {"common_step": step}}

    saved = [common(opt) for opt in saved_chain.chained_optimizers]
    saved_by_name = param_states(saved_params, saved_chain)
    loaded = []
    for opt in chain.chained_optimizers:
        sd = opt.state_dict()
        ids = {}
        for group, ids_of_group in zip(opt.optimizer.param_groups, sd["param_groups"]):
            ids.update(zip(ids_of_group["params"], group["params"]))
        name_of = {id(p): n for n, p in params.items()}
        state = {i: {k: v.clone() for k, v in saved_by_name[name_of[id(p)]].items()
                     if k != "step"} for i, p in ids.items()}
        loaded.append({"state": state,
                       "param_groups": [{"params": g["params"]} for g in sd["param_groups"]]})
    state_dict = {}
    for parts in (saved, loaded):  # a chain's parts by index, one optimizer's at the top level
        if len(parts) == 1:
            state_dict.update(parts[0])
        else:
            state_dict.update(enumerate(parts))
    return state_dict


def fixed_load(chain, state_dict):
    return upstream_fixes._load_across_expert_parallel_sizes(
        ChainedOptimizer.load_state_dict)(chain, state_dict)


@pytest.mark.parametrize("saved,resumed", [("ep2", "ep1"), ("ep1", "ep2")])
def test_a_chain_of_another_length_loads_every_parameters_adam_state(saved, resumed):
    """Upstream refuses (its messages, megatron-core 0.19.2); fixed, each parameter gets the
    saved moments and step, each group the saved hyperparameters, whichever optimizer it is
    in now."""
    saved_params, saved_chain = trained(saved)
    params, chain = trained(resumed)
    for p in params.values():  # a fresh optimizer: no state yet
        for opt in chain.chained_optimizers:
            opt.optimizer.state.pop(p, None)
    upstream_error = ("Could not find parameter group with key" if resumed == "ep1" else
                      "Expected 2 entries in state dict, but got 4")
    with pytest.raises((ValueError, RuntimeError), match=upstream_error):
        chain.load_state_dict(as_loaded(saved_params, saved_chain, params, chain))

    fixed_load(chain, as_loaded(saved_params, saved_chain, params, chain))
    want, got = param_states(saved_params, saved_chain), param_states(params, chain)
    assert sorted(got) == ["dense", "expert", "norm"]
    for name in want:
        assert sorted(got[name]) == ["exp_avg", "exp_avg_sq", "step"], name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[name][key], want[name][key]), (name, key)
        assert float(got[name]["step"]) == 2.0
    for opt in chain.chained_optimizers:
        for group in opt.optimizer.param_groups:
            assert group["lr"] == 7e-4  # the saved group's, not this run's 1e-3
            expert = any(p is params["expert"] for p in group["params"])
            assert group["is_expert_parallel"] == (expert and resumed == "ep2")
            assert group["wd_mult"] == (0.0 if group["params"][0] is params["norm"] else 1.0)


def test_a_chain_of_the_same_length_is_upstreams_own_load():
    _, chain = trained("ep2")
    _, one = trained("ep1")
    assert upstream_fixes._current_layout(chain, {0: {}, 1: {}}) is None
    assert upstream_fixes._current_layout(one, {"state": {}, "param_groups": []}) is None


class Inner:
    def __init__(self, groups):
        self.param_groups = groups


class Sub:
    def __init__(self, groups):
        self.optimizer = Inner(groups)


class Chain:
    def __init__(self, *subs):
        self.chained_optimizers = list(subs)


def test_distributed_optimizer_groups_come_from_the_common_state():
    """DistributedOptimizer (model-space formats): its param groups (torch's Adam keeps the step
    there) are all common state, its tensors ``param_state``; saved by EP=1, loaded by EP=2."""
    groups = [dict(DENSE, step=4), dict(NO_WD, step=4)]
    state_dict = {"optimizer": {"param_groups": groups}, "param_state_sharding_type":
                  "fully_reshardable", 0: {"param_state": "dense tensors"},
                  1: {"param_state": "expert tensors"}}
    chain = Chain(Sub([dict(DENSE, params=[0]), dict(NO_WD, params=[1])]),
                  Sub([dict(EXPERT, params=[0])]))
    got = upstream_fixes._current_layout(chain, state_dict)
    assert got == {
        0: {"param_state": "dense tensors", "param_state_sharding_type": "fully_reshardable",
            "optimizer": {"param_groups": [dict(DENSE, step=4), dict(NO_WD, step=4)]}},
        1: {"param_state": "expert tensors", "param_state_sharding_type": "fully_reshardable",
            "optimizer": {"param_groups": [dict(EXPERT, step=4)]}}}


def test_saved_optimizers_at_different_steps_are_refused_in_one_line():
    state_dict = {0: {"param_groups": [DENSE], "state": {"common_step": torch.tensor(4.0)}},
                  1: {"param_groups": [EXPERT], "state": {"common_step": torch.tensor(3.0)}},
                  "state": {}, "param_groups": [{"params": [0]}]}
    with pytest.raises(RuntimeError) as error:
        upstream_fixes._current_layout(Chain(Sub([dict(DENSE, params=[0])])), state_dict)
    assert str(error.value) == (
        "the checkpoint's 2 optimizers (expert parallelism) hold different values of "
        "state.common_step, which one optimizer keeps once: resume at the "
        "--expert-model-parallel-size it was saved with")


def test_a_fully_reshardable_distributed_optimizer_state_loads_without_a_step_tensor():
    """``load_parameter_state_from_fully_reshardable`` passes each parameter's loaded tensors
    without ``step`` (read from the param groups); upstream's copy looked every key of torch's
    Adam state up in them (KeyError 'step': a --dist-ckpt-optim-fully-reshardable checkpoint
    never resumed without Apex/TE, at any expert-parallel size)."""
    param = torch.nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([param])
    adam.state[param] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3),
                         "exp_avg_sq": torch.zeros(3)}
    dist_opt = argparse.Namespace(
        model_param_group_index_map={"p": (0, 0)}, optimizer=adam,
        config=argparse.Namespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    loaded = {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0),
              "exp_avg_sq": torch.full((3,), 3.0)}
    upstream = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states
    with pytest.raises(KeyError, match="step"), torch.no_grad():
        upstream(dist_opt, "p", dict(loaded))
    upstream_fixes._set_states_without_autograd(upstream)(dist_opt, "p", dict(loaded))
    assert torch.equal(param.detach(), torch.ones(3))
    assert torch.equal(adam.state[param]["exp_avg_sq"], torch.full((3,), 3.0))
    assert float(adam.state[param]["step"]) == 5.0


# ---------------------------------------------------------------------------------------------
# a distributed-optimizer state in Megatron's bucket layout: refused at start


@pytest.fixture
def saved_at_ep2(tmp_path, mcore_single_rank):
    """torch_dist checkpoints at iteration 4 whose common state holds the args of an EP=2 run
    and the content metadata Megatron's save_checkpoint writes with the distributed optimizer
    (``_build_sharded_state_dict_metadata``), one per sharding type."""
    from megatron.core import dist_checkpointing

    def save(sharding, no_save_optim=False, ep=2, etp=None, tp=None):
        root = tmp_path / f"{sharding or 'no_dist_opt'}_ep{ep}_etp{etp}_tp{tp}"
        folder = root / "iter_0000004"
        folder.mkdir(parents=True)
        saved_args = argparse.Namespace(expert_model_parallel_size=ep,
                                        use_distributed_optimizer=sharding is not None,
                                        no_save_optim=no_save_optim)
        if etp is not None:
            saved_args.expert_tensor_parallel_size = etp
        if tp is not None:
            saved_args.tensor_model_parallel_size = tp
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        if sharding:
            metadata["distrib_optim_sharding_type"] = sharding
        dist_checkpointing.save({"args": saved_args, "iteration": 4}, str(folder),
                                content_metadata=metadata)
        (root / "latest_checkpointed_iteration.txt").write_text("4")
        return str(root)

    return save


REFUSAL = ("--load={0}: its distributed-optimizer state was saved at --expert-model-parallel-size "
           "2 in Megatron's bucket layout (dp_reshardable), which --expert-model-parallel-size 1 "
           "cannot load; to keep Adam's moments and step, re-save it in the fully reshardable "
           "format with `python -m megatron_ext.tools.reshardable --load {0} --save "
           "{0}_reshardable` and resume with --load {0}_reshardable; or resume at "
           "--expert-model-parallel-size 2, or pass --no-load-optim (the weights load, Adam's "
           "moments and step start afresh)")


@pytest.mark.parametrize("sharding,extra,refused", [
    ("dp_reshardable", [], True),
    ("dp_reshardable", ["--expert-model-parallel-size", "2"], False),
    ("dp_reshardable", ["--no-load-optim"], False),
    ("dp_reshardable", ["--finetune"], False),
    ("fully_reshardable", [], False),
    (None, [], False),  # Megatron's FP32/Float16 optimizers: compat/upstream_fixes.py
])
def test_a_bucket_layout_state_at_another_expert_parallel_size_is_refused(
        saved_at_ep2, sharding, extra, refused):
    from megatron_ext.training.preflight import check_bucket_layout_resume

    load = saved_at_ep2(sharding)
    args = parse(["--load", load, "--use-distributed-optimizer", *extra], world_size=2)
    if not refused:
        check_bucket_layout_resume(args)
        return
    with pytest.raises(ValueError) as error:
        check_bucket_layout_resume(args)
    assert str(error.value) == REFUSAL.format(load)


def test_a_bucket_layout_state_at_another_expert_tensor_parallel_size_is_refused(saved_at_ep2):
    """The expert-TP size splits the expert optimizer's buffers as EP does (Megatron's load of a
    TP=2 checkpoint saved at expert-TP 2, resumed at expert-TP 1, raised the KeyError listing
    every key); the line names what changed."""
    from test_cli_errors import SIGMA

    from megatron_ext.training.preflight import check_bucket_layout_resume

    load = saved_at_ep2("dp_reshardable", ep=1, etp=2)
    args = parse(["--load", load, "--use-distributed-optimizer", *SIGMA], world_size=2)
    with pytest.raises(ValueError) as error:
        check_bucket_layout_resume(args)
    assert str(error.value).startswith(
        f"--load={load}: its distributed-optimizer state was saved at "
        "--expert-tensor-parallel-size 2 in Megatron's bucket layout (dp_reshardable), which "
        "--expert-tensor-parallel-size 1 cannot load; to keep Adam's moments and step")
    assert "; or resume at --expert-tensor-parallel-size 2, or pass" in str(error.value)
    both = saved_at_ep2("dp_reshardable", ep=2, etp=2)
    with pytest.raises(ValueError, match="saved at --expert-model-parallel-size 2 "
                                         "--expert-tensor-parallel-size 2 in"):
        check_bucket_layout_resume(parse(["--load", both, "--use-distributed-optimizer",
                                          *SIGMA], world_size=2))
    same = saved_at_ep2("dp_reshardable", ep=1, etp=1)
    check_bucket_layout_resume(parse(["--load", same, "--use-distributed-optimizer", *SIGMA],
                                     world_size=2))


def test_a_bucket_layout_state_at_another_tensor_parallel_size_is_refused(saved_at_ep2):
    """Megatron refuses it too, but after building the model and with advice that does not help
    (``--ckpt-fully-parallel-save``); a dense model's line says nothing of expert sizes."""
    from megatron_ext.training.preflight import check_bucket_layout_resume

    load = saved_at_ep2("dp_reshardable", ep=1, tp=2)
    with pytest.raises(ValueError) as error:
        check_bucket_layout_resume(parse(["--load", load, "--use-distributed-optimizer"],
                                         world_size=2))
    assert ("saved at --tensor-model-parallel-size 2 in Megatron's bucket layout "
            "(dp_reshardable), which --tensor-model-parallel-size 1 cannot load") in str(error.value)



def test_a_checkpoint_saved_without_optimizer_state_is_not_refused(saved_at_ep2):
    from megatron_ext.training.preflight import check_bucket_layout_resume

    load = saved_at_ep2("dp_reshardable", no_save_optim=True)
    check_bucket_layout_resume(parse(["--load", load, "--use-distributed-optimizer"],
                                       world_size=2))


def test_the_launch_ends_with_the_line_before_building_anything(saved_at_ep2, monkeypatch):
    """Megatron's load raised a KeyError listing every key of the checkpoint, after the model
    was built."""
    from test_cli_errors import SIGMA

    load = saved_at_ep2("dp_reshardable")
    for name, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    proc = run_python([PRETRAIN, *TINY_GPT, *SIGMA, "--use-distributed-optimizer",
                       "--train-iters", "6", "--load", load], ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "megatron-ext: " + REFUSAL.format(load)
