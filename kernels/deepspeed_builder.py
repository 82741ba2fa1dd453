"""DeepSpeed's ``cpu_adam`` op builder with its question about the CPU answered once per machine.

Every load of DeepSpeed's ``cpu_adam`` op (built or not) computes the compiler flags first, so
that ``torch.utils.cpp_extension`` can tell whether the build it has is for these flags:
``CPUOpBuilder.cxx_args`` asks ``cpu_arch()`` and ``simd_width()``, and each asks py-cpuinfo's
``get_cpu_info()``, which starts a Python interpreter (``python cpuinfo.py --json``, to survive a
crashing CPUID) that starts a process of its own: about 1.2 s each on an idle core, twice per
process, so every training rank with STEM's host tables (the dense CPU optimizer) paid ~2.5 s of
its start-up for an answer that only changes with the machine (docs/cpu_backend.md, "What a
launch pays before its first step").

:func:`builder` extends the builder DeepSpeed's accelerator gives (the same ``CPUAdamBuilder`` on
a GPU machine and on a CPU-only one) so that DeepSpeed's own two answers are computed once per
machine and kept beside the builds (``_build_dir.build_root()``), in a file keyed by the CPU's
signature and the versions of DeepSpeed and py-cpuinfo that gave them; a process reads them
once. The flags, and so the built op and torch's check of it, are DeepSpeed's own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Dict, Optional

from megatron_ext_kernels._build_dir import build_root, cpu_signature

QUESTIONS = ("cpu_arch", "simd_width")  # the builder's methods that ask py-cpuinfo
_LOCK = threading.Lock()
_ANSWERS: Dict[str, Dict[str, str]] = {}  # answers file -> its answers, read once per process


@functools.lru_cache(maxsize=None)  # installed packages do not change under a running process
def _versions() -> str:
    found = []
    for name in ("deepspeed", "py-cpuinfo"):
        try:
            found.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            found.append(f"{name}=none")
    return ",".join(found)


def answers_path(root: Optional[str] = None, cpu: Optional[str] = None,
                 versions: Optional[str] = None) -> str:
    """The file of DeepSpeed's answers for this CPU, beside the builds."""
    key = "\0".join((cpu_signature() if cpu is None else cpu,
                     _versions() if versions is None else versions))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(build_root() if root is None else root,
                        f"deepspeed-cpu-flags-{digest}.json")


def _read(path: str) -> Optional[Dict[str, str]]:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(found, dict) and all(isinstance(found.get(q), str) for q in QUESTIONS)
    return found if ok else None


def cpu_answers(ask: Callable[[], Dict[str, str]], path: Optional[str] = None) -> Dict[str, str]:
    """DeepSpeed's answers (``ask()``: ``{"cpu_arch": ..., "simd_width": ...}``) from memory, from
    ``path`` (written by an earlier process on this machine), or asked now and written there
    (to a temporary name, then renamed: ranks starting together may both ask, and a reader sees
    a whole file or none)."""
    path = answers_path() if path is None else path
    with _LOCK:
        found = _ANSWERS.get(path) or _read(path)
        if found is None:
            asked = ask()
            found = {q: asked[q] for q in QUESTIONS}
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(tmp, "w") as f:
                    json.dump(found, f)
                os.replace(tmp, path)
            except OSError:  # a folder we cannot write: this process keeps them in memory
                pass
        _ANSWERS[path] = found
        return dict(found)


@functools.lru_cache(maxsize=None)
def _answering_once(base: type) -> type:
    """``base`` (a DeepSpeed op builder class) whose CPU questions are answered by
    :func:`cpu_answers`, DeepSpeed's own methods asking only where no answer is kept."""

    class AnsweredOnce(base):  # extends deepspeed.ops.op_builder's CPUAdamBuilder
        def _answers(self) -> Dict[str, str]:
            return cpu_answers(lambda: {"cpu_arch": base.cpu_arch(self),
                                        "simd_width": base.simd_width(self)})

        def cpu_arch(self):
            return self._answers()["cpu_arch"]

        def simd_width(self):
            return self._answers()["simd_width"]

    AnsweredOnce.__name__ = AnsweredOnce.__qualname__ = base.__name__
    return AnsweredOnce


def builder():
    """A builder of DeepSpeed's ``cpu_adam`` op (``.load()`` loads or builds it), as DeepSpeed's
    accelerator chooses it, asking py-cpuinfo only where this machine has no kept answer."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    return _answering_once(CPUAdamBuilder)()
