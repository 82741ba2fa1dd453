"""A Sigma MoE layer: upstream's MoE layer with a top-k of its own.

Extends ``megatron.core.transformer.moe.moe_layer.MoELayer`` (router, experts and token dispatcher
are upstream's, the router class is ``SigmaRouter``). Upstream reads the top-k from the shared
``TransformerConfig`` (``moe_router_topk``), and its dispatchers size their buffers from it
(``num_out_tokens = tokens x moe_router_topk``). Progressive sparsification needs a different
top-k per layer that changes during a run, so each layer gets a shallow copy of the config with
its own ``moe_router_topk``; :meth:`set_topk` changes it in the copy, the router and the
dispatcher together. The dispatchers only read ``moe_*`` fields from that copy.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

from megatron_ext.sigma.config import SigmaConfig

class SigmaMoELayer(MoELayer):
    def __init__(self, config, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: Optional[str] = None, *,
                 sigma: SigmaConfig, layer_index: int):
        config = copy.copy(config)
        config.moe_router_topk = sigma.initial_topks()[layer_index]
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        self.layer_index = layer_index  # 0-based global layer
        self.router.layer_index = layer_index

    @property
    def topk(self) -> int:
        return self.config.moe_router_topk

    def set_topk(self, topk: int) -> None:
        if topk == self.config.moe_router_topk:
            return
        self.config.moe_router_topk = topk
        self.router.set_topk(topk)
        if hasattr(self.token_dispatcher, "router_topk"):
            self.token_dispatcher.router_topk = topk


def release_layers(layers) -> None:
    """After a training (the Sigma run's ``close``): drop the autograd graphs that upstream's token
    dispatchers keep from the last step (``MoEAlltoAllTokenDispatcher.probs``, megatron-core 0.19).
    Through such a graph the router weight's gradient accumulator holds Megatron DDP's gradient
    hook, which holds the model: a cycle through autograd's C++ side that Python's collector
    cannot free, so every finished Sigma model, with its process groups and their threads, stayed
    alive for the life of the process (57 gloo threads per rank per training in a test launch)."""
    for layer in layers:
        dispatcher = getattr(layer, "token_dispatcher", None)
        for name, value in list(vars(dispatcher).items() if dispatcher is not None else ()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(dispatcher, name, None)
