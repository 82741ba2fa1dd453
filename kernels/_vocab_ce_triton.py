"""Triton kernels of the fused vocab-parallel cross entropy (``kernels/vocab_ce.py`` holds the API
and says what they compute; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run them). One program per row of logits, walking its vocabulary shard in blocks of ``BLOCK``
columns; all arithmetic in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_ext_kernels._stem_gate_triton import _rounded  # bf16 rounding, same compiled and interpreted


@triton.jit
def ce_forward(logits, stride, target, row_max, row_sum, target_logit, n_cols, vocab_start,
               BLOCK: tl.constexpr):
    """Per row: the shard's max ``m``, ``sum(exp(x - m))`` (online: rescaled when the max grows)
    and the target's logit where the target falls in this shard (0 elsewhere)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    t = tl.load(target + row).to(tl.int64) - vocab_start
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    xt = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        xt += tl.sum(tl.where(cols == t, x, 0.0), axis=0)
    tl.store(row_max + row, m)
    tl.store(row_sum + row, s)
    tl.store(target_logit + row, xt)


@triton.jit
def ce_backward(logits, stride, grad, grad_stride, target, lse, grad_loss, n_cols, vocab_start,
                BLOCK: tl.constexpr):
    """Per row: ``(exp(x - lse) - [column is the target]) * grad_loss`` in the gradient's dtype."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    out = grad + row * grad_stride
    t = tl.load(target + row).to(tl.int64) - vocab_start
    row_lse = tl.load(lse + row)
    g = tl.load(grad_loss + row).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.exp(x - row_lse) - tl.where(cols == t, 1.0, 0.0)
        tl.store(out + cols, _rounded(p * g, out.dtype.element_ty), mask=inside)
