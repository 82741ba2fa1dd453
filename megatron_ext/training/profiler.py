"""Every thread in Megatron's PyTorch-profiler trace (``--ext-profile-all-threads``).

Extends Megatron's ``--profile --use-pytorch-profiler`` (``megatron.training.training.train``
builds a ``torch.profiler.profile`` and exports ``torch_profile/rank-<r>.json.gz``). Upstream's
profiler records the CPU operators of the thread that started it only, so the work that managed
STEM tables do on their worker thread (``stem/runtime/worker.py``: the owners' row reads, the CPU table
step, the wait for the gradients' copy) is missing from the timeline, and so is what the GPU's
streams waited for. With the flag, the profiler Megatron builds gets PyTorch's experimental
``profile_all_threads`` (the operators and ``record_function`` ranges of every thread; the
tables' ranges are named ``stem/...``) and, with CUDA, ``enable_cuda_sync_events`` (stream waits
and synchronisations on the GPU timeline). ``megatron_ext.tools.trace_summary`` reads both.

Both are experimental in PyTorch ("backward compatibility is not guaranteed"): a PyTorch without
them stops the run at start-up with a message, rather than profiling less than asked.
"""

from __future__ import annotations

import torch
import torch.profiler


def experimental_config(cuda: bool):
    """PyTorch's ``_ExperimentalConfig`` for all threads (and CUDA's synchronisation events)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True,
                                                       enable_cuda_sync_events=cuda)
    except (AttributeError, TypeError) as exc:
        raise RuntimeError(
            f"--ext-profile-all-threads: this PyTorch ({torch.__version__}) has no profiler "
            f"option to record every thread ({exc}); drop the flag") from None


class _AllThreadsProfile(torch.profiler.profile):
    """``torch.profiler.profile`` with ``experimental_config`` defaulting to all threads."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("experimental_config") is None:
            kwargs["experimental_config"] = experimental_config(torch.cuda.is_available())
        super().__init__(*args, **kwargs)


_UPSTREAM = torch.profiler.profile


def install(args) -> bool:
    """With ``--ext-profile-all-threads`` (and Megatron's PyTorch profiler on), the profilers
    built from now on record every thread; without, upstream's (a process may train more than
    once: tests). Returns whether it installed the extension."""
    if not getattr(args, "ext_profile_all_threads", False):
        uninstall()
        return False
    if not (args.profile and args.use_pytorch_profiler):
        raise ValueError("--ext-profile-all-threads extends Megatron's PyTorch profiler: add "
                         "--profile --use-pytorch-profiler")
    experimental_config(torch.cuda.is_available())  # fails here, at start-up, if unsupported
    torch.profiler.profile = _AllThreadsProfile
    return True


def uninstall() -> None:
    """Back to upstream's profiler (tests, a second training in one process)."""
    torch.profiler.profile = _UPSTREAM
