"""Triton kernel of the direct read of host rows (``kernels/host_rows.py`` holds the API and the
plain-PyTorch reference; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run it).

On a GPU ``src_ptr`` is a host address the device can reach through unified virtual addressing
(page-locked memory: PyTorch's pinned allocator, or a range registered with ``cudaHostRegister``):
every load of it is a read over PCIe (or NVLink-C2C), issued by the kernel itself, with no copy
engine and no staging buffer between.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype``, to nearest, ties to even, as ``Tensor.to`` rounds.
    For bf16 the rounding is done on the bits, so that the result is the same compiled and under
    the interpreter (whose fp32 -> bf16 cast truncates); a NaN stays a NaN (its low bits could
    carry it to infinity). The same rounding as ``kernels/_stem_gate_triton.py``'s."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def gather_host_rows(src_ptr, idx_ptr, pos_ptr, out_ptr, n_rows, n_cols, stride_src, stride_out,
                     HAS_POS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[pos[j], :] = src[idx[j], :]`` cast to ``out``'s dtype (``pos[j] = j`` without
    ``HAS_POS``), one program per ``BLOCK_R`` rows x ``BLOCK_C`` columns. A row of ``src`` is
    read in contiguous ``BLOCK_C`` spans, so each warp's loads are whole 128-byte requests
    over the bus."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    ids = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    dst = rows
    if HAS_POS:
        dst = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    x = tl.load(src_ptr + ids[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    if src_ptr.dtype.element_ty != out_ptr.dtype.element_ty:
        x = _rounded(x.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + dst[:, None] * stride_out + cols[None, :], x, mask=mask)
