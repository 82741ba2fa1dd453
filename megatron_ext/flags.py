"""A command line's flags read without a parser: before Megatron's parser runs (preset expansion,
the trainer's entry), without it (the model's shape from a list of flags, the scaling harness),
or beside it (the converter's logits check). A base module, so that every layer may read them."""

from __future__ import annotations

from typing import Optional, Sequence


def flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given for ``flag`` (``--x v`` or ``--x=v``), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)
