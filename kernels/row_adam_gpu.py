"""The GPU tier's sparse AdamW step of touched rows over every layer at once, in one kernel.

The plain-PyTorch reference (:func:`sparse_adamw_rows_reference`) is what
``megatron_ext/stem/runtime/row_adam.py`` runs (``RowAdamW._step_stacked``): gather the rows and
their moments (``index_select``), bring them up to date (``catch_up_rows``), step them
(``_torch_adamw``), scatter them back: about 25 kernels, each a pass over ``[layers, rows,
width]``. The fused path (:func:`sparse_adamw_rows`, ``_row_adam_gpu_triton.py``) reads each
row, its moments and its gradient once and writes the row and moments once, in place.

Exactness: the kernel computes each op as PyTorch's CUDA kernels do (see the Triton module), so
on a GPU it is meant to give the torch path's bits; that needs a GPU to check
(``tests/test_row_adam_gpu.py``, marked). Under Triton's interpreter on the CPU it agrees within
a few ulp, not bitwise: the interpreter's ``fma`` is NumPy's multiply then add (two roundings),
and PyTorch's CPU kernels round their ``add(alpha)``/``addcmul``/``addcdiv`` otherwise (fused
multiply-adds in their vectorised loops, ``(value * t1) / t2`` in ``addcdiv``). So the torch path
stays the default; the kernel is chosen with ``RowAdamW``'s ``gpu_kernel="triton"`` until a GPU
run has measured it.
"""

from __future__ import annotations

import math

import torch

from megatron_ext_kernels._triton_runtime import available, interpreted, kernels

BLOCK = 1024  # columns per program


def sparse_adamw_rows_reference(p, m, v, g, index, factors, lr, beta1, beta2, eps,
                                weight_decay, step):
    """``p``, ``m``, ``v``: ``[layers, R, W]`` fp32 (updated in place at rows ``index``);
    ``g``: ``[layers, n, W]`` the rows' gradients; ``factors``: ``[5, layers, n]`` fp32 (the
    catch-up's owed decay, momentum move, moment scales and eps: ``RowClock.coefficients``)."""
    owed, move, m_scale, v_scale, row_eps = (f.unsqueeze(-1) for f in factors.unbind(0))
    pr, mr, vr = (x.index_select(1, index) for x in (p, m, v))
    ratio = torch.where(vr > 0, mr / (vr.sqrt() + row_eps), torch.zeros_like(mr))
    pr, mr, vr = pr * owed - move * ratio, mr * m_scale, vr * v_scale
    pr.mul_(1.0 - lr * weight_decay)
    mr.mul_(beta1).add_(g, alpha=1.0 - beta1)
    vr.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    pr.addcdiv_(mr, vr.sqrt() / bc2_sqrt + eps, value=-lr / bc1)
    p[:, index], m[:, index], v[:, index] = pr, mr, vr


def _fp32_reciprocal(x: float) -> float:
    """``1 / x`` as PyTorch's CUDA division by a scalar computes it: in fp32, of ``x`` in fp32."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(x, dtype=torch.float32))


def usable(p: torch.Tensor) -> bool:
    """Whether the kernel can step ``p``'s rows here: Triton and a CUDA tensor (or the CPU under
    the interpreter)."""
    return available() and (p.is_cuda or interpreted())


def sparse_adamw_rows(p, m, v, g, index, factors, lr, beta1, beta2, eps, weight_decay,
                      step) -> None:
    """:func:`sparse_adamw_rows_reference` in one kernel (same arguments). Rows must be
    unique (each is read and written by its own programs)."""
    layers, _, width = p.shape
    n = index.numel()
    if n == 0:
        return
    for x in (p, m, v, g):
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            raise ValueError("the GPU tier's row kernel takes fp32 tensors with contiguous rows")
    if g.shape != (layers, n, width) or factors.shape != (5, layers, n):
        raise ValueError(f"row kernel: gradients {tuple(g.shape)} and factors "
                         f"{tuple(factors.shape)} for {layers} layers x {n} rows x {width}")
    factors = factors.to(torch.float32).contiguous()
    index = index.to(torch.int64).contiguous()
    bc1 = 1.0 - beta1 ** step
    grid = (layers * n, (width + BLOCK - 1) // BLOCK)
    kernels("_row_adam_gpu_triton").sparse_adamw_rows[grid](
        p, m, v, g, index, factors, n, width,
        p.stride(0), p.stride(1), m.stride(0), m.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), factors.stride(0), factors.stride(1),
        1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
        _fp32_reciprocal(math.sqrt(1.0 - beta2 ** step)), eps, -lr / bc1,
        BLOCK=BLOCK, enable_fp_fusion=False)
