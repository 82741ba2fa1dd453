"""Which vocab-parallel cross entropy a training's loss runs (``--ext-cross-entropy``).

Extends ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``: Megatron-Core's language
models (``LanguageModule.compute_language_model_loss``: GPT, hybrid, their MTP heads) call it by
its package's name when ``--cross-entropy-loss-fusion`` is off, so the row of
``training/upstream_seams.py`` that replaces it is the only way in. ``fused`` runs
``megatron_ext_kernels/vocab_ce.py`` (Triton: no fp32 copy of the logits, 4.2 GB kept at
4 x 4096 tokens and a 128256 vocabulary instead of 8.4 GB, about a tenth of the memory traffic,
counted); ``upstream`` Megatron's own; ``auto`` is upstream's until a GPU run has measured the
fused one (``docs/scaling.md``). Label smoothing (which Megatron's models do not pass) always
takes upstream's path.
"""

from __future__ import annotations

import functools
from typing import Callable

from megatron.core import parallel_state
from megatron.training import get_args

from megatron_ext.training import kernel_choice
from megatron_ext_kernels import vocab_ce

CHOICES = kernel_choice.CHOICES


def resolve(choice: str) -> str:
    """``fused`` or ``upstream`` for the flag's value; a choice this machine cannot run, in one
    line."""
    return kernel_choice.resolve("--ext-cross-entropy", choice)


def check_args(args) -> str:
    """Before anything is built: the cross entropy this training runs, or the reason it cannot."""
    choice = resolve(getattr(args, "ext_cross_entropy", "auto"))
    if choice == "fused" and getattr(args, "cross_entropy_loss_fusion", False):
        raise ValueError("--ext-cross-entropy fused with --cross-entropy-loss-fusion: Megatron "
                         "then runs its own fused loss and never this one; drop one of the two")
    return choice


def wrap(upstream: Callable) -> Callable:
    """Upstream's ``vocab_parallel_cross_entropy``, or the fused one where the training's
    ``--ext-cross-entropy`` chose it (read from Megatron's arguments at the first call)."""
    chosen = []

    @functools.wraps(upstream)
    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0,
                                     tp_group=None):
        if not chosen:
            chosen.append(resolve(getattr(get_args(), "ext_cross_entropy", "auto")))
        if chosen[0] == "fused" and not label_smoothing:
            if tp_group is None:
                tp_group = parallel_state.get_tensor_model_parallel_group()
            return vocab_ce.fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target,
                                                                tp_group)
        return upstream(vocab_parallel_logits, target, label_smoothing, tp_group)

    return vocab_parallel_cross_entropy
