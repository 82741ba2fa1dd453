"""StructMoE's layer specs (``models/specs.py`` holds the generic pieces): the dense layer spec with
``StructMoEMLP`` as the MLP, built from the same fc1/fc2 builders, in every layer."""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.models.specs import LayerFn, with_mlp
from megatron_ext.structmoe.mlp import StructMoEMLP


def structmoe_layer_spec(dense: ModuleSpec, structmoe, mlp_block: Optional[int] = None,
                         num_mlp_blocks: Optional[int] = None) -> ModuleSpec:
    """A StructMoE layer: the dense layer (or the hybrid path's ``MLPLayer``) with a StructMoE MLP;
    ``mlp_block`` and ``num_mlp_blocks`` where the layers are not the MLP blocks (the hybrid path)."""
    return with_mlp(dense, StructMoEMLP.as_mlp_submodule, structmoe=structmoe,
                    mlp_block=mlp_block, num_mlp_blocks=num_mlp_blocks)


def structmoe_layers_fn(structmoe) -> LayerFn:
    """StructMoE in every layer (the paper augments each MLP)."""
    return lambda i, dense: structmoe_layer_spec(dense, structmoe)
