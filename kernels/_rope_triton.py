"""Triton kernel of the fused rotary position embedding (``kernels/rope.py`` holds the API and says
what it computes; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run
it). A program per block of (position, sequence) rows and of heads; all arithmetic in fp32, the
result rounded once to the output's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_ext_kernels._stem_gate_triton import _rounded  # bf16 rounding, same compiled and interpreted


@triton.jit
def rope(x, out, freqs, rows, batch, heads, stride_xs, stride_xb, stride_xh, stride_fs,
         stride_fb, rot_dim, head_dim, mscale, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
         BLOCK_P: tl.constexpr, BLOCK_REST: tl.constexpr, INTERLEAVED: tl.constexpr,
         BACKWARD: tl.constexpr):
    """Each rotated pair of features ``(i, i + rot_dim / 2)`` (``INTERLEAVED``: ``(2i, 2i + 1)``),
    ``a`` and ``c``, of ``x[s, b, h, :]``, read once:
    forward ``a' = a cos(f_a) - c sin(f_a)``, ``c' = c cos(f_c) + a sin(f_c)`` (Megatron's
    ``t cos + _rotate_half(t) sin``); ``BACKWARD`` its transpose, ``a' = a cos(f_a) + c sin(f_c)``,
    ``c' = c cos(f_c) - a sin(f_a)``, with ``f`` the pair's two entries of
    ``freqs[s, b or 0, 0, :]`` and ``cos``/``sin`` times ``mscale``; the features past
    ``rot_dim`` copied. A program covers ``BLOCK_R`` consecutive ``(s, b)`` rows
    (``rows = s * batch``), ``BLOCK_H`` heads and ``BLOCK_P`` pairs (``BLOCK_REST`` copied
    features, 0 when none); ``out`` is contiguous ``[s, b, heads, head_dim]``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = r // batch
    b = r % batch
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_P)
    n_pairs = rot_dim // 2
    if INTERLEAVED:
        da = 2 * i
        dc = 2 * i + 1
    else:
        da = i
        dc = i + n_pairs
    inside = r < rows
    f = freqs + (s * stride_fs + b * stride_fb)[:, None]
    fmask = inside[:, None] & (i < n_pairs)[None, :]
    fa = tl.load(f + da[None, :], mask=fmask, other=0.0).to(tl.float32)
    fc = tl.load(f + dc[None, :], mask=fmask, other=0.0).to(tl.float32)
    cos_a = tl.cos(fa) * mscale
    cos_c = tl.cos(fc) * mscale
    if BACKWARD:
        sin_a = tl.sin(fc) * mscale
        sin_c = -(tl.sin(fa) * mscale)
    else:
        sin_a = -(tl.sin(fa) * mscale)
        sin_c = tl.sin(fc) * mscale
    src = x + (s * stride_xs + b * stride_xb)[:, None, None] \
        + (h.to(tl.int64) * stride_xh)[None, :, None]
    dst = out + ((r * heads)[:, None, None] + h.to(tl.int64)[None, :, None]) * head_dim
    mask = inside[:, None, None] & (h < heads)[None, :, None] & (i < n_pairs)[None, None, :]
    a = tl.load(src + da[None, None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(src + dc[None, None, :], mask=mask, other=0.0).to(tl.float32)
    a_out = a * cos_a[:, None, :] + c * sin_a[:, None, :]
    c_out = c * cos_c[:, None, :] + a * sin_c[:, None, :]
    tl.store(dst + da[None, None, :], _rounded(a_out, out.dtype.element_ty), mask=mask)
    tl.store(dst + dc[None, None, :], _rounded(c_out, out.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:
        j = rot_dim + tl.arange(0, BLOCK_REST)
        rest = inside[:, None, None] & (h < heads)[None, :, None] & (j < head_dim)[None, None, :]
        tl.store(dst + j[None, None, :], tl.load(src + j[None, None, :], mask=rest), mask=rest)
