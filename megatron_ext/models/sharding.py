"""Distributed-checkpoint layout of MLPs that own parameters besides Megatron's linears.

Extends the logic of ``megatron.core.transformer.mlp.MLP.sharded_state_dict``: children (fc1/fc2)
give their own sharded tensors (a gated fc1 gets upstream's SwiGLU factory so that ``[gate; up]``
reshards across TP sizes), and the module's own parameters are wrapped with the TP axis they are
split along (``None`` = replicated across TP).
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)


def mlp_sharded_state_dict(module, prefix: str, sharded_offsets: tuple, metadata: Optional[dict],
                           own_params_tp_axis: Dict[str, Optional[int]],
                           gated_fc1: bool) -> ShardedStateDict:
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
    sharded: ShardedStateDict = {}
    for name, child in module._modules.items():
        sub_sd = sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata)
        if gated_fc1 and name == "linear_fc1":
            key = f"{prefix}{name}.weight"
            sub_sd[key] = apply_swiglu_sharded_factory(
                sub_sd[key], sharded_offsets, singleton_local_shards,
                tp_group=module.tp_group, dp_group=metadata["dp_cp_group"])
        sharded.update(sub_sd)
    own = {name: getattr(module, name) for name in own_params_tp_axis}
    axis_map = {name: axis for name, axis in own_params_tp_axis.items() if axis is not None}
    sharded.update(make_sharded_tensors_for_checkpoint(
        own, prefix, axis_map, sharded_offsets, tp_group=module.tp_group,
        dp_cp_group=metadata["dp_cp_group"]))
    return sharded
