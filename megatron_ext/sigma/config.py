"""Sigma MoE options (``--sigma-*`` flags map 1:1 onto these fields) and layout validation.

The expert shape and the target sparsity are Megatron's own MoE flags (``--num-experts``,
``--moe-ffn-hidden-size``, ``--moe-router-topk``, ``--expert-model-parallel-size``); they are
copied here so that one ``__post_init__`` can refuse a layout that cannot work with a message
naming the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

LBLS = ("global", "top1", "none")
# --sigma-compile: none (eager), router (upstream's routing and the statistics compiled; router.py).
COMPILE_CHOICES = ("none", "router")


def parse_topk_schedule(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``"[8,8,6,6,4,4,2,2]"`` (or ``"8,8,6,6"``) -> ``(8, 8, 6, 6, ...)``; None/empty -> None."""
    if text is None or not text.strip():
        return None
    body = text.strip()
    if not body.startswith("["):
        body = f"[{body}]"
    try:
        values = json.loads(body)
    except json.JSONDecodeError:
        raise ValueError(f"--sigma-topk-schedule={text!r}: expected a list of integers such as "
                         "\"[8,8,6,6,4,4,2,2]\"") from None
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"--sigma-topk-schedule={text!r}: expected a non-empty list of integers "
                         "such as \"[8,8,6,6,4,4,2,2]\"")
    return tuple(values)


def parse_sparsify_at(text: Optional[str]) -> Optional[Union[int, float]]:
    """A fraction of training (``0.9``: a number with a decimal point, in (0, 1]) or a step
    (``1000``: an integer >= 0)."""
    if text is None:
        return None
    text = str(text).strip()
    try:
        if any(c in text for c in ".eE"):
            value = float(text)
            if not 0.0 < value <= 1.0:
                raise ValueError
            return value
        value = int(text)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise ValueError(f"--sigma-sparsify-at={text!r}: expected a fraction of training in "
                         "(0, 1] such as 0.9, or a step >= 0 such as 1000") from None


@dataclass
class SigmaConfig:
    """Options of the Sigma MoE family."""

    num_layers: int
    num_experts: int  # --num-experts
    topk: int  # --moe-router-topk: the target top-k of every layer
    ep_size: int = 1  # --expert-model-parallel-size
    lbl: str = "global"
    lbl_coeff: float = 1e-3
    top1_temperature: float = 1.0
    topk_schedule: Optional[Tuple[int, ...]] = None  # top-k of the first layers before the switch
    sparsify_at: Optional[Union[int, float]] = None  # fraction of training (float) or step (int)
    compile: str = "none"

    def __post_init__(self) -> None:
        if self.num_experts is None or self.num_experts < 1:
            raise ValueError(f"--num-experts={self.num_experts}: the Sigma family needs >= 1 "
                             "experts in every layer")
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(f"--num-experts={self.num_experts} is not divisible by "
                             f"--expert-model-parallel-size={self.ep_size}: every expert-parallel "
                             "rank must hold the same number of experts")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk={self.topk}: must be in 1..{self.num_experts} "
                             "(--num-experts)")
        if self.lbl not in LBLS:
            raise ValueError(f"--sigma-lbl={self.lbl!r}: allowed {', '.join(LBLS)}")
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"--sigma-compile={self.compile!r}: allowed "
                             f"{', '.join(COMPILE_CHOICES)}")
        if self.lbl_coeff < 0:
            raise ValueError(f"--sigma-lbl-coeff={self.lbl_coeff}: must be >= 0")
        if not self.top1_temperature > 0:
            raise ValueError(f"--sigma-top1-lbl-temperature={self.top1_temperature}: must be > 0")
        if self.topk_schedule is not None:
            self.topk_schedule = tuple(self.topk_schedule)
            if len(self.topk_schedule) > self.num_layers:
                raise ValueError(f"--sigma-topk-schedule has {len(self.topk_schedule)} entries "
                                 f"but the model has {self.num_layers} layers (--num-layers; on "
                                 "the hybrid path the E symbols of --hybrid-layer-pattern)")
            for i, k in enumerate(self.topk_schedule):
                if not 1 <= k <= self.num_experts:
                    raise ValueError(f"--sigma-topk-schedule entry {i} (layer {i}) is {k}: must "
                                     f"be in 1..{self.num_experts} (--num-experts)")
            if self.sparsify_at is None:
                raise ValueError("--sigma-topk-schedule needs --sigma-sparsify-at (a fraction of "
                                 "training such as 0.9, or a step) to say when every layer "
                                 "switches to --moe-router-topk")
        elif self.sparsify_at is not None:
            raise ValueError("--sigma-sparsify-at without --sigma-topk-schedule: there is nothing "
                             "to switch")

    def initial_topks(self) -> Tuple[int, ...]:
        """Top-k of every layer before the switch (the schedule, then the target)."""
        head = tuple(self.topk_schedule or ())
        return head + (self.topk,) * (self.num_layers - len(head))

    def target_topks(self) -> Tuple[int, ...]:
        return (self.topk,) * self.num_layers

    def switch_iteration(self, train_iters: Optional[int]) -> Optional[int]:
        """Completed iterations after which every layer uses the target top-k: steps 1..S run
        the schedule, steps S+1.. the target. None: no schedule."""
        if self.topk_schedule is None:
            return None
        if isinstance(self.sparsify_at, float):
            if not train_iters:
                raise ValueError(f"--sigma-sparsify-at={self.sparsify_at} is a fraction of "
                                 "training: it needs --train-iters (or give a step)")
            return int(round(self.sparsify_at * train_iters))
        return int(self.sparsify_at)

    def topks_at(self, completed_iterations: int, train_iters: Optional[int]) -> Sequence[int]:
        switch = self.switch_iteration(train_iters)
        if switch is None or completed_iterations >= switch:
            return self.target_topks()
        return self.initial_topks()
