"""The family's optimizer hook into ``megatron.training`` (``models/family.py``:
``wrap_optimizer``; its per-iteration ``log_report`` is one of the run's log hooks,
``training/session.py``).

Extends ``megatron.training.training.get_megatron_optimizer`` (the name ``pretrain``'s
``setup_model_and_optimizer`` calls; the row of ``training/upstream_seams.py``): the optimizer
upstream builds is handed to the family of the running training (``--model-family``), which may
chain its own onto it.
"""

from __future__ import annotations

from typing import Callable



def wrap_get_megatron_optimizer(upstream: Callable, family_run, trained: list) -> Callable:
    """``family_run``: the training's ``FamilyRun``; ``trained``: the session's list of the model
    chunks the training optimizes (``training/session.py``), to which they are added."""

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = upstream(config, model_chunks, *args, **kwargs)
        trained.extend(model_chunks)
        return family_run.wrap_optimizer(optimizer, model_chunks)

    return get_megatron_optimizer
