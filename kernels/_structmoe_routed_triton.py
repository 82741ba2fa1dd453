"""Triton kernels of StructMoE's fused router + codes stage (``kernels/structmoe_routed.py`` holds
the API, the autograd function and the shapes; read that module first).

Imported lazily, on first use: ``@triton.jit`` decides at decoration time whether a kernel is
compiled for the GPU or run by Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests
run them).

Notation: one program per ``BLOCK_N`` tokens; ``L`` experts of rank ``r``; in memory, ``L r``
code columns, column ``l r + j`` is expert ``l``'s ``j``-th (the layout of ``A`` permuted to
``[H, L r]`` and of ``B`` reshaped to ``[L r, D]``). In registers the columns are padded per
expert to ``[L_P, R_P]`` (powers of two; ``L_P >= 16``, what ``tl.dot`` needs), so that a code
tile is ``[BLOCK_N, L_P, R_P]`` and per-expert work is a broadcast or a sum over the last axis,
not a gather.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_codes_fwd(x_ptr, wr_ptr, a_ptr,
                    probs_ptr, idx_ptr, wts_ptr, codes_ptr, u_ptr, counts_ptr,
                    n_tokens, hidden, stride_x, stride_wr, stride_a, stride_c,
                    N_EXPERTS: tl.constexpr, RANK: tl.constexpr,
                    TOPK: tl.constexpr, L_P: tl.constexpr, R_P: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, IEEE_DOT: tl.constexpr):
    """Router logits and ``u = x A_cat`` in one pass over ``x``, then softmax, top-k, the masked
    and scaled codes, and the per-expert slot counts."""
    tokens = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    tmask = tokens < n_tokens
    experts = tl.arange(0, L_P)
    emask = experts < N_EXPERTS
    # Padded column q = l R_P + j of the accumulator; its memory column l r + j (if j < r).
    q = tl.arange(0, L_P * R_P)
    q_col = (q // R_P) * RANK + q % R_P
    q_mask = (q // R_P < N_EXPERTS) & (q % R_P < RANK)

    logits = tl.zeros((BLOCK_N, L_P), dtype=tl.float32)
    u = tl.zeros((BLOCK_N, L_P * R_P), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hmask = hs < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_x + hs[None, :],
                    mask=tmask[:, None] & hmask[None, :], other=0.0)
        wr_t = tl.load(wr_ptr + experts[None, :] * stride_wr + hs[:, None],
                       mask=hmask[:, None] & emask[None, :], other=0.0)       # [BLOCK_H, L_P]
        a = tl.load(a_ptr + hs[:, None] * stride_a + q_col[None, :],
                    mask=hmask[:, None] & q_mask[None, :], other=0.0)         # [BLOCK_H, L_P R_P]
        # The router in fp32 from the upcast operands, as route() computes x.float() @ w.float().t()
        # (bf16 products are exact in fp32, so only the summation order differs).
        xf = x.to(tl.float32)
        logits = tl.dot(xf, wr_t.to(tl.float32), logits, input_precision="ieee")
        if IEEE_DOT:
            # fp32 inputs (no TF32, like torch's default matmul), and the interpreter, whose
            # tl.dot multiplies bf16 tiles as their raw uint16 storage.
            u = tl.dot(xf, a.to(tl.float32), u, input_precision="ieee")
        else:
            u = tl.dot(x, a, u)  # bf16/fp16 tensor cores, fp32 accumulation

    # Softmax in fp32 over the real experts (the padding columns get exp(-inf) = 0).
    logits = tl.where(emask[None, :], logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    rows_e = tokens[:, None] * N_EXPERTS + experts[None, :]
    tl.store(probs_ptr + rows_e, probs, mask=tmask[:, None] & emask[None, :])

    # Top-k by iterated argmax: tl.argmax returns the lowest index among equal maxima, so exact
    # ties go to the lower expert; slots come out in descending score, like torch.topk. Taken
    # experts (and the padding) drop to -1, below every probability.
    remaining = tl.where(emask[None, :], probs, -1.0)
    gate = tl.zeros((BLOCK_N, L_P), dtype=tl.float32)  # s_l(x) at the selected experts, else 0
    counts = tl.zeros((L_P,), dtype=tl.int32)
    for slot in tl.static_range(TOPK):
        best = tl.argmax(remaining, axis=1)
        score = tl.max(remaining, axis=1)
        chosen = experts[None, :] == best[:, None]
        remaining = tl.where(chosen, -1.0, remaining)
        tl.store(idx_ptr + tokens * TOPK + slot, best.to(tl.int64), mask=tmask)
        tl.store(wts_ptr + tokens * TOPK + slot, score, mask=tmask)
        gate = tl.where(chosen, score[:, None], gate)
        counts += tl.sum((chosen & tmask[:, None]).to(tl.int32), axis=0)
    # Integer atomics: the totals do not depend on the order the programs add them in.
    tl.atomic_add(counts_ptr + experts, counts, mask=emask)

    # codes = s_l(x) * (x A_l) in the selected experts' columns, 0 elsewhere; one rounding.
    u3 = tl.reshape(u, (BLOCK_N, L_P, R_P))
    out, omask = _code_tile(tokens, tmask, stride_c, N_EXPERTS, RANK, L_P, R_P)
    tl.store(u_ptr + out, u3.to(u_ptr.dtype.element_ty), mask=omask)
    tl.store(codes_ptr + out, (u3 * gate[:, :, None]).to(codes_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _code_tile(tokens, tmask, stride, N_EXPERTS: tl.constexpr, RANK: tl.constexpr,
               L_P: tl.constexpr, R_P: tl.constexpr):
    """Offsets and mask of a ``[BLOCK_N, L_P, R_P]`` tile of ``[N, L r]`` codes."""
    ls = tl.arange(0, L_P)[None, :, None]
    js = tl.arange(0, R_P)[None, None, :]
    offs = tokens[:, None, None] * stride + ls * RANK + js
    mask = tmask[:, None, None] & (ls < N_EXPERTS) & (js < RANK)
    return offs, mask


@triton.jit
def route_codes_bwd(gcodes_ptr, u_ptr, probs_ptr, idx_ptr, wts_ptr, gprobs_ptr, gwts_ptr,
                    gcat_ptr,
                    n_tokens, stride_c, stride_g,
                    N_EXPERTS: tl.constexpr, RANK: tl.constexpr,
                    TOPK: tl.constexpr, L_P: tl.constexpr, R_P: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_GCODES: tl.constexpr, HAS_GPROBS: tl.constexpr,
                    HAS_GWTS: tl.constexpr):
    """Per token: ``grad_u`` (the codes' gradient in the selected columns times their score) and
    the router logits' gradient (softmax backward of the probabilities' gradient: the one from
    the caller, e.g. the load-balancing loss, plus, at the selected experts, the scores'
    gradient ``sum_j grad_codes[l r + j] u[l r + j]`` and any gradient of the returned weights).

    Writes ``[grad_u | grad_logits]`` side by side into ``gcat`` (the dtype of x) for the two
    GEMMs that follow."""
    tokens = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    tmask = tokens < n_tokens
    experts = tl.arange(0, L_P)
    emask2 = tmask[:, None] & (experts < N_EXPERTS)[None, :]
    rows_e = tokens[:, None] * N_EXPERTS + experts[None, :]

    probs = tl.load(probs_ptr + rows_e, mask=emask2, other=0.0)
    if HAS_GPROBS:
        gp = tl.load(gprobs_ptr + rows_e, mask=emask2, other=0.0)
    else:
        gp = tl.zeros((BLOCK_N, L_P), dtype=tl.float32)
    selected = tl.zeros((BLOCK_N, L_P), dtype=tl.float32)  # 1 at the selected experts
    gate = tl.zeros((BLOCK_N, L_P), dtype=tl.float32)      # their scores s_l(x), else 0
    for slot in tl.static_range(TOPK):
        best = tl.load(idx_ptr + tokens * TOPK + slot, mask=tmask, other=0).to(tl.int32)
        chosen = experts[None, :] == best[:, None]
        selected = tl.where(chosen, 1.0, selected)
        score = tl.load(wts_ptr + tokens * TOPK + slot, mask=tmask, other=0.0)
        gate = tl.where(chosen, score[:, None], gate)
        if HAS_GWTS:
            g_w = tl.load(gwts_ptr + tokens * TOPK + slot, mask=tmask, other=0.0)
            gp += tl.where(chosen, g_w[:, None], 0.0)
    offs, mask = _code_tile(tokens, tmask, stride_c, N_EXPERTS, RANK, L_P, R_P)
    if HAS_GCODES:
        gc = tl.load(gcodes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gp += selected * tl.sum(gc * u, axis=2)  # d s_l = sum_j grad_codes[l r + j] u[l r + j]
        grad_u = gc * gate[:, :, None]
    else:
        grad_u = tl.zeros((BLOCK_N, L_P, R_P), dtype=tl.float32)

    # Softmax backward: dz = p * (g - sum_l p_l g_l).
    glogits = probs * (gp - tl.sum(probs * gp, axis=1)[:, None])
    out_ty = gcat_ptr.dtype.element_ty
    g_offs, _ = _code_tile(tokens, tmask, stride_g, N_EXPERTS, RANK, L_P, R_P)
    tl.store(gcat_ptr + g_offs, grad_u.to(out_ty), mask=mask)
    tl.store(gcat_ptr + tokens[:, None] * stride_g + N_EXPERTS * RANK + experts[None, :],
             glogits.to(out_ty), mask=emask2)
