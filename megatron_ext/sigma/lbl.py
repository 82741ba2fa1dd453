"""The two load-balancing losses of the Sigma-MoE-Tiny report on global-batch statistics.

Global-batch LBL (Eq. 1), ``f_i`` and ``P_i`` over every token of one global batch (all
micro-batches, all data-parallel ranks, all TP/CP shards of the sequence)::

    LBL = N_E sum_i f_i P_i,   f_i = c_i / (k T),   P_i = (1/T) sum_x softmax(logits_x)_i

Top-1 LBL (Eqs. 2-4), temperature ``tau``::

    LBL_top1 = N_E sum_i fhat_i^2 / pbar,   fhat_i = (1/T) sum_x q_xi,
    pbar = (1/T) sum_x max_i q_xi,          q_x = softmax(logits_x / tau)

Gradient. Both losses depend on statistics of the whole global batch, which are known only after
the last micro-batch, while each micro-batch's backward runs right after its forward. The router
therefore takes the gradient of the loss's first-order expansion around the statistics of the
*previous* global batch (``Coefficients``): per token the gradient weights are

    global:  dLBL/dP_i = N_E f'_i              (f is not differentiable; Eq. 1 treats it as a constant)
    top1:    dLBL/dfhat_i = 2 N_E fhat'_i / pbar',   dLBL/dpbar = -N_E |fhat'|^2 / pbar'^2

with ``'`` marking the previous global batch. These weights are the same for every micro-batch and
rank of a step, so the gradient does not depend on DP size, micro-batch count, TP, CP or EP; when
the previous batch's statistics equal this batch's it is exactly the gradient of Eq. 1 / Eqs. 2-4.
Before any statistics exist (the first step of a run) the weights are zero. The *values* logged
are Eq. 1 and Eqs. 2-4 of the finished global batch, exactly.

Everything here is plain tensor maths (the router and the tests share it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Layout of the per-layer accumulator: counts, P sums, q sums (N_E each), then sum of max q and T.
ACC_FIELDS = ("counts", "prob_sums", "q_sums", "qmax_sum", "tokens")


def acc_size(num_experts: int) -> int:
    return 3 * num_experts + 2


@dataclass
class BatchStats:
    """Fractions of one global batch: f (routing slots), P (mean softmax), fhat and pbar (mean
    temperature softmax and its mean maximum), and the token count T."""

    f: torch.Tensor
    p: torch.Tensor
    fhat: torch.Tensor
    pbar: torch.Tensor
    tokens: torch.Tensor  # 0-d; kept on the device (no host synchronization per step)
    topk: int

    @classmethod
    def from_acc(cls, acc: torch.Tensor, num_experts: int, topk: int) -> "BatchStats":
        e = num_experts
        tokens = acc[3 * e + 1]
        t = tokens.clamp(min=1.0)
        return cls(f=acc[:e] / (topk * t), p=acc[e:2 * e] / t, fhat=acc[2 * e:3 * e] / t,
                   pbar=acc[3 * e] / t, tokens=tokens, topk=topk)

    @property
    def num_experts(self) -> int:
        return self.f.numel()

    def global_lbl(self) -> float:
        return float(global_lbl(self.f, self.p))

    def top1_lbl(self) -> float:
        return float(top1_lbl(self.fhat, self.pbar)) if float(self.pbar) > 0 else 0.0

    def load_deviation(self):
        """Relative deviation from uniform allocation of the max- and min-loaded expert
        (Fig. 2a of the report): ``(c - c_uniform) / c_uniform`` with ``c_uniform = k T / N_E``,
        i.e. ``N_E f - 1``."""
        dev = self.num_experts * self.f - 1.0
        return float(dev.max()), float(dev.min())

    @staticmethod
    def cv(x: torch.Tensor) -> float:
        """Coefficient of variation across experts (std / mean; 0 when uniform)."""
        mean = x.mean()
        return float(x.std(unbiased=False) / mean) if float(mean) > 0 else 0.0


def global_lbl(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Eq. 1."""
    return f.numel() * torch.sum(f * p)


def top1_lbl(fhat: torch.Tensor, pbar: torch.Tensor) -> torch.Tensor:
    """Eq. 2 (``fhat`` from Eq. 3, ``pbar`` from Eq. 4)."""
    return fhat.numel() * torch.sum(fhat * fhat) / pbar


@dataclass
class Coefficients:
    """Gradient weights of the LBL with respect to the per-token statistics (see module doc)."""

    w_p: torch.Tensor  # global LBL: weight of P_i
    w_fhat: torch.Tensor  # top-1 LBL: weight of fhat_i
    w_pbar: torch.Tensor  # top-1 LBL: weight of pbar (a 0-d tensor)


def coefficients(prev_f: torch.Tensor, prev_fhat: torch.Tensor,
                 prev_pbar: torch.Tensor) -> Coefficients:
    """Tensor ops only (no host synchronization): zero weights while ``prev_pbar`` is 0, i.e.
    before any statistics exist."""
    n = prev_f.numel()
    pbar = prev_pbar.reshape(())
    have = pbar > 0
    safe = torch.where(have, pbar, torch.ones_like(pbar))
    w_fhat = torch.where(have, 2.0 * n * prev_fhat / safe, torch.zeros_like(prev_fhat))
    w_pbar = torch.where(have, -n * torch.sum(prev_fhat * prev_fhat) / (safe * safe),
                         torch.zeros_like(pbar))
    return Coefficients(w_p=n * prev_f, w_fhat=w_fhat, w_pbar=w_pbar)
