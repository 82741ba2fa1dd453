"""Extra per-iteration metrics in Megatron's training log.

Extends ``megatron.training.training.training_log``: ``install()`` wraps it once; every registered
hook runs on every rank at every iteration (hooks may use collectives), before upstream's log, with
``(args, iteration, total_loss_dict, writer, wandb_writer)``. ``writer``/``wandb_writer`` are
Megatron's (they exist on the last rank only) and are ``None`` on iterations that
``--tensorboard-log-interval`` skips. Loss-like values added to ``total_loss_dict`` show on the
console line.
"""

from __future__ import annotations

import functools
from typing import Callable, List

from megatron.training import get_args, training
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

Hook = Callable[..., None]
_HOOKS: List[Hook] = []


def register(hook: Hook) -> None:
    if hook not in _HOOKS:
        _HOOKS.append(hook)
    install()


def install() -> None:
    upstream = training.training_log
    if getattr(upstream, "_megatron_ext_hooks", False):
        return

    @functools.wraps(upstream)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        args = get_args()
        write = iteration % args.tensorboard_log_interval == 0
        writer = get_tensorboard_writer() if write else None
        wandb_writer = get_wandb_writer() if write else None
        for hook in _HOOKS:
            hook(args, iteration, total_loss_dict, writer, wandb_writer)
        return upstream(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)

    training_log._megatron_ext_hooks = True
    training.training_log = training_log
