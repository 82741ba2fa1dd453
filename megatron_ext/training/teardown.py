"""Back to a fresh process's state after a training, so that another can start in the same one.

Extends upstream's ``megatron.training.training.destroy_global_state`` (what Megatron's in-process
restart calls: global args, timers, the micro-batch calculator, the model-parallel groups, the
rerun state machine) with what Megatron keeps elsewhere per process and what the plugin keeps:
the tensorboard writer (flushed and closed), Megatron's aux-loss gradient scale, the plugin's
log hooks and run report, the STEM table optimizers of the training, the Sigma router registry, and the host
worker's queue (waited for). The default process group stays up: ``initialize_megatron`` finds it and
builds the next training's groups. Every training seeds its generators itself.

Used by ``tests/dist/multi_config.py`` (several test trainings per launch of the ranks).
"""

from __future__ import annotations

import gc


def destroy_training_state() -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.training import training
    from megatron.training.global_vars import get_tensorboard_writer

    from megatron_ext.stem import table_optimizer
    from megatron_ext.stem.worker import WORKER
    from megatron_ext.training import log_hooks, run_report

    WORKER.wait()
    from megatron_ext.training.checkpoint_hooks import WRITER

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
    table_optimizer._ACTIVE.clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    training.destroy_global_state()
    # The finished training's model outlives it (Megatron DDP's gradient hooks keep it in
    # reference cycles through autograd nodes that the collector does not free), so the
    # registries that hold modules weakly are emptied here rather than left to the collector.
    from megatron_ext.sigma import router

    router._ROUTERS.clear()
    gc.collect()
