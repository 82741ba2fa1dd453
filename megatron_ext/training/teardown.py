"""Back to a fresh process's state after a training, so that another can start in the same one.

Extends upstream's ``megatron.training.training.destroy_global_state`` (what Megatron's in-process
restart calls: global args, timers, the micro-batch calculator, the model-parallel groups, the
rerun state machine) with what Megatron keeps elsewhere per process and what the plugin keeps:
the tensorboard writer (flushed and closed), Megatron's aux-loss gradient scale and MoE metrics
tracker (whose entries keep the layer count of the training that first recorded them), the plugin's
log hooks and run report, and each registered family's own (its ``reset`` hook: STEM waits for the
host worker and forgets its table optimizers, Sigma empties its router registry). The default process group stays up: ``initialize_megatron`` finds it and
builds the next training's groups. Every training seeds its generators itself.

Used by ``tests/dist/multi_config.py`` (several test trainings per launch of the ranks).
"""

from __future__ import annotations

import gc

from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.training import training
from megatron.training.global_vars import get_tensorboard_writer

from megatron_ext.models.registry import families
from megatron_ext.training import log_hooks, run_report
from megatron_ext.training.batch import reset_host_tensor_parallel_group
from megatron_ext.training.checkpoint_hooks import WRITER


def destroy_training_state() -> None:
    for family in families():
        if family.reset is not None:
            family.reset()
    WRITER.wait()
    try:
        writer = get_tensorboard_writer()
    except Exception:  # global state already gone
        writer = None
    if writer is not None:
        writer.flush()
        writer.close()
    if run_report._REPORT is not None:
        run_report._REPORT.at_exit()
        run_report._REPORT = None
    log_hooks._HOOKS.clear()  # each install registers its hook again
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    destroy_moe_metrics_tracker()
    reset_host_tensor_parallel_group()
    training.destroy_global_state()
    gc.collect()
