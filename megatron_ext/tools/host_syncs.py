"""Find host synchronisations and count ops without a GPU: a recorder for a forward or backward.

On CUDA some ops make the host wait for the device: a value read on the host (``.item()``,
``bool(t)``, ``if t:``, ``.tolist()``, a copy to the CPU) or an output whose shape depends on the
data (``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without
``output_size``, ``bincount``, which reads the largest index to size its output). On the CPU the
same ops run without waiting, so a CPU test cannot see the wait; it can see the ops. ``Recorder``
is a ``TorchDispatchMode`` (every aten op, forward and backward, after autograd) joined with a
``TorchFunctionMode`` (the tensor methods that copy to the host without an aten op on the CPU:
``tolist``, ``numpy``, ``cpu``): inside ``with Recorder() as rec:`` it lists each such op with
the project line that called it (``rec.syncs``) and counts every aten op (``rec.counts``), so a
GPU profile's kernel list can be set against the op list of the same code.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the real check; this is the CPU's.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that wait for the device on CUDA whatever their arguments, with why.
ALWAYS = {
    aten._local_scalar_dense.default: "reads a value on the host (.item(), bool(), int(), "
                                      "float(), a Python if on a tensor)",
    aten.nonzero.default: "nonzero: output shape depends on the data",
    aten.masked_select.default: "masked_select: output shape depends on the data",
    aten.bincount.default: "bincount: reads the largest index on the host to size its output",
    aten._unique.default: "unique: output shape depends on the data",
    aten._unique2.default: "unique: output shape depends on the data",
    aten.unique_dim.default: "unique: output shape depends on the data",
    aten.unique_consecutive.default: "unique_consecutive: output shape depends on the data",
    aten.equal.default: "equal: returns a Python bool",
    aten.is_nonzero.default: "is_nonzero: returns a Python bool",
}

# Ops that return a new tensor object over the same memory without being marked as views.
METADATA = {aten._unsafe_view.default, aten.lift_fresh.default}

# Tensor methods that copy to the host; on CPU tensors they run no aten op at all.
HOST_COPIES = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy",
               torch.Tensor.cpu: "cpu"}

_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROJECT = (os.path.join(_HERE, "megatron_ext") + os.sep, os.path.join(_HERE, "kernels") + os.sep)


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices or ())


def sync_reason(func, args, kwargs) -> Optional[str]:
    """Why ``func(*args, **kwargs)`` would make the host wait on CUDA, or None."""
    if func in ALWAYS:
        return ALWAYS[func]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size: output shape depends on the data"
    if func is aten.index.Tensor and _bool_index(args[1]):
        return "boolean-mask indexing: output shape depends on the data"
    if func in (aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default) and _bool_index(args[1]):
        return "boolean-mask assignment: nonzero of the mask"
    if func is aten.histc.default:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if lo == hi:
            return "histc with min == max: reads the data's range on the host"
    if func in (aten._to_copy.default, aten.copy_.default):
        dst = kwargs.get("device") if func is aten._to_copy.default else args[0].device
        src = args[0].device if func is aten._to_copy.default else args[1].device
        if dst is not None and torch.device(dst).type == "cpu" and src.type != "cpu":
            return "copy to the host"
    return None


def _caller() -> str:
    """The innermost frame in this project's code (megatron_ext/, kernels/), else the innermost
    frame outside torch: where to look."""
    # Torch-function modes (this recorder's, the CPU backend's in compat/cpu.py) only pass the
    # call on: the caller is the frame below them.
    frames = [f for f in traceback.extract_stack()[:-3]
              if f.name not in ("__torch_function__", "__torch_dispatch__")]
    for frame in reversed(frames):
        if frame.filename.startswith(_PROJECT) and not frame.filename.endswith("host_syncs.py"):
            return f"{os.path.relpath(frame.filename, _HERE)}:{frame.lineno} ({frame.name})"
    for frame in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


@dataclass(frozen=True)
class Sync:
    op: str
    reason: str
    where: str

    def __str__(self) -> str:
        return f"{self.op}: {self.reason} at {self.where}"


class _Dispatch(TorchDispatchMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        rec.counts[func.name()] += 1
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            rec.syncs.append(Sync(func.name(), reason, _caller()))
        out = func(*args, **kwargs)
        if not (func.is_view or func in METADATA):
            rec.kernels[func.name()] += 1
            if not func._schema.is_mutable:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        rec.new_tensors.append((func.name(), tuple(t.shape)))
        return out


class _Function(TorchFunctionMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = HOST_COPIES.get(func)
        if name is not None:
            self.recorder.syncs.append(Sync(f"Tensor.{name}", "copy to the host", _caller()))
        return func(*args, **(kwargs or {}))


class Recorder:
    """``with Recorder() as rec: ...``: ``rec.syncs`` (ops that would wait for a GPU, with the
    calling line), ``rec.counts`` (aten op name -> calls), ``rec.kernels`` (the same for the ops
    that compute: no views, no metadata ops; an in-place op counts, as it launches a kernel)
    and ``rec.new_tensors`` (``(op, shape)`` of every tensor those ops allocated; in-place ops
    allocate none) of what ran inside."""

    def __init__(self):
        self.syncs: list[Sync] = []
        self.counts: Counter = Counter()
        self.kernels: Counter = Counter()
        self.new_tensors: list[tuple[str, tuple]] = []
        self._modes = (_Function(self), _Dispatch(self))

    def __enter__(self) -> "Recorder":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def forward_backward(fn, *, grad_fn=None) -> tuple["Recorder", "Recorder"]:
    """Run ``out = fn()`` under one recorder and its backward (``grad_fn(out).backward()``, by
    default ``out.float().sum()``; a tuple's first element) under another: ``(fwd, bwd)``."""
    with Recorder() as fwd:
        out = fn()
    first = out[0] if isinstance(out, (tuple, list)) else out
    loss = grad_fn(out) if grad_fn is not None else first.float().sum()
    with Recorder() as bwd:
        loss.backward()
    return fwd, bwd


def cuda_syncs(fn) -> Optional[list[str]]:
    """Run ``fn()`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and return where each
    synchronisation CUDA reported was called from (``file:line``); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{os.path.relpath(w.filename, _HERE)}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message)]


def census(fn) -> dict:
    """One call of ``fn`` (a training step) recorded, then one under CUDA's sync check (on a
    GPU): ``kernels`` (computing aten ops launched), ``would_sync`` (what the recorder flags,
    with where), ``cuda_syncs`` (what CUDA reported, None on the CPU). For the benchmarks' JSON:
    the op count beside the GPU profile's kernel count, the syncs beside its idle gaps."""
    with Recorder() as rec:
        fn()
    return {"kernels": sum(rec.kernels.values()),
            "would_sync": [str(s) for s in rec.syncs], "cuda_syncs": cuda_syncs(fn)}
