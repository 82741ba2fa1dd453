"""Back to a fresh process's state after a training, so that another can start in the same one.

Extends upstream's ``megatron.training.training.destroy_global_state`` (what Megatron's in-process
restart calls: global args, timers, the micro-batch calculator, the model-parallel groups, the rerun
state machine) with what Megatron keeps elsewhere per process and what the plugin keeps: every
process group but the default one (upstream destroys only its ``*_GLOO`` groups; the others lose
their last Megatron reference but stay registered with ``torch.distributed``, and under gloo each
keeps its context and its ``pt_gloo_runloop``/``gloo_tcp_loop`` threads for the life of the process:
hundreds of threads per rank after a launch of a few dozen trainings), the tensorboard writer
(flushed and closed), Megatron's aux-loss gradient scale and MoE metrics tracker (whose entries keep
the layer count of the training that first recorded them). The default process group stays up:
``initialize_megatron`` finds it and builds the next training's groups. Every training seeds its
generators itself. The run's own state (its log hooks, run report, manifest writer, ``--save``'s
lock, the gloo copy of the tensor-parallel group, the trainer's callbacks on its models' configs
(``release_model_configs``, which kept a model with the distributed optimizer alive), the upstream
functions it replaced, and the family's run: STEM's host worker and table optimizers, Sigma's
layers) is not here: the entry point closes its ``TrainingSession`` on every way out
(``training/session.py``).

Used by ``tests/dist/multi_config.py`` (several test trainings per launch of the ranks).
"""

from __future__ import annotations

import gc

import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.utils import get_model_config
from megatron.training import training
from megatron.training.global_vars import get_tensorboard_writer

from megatron_ext.training import upstream_seams


# What upstream's ``train()`` attaches to the model's config (megatron-core 0.19,
# ``megatron.training.training.train``): bound methods of the optimizer and the DDP chunks.
TRAINER_CALLBACKS = ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                     "finalize_model_grads_func")


def release_model_configs(chunks) -> None:
    """Detach the trainer's callbacks from the configs of the model ``chunks`` (the training
    session's, at its end), so that a finished model and its optimizer can be freed. Upstream's ``DistributedOptimizer`` keeps the shards of
    fp32 parameters as views made without ``detach()`` (``model_param.view(-1)[start:end]``; its
    fp16/bf16 branch detaches). Their autograd graph holds each parameter's ``AccumulateGrad``
    node, whose hook (Megatron DDP's backward post-hook) holds the DDP chunk, whose config holds
    the optimizer's ``scale_loss`` (``grad_scale_func``): a cycle through autograd's C++ side,
    which Python's collector cannot see, so the model, the optimizer and their process groups
    lived for the rest of the process (60 gloo threads per rank more after each training of a
    2-rank launch of tiny GPT trainings with ``--use-distributed-optimizer``, measured
    2026-11-26). Without the config's link to the optimizer the cycle is an ordinary one."""
    for config in {id(c): c for c in map(get_model_config, chunks)}.values():
        for name in TRAINER_CALLBACKS:
            if getattr(config, name, None) is not None:
                setattr(config, name, None)


def destroy_training_state() -> None:
    try:
        writer = get_tensorboard_writer()
    except Exception:  # global state already gone
        writer = None
    if writer is not None:
        writer.flush()
        writer.close()
    destroy_moe_metrics_tracker()
    training.destroy_global_state()
    upstream_seams.forget_upstream_state()  # what destroy_global_state leaves (its RESETS)
    clear_rotary_caches()
    destroy_subgroups()
    gc.collect()


def clear_rotary_caches() -> None:
    """Empty the ``lru_cache`` of the rotary embeddings' ``forward`` (megatron-core 0.19), whose
    keys hold the embedding modules (and their ``cp_group``) of every training that ran, so that
    destroyed groups are freed with their threads."""
    for cls in (RotaryEmbedding, YarnRotaryEmbedding):
        cls.forward.cache_clear()


def destroy_subgroups() -> None:
    """Destroy every process group this rank belongs to except the default one (the next
    training's ``initialize_megatron`` builds its own). A no-op without ``torch.distributed``.
    In the order the groups were made, which is the same on every rank (upstream's
    ``destroy_process_group(WORLD)`` keeps an order too: NCCL's abort was a collective in some
    versions). A group still referenced somewhere fails when used, not silently."""
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    # torch.distributed's registry of this rank's groups (private; no public list of groups).
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
