"""Fused rotary position embedding: Megatron-Core's unfused ``_apply_rotary_pos_emb_bshd``
(``megatron/core/models/common/embeddings/rope_utils.py``, what every attention layer applies to
its queries and keys when Transformer Engine's fused RoPE is absent) in one pass.

Upstream's unfused path, per query or key tensor: ``cos``/``sin`` of the frequencies, a multiply,
``_rotate_half`` (a negation and a ``cat``), a second multiply, an add and a ``cat`` with the
features left unrotated, each a kernel reading and writing the whole tensor in the model's dtype
(rounded after every op), and about a dozen in the backward. Counted for dense_1b's attention at
one sequence of 4096 (queries of 32 heads and keys of 8, 64 features, bf16: 21 MB): about 0.23 GB
moved per layer forward and 0.25 GB backward, against 0.04 GB each way here; over 16 layers about
6 GB per sequence, 2-3 ms of HBM time, about 3% of that model's step at 40% MFU. Not yet measured
on a GPU (``benchmarks/rope.py``).

Here one Triton kernel (``_rope_triton.py``) reads each pair of features a rotation mixes once,
computes ``x cos + R x sin`` in fp32 from fp32 ``cos``/``sin`` of the frequencies, and writes the
result once, rounded to nearest; the backward is the same kernel applying the transpose,
``g cos + R^T (g sin)``. So in fp32 the numbers are upstream's up to the rounding of ``cos``/``sin``
and of a fused multiply-add; in bf16 they are the exact product rounded once, where upstream rounds
after each of its ops (closer to the exact value, not bit-equal to upstream).

Covered: ``t [s, b, heads, head_dim]`` with unit stride in the last dimension (any strides
elsewhere: the key view of Megatron's fused QKV projection is read in place),
``freqs [s, 1 or b, 1, rot_dim]`` with ``rot_dim`` even and at most ``head_dim`` (the rest
copied), halves or interleaved pairs, any ``mscale``. :func:`supports` says whether a call is
covered; the seam (``megatron_ext/training/rope.py``) leaves every other call to upstream.
"""

from __future__ import annotations

import torch

from megatron_ext_kernels._triton_runtime import available, kernels
from megatron_ext_kernels._triton_runtime import offline_build as _offline_build

BLOCK_ELEMENTS = 1024  # rows x heads x rotated features per program
NUM_WARPS = 4


def _kernels():
    return kernels("_rope_triton")


def supports(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether :func:`fused_rope` computes this call (shapes and dtypes above)."""
    if t.dim() != 4 or freqs.dim() != 4 or t.numel() == 0:
        return False
    s, b, _, d = t.shape
    rot = freqs.shape[-1]
    return (freqs.shape[0] == s and freqs.shape[1] in (1, b) and freqs.shape[2] == 1
            and rot % 2 == 0 and 0 < rot <= d and not freqs.requires_grad
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and freqs.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and t.device == freqs.device)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _blocks(rows: int, heads: int, d: int, rot: int) -> tuple:
    """Rows, heads and rotated pairs per program, and the copied features' block (0: none):
    pairs and copied features padded to powers of two, then heads and rows as many as
    ``BLOCK_ELEMENTS`` allow (about 8 elements a thread at 4 warps: the offline build of sm_80
    and sm_90 holds them in registers without spilling, ``tests/test_rope.py``)."""
    block_p = _pow2(rot // 2)
    block_rest = _pow2(d - rot) if d > rot else 0
    block_h = max(1, min(_pow2(heads), BLOCK_ELEMENTS // (2 * block_p)))
    block_r = max(1, min(_pow2(rows), BLOCK_ELEMENTS // (2 * block_p * block_h)))
    return block_r, block_h, block_p, block_rest


def _apply(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float,
           backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    if freqs.stride(-1) != 1:
        freqs = freqs.contiguous()
    s, b, heads, d = x.shape
    out = torch.empty((s, b, heads, d), dtype=x.dtype, device=x.device)
    rows, rot = s * b, freqs.shape[-1]
    block_r, block_h, block_p, block_rest = _blocks(rows, heads, d, rot)
    stride_fb = freqs.stride(1) if freqs.shape[1] > 1 else 0
    grid = ((rows + block_r - 1) // block_r, (heads + block_h - 1) // block_h)
    _kernels().rope[grid](x, out, freqs, rows, b, heads, x.stride(0), x.stride(1), x.stride(2),
                          freqs.stride(0), stride_fb, rot, d, float(mscale),
                          BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_P=block_p,
                          BLOCK_REST=block_rest, INTERLEAVED=bool(interleaved),
                          BACKWARD=backward, num_warps=NUM_WARPS)
    return out


def offline_build(arch: int, dtype: str = "bf16", heads: int = 32, head_dim: int = 64,
                  rot_dim: int = 64, rows: int = 8192, interleaved: bool = False,
                  backward: bool = False) -> dict:
    """The kernel compiled for ``sm_<arch>`` without a GPU with the blocks and warps a launch at
    this shape uses: its registers, shared and local memory (``_triton_runtime.offline_build``)."""
    block_r, block_h, block_p, block_rest = _blocks(rows, heads, head_dim, rot_dim)
    return _offline_build(_kernels().rope, dict(x=dtype, out=dtype, freqs="fp32"),
                          ("rows", "batch", "heads", "stride_xs", "stride_xb", "stride_xh",
                           "stride_fs", "stride_fb", "rot_dim", "head_dim"),
                          dict(BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_P=block_p,
                               BLOCK_REST=block_rest, INTERLEAVED=interleaved,
                               BACKWARD=backward),
                          arch, dict(num_warps=NUM_WARPS), floats=("mscale",))


class FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, interleaved, mscale):
        ctx.save_for_backward(freqs)
        ctx.interleaved, ctx.mscale = interleaved, mscale
        return _apply(t, freqs, interleaved, mscale, backward=False)

    @staticmethod
    def backward(ctx, grad):
        (freqs,) = ctx.saved_tensors
        return _apply(grad, freqs, ctx.interleaved, ctx.mscale, backward=True), None, None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
               mscale: float = 1.0) -> torch.Tensor:
    """``rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved,
    mscale=mscale)`` for a call :func:`supports` covers: a new contiguous tensor of ``t``'s
    shape and dtype."""
    if not available():
        raise RuntimeError("the fused RoPE needs Triton and a CUDA device (or TRITON_INTERPRET=1 "
                           "on the CPU)")
    if not supports(t, freqs):
        raise ValueError(f"fused RoPE: t {tuple(t.shape)} {t.dtype} with freqs "
                         f"{tuple(freqs.shape)} {freqs.dtype} is not covered (kernels/rope.py)")
    return FusedRope.apply(t, freqs, bool(interleaved), float(mscale))


def reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
              mscale: float = 1.0) -> torch.Tensor:
    """Plain PyTorch in float64, written for the tests from the definition (rotation of each
    feature pair by its angle), not from upstream's code: the exact value the kernel rounds."""
    x = t.double()
    f = freqs.double()
    rot = f.shape[-1]
    r, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        a, c = r[..., 0::2], r[..., 1::2]
        fa = f[..., 0::2]
    else:
        a, c = r[..., : rot // 2], r[..., rot // 2:]
        fa = f[..., : rot // 2]
    cos, sin = torch.cos(fa) * mscale, torch.sin(fa) * mscale
    ya, yc = a * cos - c * sin, c * cos + a * sin
    if interleaved:
        y = torch.stack((ya, yc), dim=-1).flatten(-2)
    else:
        y = torch.cat((ya, yc), dim=-1)
    return torch.cat((y, rest), dim=-1)
