"""One line on rank 0 (as ``megatron.training.print_rank_0``, for code outside the trainer)."""

from __future__ import annotations

import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
