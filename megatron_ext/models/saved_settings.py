"""The settings a checkpoint's model was built with, against this run's.

Megatron saves the run's parsed flags (``args``, ours among them) in every checkpoint's common
state. A resume whose flags build another model from the same weights loaded silently (STEM's
``--stem-variant gate`` on an ``up`` checkpoint: the tables then gate instead of projecting up)
or failed inside upstream's loader (``dagger``: a shape-mismatch traceback). The trainer compares
the settings every model has (``COMMON``) and each family its own (its ``check_checkpoint``) before
upstream's loader reads a tensor, and refuses a difference with one line naming both values.

Only settings that change the model are compared: its shapes, which layers are which, what a
layer computes. Where the weights live and how they are stepped (STEM's placement, sharding,
ownership, optimizer, prefetch, kernel; backends; load-balancing losses; initialisation, which a
checkpoint overrides) stay free to change on resume.

A setting the checkpoint's args lack (saved by an older version, or by Megatron without this
plugin) is not compared.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from megatron_ext.checkpoint_manifest import CheckpointError
from megatron_ext.checkpoint_reader import MegatronCheckpoint
from megatron_ext.models.hybrid_pattern import mlp_block_count

# (how the message names it: the flags that set it, the value of a run's args)
Setting = Tuple[str, Callable[[Any], Any]]

COMMON: Tuple[Setting, ...] = (
    ("--model-family", lambda a: getattr(a, "model_family", None) or "gpt"),
    ("--hidden-size", lambda a: a.hidden_size),
    ("--num-attention-heads", lambda a: a.num_attention_heads),
    # A GPT-path checkpoint loads into the hybrid path (models/hybrid_checkpoint.py): the i-th MLP
    # block is GPT layer i, so the blocks are compared, not --num-layers.
    ("MLP blocks (--num-layers, or the '-'/'E' of --hybrid-layer-pattern)", mlp_block_count),
)
FFN: Setting = ("--ffn-hidden-size", lambda a: a.ffn_hidden_size)


def saved_args(load_dir: str, step: Optional[int] = None):
    """The args of the checkpoint upstream's loader will read (its common state; no tensor is
    read), or None where there are none to compare (no ``torch_dist`` checkpoint there: upstream's
    loader, or the start-up check, reports it)."""
    try:
        return MegatronCheckpoint(load_dir, step).args
    except Exception:  # unreadable here: upstream's loader reads it next and names the problem
        return None


def differences(saved, args, settings: Sequence[Setting]) -> List[str]:
    """``"FLAG: A in the checkpoint, B in this run"`` for each setting whose values differ."""
    out = []
    for name, value in settings:
        try:
            then = value(saved)
        except (AttributeError, KeyError, TypeError, ValueError):
            continue  # the checkpoint's args do not say
        now = value(args)
        if then != now:
            out.append(f"{name}: {_show(then)} in the checkpoint, {_show(now)} in this run")
    return out


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def check(load_dir: str, step: Optional[int], args, settings: Sequence[Setting],
          saved=None) -> None:
    """Refuse (``CheckpointError``, one line) a checkpoint of ``load_dir`` whose model differs from
    the one ``args`` build in any of ``settings``. ``saved``: its args, when already read."""
    saved = saved_args(load_dir, step) if saved is None else saved
    if saved is None:
        return
    found = differences(saved, args, settings)
    if found:
        raise CheckpointError(
            f"--load={load_dir}: the checkpoint holds another model than this run builds ("
            + "; ".join(found) + "); resume with the checkpoint's settings, or start a new "
            "training (another --save, without --load)")
