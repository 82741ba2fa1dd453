"""The family's optimizer hook into ``megatron.training`` (``models/family.py``:
``wrap_optimizer``; its per-iteration ``log_report`` is one of the run's log hooks,
``training/session.py``).

Extends ``megatron.training.training.get_megatron_optimizer`` (the name ``pretrain``'s
``setup_model_and_optimizer`` calls; the row of ``training/upstream_seams.py``): the optimizer
upstream builds gets the torch AdamW implementation of ``--ext-adam-impl`` (``adam_impl.py``), then
is handed to the family of the running training (``--model-family``), which may chain its own
onto it.
"""

from __future__ import annotations

from typing import Callable

from megatron.training import get_args, print_rank_0

from megatron_ext.training import adam_impl


def wrap_get_megatron_optimizer(upstream: Callable, family_run, trained: list) -> Callable:
    """``family_run``: the training's ``FamilyRun``; ``trained``: the session's list of the model
    chunks the training optimizes (``training/session.py``), to which they are added."""

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = upstream(config, model_chunks, *args, **kwargs)
        line = adam_impl.select(optimizer, getattr(get_args(), "ext_adam_impl", "auto"))
        if line:
            print_rank_0(line)
        trained.extend(model_chunks)
        return family_run.wrap_optimizer(optimizer, model_chunks)

    return get_megatron_optimizer
