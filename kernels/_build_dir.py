"""Where the package's just-in-time built CPU extensions go (``row_adam_cpu``'s kernels, a plain
C library compiled by ``row_adam_cpu._build``, and DeepSpeed's ``cpu_adam`` op, built through
``torch.utils.cpp_extension``).

torch keeps every JIT extension under one folder per name (``~/.cache/torch_extensions/
py312_cu130/<name>``) and rebuilds it in place whenever the sources or flags differ from the last
build there. Two things make that folder the wrong key here:

* the flags carry the virtualenv's paths (DeepSpeed's include folder), so two checkouts with their
  own virtualenvs on one machine rebuild each other's build at every switch (45-60 s for
  ``cpu_adam``);
* the row kernels are built for the CPU's instruction-set level (``row_adam_cpu.arch_flags``),
  so a home folder shared by nodes with different CPUs (NFS on a cluster, a login node that
  built first) must not hand a node a binary with instructions it lacks.

So, unless the user chose a folder (``TORCH_EXTENSIONS_DIR``), builds go under torch's default
root in a folder keyed by the interpreter's prefix, torch's version and the CPU (model and
instruction-set flags from ``/proc/cpuinfo``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
from typing import Iterator, Optional

import torch

_ENV = "TORCH_EXTENSIONS_DIR"
_LOCK = threading.Lock()


def cpu_signature(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first processor's model name and instruction-set flags (``platform`` where there is
    no ``/proc/cpuinfo``)."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # end of the first processor's block
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    fields[key] = value.strip()
    except OSError:
        pass
    if not fields:
        return f"{platform.machine()}|{platform.processor()}"
    return "|".join(f"{k}={fields[k]}" for k in sorted(fields))


def build_root(environ: Optional[dict] = None, prefix: Optional[str] = None,
               cpu: Optional[str] = None) -> str:
    """The folder the extensions' build folders go in: the user's ``TORCH_EXTENSIONS_DIR`` when
    set, else one under torch's default root keyed by interpreter prefix, torch version and
    CPU."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(_ENV)
    if chosen:
        return chosen
    from torch.utils.cpp_extension import get_default_build_root

    key = "\0".join((os.path.realpath(sys.prefix if prefix is None else prefix),
                     torch.__version__, cpu_signature() if cpu is None else cpu))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(get_default_build_root(), f"megatron_ext-{digest}")


@contextlib.contextmanager
def build_environment() -> Iterator[str]:
    """Run a ``torch.utils.cpp_extension`` load with ``TORCH_EXTENSIONS_DIR`` set to
    ``build_root()``; the variable is restored afterwards. Serialised: the variable is
    process-wide."""
    with _LOCK:
        before = os.environ.get(_ENV)
        root = build_root()
        os.makedirs(root, exist_ok=True)
        os.environ[_ENV] = root
        try:
            yield root
        finally:
            if before is None:
                os.environ.pop(_ENV, None)
            else:
                os.environ[_ENV] = before
