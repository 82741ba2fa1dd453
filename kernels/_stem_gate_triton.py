"""Triton kernels of the fused STEM lookup-and-gate (``kernels/stem_gate.py`` holds the API and the
plain-PyTorch reference; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run them).

Variants (``VARIANT``), with ``a`` the first ``F`` columns of ``linear_fc1``'s output, ``u`` the
second ``F`` columns (dagger only) and ``t = U[id]`` the token's table row::

    0  up      out = silu(a) * t
    1  gate    out = silu(t) * a
    2  dagger  out = silu(a) * (u + t)

All arithmetic is fp32; the row is first rounded to the output dtype, as the PyTorch path rounds
the looked-up row to the model's dtype before the product.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` to nearest, ties to even. For bf16 the rounding is done on
    the bits so that the result is the same compiled and under the interpreter (whose fp32 ->
    bf16 cast truncates); the cast that follows is then exact."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _silu_and_grad(z):
    s = tl.sigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s))


@triton.jit
def stem_gate_fwd(fc1_ptr, tab_ptr, idx_ptr, out_ptr, n_tokens, n_cols,
                  stride_fc1, stride_tab, stride_out,
                  VARIANT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """One program per (BLOCK_N tokens, BLOCK_F columns): gather the rows, apply the gate."""
    tokens = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    tmask = tokens < n_tokens
    mask = tmask[:, None] & (cols < n_cols)[None, :]
    ids = tl.load(idx_ptr + tokens, mask=tmask, other=0).to(tl.int64)
    t = tl.load(tab_ptr + ids[:, None] * stride_tab + cols[None, :], mask=mask, other=0.0)
    t = _rounded(t.to(tl.float32), out_ptr.dtype.element_ty).to(tl.float32)
    fc1 = fc1_ptr + tokens[:, None] * stride_fc1 + cols[None, :]
    a = tl.load(fc1, mask=mask, other=0.0).to(tl.float32)
    if VARIANT == 0:
        out = _silu_and_grad(a)[0] * t
    elif VARIANT == 1:
        out = _silu_and_grad(t)[0] * a
    else:
        u = tl.load(fc1 + n_cols, mask=mask, other=0.0).to(tl.float32)
        out = _silu_and_grad(a)[0] * (u + t)
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :],
             _rounded(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def stem_gate_bwd(grad_ptr, fc1_ptr, tab_ptr, order_ptr, sorted_ptr, starts_ptr,
                  dfc1_ptr, dst_ptr, n_tokens, n_cols,
                  stride_grad, stride_fc1, stride_tab, stride_dfc1, stride_dst,
                  VARIANT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    """Programs stride over the segments of equal ids in sorted order, for one block of BLOCK_F
    columns each: program ``p`` takes segments ``p, p + P, p + 2P, ...`` (``P`` programs along
    axis 0, a few per SM, so that the grid does not depend on the number of distinct ids, which
    only the device knows).

    Segment ``s`` covers sorted positions ``starts[s] .. starts[s+1]``; ``starts[s] == n_tokens``
    past the last distinct id. For each segment the program loads the table row once, walks the
    segment's tokens BLOCK_T at a time, writes each token's ``linear_fc1`` gradient, sums the row
    gradients of the segment in fp32 and adds the sum to ``dst[id]``. Every id has exactly one
    segment, so no two programs touch the same ``dst`` row: no atomics, and the summation order
    is fixed (bitwise reproducible)."""
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < n_cols
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    while start < n_tokens:
        end = tl.load(starts_ptr + seg + 1)
        row = tl.load(sorted_ptr + start).to(tl.int64)
        t = tl.load(tab_ptr + row * stride_tab + cols, mask=cmask, other=0.0)
        t = _rounded(t.to(tl.float32), grad_ptr.dtype.element_ty).to(tl.float32)[None, :]
        acc = tl.zeros([BLOCK_F], dtype=tl.float32)
        for first in range(start, end, BLOCK_T):
            pos = first + tl.arange(0, BLOCK_T)
            pmask = pos < end
            tokens = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
            mask = pmask[:, None] & cmask[None, :]
            go = tl.load(grad_ptr + tokens[:, None] * stride_grad + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            fc1 = fc1_ptr + tokens[:, None] * stride_fc1 + cols[None, :]
            dfc1 = dfc1_ptr + tokens[:, None] * stride_dfc1 + cols[None, :]
            a = tl.load(fc1, mask=mask, other=0.0).to(tl.float32)
            if VARIANT == 0:
                silu_a, dsilu_a = _silu_and_grad(a)
                tl.store(dfc1, _rounded(go * t * dsilu_a, dfc1_ptr.dtype.element_ty), mask=mask)
                rows = go * silu_a
            elif VARIANT == 1:
                silu_t, dsilu_t = _silu_and_grad(t)
                tl.store(dfc1, _rounded(go * silu_t, dfc1_ptr.dtype.element_ty), mask=mask)
                rows = go * a * dsilu_t
            else:
                u = tl.load(fc1 + n_cols, mask=mask, other=0.0).to(tl.float32)
                silu_a, dsilu_a = _silu_and_grad(a)
                tl.store(dfc1, _rounded(go * (u + t) * dsilu_a, dfc1_ptr.dtype.element_ty),
                         mask=mask)
                rows = go * silu_a
                tl.store(dfc1 + n_cols, _rounded(rows, dfc1_ptr.dtype.element_ty), mask=mask)
            acc += tl.sum(rows, axis=0)
        dst = dst_ptr + row * stride_dst + cols
        total = tl.load(dst, mask=cmask, other=0.0).to(tl.float32) + acc
        tl.store(dst, _rounded(total, dst_ptr.dtype.element_ty), mask=cmask)
        seg += tl.num_programs(0)
        start = tl.load(starts_ptr + seg, mask=seg < n_tokens, other=n_tokens)
