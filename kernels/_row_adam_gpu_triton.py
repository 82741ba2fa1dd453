"""Triton kernel of the GPU tier's sparse row step (``kernels/row_adam_gpu.py`` holds the API and
the plain-PyTorch reference; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run them).

One program per (layer, row, column block): the row's parameters and moments are read once from
the stacked shards at ``index[row]``, brought up to date (the sparse AdamW's catch-up, five fp32
factors per layer and row), stepped with the row's gradient (AdamW) and written back in place.
Each operation is written as PyTorch's CUDA kernel computes it, rounded where it rounds: the
catch-up's ops are separate kernels there (no contraction: the launch passes
``enable_fp_fusion=False``), ``add(alpha)``, ``addcmul`` and ``addcdiv`` are single expressions
that nvcc contracts to one FMA (``tl.fma`` here); square roots and divisions are IEEE-rounded
(``sqrt_rn``, ``div_rn``), as nvcc's defaults are, but a division by a Python scalar, which
PyTorch's CUDA kernel computes as a product with the scalar's fp32 reciprocal.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sparse_adamw_rows(p_ptr, m_ptr, v_ptr, g_ptr, index_ptr, f_ptr,
                      n_rows, width,
                      p_layer, p_row, m_layer, m_row, v_layer, v_row, g_layer, g_row,
                      f_kind, f_layer,
                      decay, beta1, alpha1, beta2, alpha2, inv_bc2_sqrt, eps, step_size,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    layer = pid // n_rows
    r = pid % n_rows
    row = tl.load(index_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    layer = layer.to(tl.int64)
    p_at = p_ptr + layer * p_layer + row * p_row + cols
    m_at = m_ptr + layer * m_layer + row * m_row + cols
    v_at = v_ptr + layer * v_layer + row * v_row + cols
    p = tl.load(p_at, mask=mask, other=0.0)
    m = tl.load(m_at, mask=mask, other=0.0)
    v = tl.load(v_at, mask=mask, other=0.0)
    g = tl.load(g_ptr + layer * g_layer + r * g_row + cols, mask=mask, other=0.0)
    f = f_ptr + layer * f_layer + r
    owed = tl.load(f)
    move = tl.load(f + f_kind)
    m_scale = tl.load(f + 2 * f_kind)
    v_scale = tl.load(f + 3 * f_kind)
    row_eps = tl.load(f + 4 * f_kind)
    # catch_up_rows: where(v > 0, m / (sqrt(v) + eps), 0); p * owed - move * ratio; m, v scaled
    ratio = tl.where(v > 0.0, tl.div_rn(m, tl.sqrt_rn(v) + row_eps), 0.0)
    p = p * owed - move * ratio
    m = m * m_scale
    v = v * v_scale
    # _torch_adamw: p *= 1 - lr wd; m = m b1 + (1 - b1) g; v = v b2 + (1 - b2) g g;
    # p += -lr/bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
    p = p * decay
    m = tl.fma(g, alpha1, m * beta1)
    v = tl.fma(alpha2 * g, g, v * beta2)
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps  # PyTorch's CUDA x / scalar is x * (1 / scalar)
    p = tl.fma(step_size, tl.div_rn(m, denom), p)
    tl.store(p_at, p, mask=mask)
    tl.store(m_at, m, mask=mask)
    tl.store(v_at, v, mask=mask)
