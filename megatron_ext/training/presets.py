"""Model presets: data files under ``launch/presets`` that expand into command-line flags.

A preset is a JSON file::

    {"_comment": "where the numbers come from",
     "tokenizer": {"name": "meta-llama/Llama-3.2-1B", "vocab_size": 128256},
     "flags": {"num-layers": 16, "swiglu": true, ...}}

Each ``flags`` entry becomes a Megatron or megatron-ext flag (``true``: the switch alone;
``false``/``null``: left out). ``--preset NAME`` (a name under ``launch/presets`` or a path;
``--sigma-preset`` is the older spelling) is expanded *before* the command line's own flags, so a
flag given explicitly wins (argparse keeps the last value). ``tokenizer`` is not a flag: it names
the tokenizer the paper used and its vocabulary, which ``--dry-run`` uses when no tokenizer is
given. A family's fixed flags (``megatron_ext.sigma.presets.FAMILY_FLAGS``) are added after the
expansion where the command line lacks them.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

from megatron_ext.flags import flag_value, has_flag
from megatron_ext.models.registry import get_family

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET_DIR = os.path.join(ROOT, "launch", "presets")
PRESET_FLAGS = ("--preset", "--sigma-preset")


def available_presets() -> List[str]:
    """Names of the presets under ``launch/presets``: every JSON file there is one (its dry run
    as shipped is tested: tests/test_presets_dry_run.py)."""
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def preset_path(name: str, flag: str = "--preset") -> str:
    if os.path.isfile(name):
        return name
    path = os.path.join(PRESET_DIR, name if name.endswith(".json") else name + ".json")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}={name}: no such preset (available: "
                         f"{', '.join(available_presets())}, or a path to a JSON file)")
    return path


def load_preset_file(name: str, flag: str = "--preset") -> Dict[str, object]:
    path = preset_path(name, flag)
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}={name}: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("flags"), dict):
        raise ValueError(f"{flag}={name}: the file has no \"flags\" object")
    return data


def load_preset(name: str, flag: str = "--preset") -> Dict[str, object]:
    """The preset's flags (``{"num-layers": 16, ...}``)."""
    return load_preset_file(name, flag)["flags"]


def preset_tokenizer(argv: Sequence[str]) -> Dict[str, object]:
    """The ``tokenizer`` entry of the preset named in ``argv`` ({} without one)."""
    for flag in PRESET_FLAGS:
        name = flag_value(argv, flag)
        if name is not None:
            return dict(load_preset_file(name, flag).get("tokenizer") or {})
    return {}


def preset_argv(flags: Dict[str, object]) -> List[str]:
    out: List[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        out.append(f"--{key}")
        if value is not True:
            out.append(str(value))
    return out


def expand_argv(argv: Sequence[str]) -> List[str]:
    """The preset's flags (if any), then ``argv``, then the family's fixed flags where absent."""
    argv = list(argv)
    given = [(flag, flag_value(argv, flag)) for flag in PRESET_FLAGS]
    given = [(flag, name) for flag, name in given if name is not None]
    if len(given) > 1:
        raise ValueError(f"--preset={given[0][1]} and --sigma-preset={given[1][1]}: give one "
                         "preset")
    if given:
        flag, name = given[0]
        argv = preset_argv(load_preset(name, flag)) + argv
    family = flag_value(argv, "--model-family")
    if family is not None:
        try:
            implied = get_family(family).default_flags
        except ValueError:  # an unknown family: the parser names it
            implied = ()
        for flag, value in implied:
            if not has_flag(argv, flag):
                argv += [flag] + ([value] if value is not None else [])
    return argv
