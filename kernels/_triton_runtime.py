"""What every Triton kernel module of the project needs around its kernels: whether they can run
here, their lazy import, and an offline GPU build that reports resource use without a GPU.

Kernel modules keep their ``@triton.jit`` functions in a module of their own, imported on first
use through :func:`kernels`: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run them), and importing the API module must work without Triton.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
from types import ModuleType
from typing import Dict, Mapping, Sequence

import torch


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Triton importable and a place to run it: a CUDA device, or Triton's interpreter on the CPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or interpreted()


def kernels(module: str) -> ModuleType:
    """The module ``megatron_ext_kernels.<module>`` holding jitted kernels (imported once)."""
    return importlib.import_module(f"megatron_ext_kernels.{module}")


def offline_build(fn, pointers: Mapping[str, str], ints: Sequence[str],
                  constexprs: Mapping[str, object], arch: int, options: Mapping[str, object],
                  aligned: Sequence[str] = (), floats: Sequence[str] = ()) -> Dict[str, int]:
    """Compile the jitted ``fn`` for ``sm_<arch>`` without a GPU and return its shared memory and
    per-thread registers and local memory (register spills), read with the ``cuobjdump`` Triton
    ships. ``pointers``: argument -> element type (``"bf16"``, ``"i64"``, ...); ``ints``: i32
    arguments, then ``floats`` fp32 ones (the signature in that order, as the kernel's
    arguments); pointers and the ``aligned`` ints get the 16-divisibility a launch specialises
    them with. Needs a process whose Triton was imported without ``TRITON_INTERPRET=1``."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    if interpreted():
        raise RuntimeError("offline_build needs Triton's compiler: unset TRITON_INTERPRET")
    signature = {**{p: "*" + t for p, t in pointers.items()}, **{i: "i32" for i in ints},
                 **{f: "fp32" for f in floats}, **{c: "constexpr" for c in constexprs}}
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if a in pointers or a in aligned}
    compiled = triton.compile(ASTSource(fn, signature, dict(constexprs), attrs),
                              target=GPUTarget("cuda", arch, 32), options=dict(options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    return dict(shared=compiled.metadata.shared,
                registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                local=int(re.search(r"STACK:(\d+)", usage).group(1)))
