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
def _segment_sum(start_a, sum_a, start_b, sum_b):
    """Combine of a segmented inclusive scan: ``start`` marks the first element of a segment, so
    the running sum restarts there (associative, as ``tl.associative_scan`` requires)."""
    return start_a | start_b, tl.where(start_b != 0, sum_b, sum_a + sum_b)


@triton.jit
def stem_gate_bwd(grad_ptr, fc1_ptr, tab_ptr, order_ptr, sorted_ptr, dfc1_ptr, dst_ptr,
                  part_ptr, n_tokens, n_cols,
                  stride_grad, stride_fc1, stride_tab, stride_dfc1, stride_dst,
                  VARIANT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_F: tl.constexpr):
    """One program per (CHUNK sorted positions, BLOCK_F columns): the same work for every
    program, however the ids are distributed.

    The program writes its tokens' ``linear_fc1`` gradients, then sums their row gradients per
    run of equal ids with a segmented scan over the chunk (in registers, fp32). A run that lies
    wholly inside the chunk is added to ``dst[id]`` here: no other program touches that row. A run
    that crosses the chunk's left edge leaves its sum in ``part[2 chunk]``, one that crosses the
    right edge (and starts in the chunk) in ``part[2 chunk + 1]``; ``stem_gate_bwd_carry`` adds
    those up in chunk order. No atomics: the result does not depend on scheduling."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < n_cols
    lo = chunk * CHUNK
    last = tl.minimum(lo + CHUNK, n_tokens) - 1
    pos = lo + tl.arange(0, CHUNK)
    pmask = pos < n_tokens
    row = tl.load(sorted_ptr + pos, mask=pmask, other=-1)
    prev = tl.load(sorted_ptr + pos - 1, mask=pmask & (pos > 0), other=-1)
    nxt = tl.load(sorted_ptr + pos + 1, mask=pos + 1 < n_tokens, other=-1)
    before = tl.load(sorted_ptr + lo - 1, mask=lo > 0, other=-1)
    tokens = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
    row64 = row.to(tl.int64)
    mask = pmask[:, None] & cmask[None, :]
    t = tl.load(tab_ptr + row64[:, None] * stride_tab + cols[None, :], mask=mask, other=0.0)
    t = _rounded(t.to(tl.float32), grad_ptr.dtype.element_ty).to(tl.float32)
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
        tl.store(dfc1, _rounded(go * (u + t) * dsilu_a, dfc1_ptr.dtype.element_ty), mask=mask)
        rows = go * silu_a
        tl.store(dfc1 + n_cols, _rounded(rows, dfc1_ptr.dtype.element_ty), mask=mask)
    # Runs of equal ids inside the chunk: a run starts where the id changes or at the chunk's
    # first position, and its sum is complete at its last position in the chunk.
    starts = ((row != prev) | (pos == lo)).to(tl.int32)
    _, sums = tl.associative_scan((tl.broadcast_to(starts[:, None], (CHUNK, BLOCK_F)), rows), 0,
                                  _segment_sum)
    ends = pmask & ((row != nxt) | (pos == last))
    left = row == before                 # the run began in an earlier chunk
    right = (pos == last) & (row == nxt)  # the run goes on in the next chunk
    whole = ends & ~left & ~right
    dst = dst_ptr + row64[:, None] * stride_dst + cols[None, :]
    wmask = whole[:, None] & cmask[None, :]
    total = tl.load(dst, mask=wmask, other=0.0).to(tl.float32) + sums
    tl.store(dst, _rounded(total, dst_ptr.dtype.element_ty), mask=wmask)
    slot = 2 * chunk.to(tl.int64) + tl.where(left, 0, 1)
    pmask2 = (ends & (left | right))[:, None] & cmask[None, :]
    tl.store(part_ptr + slot[:, None] * n_cols + cols[None, :], sums, mask=pmask2)


@triton.jit
def stem_gate_bwd_carry(sorted_ptr, part_ptr, dst_ptr, n_tokens, n_cols, n_chunks, stride_dst,
                        CHUNK: tl.constexpr, SPAN: tl.constexpr, BLOCK_F: tl.constexpr):
    """The runs that cross chunk edges, each added to ``dst`` by the program of the chunk where
    it starts: its partial sum there (``part[2 c + 1]``), then those of the chunks it covers
    (``part[2 c' ]``), SPAN chunks at a time, in chunk order."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = cols < n_cols
    last = tl.minimum(chunk * CHUNK + CHUNK, n_tokens) - 1
    row = tl.load(sorted_ptr + last)
    nxt = tl.load(sorted_ptr + last + 1, mask=last + 1 < n_tokens, other=-1)
    before = tl.load(sorted_ptr + chunk * CHUNK - 1, mask=chunk > 0, other=-1)
    if (nxt == row) & (before != row):
        total = tl.load(part_ptr + (2 * chunk.to(tl.int64) + 1) * n_cols + cols, mask=cmask,
                        other=0.0)
        first = chunk + 1
        more = True
        while more:
            cs = first + tl.arange(0, SPAN)
            inside = cs < n_chunks
            ids = tl.load(sorted_ptr + cs.to(tl.int64) * CHUNK, mask=inside, other=-1)
            covered = inside & (ids == row)
            p = tl.load(part_ptr + (2 * cs.to(tl.int64))[:, None] * n_cols + cols[None, :],
                        mask=covered[:, None] & cmask[None, :], other=0.0)
            total += tl.sum(p, axis=0)
            more = tl.sum(covered.to(tl.int32), axis=0) == SPAN
            first += SPAN
        dst = dst_ptr + row.to(tl.int64) * stride_dst + cols
        total += tl.load(dst, mask=cmask, other=0.0).to(tl.float32)
        tl.store(dst, _rounded(total, dst_ptr.dtype.element_ty), mask=cmask)
