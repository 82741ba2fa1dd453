"""Fused STEM lookup-and-gate: ``silu(W_g x) * U[t]`` in one kernel, forward and backward.

The plain-PyTorch reference (:func:`stem_gate_reference`) is what ``StemMLP`` computes without
the kernel: gather the rows (``F.embedding``), cast them to the model's dtype, apply the variant's
gate. The fused path (:func:`stem_gate`, Triton kernels in ``_stem_gate_triton.py``):

* forward: one pass reads ``linear_fc1``'s output and the token's table row and writes the gated
  product; nothing but the inputs is kept for backward (the reference keeps the gathered rows and
  the activation);
* backward: the tokens are sorted by table row on the device (``torch.sort``, no host sync) and
  cut into chunks of ``BwdTile.chunk`` sorted positions; one program per chunk and column block
  writes its tokens' ``linear_fc1`` gradients and sums their row gradients per run of equal rows
  with a segmented scan, in fp32. Every program does the same work whatever the ids: with
  Zipf-distributed ids the most frequent row has hundreds of tokens, and the previous design (one
  program walking each distinct row's tokens) waited on that walk (docs/benchmarks.md, STEM MLP).
  A run inside a chunk goes straight into its destination row: Megatron's ``main_grad`` of an
  ordinary table (as ``megatron.core.tensor_parallel.layers``' gradient accumulation fusion does
  for linear weights), the ``[U, F]`` gradient of a managed table's unique rows, or, for a bare
  parameter without ``main_grad``, the dense gradient autograd requires of it. A run that
  crosses a chunk edge leaves a partial sum per chunk, which a second, small kernel adds up in
  chunk order into the row. No per-token row gradient and no ``[vocab, F]`` temporary is
  materialised, and the result does not depend on thread scheduling (no atomics).

Differences to the reference are rounding only: the kernel keeps fp32 between the activation and
the product, where the reference rounds each op to the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron_ext_kernels._triton_runtime import available, interpreted, kernels
from megatron_ext_kernels._triton_runtime import offline_build as _offline_build

VARIANTS = {"up": 0, "gate": 1, "dagger": 2}

def _kernels():
    return kernels("_stem_gate_triton")


def stem_gate_reference(fc1_out: torch.Tensor, table: torch.Tensor, index: torch.Tensor,
                        variant: str = "up") -> torch.Tensor:
    """Plain PyTorch: ``fc1_out [..., W]``, ``table [R, F]``, ``index [...]`` into the table rows;
    ``W = F`` (up, gate) or ``2 F`` (dagger: ``[gate | up]`` as Megatron's gated ``linear_fc1``)."""
    return gate_product(fc1_out, F.embedding(index, table), variant, F.silu, fc1_out.dtype)


def gate_product(fc1_out: torch.Tensor, rows: torch.Tensor, variant: str = "up",
                 activation=F.silu, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The variant's gated product of ``linear_fc1``'s output and the gathered table rows (cast
    to ``dtype`` first, where given): the PyTorch path's ops after the gather (``StemMLP``), the
    region ``--stem-compile gate`` compiles (cast, activation and product in one kernel forward,
    their gradients in one or two backward; the gather and its row-sparse backward stay
    eager)."""
    if dtype is not None:
        rows = rows.to(dtype)
    if variant == "up":
        return activation(fc1_out) * rows
    if variant == "gate":
        return activation(rows) * fc1_out
    if variant == "dagger":  # Eq. 5
        gate, up = torch.chunk(fc1_out, 2, dim=-1)
        return activation(gate) * (up + rows)
    raise ValueError(f"unknown STEM variant {variant!r}")


def _check(fc1_out: torch.Tensor, table: torch.Tensor, index: torch.Tensor, variant: str) -> int:
    if variant not in VARIANTS:
        raise ValueError(f"unknown STEM variant {variant!r}: one of {', '.join(VARIANTS)}")
    width = table.shape[-1] * (2 if variant == "dagger" else 1)
    if table.dim() != 2 or fc1_out.shape[-1] != width:
        raise ValueError(f"STEM gate: linear_fc1 output width {fc1_out.shape[-1]} does not fit a "
                         f"{variant!r} table of shape {tuple(table.shape)}")
    if tuple(fc1_out.shape[:-1]) != tuple(index.shape):
        raise ValueError(f"STEM gate: ids of shape {tuple(index.shape)} for linear_fc1 output of "
                         f"shape {tuple(fc1_out.shape)}")
    if fc1_out.device != table.device or index.device != table.device:
        raise ValueError("STEM gate: fc1 output, table and ids must be on one device")
    if not fc1_out.is_cuda and not interpreted():
        raise ValueError("STEM gate: the fused kernel runs on CUDA tensors (or on the CPU under "
                         "TRITON_INTERPRET=1); these are on the CPU: use the PyTorch path")
    return VARIANTS[variant]


ROWS = 4  # tokens per program tile of the forward
SPAN = 8  # chunk partials the backward's carry pass adds per step


class BwdTile(NamedTuple):
    """The backward's program tile: ``chunk`` sorted token positions (the most any program
    handles, whatever the ids) by ``block_f`` columns, on ``num_warps`` warps. The default keeps
    16 elements per thread and tensor: in bf16 at F = 5632, 80 (up) to 96 registers on sm_90, 96
    to 120 on sm_80, no spills (``offline_build``), so that four to six programs fit an SM
    (16,128,8 and 16,256,4 took 110-255 registers). ``benchmarks/stem_mlp.py --gate-tiles``
    times others on a GPU."""

    chunk: int = 16
    block_f: int = 128
    num_warps: int = 4


BWD_TILE = BwdTile()


def _blocks(n_cols: int):
    """Forward: column block, grid width and warps. A ``[ROWS, BLOCK_F]`` tile with about 16
    elements per thread and tensor: at BLOCK_F = 1024 with 8 warps it compiles for sm_80 and
    sm_90 without register spills (``offline_build``; 4 warps spilled)."""
    block_f = min(1024, _next_power_of_2(n_cols))
    num_warps = max(1, min(8, block_f * ROWS // 512))
    return block_f, _cdiv(n_cols, block_f), num_warps


def _bwd_blocks(n_cols: int, tile: BwdTile):
    """Backward: column block, grid width and warps for ``tile`` (fewer warps for a narrow
    table: about 16 elements per thread and tensor)."""
    block_f = min(tile.block_f, _next_power_of_2(n_cols))
    num_warps = max(1, min(tile.num_warps, block_f * tile.chunk // 512))
    return block_f, _cdiv(n_cols, block_f), num_warps


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


class StemGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out, table, index, variant_id, dst_hint, tile):
        shape = fc1_out.shape
        fc1 = fc1_out.reshape(-1, shape[-1])
        if fc1.stride(-1) != 1:
            fc1 = fc1.contiguous()
        ids = index.reshape(-1)
        tab = table if table.stride(-1) == 1 else table.contiguous()
        n, n_cols = fc1.shape[0], tab.shape[1]
        out = torch.empty(n, n_cols, dtype=fc1_out.dtype, device=fc1_out.device)
        if n:
            block_f, grid_f, num_warps = _blocks(n_cols)
            _kernels().stem_gate_fwd[(_cdiv(n, ROWS), grid_f)](
                fc1, tab, ids, out, n, n_cols, fc1.stride(0), tab.stride(0), out.stride(0),
                VARIANT=variant_id, BLOCK_N=ROWS, BLOCK_F=block_f, num_warps=num_warps)
        ctx.save_for_backward(fc1, ids)
        ctx.table = table
        ctx.variant_id = variant_id
        ctx.shape = shape
        ctx.dst_hint = dst_hint
        ctx.tile = tile
        return out.view(*shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, grad_out):
        fc1, ids = ctx.saved_tensors
        table = ctx.table
        tab = table if table.stride(-1) == 1 else table.contiguous()
        n, n_cols = fc1.shape[0], tab.shape[1]
        grad = grad_out.reshape(n, n_cols)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        main_grad = getattr(table, "main_grad", None) if ctx.dst_hint == "main_grad" else None
        if main_grad is not None:
            dst = main_grad
        else:
            # The gradient autograd expects of the table (dense only for a bare parameter, the
            # unique rows' [U, F] for a managed table), accumulated in fp32.
            dst = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
        dfc1 = torch.empty_like(fc1)
        if n:
            # Tokens sorted by row on the device (no host sync); stable, so that the order of
            # the tokens of a row, and with it every sum, is the same in every call.
            ordered, order = torch.sort(ids, stable=True)
            tile = ctx.tile
            n_chunks = _cdiv(n, tile.chunk)
            # Per chunk, the partial row sums of the runs that cross its edges (read only
            # where the kernel wrote them).
            part = torch.empty(2 * n_chunks, n_cols, dtype=torch.float32, device=grad.device)
            block_f, grid_f, num_warps = _bwd_blocks(n_cols, tile)
            k = _kernels()
            k.stem_gate_bwd[(n_chunks, grid_f)](
                grad, fc1, tab, order, ordered, dfc1, dst, part, n, n_cols,
                grad.stride(0), fc1.stride(0), tab.stride(0), dfc1.stride(0), dst.stride(0),
                VARIANT=ctx.variant_id, CHUNK=tile.chunk, BLOCK_F=block_f, num_warps=num_warps)
            if n_chunks > 1:
                k.stem_gate_bwd_carry[(n_chunks, grid_f)](
                    ordered, part, dst, n, n_cols, n_chunks, dst.stride(0),
                    CHUNK=tile.chunk, SPAN=SPAN, BLOCK_F=block_f, num_warps=num_warps)
        if main_grad is not None:
            table.grad_added_to_main_grad = True
            # Never read: DDP's hook skips it because grad_added_to_main_grad is set.
            grad_table = torch.empty(table.shape, dtype=table.dtype, device=table.device)
        else:
            grad_table = dst.to(table.dtype)
        return dfc1.view(ctx.shape), grad_table, None, None, None, None


def stem_gate(fc1_out: torch.Tensor, table: torch.Tensor, index: torch.Tensor,
              variant: str = "up", accumulate_main_grad: bool = True,
              bwd_tile: Optional[BwdTile] = None) -> torch.Tensor:
    """Fused ``stem_gate_reference``. ``table`` is a table parameter (its row gradients go into
    ``table.main_grad`` when Megatron's DDP has set one up and ``accumulate_main_grad``) or a
    managed table's unique rows (``index`` = the inverse into them). ``bwd_tile``: the
    backward's program tile (``BWD_TILE`` unless given)."""
    variant_id = _check(fc1_out, table, index, variant)
    if not available():
        raise RuntimeError("the fused STEM kernel needs Triton and a CUDA device (or "
                           "TRITON_INTERPRET=1 on the CPU); use the PyTorch path")
    return StemGate.apply(fc1_out, table, index, variant_id,
                          "main_grad" if accumulate_main_grad else None, bwd_tile or BWD_TILE)


def resolve(kernel: str, activation=None) -> str:
    """``--stem-kernel``: ``auto`` is the PyTorch path (on an H100, 2026-11-24, the fused
    lookup-and-gate took 1.76 ms against PyTorch's 0.92 ms, and the whole STEM MLP 3.10 against
    2.62 ms: docs/results/gpu_2026-11-24_h100); ``triton`` insists on the kernel (it saves the
    ``[vocab, d_ff]`` gradient temporary; on the CPU only under ``TRITON_INTERPRET=1``);
    ``torch`` forces the reference."""
    silu = activation is None or activation is F.silu
    if kernel in ("torch", "auto"):
        return "torch"
    if kernel != "triton":
        raise ValueError(f"--stem-kernel={kernel!r}: one of auto, triton, torch")
    if not silu:
        raise ValueError("--stem-kernel=triton: the fused kernel computes SiLU (SwiGLU, --swiglu); "
                         "use --stem-kernel torch for another activation")
    if not available():
        raise ValueError("--stem-kernel=triton needs Triton with a CUDA device (or "
                         "TRITON_INTERPRET=1 on the CPU)")
    return "triton"



def offline_build(arch: int, dtype: str = "bf16", variant: str = "up", n_cols: int = 5632,
                  bwd_tile: Optional[BwdTile] = None) -> dict:
    """The kernels compiled for ``sm_<arch>`` without a GPU, with the launch options
    ``stem_gate`` uses for ``n_cols`` columns: per kernel, its registers, shared and local memory
    (``_triton_runtime.offline_build``), warps and column block. The column count and the
    row strides are built as divisible by 16, as a launch specialises them at ``n_cols`` a
    multiple of 16 (5632, and its TP splits down to 704): the loads are then vectorised."""
    k = _kernels()
    tile = bwd_tile or BWD_TILE
    block_f, _, num_warps = _blocks(n_cols)
    bwd_f, _, bwd_warps = _bwd_blocks(n_cols, tile)
    variant_id = VARIANTS[variant]
    builds = {
        "stem_gate_fwd": (k.stem_gate_fwd,
                          dict(fc1_ptr=dtype, tab_ptr=dtype, idx_ptr="i64", out_ptr=dtype),
                          ("n_tokens", "n_cols", "stride_fc1", "stride_tab", "stride_out"),
                          dict(VARIANT=variant_id, BLOCK_N=ROWS, BLOCK_F=block_f), num_warps),
        "stem_gate_bwd": (k.stem_gate_bwd,
                          dict(grad_ptr=dtype, fc1_ptr=dtype, tab_ptr=dtype, order_ptr="i64",
                               sorted_ptr="i64", dfc1_ptr=dtype, dst_ptr="fp32",
                               part_ptr="fp32"),
                          ("n_tokens", "n_cols", "stride_grad", "stride_fc1", "stride_tab",
                           "stride_dfc1", "stride_dst"),
                          dict(VARIANT=variant_id, CHUNK=tile.chunk, BLOCK_F=bwd_f), bwd_warps),
        "stem_gate_bwd_carry": (k.stem_gate_bwd_carry,
                                dict(sorted_ptr="i64", part_ptr="fp32", dst_ptr="fp32"),
                                ("n_tokens", "n_cols", "n_chunks", "stride_dst"),
                                dict(CHUNK=tile.chunk, SPAN=SPAN, BLOCK_F=bwd_f), bwd_warps),
    }
    aligned = ("n_cols",) + tuple(i for ints in (b[2] for b in builds.values()) for i in ints
                                  if i.startswith("stride"))
    return {name: dict(_offline_build(fn, ptrs, ints, consts, arch, dict(num_warps=warps),
                                      tuple(a for a in aligned if a in ints)),
                       num_warps=warps, BLOCK_F=consts["BLOCK_F"])
            for name, (fn, ptrs, ints, consts, warps) in builds.items()}


def runs_on(fc1_out: torch.Tensor) -> bool:
    """Whether the fused kernel can take these activations: CUDA tensors, or any under Triton's
    interpreter. A module built for the kernel on a CUDA machine but run on the CPU (a test, a
    CPU-side export) takes the PyTorch path instead."""
    return fc1_out.is_cuda or interpreted()
