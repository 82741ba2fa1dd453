"""GPT-path checkpoints with one key per layer into the hybrid path.

Upstream's GPT/hybrid interoperation (``megatron.core.dist_checkpointing.gpt_checkpoint_interop``)
retargets a ``HybridModel``'s sharded state dict at a GPT checkpoint whose layers are stacked
(``decoder.layers.mlp.linear_fc1.weight`` with the layer as a leading axis), the format of
``TransformerBlock`` with homogeneous layers. A family whose layers differ (STEM: tables in some
layers only, ``Family.heterogeneous_layers``) saves each layer under its own key
(``decoder.layers.3.mlp.table``, ``config.hetereogenous_dist_checkpoint``), which upstream's
retargeting cannot find. ``retarget_to_layered_gpt_checkpoint`` does the same pairing (upstream's
``GPTCompatLayerMaps``: the i-th ``*`` and the i-th MLP position are GPT layer i) but keeps the
layer in the key: ``decoder.layers.<hybrid index>.`` becomes ``decoder.layers.<GPT layer>.``.
"""

from __future__ import annotations

import re

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.gpt_checkpoint_interop import GPTCompatLayerMaps
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedStateDict,
)

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_FINAL_NORM = ("decoder.final_norm.", "decoder.final_layernorm.")
_LOCAL_ONLY = ("output_layer._extra_state",)  # GPT checkpoints omit it (as upstream)


def retarget_to_layered_gpt_checkpoint(sharded_state_dict: ShardedStateDict,
                                       layer_maps: GPTCompatLayerMaps) -> None:
    """Point a hybrid model's (or its optimizer's) sharded state dict at a GPT checkpoint saved
    with one key per layer, in place; only the storage keys change."""

    def retarget(entry):
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_LOCAL_ONLY):
            return LocalNonpersistentObject(entry.data)
        match = _LAYER.search(entry.key)
        if match is not None:
            index = int(match.group(1))
            if index in layer_maps.fresh_init:
                return LocalNonpersistentObject(entry.data)
            gpt = layer_maps.attention_to_gpt.get(index, layer_maps.mlp_to_gpt.get(index))
            if gpt is None:
                raise ValueError(f"{entry.key}: hybrid layer {index} has no GPT layer in the "
                                 "pattern the model was built with")
            entry.key = f"{entry.key[:match.start()]}decoder.layers.{gpt}.{entry.key[match.end():]}"
            return entry
        hybrid, gpt = _FINAL_NORM
        if hybrid in entry.key:
            entry.key = entry.key.replace(hybrid, gpt, 1)
        return entry

    dict_list_map_inplace(retarget, sharded_state_dict)
