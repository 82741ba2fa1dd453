"""The family's hooks into ``megatron.training``: the one place the trainer's optimizer and
training log are extended for a family (``models/family.py``: ``wrap_optimizer``,
``log_report``).

Wraps ``megatron.training.training.get_megatron_optimizer`` (the name ``pretrain``'s
``setup_model_and_optimizer`` calls) once: the optimizer upstream builds is handed to the family
of the running training (``--model-family``), which may chain its own onto it. The family's
``log_report`` runs every iteration through ``training/log_hooks.py``.
"""

from __future__ import annotations

from megatron.training import get_args, training

from megatron_ext.models.registry import family_of
from megatron_ext.training import log_hooks


def install(family) -> None:
    """Before ``pretrain``: the running family's optimizer wrapper and per-iteration report."""
    if family.log_report is not None:
        log_hooks.register(family.log_report)  # again after a teardown (training/teardown.py)
    upstream = training.get_megatron_optimizer
    if getattr(upstream, "_ext_family", False):
        return

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = upstream(config, model_chunks, *args, **kwargs)
        margs = get_args()
        running = family_of(margs)
        if running.wrap_optimizer is None:
            return optimizer
        return running.wrap_optimizer(optimizer, model_chunks, margs,
                                      running.config_from_args(margs))

    get_megatron_optimizer._ext_family = True
    training.get_megatron_optimizer = get_megatron_optimizer
