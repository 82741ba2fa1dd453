"""The routed low-rank path of StructMoE: ``R(x) = sum_{l in topk(x)} s_l(x) x A_l B_l`` (Eq. 5).

Shapes (tokens flattened): ``x [N, H]``, router weight ``w_router [L, H]``, ``A [L, H, r]``,
``B [L, r, D]`` (``D`` = this TP rank's share of D'_ff). The router runs in fp32 and its softmax
scores of the selected experts weight their contributions, so the router is trained by the LM
loss (top-k selection itself is not differentiable).

Backends, numerically equal (tested against a plain reference of Eq. 5):

* ``reference``: the paper's Algorithm 1 in plain PyTorch: gather the tokens of each expert, two
  small GEMMs, scatter-add back. Data-dependent shapes (a host sync per expert on a GPU).
* ``dense-masked``: ``x @ [A_1 .. A_L]`` in one GEMM, zero all but the selected experts' ``r``
  columns (times their scores), one GEMM against the stacked ``B``. No permutation, no host
  sync; ``L / k`` times the FLOPs of the low-rank path, which is small when ``L r`` is small
  against D'_ff (the default 16 x 16 = 256).
* ``grouped``: sort the (token, slot) pairs by expert, then one grouped GEMM per stage
  (``torch._grouped_mm`` with on-device group offsets, so no host sync), and scatter-add back.
  ``k / L`` of dense-masked's low-rank FLOPs, at the price of a permutation.
* ``triton``: router and codes fused in one Triton kernel, forward and backward
  (``kernels/structmoe_routed.py``): the routing and dense-masked's codes come out of one pass
  over ``x`` with the slot counts (no ``torch.bincount``), no permutation, no host sync; the
  expand is dense-masked's GEMM. It computes its own routing, so it is a *fused* backend
  (:data:`FUSED_BACKENDS`): ``route_codes(x, w_router, a, topk) -> (Routing, codes)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron.core.transformer.moe.moe_utils import router_gating_linear

from megatron_ext.compiled import compile_region
from megatron_ext.structmoe.config import COMPILE_CHOICES

from megatron_ext_kernels.structmoe_routed import available, fused_route_codes


@dataclass
class Routing:
    probs: torch.Tensor    # [N, L] fp32 softmax scores (for the load-balancing loss)
    indices: torch.Tensor  # [N, k] selected experts
    weights: torch.Tensor  # [N, k] their scores s_l(x), differentiable w.r.t. the router
    _dispatch: Optional["Dispatch"] = field(default=None, repr=False)
    # [L] slots per expert; a fused backend passes the counts its kernel computed.
    _counts: Optional[torch.Tensor] = field(default=None, repr=False)

    def tokens_per_expert(self) -> torch.Tensor:
        """``[L]`` routing slots given to each expert, computed once per routing."""
        if self._counts is None:
            # A scatter-add of ones, not torch.bincount: bincount reads the largest index on the
            # host to size its output (a host sync per layer on CUDA); here the size is L.
            flat = self.indices.reshape(-1)
            self._counts = torch.zeros(self.probs.shape[-1], dtype=torch.int64,
                                       device=flat.device).scatter_add_(0, flat,
                                                                        torch.ones_like(flat))
        return self._counts

    def dispatch(self) -> "Dispatch":
        """The (token, slot) pairs sorted by expert, computed once per routing."""
        if self._dispatch is None:
            self._dispatch = Dispatch.of(self)
        return self._dispatch


@dataclass
class Dispatch:
    order: torch.Tensor    # [N k] positions in the flattened (token, slot) list, sorted by expert
    tokens: torch.Tensor   # [N k] token of each sorted slot
    offsets: torch.Tensor  # [L] int32 end offset of each expert's group (torch._grouped_mm's offs)

    @classmethod
    def of(cls, routing: "Routing") -> "Dispatch":
        k = routing.indices.shape[1]
        order = torch.argsort(routing.indices.reshape(-1), stable=True)
        offsets = torch.cumsum(routing.tokens_per_expert(), 0).to(torch.int32)
        return cls(order=order, tokens=order // k, offsets=offsets)


def route_head(logits: torch.Tensor, topk: int):
    """``(probs, weights, indices)`` of the fp32 logits: softmax, then top-k of the scores."""
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, topk, dim=-1)
    return probs, weights, indices


def route(x: torch.Tensor, w_router: torch.Tensor, topk: int, head=route_head) -> Routing:
    """Softmax router in fp32 with top-k selection. The logits come from upstream's
    ``router_gating_linear`` (what ``TopKRouter`` uses with ``--moe-router-dtype fp32``): it
    saves ``x`` and ``W_R`` in their own dtype for the backward instead of their fp32 copies
    (``x.float()``, ``[N, H]`` fp32 per layer, for bf16 training), and with Transformer Engine
    it computes fp32 logits from bf16 operands in one GEMM. ``head``: :func:`route_head`, or
    its compiled version (``--structmoe-compile routed``); the logits' GEMM, upstream's autograd
    Function, stays outside it."""
    logits = router_gating_linear(x, w_router, None, torch.float32)
    probs, weights, indices = head(logits, topk)
    return Routing(probs=probs, indices=indices, weights=weights)


# Each backend has two stages. ``codes`` runs on the replicated input (router and A are replicated
# across TP); ``expand`` multiplies by this rank's shard of B. Between them the StructMoE MLP puts
# Megatron's ``copy_to_tensor_model_parallel_region``, so the backward all-reduce makes the
# gradients of the codes (and so of A, the router and x) complete on every TP rank.


def reference_codes(x: torch.Tensor, a: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Algorithm 1, first multiply: ``s_l(x) x A_l`` per (token, slot), tokens grouped by expert."""
    n, k = routing.indices.shape
    flat_experts = routing.indices.reshape(-1)
    flat_weights = routing.weights.reshape(-1, 1).to(x.dtype)
    flat_tokens = torch.arange(n, device=x.device).repeat_interleave(k)
    codes = x.new_zeros(n * k, a.shape[-1])
    for expert in range(a.shape[0]):
        slots = (flat_experts == expert).nonzero().squeeze(-1)
        if slots.numel() == 0:
            continue
        codes = codes.index_copy(0, slots, x[flat_tokens[slots]] @ a[expert])
    return codes * flat_weights  # [N k, r]


def reference_expand(codes: torch.Tensor, b: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Algorithm 1, second multiply: ``(.) B_l`` per expert group, scatter-added to tokens."""
    n, k = routing.indices.shape
    flat_experts = routing.indices.reshape(-1)
    flat_tokens = torch.arange(n, device=codes.device).repeat_interleave(k)
    out = codes.new_zeros(n, b.shape[-1])
    for expert in range(b.shape[0]):
        slots = (flat_experts == expert).nonzero().squeeze(-1)
        if slots.numel() == 0:
            continue
        out = out.index_add(0, flat_tokens[slots], codes[slots] @ b[expert])
    return out


def dense_masked_codes(x: torch.Tensor, a: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One GEMM against all experts' ``A``; all but the selected experts' columns zeroed."""
    return masked_codes(x, a, routing.indices, routing.weights)


def masked_codes(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """:func:`dense_masked_codes` of a routing's ``indices`` and ``weights``."""
    n_experts, hidden, rank = a.shape
    u = x @ a.permute(1, 0, 2).reshape(hidden, n_experts * rank)          # [N, L r]
    # Scattered in place into fresh zeros (its gradient is the same gather of the weights'): an
    # out-of-place scatter copies the zeros first, one more kernel per layer on a GPU.
    gate = torch.zeros(x.shape[0], n_experts, dtype=weights.dtype, device=x.device).scatter_(
        1, indices, weights)                                                # [N, L]
    return (u.view(-1, n_experts, rank) * gate.to(u.dtype).unsqueeze(-1)).reshape(
        -1, n_experts * rank)


def dense_masked_route_tail(logits: torch.Tensor, x: torch.Tensor, a: torch.Tensor, topk: int):
    """Dense-masked from the router's logits on: ``(probs, weights, indices, codes)``, the region
    ``--structmoe-compile routed`` compiles (softmax, top-k, the gate's scatter, the A GEMM and
    the masked product, and their backward)."""
    probs, weights, indices = route_head(logits, topk)
    return probs, weights, indices, masked_codes(x, a, indices, weights)


def dense_masked_expand(codes: torch.Tensor, b: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One GEMM against the stacked ``B``."""
    return codes @ b.reshape(-1, b.shape[-1])                               # [N, D]


class _AddCodesTimesB(torch.autograd.Function):
    """``out += codes @ B_cat`` in place: one GEMM with ``beta = 1`` (cuBLAS reads ``out`` in its
    epilogue) instead of an ``[N, D]`` update tensor and an add that reads it back. In place
    inside a Function (``mark_dirty``), so that a view of ``out`` taken to make it 2-D does not
    make autograd copy the gradient of ``out`` (``CopySlices``) in the backward."""

    @staticmethod
    def forward(ctx, out, codes, b2d):
        out.view(-1, out.shape[-1]).addmm_(codes, b2d)
        ctx.mark_dirty(out)
        ctx.save_for_backward(codes, b2d)
        return out

    @staticmethod
    def backward(ctx, grad):
        codes, b2d = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_codes = g @ b2d.t() if ctx.needs_input_grad[1] else None
        grad_b = codes.t() @ g if ctx.needs_input_grad[2] else None
        return grad, grad_codes, grad_b


def dense_masked_expand_into(out: torch.Tensor, codes: torch.Tensor, b: torch.Tensor,
                             routing: Routing) -> torch.Tensor:
    """``out + dense_masked_expand(codes, b)``, added into ``out`` (``[..., D]``, its rows the
    tokens of ``codes``) by the GEMM itself where the dtypes agree and ``out`` is 2-D-viewable."""
    b2d = b.reshape(-1, b.shape[-1])
    if out.dtype == codes.dtype == b2d.dtype and _rows_viewable(out):
        return _AddCodesTimesB.apply(out, codes, b2d)
    return out + (codes @ b2d).view(out.shape).to(out.dtype)


def _rows_viewable(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def expand_into_stage(backend: str):
    """``expand_into(out, codes, b, routing) -> out + expand(codes, b, routing)``: dense-masked's
    (and the fused triton backend's, whose expand it is) adds in the GEMM; the others add."""
    if backend in ("dense-masked", "triton"):
        return dense_masked_expand_into
    expand = (FUSED_BACKENDS.get(backend) or backend_stages(backend))[1]

    def expand_into(out, codes, b, routing):
        return out + expand(codes, b, routing).view(out.shape).to(out.dtype)

    return expand_into


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (rows of ``x`` in groups ending at ``offsets``, group g times
    ``w[g]``), zero-padding the inner and output widths to the 16-byte multiples it requires."""
    align = max(1, 16 // x.element_size())
    k, n = w.shape[-2], w.shape[-1]
    pad_k, pad_n = -k % align, -n % align
    if pad_k:
        x = torch.nn.functional.pad(x, (0, pad_k))
    if pad_k or pad_n:
        w = torch.nn.functional.pad(w, (0, pad_n, 0, pad_k))
    out = torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offsets)
    return out[:, :n] if pad_n else out


def grouped_codes(x: torch.Tensor, a: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Tokens gathered in expert order, one grouped GEMM against ``A`` (``[N k, r]``, sorted)."""
    d = routing.dispatch()
    weights = routing.weights.reshape(-1)[d.order].to(x.dtype).unsqueeze(-1)
    return grouped_mm(x[d.tokens], a, d.offsets) * weights


def grouped_expand(codes: torch.Tensor, b: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One grouped GEMM against ``B``, scatter-added back to the tokens."""
    d = routing.dispatch()
    rows = grouped_mm(codes, b, d.offsets)                   # [N k, D]
    return rows.new_zeros(routing.indices.shape[0], b.shape[-1]).index_add(0, d.tokens, rows)


BACKENDS = {
    "reference": (reference_codes, reference_expand),
    "dense-masked": (dense_masked_codes, dense_masked_expand),
    "grouped": (grouped_codes, grouped_expand),
}


def triton_route_codes(x: torch.Tensor, w_router: torch.Tensor, a: torch.Tensor,
                       topk: int) -> tuple[Routing, torch.Tensor]:
    """Routing and dense-masked's ``[N, L r]`` codes from the fused Triton kernel."""
    fused, codes = fused_route_codes(x, w_router, a, topk)
    return Routing(probs=fused.probs, indices=fused.indices, weights=fused.weights,
                   _counts=fused.counts), codes


# Backends that compute the routing themselves: (route_codes, expand).
FUSED_BACKENDS = {
    "triton": (triton_route_codes, dense_masked_expand),
}


def check_fused_backend(backend: str) -> None:
    """Refuse a fused backend that cannot run here, with the flag named (at build time)."""
    if backend == "triton":
        if not available():
            raise ValueError(
                "--structmoe-backend=triton needs Triton and a CUDA device (on the CPU only under "
                "Triton's interpreter, environment TRITON_INTERPRET=1, slow: for tests); use "
                "--structmoe-backend dense-masked or grouped")


# The GPU measurement ``auto`` follows (benchmarks/structmoe_step.py on one H100, 2026-11-27:
# GPT step dense-masked 89.0 ms, grouped 96.2, triton 167.2; dense 68.6).
# tests/test_structmoe_default_backend.py checks that ``auto`` picks its fastest backend.
GPU_EVIDENCE = "docs/results/gpu_2026-11-27c_h100/structmoe_step.json"
GPU_DEFAULT = "dense-masked"


def resolve_backend(backend: str) -> str:
    """``auto``: grouped on the CPU, where it measured fastest (benchmarks/structmoe_step.py,
    docs/benchmarks.md); on a GPU the fastest in :data:`GPU_EVIDENCE` (dense-masked on an H100,
    2026-11-24 and 2026-11-27: docs/results/gpu_2026-11-24_h100, gpu_2026-11-27c_h100)."""
    if backend != "auto":
        return backend
    return GPU_DEFAULT if torch.cuda.is_available() else "grouped"


def backend_stages(backend: str):
    """``(codes, expand)`` of a backend that takes a precomputed routing."""
    try:
        return BACKENDS[backend]
    except KeyError:
        fused = (f" ({backend} computes its own routing: route_codes_stages)"
                 if backend in FUSED_BACKENDS else "")
        raise ValueError(f"--structmoe-backend={backend!r}: available here: "
                         f"{', '.join(BACKENDS)}{fused}") from None


def route_codes_stages(backend: str, compile: str = "none"):
    """``(route_codes, expand)`` of any backend, ``route_codes(x, w_router, a, topk) ->
    (Routing, codes)``: a fused backend's own, or ``route()`` followed by the backend's codes.
    ``compile="routed"`` (``--structmoe-compile``): the small ops between the GEMMs compiled
    (:func:`megatron_ext.compiled.compile_region`): dense-masked's whole tail after the router's
    logits, the other backends' router head (their gathers and grouped GEMMs stay eager)."""
    if backend in FUSED_BACKENDS:
        check_fused_backend(backend)
        if compile != "none":
            raise ValueError(check_compile(backend, compile))
        return FUSED_BACKENDS[backend]
    codes_fn, expand_fn = backend_stages(backend)
    if compile == "none":
        head = route_head
    elif backend == "dense-masked":
        tail = compile_region(dense_masked_route_tail)

        def route_codes(x, w_router, a, topk):
            logits = router_gating_linear(x, w_router, None, torch.float32)
            probs, weights, indices, codes = tail(logits, x, a, topk)
            return Routing(probs=probs, indices=indices, weights=weights), codes

        return route_codes, expand_fn
    else:
        head = compile_region(route_head)

    def route_codes(x, w_router, a, topk):
        routing = route(x, w_router, topk, head)
        return routing, codes_fn(x, a, routing)

    return route_codes, expand_fn


def check_compile(backend: str, compile: str) -> Optional[str]:
    """Why ``--structmoe-compile`` cannot work with this backend (one line), or None."""
    if compile not in COMPILE_CHOICES:
        return f"--structmoe-compile={compile!r}: allowed {', '.join(COMPILE_CHOICES)}"
    if compile != "none" and backend in FUSED_BACKENDS:
        return (f"--structmoe-compile {compile}: --structmoe-backend {backend} already fuses the "
                "router and codes in its own kernel; use --structmoe-backend dense-masked or "
                "grouped, or --structmoe-compile none")
    return None


def routed(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, routing: Routing,
           backend: str = "dense-masked") -> torch.Tensor:
    """``sum_{l in topk(x)} s_l(x) x A_l B_l`` on one rank."""
    codes_fn, expand_fn = backend_stages(backend)
    return expand_fn(codes_fn(x, a, routing), b, routing)
