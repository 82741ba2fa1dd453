"""Host-to-GPU copies of the small tensors the tables move (indices, positions, factors) without
blocking the thread that queues them.

A plain ``.to("cuda")`` of a pageable host tensor synchronises the stream: the training thread
would wait for the GPU, the worker thread for the GPU tier's earlier kernels on its side stream.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to a GPU through pinned memory without blocking
    the host (PyTorch's pinned-memory allocator keeps the staging block until the copy ends)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
