"""Which rotary position embedding a training's attention applies without Transformer Engine
(``--ext-rope``).

Extends ``megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd``:
``apply_rotary_pos_emb`` (every attention layer's queries and keys, and the packed-sequence path
sequence by sequence) calls it by its module's name when ``apply_rope_fusion`` is off, which
Megatron requires without Transformer Engine (``arguments.drop_unavailable_fusions`` turns it off
there), so the row of ``training/upstream_seams.py`` that replaces it is the only way in. ``fused``
runs ``megatron_ext_kernels/rope.py`` (one Triton kernel each way) for the calls it covers and
upstream's for the rest; ``upstream`` Megatron's own; ``auto`` is upstream's until a GPU run has
measured the fused one (``benchmarks/rope.py``, ``docs/scaling.md``).
"""

from __future__ import annotations

import functools
from typing import Callable

from megatron.training import get_args

from megatron_ext.training import kernel_choice
from megatron_ext_kernels import rope

CHOICES = kernel_choice.CHOICES


def resolve(choice: str) -> str:
    """``fused`` or ``upstream`` for the flag's value; a choice this machine cannot run, in one
    line."""
    return kernel_choice.resolve("--ext-rope", choice)


def check_args(args) -> str:
    """Before anything is built (after ``drop_unavailable_fusions``): the RoPE this training
    runs, or the reason it cannot."""
    choice = resolve(getattr(args, "ext_rope", "auto"))
    if choice == "fused":
        if getattr(args, "position_embedding_type", "rope") != "rope":
            raise ValueError(f"--ext-rope fused with --position-embedding-type "
                             f"{args.position_embedding_type}: the model applies no rotary "
                             "embedding; drop --ext-rope fused")
        if getattr(args, "apply_rope_fusion", False):
            raise ValueError("--ext-rope fused with rope fusion on (Transformer Engine's fused "
                             "RoPE): Megatron then runs that one and never this; add "
                             "--no-rope-fusion or drop --ext-rope fused")
    return choice


def wrap(upstream: Callable) -> Callable:
    """Upstream's ``_apply_rotary_pos_emb_bshd``, or the fused kernel where the training's
    ``--ext-rope`` chose it and the call is one it covers (read from Megatron's arguments at the
    first call)."""
    chosen = []

    @functools.wraps(upstream)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False,
                                   mla_rotary_interleaved=False, mscale=1.0,
                                   multi_latent_attention=None):
        if not chosen:
            chosen.append(resolve(getattr(get_args(), "ext_rope", "auto")))
        if (chosen[0] == "fused" and not mla_rotary_interleaved
                and multi_latent_attention is None and rope.supports(t, freqs)):
            return rope.fused_rope(t, freqs, rotary_interleaved, mscale)
        return upstream(t, freqs, rotary_interleaved=rotary_interleaved,
                        mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
                        multi_latent_attention=multi_latent_attention)

    return _apply_rotary_pos_emb_bshd
