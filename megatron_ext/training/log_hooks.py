"""Extra per-iteration metrics in Megatron's training log.

Extends ``megatron.training.training.training_log`` (the row of ``training/upstream_seams.py``):
every hook of the training run (``TrainingSession.log_hooks``: the family's ``log_report``, the
run report's) runs on every rank at every iteration (hooks may use collectives), before
upstream's log, with ``(args, iteration, total_loss_dict, writer, wandb_writer)``.
``writer``/``wandb_writer`` are Megatron's (they exist on the last rank only) and are ``None`` on
iterations that ``--tensorboard-log-interval`` skips. Loss-like values added to
``total_loss_dict`` show on the console line.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from megatron.training import get_args
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

Hook = Callable[..., None]


def wrap_training_log(upstream: Callable, hooks: Sequence[Hook]) -> Callable:
    """``training_log`` that runs ``hooks`` (read at each call) before ``upstream``."""

    @functools.wraps(upstream)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        args = get_args()
        write = iteration % args.tensorboard_log_interval == 0
        writer = get_tensorboard_writer() if write else None
        wandb_writer = get_wandb_writer() if write else None
        for hook in hooks:
            hook(args, iteration, total_loss_dict, writer, wandb_writer)
        return upstream(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)

    return training_log
