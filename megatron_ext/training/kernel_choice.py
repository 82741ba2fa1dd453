"""The choice of a flag that swaps one of Megatron's unfused paths for a Triton kernel of this
project (``--ext-cross-entropy``, ``--ext-rope``): ``auto``, ``upstream`` or ``fused``, resolved
to the path a training runs, or refused in one line where the kernel cannot run here."""

from __future__ import annotations

from megatron_ext_kernels._triton_runtime import available

CHOICES = ("auto", "upstream", "fused")


def resolve(flag: str, choice: str) -> str:
    """``fused`` or ``upstream`` for ``flag``'s value (``auto`` is upstream's until a GPU run
    has measured the kernel); a choice this machine cannot run, in one line."""
    if choice not in CHOICES:
        raise ValueError(f"{flag} {choice}: choose one of {', '.join(CHOICES)}")
    if choice == "fused" and not available():
        raise ValueError(f"{flag} fused needs Triton and a CUDA device (or TRITON_INTERPRET=1 "
                         f"on the CPU); use {flag} upstream")
    return "fused" if choice == "fused" else "upstream"
