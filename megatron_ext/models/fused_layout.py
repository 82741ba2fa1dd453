"""Megatron's fused tensor layouts and their Hugging Face halves (the classic conversion bugs).

* ``linear_qkv.weight`` ``[ng * (nh/ng + 2) * hd, H]``: for each of the ``ng`` query groups, the
  ``nh/ng`` query heads of that group, then its key head, then its value head
  (``megatron.core.transformer.attention.SelfAttention.get_query_key_value_tensors``). Tensor
  parallelism splits it by whole groups, so the global (checkpoint) tensor has this layout for
  every TP size.
* A gated ``linear_fc1.weight`` ``[2F, H]`` is ``[gate; up]`` in a checkpoint: upstream's
  ``apply_swiglu_sharded_factory`` saves each TP rank's gate half and up half at the offsets of a
  global ``[W_gate; W_up]``, so the global tensor does not depend on the TP size either.

Knowledge of the model's own tensors, so it lives in ``models/``: the converters
(``convert/to_hf.py``, ``convert/from_hf.py``) and a family's export terms (``sigma/family.py``)
split and merge with it.
"""

from __future__ import annotations

from typing import Tuple

import torch


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[ng*(nh/ng+2)*hd, H]`` -> q ``[nh*hd, H]``, k ``[ng*hd, H]``, v ``[ng*hd, H]``."""
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} attention heads are not divisible into {num_groups} "
                         "query groups")
    per_group = num_heads // num_groups
    expected = num_groups * (per_group + 2) * head_dim
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv has {qkv.shape[0]} rows; {num_heads} heads, {num_groups} "
                         f"groups and head dim {head_dim} need {expected}")
    grouped = qkv.reshape(num_groups, per_group + 2, head_dim, -1)
    q = grouped[:, :per_group].reshape(num_heads * head_dim, -1)
    k = grouped[:, per_group].reshape(num_groups * head_dim, -1)
    v = grouped[:, per_group + 1].reshape(num_groups * head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_groups: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    per_group = num_heads // num_groups
    hidden = q.shape[-1]
    grouped = torch.cat([
        q.reshape(num_groups, per_group, head_dim, hidden),
        k.reshape(num_groups, 1, head_dim, hidden),
        v.reshape(num_groups, 1, head_dim, hidden),
    ], dim=1)
    return grouped.reshape(num_groups * (per_group + 2) * head_dim, hidden).contiguous()


def split_gated_fc1(fc1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's gated ``linear_fc1.weight`` ``[2F, ...]`` -> (gate, up)."""
    if fc1.shape[0] % 2:
        raise ValueError(f"a gated linear_fc1 has an even number of rows, not {fc1.shape[0]}")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def merge_gated_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_gated_fc1`."""
    return torch.cat([gate, up], dim=0).contiguous()
