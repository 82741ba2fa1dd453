"""Does a load-balancing loss balance a router it alone trains? Exact gradient vs ours.

    .venv/bin/python benchmarks/sigma_lbl_toy.py          # about a minute on one CPU core

A router ``W [E, H]`` (8 experts) sees batches of 1024 tokens drawn from 4 clusters of unequal
weight (a skewed corpus) and is trained by Adam on the load-balancing loss alone (no LM loss), for
the global-batch LBL (Eq. 1) and the Top-1 LBL (Eqs. 2-4) of the Sigma-MoE-Tiny report, each with:

* ``exact``: autograd through the loss of the current batch (Eq. 1 treats f as a constant);
* ``previous``: what ``megatron_ext.sigma.router`` does to keep the gradient independent of DP,
  micro-batches, TP and EP: the loss linearised at the previous batch's statistics
  (``megatron_ext.sigma.lbl.coefficients``).

Printed: the coefficient of variation of the hard top-1 fractions f (0 = balanced), averaged over
the last 100 of 600 steps, from a router initialised near uniform (std 0.002, every expert's
probability about 1/E, as a freshly initialised model) and from a sharper one (std 0.5).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.sigma.lbl import coefficients  # noqa: E402


def train(loss: str, tau: float, grad: str, lr: float, init: float, steps: int = 600,
          experts: int = 8, hidden: int = 32, tokens: int = 1024, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, hidden, generator=g) * 2
    weights = torch.tensor([0.5, 0.25, 0.15, 0.1])
    w = (torch.randn(experts, hidden, generator=g) * init).requires_grad_()
    opt = torch.optim.Adam([w], lr=lr)
    prev = None
    cvs = []
    for step in range(steps):
        x = centers[torch.multinomial(weights, tokens, replacement=True, generator=g)]
        x = x + torch.randn(tokens, hidden, generator=g)
        logits = x @ w.t()
        p = logits.softmax(-1)
        f = torch.bincount(p.argmax(-1), minlength=experts).float() / tokens
        q = (logits / tau).softmax(-1)
        fhat, pbar = q.mean(0), q.max(-1).values.mean()
        if grad == "exact":
            value = experts * (f * p.mean(0)).sum() if loss == "global" \
                else experts * (fhat ** 2).sum() / pbar
        elif prev is None:  # no statistics yet: zero weights, as in the router's first step
            value = 0.0 * logits.sum()
        else:
            c = coefficients(prev[0], prev[1], prev[2])
            value = (c.w_p * p.mean(0)).sum() if loss == "global" \
                else (c.w_fhat * fhat).sum() + c.w_pbar * pbar
        opt.zero_grad()
        value.backward()
        opt.step()
        prev = (f, fhat.detach(), pbar.detach().reshape(1))
        if step >= steps - 100:
            cvs.append(float(f.std(unbiased=False) / f.mean()))
    return sum(cvs) / len(cvs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    torch.set_num_threads(1)
    runs = [("global", 1.0), ("top1", 1.0), ("top1", 0.1)]
    header = " | ".join(f"{name} tau={tau:g} {grad}" for name, tau in runs
                        for grad in ("exact", "previous"))
    print("CV(f), mean of the last 100 of 600 steps (0 = balanced; no LBL at init: see row)\n")
    print(f"| router init, lr | {header} |\n|" + " --- |" * (1 + 2 * len(runs)))
    for init, lr in ((0.002, 1e-2), (0.002, 1e-3), (0.5, 1e-3)):
        cells = [f"{train(name, tau, grad, lr, init):.2f}" for name, tau in runs
                 for grad in ("exact", "previous")]
        print(f"| std {init:g}, lr {lr:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
