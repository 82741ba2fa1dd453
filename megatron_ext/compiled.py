"""``torch.compile`` of the families' small-op regions (issue 50, capability 2).

The families' extra GPU time is largely many small kernels between their GEMMs
(``benchmarks/routed_ops.py``: StructMoE's dense-masked routed path 22 forward / 35 backward
kernels per layer against the dense MLP's 3 / 10; Sigma's router 16 / 15; STEM's lookup-and-gate
a gather, a cast, a SiLU and a product). Each family wraps such a region in a pure tensor
function and, with its ``--<family>-compile`` flag, runs it through :func:`compile_region`:
Inductor fuses the elementwise ops and reductions of the forward and of its backward into a few
kernels. What must stay eager stays outside the regions: autograd Functions with side effects
(STEM's row-sparse ``TableLookup``, upstream's ``MoEAuxLossAutoScaler`` and
``router_gating_linear``), the metrics tracker's records, host counters.

The regions are compiled with ``fullgraph=True`` (a graph break raises instead of silently
splitting the region) and ``dynamic=False`` (the shapes of a training are fixed; a new shape, such
as an evaluation batch or a changed top-k, compiles once more).
"""

from __future__ import annotations

import shutil
from typing import Callable, Optional

import torch

# The value of every family's compile flag that leaves its regions eager.
NONE = "none"


def compile_region(fn: Callable) -> Callable:
    """``fn`` compiled by Inductor, whole (a graph break is an error) and for fixed shapes."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


def unavailable(flag: str, on_gpu: Optional[bool] = None) -> Optional[str]:
    """Why ``flag`` (a family's compile flag, set to compile) cannot work on this machine, as the
    one line to refuse it with; None where it can. ``on_gpu``: where the model will run (default:
    on a GPU when CUDA is available)."""
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    fix = f"pass {flag} none"
    if not torch._dynamo.is_dynamo_supported():
        return (f"{flag}: torch.compile is not supported by this Python/PyTorch "
                f"(torch {torch.__version__}); {fix}")
    if on_gpu:
        try:
            import triton  # noqa: F401  (Inductor's GPU code is Triton)
        except ImportError:
            return f"{flag}: torch.compile on a GPU needs Triton, which is not installed; {fix}"
    elif not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return (f"{flag}: torch.compile on the CPU needs a C++ compiler (g++, c++ or clang++ on "
                f"PATH); {fix}")
    return None


def check_available(flag: str, on_gpu: Optional[bool] = None) -> None:
    """Refuse ``flag`` with one line where :func:`unavailable` says it cannot work."""
    reason = unavailable(flag, on_gpu)
    if reason is not None:
        raise ValueError(reason)
