"""Which of torch's AdamW implementations Megatron's optimizer runs without Transformer Engine and
Apex (``--ext-adam-impl``).

Extends ``megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups``: without TE's
or Apex's ``FusedAdam`` it builds ``torch.optim.AdamW`` (``USING_PYTORCH_OPTIMIZER``) with torch's
default implementation, which on CUDA is the foreach one: about ten multi-tensor operations per
step, each a pass over the parameters or states with its own launches and temporaries. torch's
fused implementation reads each parameter, gradient and state once per step. Megatron-Core has no
option for it, so the choice is made on the optimizer upstream built (the trainer's optimizer
hook, ``family_hooks``), by the same switch torch's constructor sets (``fused`` in every param
group) after the same checks.

The numbers: torch's fused and foreach AdamW compute the same update in fp32 with the operations
in another order, so they agree to fp32 rounding, not bit for bit (``tests/test_adam_impl.py``).
A resume keeps the choice's step counters where its kernel reads them (``compat/upstream_fixes.py``).
"""

from __future__ import annotations

from typing import Iterator, List

import torch
from megatron.core import optimizer as megatron_optimizer

CHOICES = ("auto", "foreach", "fused")


def torch_adams(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch Adam/AdamW optimizers inside Megatron's wrappers (``ChainedOptimizer``'s
    ``chained_optimizers``, each ``MegatronOptimizer``'s ``optimizer``)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        yield optimizer
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained:
        # ChainedOptimizer's own ``optimizer`` property asserts when it chains several (expert
        # parallelism gives the experts an optimizer of their own).
        for inner in chained:
            yield from torch_adams(inner)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from torch_adams(inner)


def _params(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _fused_supported(opt: torch.optim.Optimizer) -> str:
    """Why torch's fused kernel cannot run this optimizer ('' when it can), asked of torch's own
    constructor on one tensor per device and dtype of its parameters."""
    for group in opt.param_groups:
        if "fused" not in group:
            return f"{type(opt).__name__} of this torch has no fused implementation"
        if group.get("differentiable"):
            return "a differentiable optimizer"
    for device, dtype in {(p.device, p.dtype) for p in _params(opt)}:
        try:
            type(opt)([torch.zeros(1, device=device, dtype=dtype)], fused=True)
        except (RuntimeError, ValueError) as e:
            return f"parameters of {dtype} on {device}: {e}"
    return ""


def _beside_fused_adam(choice: str) -> ValueError:
    return ValueError(f"--ext-adam-impl {choice}: Megatron runs Transformer Engine's or Apex's "
                      "FusedAdam here; the flag chooses among torch's AdamW implementations, "
                      "used only without both")


def check_args(args) -> None:
    """Before anything is built: a choice this setup cannot honour, in one line."""
    choice = getattr(args, "ext_adam_impl", "auto")
    if choice == "auto":
        return
    if not megatron_optimizer.USING_PYTORCH_OPTIMIZER:
        raise _beside_fused_adam(choice)
    if getattr(args, "optimizer", "adam") != "adam" or getattr(args, "optimizer_cpu_offload",
                                                                 False):
        raise ValueError(f"--ext-adam-impl {choice}: for Megatron's GPU Adam (--optimizer adam "
                         "without --optimizer-cpu-offload)")


def select(optimizer, choice: str) -> str:
    """Put ``choice`` in place on every torch Adam inside ``optimizer``; returns the line that
    says what runs (empty where ``auto`` leaves upstream's optimizer as it is: TE's or Apex's
    FusedAdam, or torch's default off the GPU)."""
    if choice not in CHOICES:
        raise ValueError(f"--ext-adam-impl {choice}: choose one of {', '.join(CHOICES)}")
    if not megatron_optimizer.USING_PYTORCH_OPTIMIZER:
        if choice != "auto":
            raise _beside_fused_adam(choice)
        return ""
    adams = list(torch_adams(optimizer))
    if not adams:
        if choice == "fused":
            raise ValueError("--ext-adam-impl fused: the optimizer Megatron built has no torch "
                             "Adam in it (--optimizer adam)")
        return ""
    if choice == "foreach":
        return f"megatron-ext: torch AdamW, torch's default implementation (--ext-adam-impl {choice})"
    if choice == "auto" and not all(p.is_cuda for opt in adams for p in _params(opt)):
        return ""  # off the GPU: Megatron's optimizer as upstream builds it, nothing to say
    for opt in adams:
        why = _fused_supported(opt)
        if why:
            raise ValueError(f"--ext-adam-impl {choice}: torch's fused AdamW cannot run here "
                             f"({why}); use --ext-adam-impl foreach")
    for opt in adams:
        # What torch's constructor does for fused=True (torch/optim/adam.py): the switch in the
        # defaults and in each group, and the step's support of a grad scaler's found_inf.
        opt.defaults["fused"] = True
        for group in opt.param_groups:
            group["fused"] = True
            if group.get("foreach"):
                group["foreach"] = False
        opt._step_supports_amp_scaling = True
    return f"megatron-ext: torch AdamW, fused (--ext-adam-impl {choice})"
