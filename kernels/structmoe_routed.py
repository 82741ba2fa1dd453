"""StructMoE's routed low-rank path, router and codes fused: one Triton kernel, forward and backward.

The routed update is ``R(x) = sum_{l in topk(x)} s_l(x) x A_l B_l`` (Eq. 5 of the StructMoE
paper). ``megatron_ext/structmoe/routed.py`` computes it in plain PyTorch (``route()``, then the
``reference`` backend, Algorithm 1, or the ``dense-masked`` one); this module fuses its first
stage, for small ``L r`` (the default 16 x 16 = 256 code columns):

* forward, one program per block of tokens, one pass over ``x``: router logits ``x W_R^T`` in
  fp32, softmax, top-k by iterated argmax (exact ties go to the lower expert), ``u = x A_cat``
  (``A`` as ``[H, L r]``, fp32 accumulation), ``codes[n, l r + j] = s_l(n) u[n, l r + j]`` for the
  selected ``l`` and 0 elsewhere, and the slots per expert by integer atomics (so
  ``tokens_per_expert`` needs no ``torch.bincount``, a host sync on CUDA). No permutation of the
  tokens, no host sync, no data-dependent shape.
* the expand stage stays a plain GEMM of the masked codes against ``B`` reshaped to ``[L r, D]``
  (the dense-masked backend's), done by the caller (cuBLAS on a GPU).
* backward: a kernel per token block writes ``grad_u`` (the codes' gradient in the selected
  columns times the score) and the router logits' gradient (softmax backward of the
  probabilities' gradient from the load-balancing loss plus the selected scores' gradient), side
  by side as ``G = [grad_u | grad_logits]``; then two GEMMs: ``grad_x = G [A_cat^T; W_R]`` and
  ``x^T G = [grad_A_cat | grad_W_R^T]``.

Precision: the forward router runs in fp32 on the upcast operands, as ``route()`` does. In the
backward, ``grad_logits`` joins ``G`` in the dtype of ``x``: for bf16 that rounds it to bf16
before the two GEMMs (what Megatron's router does with a bf16 router weight), where the
PyTorch path keeps ``x.float()`` for an fp32 GEMM; this saves materialising ``x`` in fp32
(``4 N H`` bytes per layer). fp32 inputs give fp32 everywhere.

Triton is imported lazily: importing this module needs no Triton; :func:`available` says whether
the kernel can run here (a CUDA device, or Triton's interpreter on the CPU). :func:`offline_build`
compiles both kernels for a GPU architecture without a GPU and reports their resource use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_ext_kernels._triton_runtime import available, interpreted, kernels
from megatron_ext_kernels._triton_runtime import offline_build as _offline_build

MAX_CODES = 1024  # padded L r above this: one program's code tile no longer fits registers


def _kernels():
    return kernels("_structmoe_routed_triton")


# The codes GEMM ``u = x A_cat`` on bf16/fp16 tensor cores (``tl.dot`` of the raw tiles). Off:
# on an H100 (Triton 3.6, 2026-11-24) that path gave wrong codes for about 1% of the tokens at
# L = r = 16 (relative error up to 0.38 of the largest code, scattered token pairs, at H = 64
# as at 2048; L = r = 8 and the fp32 path were right): scripts/gpu/structmoe_codes_check.py
# shows it. The fp32 dot of the upcast tiles (what the fp32 inputs use) is the default until
# the tensor-core path is understood.
BF16_DOT = False


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _padded(n_experts: int, rank: int):
    """``L_P, R_P``: the kernels hold codes as ``[L_P, R_P]`` per token, powers of two, with
    ``L_P >= 16`` (``tl.dot``'s minimum, the router's output width)."""
    return _pow2(n_experts), _pow2(rank, floor=1)


def _launch_config(lr_p: int, fp32: bool, interpret: bool):
    """Block sizes and launch options of the forward and backward kernels for ``L_P R_P = lr_p``
    padded code columns. Small blocks under the interpreter, so that the tests' few dozen tokens
    span several programs. On a GPU, chosen from the compiled kernels' resource use (no spills,
    shared memory within an A100's and an H100's, checked offline for sm_80 and sm_90): the
    forward keeps its ``[BLOCK_N, lr_p]`` fp32 accumulator at 16K elements (64 tokens at the
    default 256 columns); the backward is memory-bound, 32 tokens per program. Not timed on a
    GPU yet."""
    if interpret:
        return dict(BLOCK_N=16, BLOCK_H=16), {}, dict(BLOCK_N=16), {}
    big = lr_p > 256
    fwd = dict(BLOCK_N=max(16, min(64, 16384 // lr_p)), BLOCK_H=32 if (fp32 or lr_p > 512) else 64)
    fwd_launch = dict(num_warps=8 if lr_p >= 256 else 4, num_stages=2 if (fp32 or big) else 3)
    bwd = dict(BLOCK_N=16 if big else 32)
    return fwd, fwd_launch, bwd, dict(num_warps=8 if lr_p >= 256 else 4)


class FusedRouting(NamedTuple):
    probs: torch.Tensor    # [N, L] fp32 softmax scores
    indices: torch.Tensor  # [N, k] int64 selected experts, in descending score
    weights: torch.Tensor  # [N, k] fp32 their scores s_l(x)
    counts: torch.Tensor   # [L] int64 routing slots per expert


class RouteCodes(torch.autograd.Function):
    """``(probs, indices, weights, counts, codes)`` of ``x [N, H]``, ``w_router [L, H]``,
    ``a [L, H, r]``; differentiable w.r.t. x, w_router and a through probs, weights and codes."""

    @staticmethod
    def forward(ctx, x, w_router, a, topk):
        n, hidden = x.shape
        n_experts, _, rank = a.shape
        lr = n_experts * rank
        a_cat = a.permute(1, 0, 2).reshape(hidden, lr)  # column l r + j = A_l[:, j]
        probs = torch.empty(n, n_experts, dtype=torch.float32, device=x.device)
        indices = torch.empty(n, topk, dtype=torch.int64, device=x.device)
        weights = torch.empty(n, topk, dtype=torch.float32, device=x.device)
        codes = torch.empty(n, lr, dtype=x.dtype, device=x.device)
        u = torch.empty(n, lr, dtype=x.dtype, device=x.device)
        counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device)
        l_p, r_p = _padded(n_experts, rank)
        lr_p = l_p * r_p
        blocks, launch, _, _ = _launch_config(lr_p, x.dtype == torch.float32, interpreted())
        if n > 0:
            k = _kernels()
            grid = (-(-n // blocks["BLOCK_N"]),)
            k.route_codes_fwd[grid](
                x, w_router, a_cat, probs, indices, weights, codes, u, counts,
                n, hidden, x.stride(0), w_router.stride(0), a_cat.stride(0), codes.stride(0),
                N_EXPERTS=n_experts, RANK=rank, TOPK=topk, L_P=l_p, R_P=r_p,
                IEEE_DOT=interpreted() or x.dtype == torch.float32 or not BF16_DOT,
                **blocks, **launch)
        ctx.save_for_backward(x, w_router, a_cat, u, probs, indices, weights)
        ctx.shape = (n_experts, rank, topk, l_p, r_p)
        counts = counts.to(torch.int64)  # torch.bincount's dtype, as route()'s Routing has
        ctx.mark_non_differentiable(indices, counts)
        ctx.set_materialize_grads(False)
        return probs, indices, weights, counts, codes

    @staticmethod
    def backward(ctx, g_probs, _g_indices, g_weights, _g_counts, g_codes):
        x, w_router, a_cat, u, probs, indices, weights = ctx.saved_tensors
        n_experts, rank, topk, l_p, r_p = ctx.shape
        n, hidden = x.shape
        lr = n_experts * rank
        need_x, need_w, need_a = ctx.needs_input_grad[:3]
        # G = [grad_u | grad_logits] in the dtype of x.
        g_cat = torch.empty(n, lr + n_experts, dtype=x.dtype, device=x.device)
        # Incoming gradients may be expanded views (stride 0, e.g. of a .sum()).
        g_codes = g_codes.contiguous() if g_codes is not None else None
        g_probs = g_probs.float().contiguous() if g_probs is not None else None
        g_weights = g_weights.float().contiguous() if g_weights is not None else None
        if n > 0:
            _, _, blocks, launch = _launch_config(l_p * r_p, x.dtype == torch.float32,
                                                  interpreted())
            dummy = probs  # never read: its HAS_* flag is off
            k = _kernels()
            k.route_codes_bwd[(-(-n // blocks["BLOCK_N"]),)](
                g_codes if g_codes is not None else dummy, u, probs, indices, weights,
                g_probs if g_probs is not None else dummy,
                g_weights if g_weights is not None else dummy,
                g_cat, n, u.stride(0), g_cat.stride(0), N_EXPERTS=n_experts, RANK=rank,
                TOPK=topk, L_P=l_p, R_P=r_p, HAS_GCODES=g_codes is not None,
                HAS_GPROBS=g_probs is not None, HAS_GWTS=g_weights is not None,
                **blocks, **launch)
        grad_x = grad_w = grad_a = None
        if need_x:
            # grad_u A_cat^T + grad_logits W_R in one GEMM.
            grad_x = g_cat @ torch.cat([a_cat.t(), w_router.to(x.dtype)], dim=0)
        if need_w or need_a:
            xt_g = x.t() @ g_cat                                    # [H, L r + L]
            if need_a:
                grad_a = xt_g[:, :lr].reshape(hidden, n_experts, rank).permute(1, 0, 2)
                grad_a = grad_a.contiguous()
            if need_w:
                grad_w = xt_g[:, lr:].t().to(w_router.dtype).contiguous()
        return grad_x, grad_w, grad_a, None


def _check(x: torch.Tensor, w_router: torch.Tensor, a: torch.Tensor, topk: int) -> None:
    if x.dim() != 2 or w_router.dim() != 2 or a.dim() != 3:
        raise ValueError(f"StructMoE fused routing: x [N, H], w_router [L, H], a [L, H, r]; got "
                         f"{tuple(x.shape)}, {tuple(w_router.shape)}, {tuple(a.shape)}")
    n_experts, hidden, rank = a.shape
    if tuple(w_router.shape) != (n_experts, hidden) or x.shape[1] != hidden:
        raise ValueError(f"StructMoE fused routing: shapes do not fit: x {tuple(x.shape)}, "
                         f"w_router {tuple(w_router.shape)}, a {tuple(a.shape)}")
    if not 1 <= topk <= n_experts:
        raise ValueError(f"--structmoe-topk={topk}: must be in 1..{n_experts}")
    l_p, r_p = _padded(n_experts, rank)
    if l_p * r_p > MAX_CODES:
        raise ValueError(f"--structmoe-backend=triton is for small L*r (<= {MAX_CODES} with L "
                         f"and r rounded up to powers of two, L to at least 16): "
                         f"--structmoe-num-experts={n_experts} x --structmoe-rank={rank}: use "
                         "--structmoe-backend dense-masked or grouped")
    if x.dtype != a.dtype or not x.dtype.is_floating_point:
        raise ValueError(f"StructMoE fused routing: x ({x.dtype}) and A ({a.dtype}) must share a "
                         "floating-point dtype")
    if not (x.device == w_router.device == a.device):
        raise ValueError("StructMoE fused routing: x, w_router and a must be on one device")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError("--structmoe-backend=triton runs on a CUDA device; on the CPU only under "
                         "Triton's interpreter (environment TRITON_INTERPRET=1, slow: for tests)")


def fused_route_codes(x: torch.Tensor, w_router: torch.Tensor, a: torch.Tensor,
                      topk: int) -> tuple[FusedRouting, torch.Tensor]:
    """Router top-k and the selected experts' ``s_l(x) x A_l`` as ``[N, L r]`` masked codes."""
    _check(x, w_router, a, topk)
    probs, indices, weights, counts, codes = RouteCodes.apply(
        x.contiguous(), w_router.contiguous(), a, topk)
    return FusedRouting(probs, indices, weights, counts), codes


def offline_build(arch: int, dtype: str = "bf16", n_experts: int = 16, rank: int = 16,
                  topk: int = 1) -> dict:
    """Both kernels compiled for ``sm_<arch>`` without a GPU, with this module's launch options
    and the specialisation a launch gives (16-byte aligned pointers, strides and H divisible by
    16): per kernel, its registers, shared and local memory (``_triton_runtime.offline_build``)."""
    k = _kernels()
    l_p, r_p = _padded(n_experts, rank)
    fwd, fwd_launch, bwd, bwd_launch = _launch_config(l_p * r_p, dtype == "fp32", False)
    shape = dict(N_EXPERTS=n_experts, RANK=rank, TOPK=topk, L_P=l_p, R_P=r_p)
    builds = {
        "route_codes_fwd": (
            k.route_codes_fwd,
            dict(x_ptr=dtype, wr_ptr=dtype, a_ptr=dtype, probs_ptr="fp32", idx_ptr="i64",
                 wts_ptr="fp32", codes_ptr=dtype, u_ptr=dtype, counts_ptr="i32"),
            ("n_tokens", "hidden", "stride_x", "stride_wr", "stride_a", "stride_c"),
            dict(shape, IEEE_DOT=dtype == "fp32", **fwd), fwd_launch),
        "route_codes_bwd": (
            k.route_codes_bwd,
            dict(gcodes_ptr=dtype, u_ptr=dtype, probs_ptr="fp32", idx_ptr="i64",
                 wts_ptr="fp32", gprobs_ptr="fp32", gwts_ptr="fp32", gcat_ptr=dtype),
            ("n_tokens", "stride_c", "stride_g"),
            dict(shape, HAS_GCODES=True, HAS_GPROBS=True, HAS_GWTS=True, **bwd), bwd_launch),
    }
    report = {}
    for name, (fn, ptrs, ints, consts, launch) in builds.items():
        aligned = [a for a in ints if a.startswith("stride") or a == "hidden"]
        report[name] = dict(_offline_build(fn, ptrs, ints, consts, arch, launch, aligned),
                            **{k_: v for k_, v in {**consts, **launch}.items()
                               if k_.startswith(("BLOCK", "num_"))})
    return report


def route_codes_reference(x: torch.Tensor, w_router: torch.Tensor, a: torch.Tensor,
                          topk: int) -> tuple[FusedRouting, torch.Tensor]:
    """Plain PyTorch of the same outputs (``route()`` and the dense-masked codes of
    ``megatron_ext/structmoe/routed.py``, written out here so this module stands alone)."""
    logits = x.float() @ w_router.float().t()
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, topk, dim=-1)
    n_experts, hidden, rank = a.shape
    u = x @ a.permute(1, 0, 2).reshape(hidden, n_experts * rank)
    gate = torch.zeros_like(probs).scatter(1, indices, weights)
    codes = (u.view(-1, n_experts, rank) * gate.to(u.dtype).unsqueeze(-1)).reshape(u.shape)
    counts = torch.bincount(indices.reshape(-1), minlength=n_experts)
    return FusedRouting(probs, indices, weights, counts), codes
