"""Sigma presets (data files under ``launch/presets``) and the family's fixed flags.

A preset is a JSON file ``{"flags": {"num-layers": 56, "swiglu": true, ...}}``: each entry becomes
a Megatron or megatron-ext flag (``true``: the switch alone; ``false``/``null``: left out). The
entry point expands ``--sigma-preset NAME`` (a name under ``launch/presets`` or a path) *before*
the command line's own flags, so flags given explicitly win (argparse keeps the last value).

``--model-family sigma`` also fixes what the Sigma layer is (report, Sec. 2): top-1 unless ``--moe-router-topk`` says otherwise, pre-softmax top-k
(Megatron refuses top-1 without it), an FP32 router, QK-norm and no upstream aux loss (the
family's ``--sigma-lbl`` replaces it). Those flags are added when absent; contradicting values
given explicitly are refused later by ``validate_sigma_args`` with a message.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET_DIR = os.path.join(ROOT, "launch", "presets")

FAMILY_FLAGS = (
    ("--moe-router-topk", "1"),  # Megatron's default is 2; Sigma's target sparsity is top-1
    ("--moe-router-pre-softmax", None),
    ("--moe-router-dtype", "fp32"),
    ("--moe-router-load-balancing-type", "none"),
    ("--qk-layernorm", None),
)


def _flag_value(argv: Sequence[str], flag: str):
    """The last value given for ``flag`` (``--x v`` or ``--x=v``), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _has(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def preset_path(name: str) -> str:
    if os.path.isfile(name):
        return name
    path = os.path.join(PRESET_DIR, name if name.endswith(".json") else name + ".json")
    if not os.path.isfile(path):
        available = sorted(f[:-5] for f in os.listdir(PRESET_DIR)
                           if f.startswith("sigma") and f.endswith(".json"))
        raise ValueError(f"--sigma-preset={name}: no such preset (available: "
                         f"{', '.join(available)}, or a path to a JSON file)")
    return path


def load_preset(name: str) -> Dict[str, object]:
    with open(preset_path(name)) as f:
        data = json.load(f)
    if not isinstance(data.get("flags"), dict):
        raise ValueError(f"--sigma-preset={name}: the file has no \"flags\" object")
    return data["flags"]


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
    """The preset's flags (if any), then ``argv``; with ``--model-family sigma`` (from either) the
    family's fixed flags are added where absent."""
    argv = list(argv)
    name = _flag_value(argv, "--sigma-preset")
    if name is not None:
        argv = preset_argv(load_preset(name)) + argv
    if _flag_value(argv, "--model-family") == "sigma":
        for flag, value in FAMILY_FLAGS:
            if not _has(argv, flag):
                argv += [flag] + ([value] if value is not None else [])
    return argv
