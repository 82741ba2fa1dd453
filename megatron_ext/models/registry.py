"""Model families: the contract each family fulfils, and the registry the trainer looks them up in.

A family is one object (``Family``, ``models/family.py``), defined in its own folder
(``stem/family.py``, ``structmoe/family.py``, ``sigma/family.py``; the dense baseline in
``models/gpt_family.py``), in
the spirit of torchtitan's ``TrainSpec``: its flags, its config dataclass from the parsed flags,
its checks, its decoder block spec, the model-side state it attaches, and the hooks the generic
trainer seam (``megatron_ext/training/``) calls at start-up, per micro-batch, after a checkpoint
is loaded for evaluation and after training. The trainer iterates the registered families and
never compares a family's name.

The built-in families are imported on first use of the registry (they do not import it: no
cycle). Another family registers itself with ``register_family``, from a module named by
``--ext-plugin`` (imported by the entry point before the flags are parsed).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Dict, Sequence, Tuple

from megatron_ext.models.family import Family  # noqa: F401  (the contract, re-exported)


BUILTIN = ("megatron_ext.models.gpt_family", "megatron_ext.stem.family",
           "megatron_ext.structmoe.family", "megatron_ext.sigma.family")

# Module-level because the process registers its families once, before its flags are parsed
# (plugins with ``--ext-plugin``), and every training, conversion and tool of the process reads
# them by name.
_FAMILIES: Dict[str, Family] = {}


@functools.lru_cache(maxsize=None)  # once per process; a failed import is not cached: it is
def _load_builtin() -> None:        # retried, and raises again
    for module in BUILTIN:
        family = importlib.import_module(module).FAMILY
        if family.name not in _FAMILIES:
            _FAMILIES[family.name] = family


def register_family(family: Family) -> Family:
    _load_builtin()
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    _load_builtin()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"--model-family={name}: not available (registered: "
                         f"{', '.join(sorted(_FAMILIES))})") from None


def registered_families() -> Tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_FAMILIES))


def families() -> Tuple[Family, ...]:
    """Every registered family, built-in ones first, in registration order."""
    _load_builtin()
    return tuple(_FAMILIES.values())


def family_of(args) -> Family:
    return get_family(args.model_family)


def family_config(args) -> Any:
    """The options dataclass of ``args``'s family (None for a family without options)."""
    return family_of(args).config_from_args(args)


def load_plugins(argv: Sequence[str]) -> Sequence[str]:
    """Import the modules named by ``--ext-plugin MODULE`` in ``argv`` (each registers its
    families); returns the module names."""
    names = []
    for i, arg in enumerate(argv):
        if arg == "--ext-plugin" and i + 1 < len(argv):
            names.append(argv[i + 1])
        elif arg.startswith("--ext-plugin="):
            names.append(arg.split("=", 1)[1])
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"--ext-plugin={name}: cannot import it ({exc})") from None
    return names
