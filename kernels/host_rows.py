"""Rows of a host table read by a GPU kernel: ``src[index]`` cast to the model's dtype, with
``src`` in host memory and ``index`` and the result on the GPU, in one kernel that reads the rows
over the bus itself (``--stem-host-read direct``, ``stem/runtime/store.py``).

The staged read it stands beside (``store.gather_rows``) gathers the rows on the CPU into a
pinned staging buffer, then the copy engine moves the buffer. Here the CPU does nothing per row:
through unified virtual addressing a page-locked host address is also a device address, so a
kernel given the host tensor loads its rows as it loads device memory (vLLM reads its Engram
tables for inference so, through a CUDA view of pinned memory: ``cudaHostGetDevicePointer``;
FBGEMM's UVM embeddings likewise). Triton takes the host tensor itself: its launcher asks the
driver for the device address of every pointer argument (``cuPointerGetAttribute``), which
pinned and registered memory have and pageable memory has not.

What the host memory needs: to be page-locked and mapped. PyTorch's pinned allocator
(``pin_memory``: ``cudaHostAlloc``, default flags) gives that under UVA, where every
page-locked allocation is mapped; memory allocated elsewhere (the store's host shards, mappings
of their own on huge pages, ``stem/runtime/host_memory.py``) is made so in place by
``cudaHostRegister`` (:func:`register`), which pins its pages (faulting in any not yet there)
for as long as the registration lives. Pinned pages cannot be swapped or migrated;
``MADV_DONTFORK`` (which the store's mappings have) keeps a forked child from sharing them.

The plain-PyTorch reference is :func:`host_rows_reference`; on the CPU the kernel runs under
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors and gives the reference's bits
(``tests/test_host_rows.py``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from megatron_ext_kernels._triton_runtime import available, interpreted, kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROWS = 4  # rows per program on a GPU
# Under the interpreter, which runs the programs one after another in Python: more rows per
# program, fewer programs (the row mask is still exercised by every ragged count).
INTERPRETED_ROWS = 32


def _kernels():
    return kernels("_host_rows_triton")


def host_rows_reference(src: torch.Tensor, index: torch.Tensor,
                        dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``src[index]`` as ``dtype``, on ``index``'s device: what the kernel computes."""
    rows = src[index.to(device=src.device, dtype=torch.long)]
    return rows.to(device=index.device, dtype=dtype or src.dtype)


def addressable(src: torch.Tensor) -> bool:
    """Whether a GPU kernel can read the host tensor ``src`` in place: page-locked memory
    (PyTorch's pinned allocator or a ``cudaHostRegister``ed range: ``is_pinned`` asks the
    driver, ``cudaPointerGetAttributes``)."""
    return src.device.type == "cpu" and torch.cuda.is_available() and src.is_pinned()


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _check(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor],
           positions: Optional[torch.Tensor], n_out: int) -> None:
    if src.dim() != 2 or src.device.type != "cpu" or src.dtype not in DTYPES or \
            src.stride(-1) != 1:
        raise ValueError(f"host rows: the source must be a 2-D host tensor of fp32, bf16 or "
                         f"fp16 with contiguous rows; got {_describe(src)} on {src.device}")
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"host rows: the index must be 1-D int32/int64; got {_describe(index)}")
    if out is not None and (out.dim() != 2 or out.shape[1] != src.shape[1] or
                            out.shape[0] < n_out or out.stride(-1) != 1 or
                            out.device != index.device or out.dtype not in DTYPES):
        raise ValueError(f"host rows: out {_describe(out)} on {out.device} does not take "
                         f"{n_out} rows of width {src.shape[1]} on {index.device}")
    if positions is not None and (positions.shape != index.shape or
                                  positions.device != index.device):
        raise ValueError("host rows: positions must match the index in shape and device")
    if index.is_cuda:
        if not addressable(src):
            raise ValueError(f"host rows: the direct read needs host memory the GPU can "
                             f"address (pinned, or registered with cudaHostRegister); this "
                             f"{_describe(src)} tensor is pageable: pin or register it, or use "
                             f"the staged read (--stem-host-read staged)")
    elif not interpreted():
        raise ValueError("host rows: the direct read runs with the index on a CUDA device (on "
                         "the CPU only under TRITON_INTERPRET=1); use the staged read "
                         "(--stem-host-read staged)")
    if not available():
        raise RuntimeError("host rows: the direct read needs Triton; use the staged read "
                           "(--stem-host-read staged)")


def gather_host_rows(src: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None,
                     dtype: Optional[torch.dtype] = None,
                     positions: Optional[torch.Tensor] = None,
                     block_c: Optional[int] = None) -> torch.Tensor:
    """``out[positions[j]] = src[index[j]]`` cast to ``out``'s dtype (``positions``: ``j``),
    queued on the current stream; returns ``out``, by default a new ``[len(index), width]``
    tensor of ``dtype`` (``src``'s by default) on ``index``'s device. ``src``: a host tensor the
    GPU can address (:func:`addressable`; on the CPU under the interpreter, any); ``out``: rows
    of contiguous columns, e.g. a column block of a wider tensor. Indices are not checked
    against ``src``'s rows (that would wait for the GPU): the caller's are its own local rows.
    ``block_c``: columns per program (a power of two; default up to 1024)."""
    n = index.numel()
    _check(src, index, out, positions, n if positions is None else 0)
    if out is None:
        out = torch.empty(n, src.shape[1], dtype=dtype or src.dtype, device=index.device)
    if n == 0 or src.shape[1] == 0:
        return out
    width = src.shape[1]
    block_c = block_c or min(1024, 1 << max(0, (width - 1).bit_length()))
    idx = index if index.is_contiguous() else index.contiguous()
    pos = idx if positions is None else positions.contiguous()
    rows = INTERPRETED_ROWS if src.device == index.device else ROWS
    grid = (-(-n // rows), -(-width // block_c))
    # 4 warps: a 4 x 1024 tile is 8 values per thread per load, no register pressure; what
    # bounds the read is the bus, which wants many loads in flight, i.e. many programs.
    _kernels().gather_host_rows[grid](
        src, idx, pos, out, n, width, src.stride(0), out.stride(0),
        HAS_POS=positions is not None, BLOCK_R=rows, BLOCK_C=block_c, num_warps=4)
    return out


def _unregister(address: int, keep: torch.Tensor) -> None:
    """Undo :func:`register` (``keep``: the tensor, held until now so that its memory is not
    unmapped while registered). At interpreter exit CUDA may be gone already: nothing to do."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001  (the process is ending; the driver frees it with it)
        pass
    del keep


def register(t: torch.Tensor, owner: object) -> Optional[weakref.finalize]:
    """Make the contiguous host tensor ``t`` readable by GPU kernels in place
    (``cudaHostRegister``, default flags: mapped and portable under UVA) until ``owner`` is
    collected; returns the finalizer that unregisters it (None: ``t`` is addressable already).
    Raises ``ValueError`` naming the size and the driver's error where the driver refuses (no
    UVA, a locked-memory limit, a range already registered). Each page of ``t`` is pinned, so
    this costs a page-table walk of all of it (measured by ``benchmarks/stem_host_read.py``)."""
    if addressable(t):
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"host rows: only a contiguous host tensor can be registered; got "
                         f"{_describe(t)} on {t.device}")
    address, size = t.data_ptr(), t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, size, 0)
    if int(err) != 0:
        raise ValueError(f"host rows: cudaHostRegister of {size / 2**30:.2f} GiB of host rows "
                         f"failed ({cudart.cudaGetErrorString(err)}); use the staged read "
                         f"(--stem-host-read staged)")
    return weakref.finalize(owner, _unregister, address, t)
