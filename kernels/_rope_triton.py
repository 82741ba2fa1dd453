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
         BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr):
    """``out[s, b, h, :] = x[s, b, h, :] * cos + R x[s, b, h, :] * sin`` over the first
    ``rot_dim`` features (``R`` Megatron's ``_rotate_half``: halves, or even/odd pairs when
    ``INTERLEAVED``), the rest copied; with ``BACKWARD`` the transpose, ``x * cos + R^T (x * sin)``
    (the gradient of the forward). ``cos``/``sin`` of ``freqs[s, b or 0, 0, :]`` times ``mscale``.
    A program covers ``BLOCK_R`` consecutive ``(s, b)`` rows (``rows = s * batch``) and
    ``BLOCK_H`` heads; ``out`` is contiguous ``[s, b, heads, head_dim]``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = r // batch
    b = r % batch
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rotated = d < rot_dim
    if INTERLEAVED:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
    else:
        half = rot_dim // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
    partner = tl.where(rotated, partner, d)
    f = freqs + (s * stride_fs + b * stride_fb)[:, None]
    fmask = (r < rows)[:, None] & rotated[None, :]
    cos = tl.cos(tl.load(f + d[None, :], mask=fmask, other=0.0).to(tl.float32)) * mscale
    if BACKWARD:
        # (R^T y)[d] = y[partner] for a first feature, -y[partner] for a second: the sine is the
        # partner's (equal to d's for Megatron's frequencies, not assumed)
        sin = tl.sin(tl.load(f + partner[None, :], mask=fmask, other=0.0).to(tl.float32))
        sin = tl.where(first[None, :], sin, -sin) * mscale
    else:
        # (R x)[d] = -x[partner] for a first feature, x[partner] for a second
        sin = tl.sin(tl.load(f + d[None, :], mask=fmask, other=0.0).to(tl.float32))
        sin = tl.where(first[None, :], -sin, sin) * mscale
    mask = (r < rows)[:, None, None] & (h < heads)[None, :, None] & (d < head_dim)[None, None, :]
    src = x + (s * stride_xs + b * stride_xb)[:, None, None] \
        + (h.to(tl.int64) * stride_xh)[None, :, None]
    v = tl.load(src + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(src + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.where(rotated[None, None, :], v * cos[:, None, :] + w * sin[:, None, :], v)
    dst = out + ((r * heads)[:, None, None] + h.to(tl.int64)[None, :, None]) * head_dim \
        + d[None, None, :]
    tl.store(dst, _rounded(y, out.dtype.element_ty), mask=mask)
