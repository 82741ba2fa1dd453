"""The hybrid path: upstream's ``HybridModel`` and ``HybridStack`` (``megatron.core.models.hybrid``,
what megatron-core 0.19 builds new models on; ``GPTModel`` is deprecated there), with the token
ids of each micro-batch given to token-indexed layers (STEM) and with per-layer specs.

Upstream has no way to pass token ids to a hybrid layer: ``HybridModel.forward`` calls its
decoder with fixed arguments (hybrid_model.py:515), ``HybridStack.forward`` calls the layers
without ``context`` and hands ``context=None`` to the full-recompute checkpoint
(hybrid_block.py:353). ``TokenIdsHybridStack`` passes the ids as ``context`` to every layer
and into the checkpoint, as ``TransformerBlock`` does on the GPT path, so a recomputed layer
sees the ids of its own micro-batch (saved by the checkpoint) under pipeline schedules; the
model hands them over to its stack for the one synchronous decoder call.

Upstream's stack holds one spec per layer symbol (every ``-`` the same MLP layer, every ``E`` the
same MoE layer); STEM puts its table in some MLP layers only, and Sigma gives each MoE layer its
own top-k (progressive sparsification, indexed by MoE block). ``LayerChoice`` is a spec slot that
builds, per global layer index, the layer spec given for that index, else the symbol's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.recompute import checkpointed_forward
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from megatron_ext.models.layer import TokenContextTransformerLayer
from megatron_ext.models.token_ids import TokenIdsMixin


class LayerChoice:
    """A layer slot of ``HybridStackSubmodules`` that builds ``by_index[layer_number - 1]`` (the
    global layer index in the pattern, ``|`` not counted) where given, else ``default``."""

    def __new__(cls, *, by_index: Dict[int, ModuleSpec], default: ModuleSpec, layer_number: int,
                **kwargs):
        return build_module(by_index.get(layer_number - 1, default), layer_number=layer_number,
                            **kwargs)


def layer_choice(default: ModuleSpec, by_index: Dict[int, ModuleSpec]) -> ModuleSpec:
    if not by_index:
        return default
    return ModuleSpec(module=LayerChoice, params=dict(by_index=by_index, default=default))


def spec_modules(spec: Any):
    """The layer classes a stack slot (a spec or a ``LayerChoice``) can build."""
    if isinstance(spec, ModuleSpec) and spec.module is LayerChoice:
        return [spec_modules(s)[0] for s in
                [spec.params["default"], *spec.params["by_index"].values()]]
    return [spec.module if isinstance(spec, ModuleSpec) else spec]


@dataclass
class TokenHybridStackSubmodules(HybridStackSubmodules):
    """Upstream's submodules plus the final norm (upstream builds Transformer Engine's ``TENorm``
    whatever the spec, hybrid_block.py:213, which has no CPU implementation)."""

    final_norm: Any = None


def stack_has_token_layers(stack_spec: ModuleSpec) -> bool:
    """Some layer of the stack (on any pipeline stage) is token-indexed."""
    sub = stack_spec.submodules
    slots = [getattr(sub, name) for name in ("attention_layer", "mlp_layer", "moe_layer")]
    return any(isinstance(m, type) and issubclass(m, TokenContextTransformerLayer)
               for slot in slots for m in spec_modules(slot))


class TokenIdsHybridStack(HybridStack):
    """Extends ``megatron.core.models.hybrid.hybrid_block.HybridStack``: the final norm from the
    spec, and the token ids (``take_token_ids``) passed to every layer as ``context``."""

    def __init__(self, config, submodules: TokenHybridStackSubmodules, *args,
                 post_layer_norm: bool = True, **kwargs):
        if config.fp8 or config.fp4:
            raise ValueError("the hybrid path of megatron-ext does not support --fp8-format / "
                             "--fp4-format yet")
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and self.post_layer_norm:
            self.final_norm = build_module(
                submodules.final_norm, config=self.config, hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon)
        self._token_ids: Optional[torch.Tensor] = None

    def take_token_ids(self, token_ids: Optional[torch.Tensor]) -> None:
        """The ids ``[s, b]`` of the micro-batch of the next ``forward`` call (one call)."""
        self._token_ids = token_ids

    def forward(self, hidden_states, attention_mask, inference_context=None, rotary_pos_emb=None,
                *, inference_params=None, packed_seq_params=None, padding_mask=None):
        token_ids, self._token_ids = self._token_ids, None
        if token_ids is None:  # no token-indexed layer on this chunk: upstream's forward
            return super().forward(hidden_states, attention_mask, inference_context,
                                   rotary_pos_emb, inference_params=inference_params,
                                   packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        inference_context = inference_context or inference_params
        if not self.pre_process:
            hidden_states = self.input_tensor  # set_input_tensor (pipeline schedules)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if self.config.recompute_granularity == "full" and self.training:
            # The ids are an argument of the checkpoint, so its recompute in backward sees them.
            hidden_states = checkpointed_forward(
                self, hidden_states=hidden_states, attention_mask=attention_mask,
                context=token_ids, context_mask=None, rotary_pos_emb=rotary_pos_emb,
                attention_bias=None, packed_seq_params=packed_seq_params,
                padding_mask=padding_mask, use_inner_quantization_context=False)
        else:
            for layer in self.layers:
                if not isinstance(layer, TransformerLayer):
                    raise ValueError(f"{type(layer).__name__}: only transformer-style layers "
                                     "(*, -, E) can share a stack with token-indexed layers")
                hidden_states, _ = layer(
                    hidden_states=hidden_states, attention_mask=attention_mask,
                    context=token_ids, inference_context=inference_context,
                    rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        # Viewless between pipeline stages, as upstream (TransformerBlock, HybridStack).
        return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad,
                                    keep_graph=True)


class TokenIdsHybridModel(TokenIdsMixin, HybridModel):
    """Extends ``megatron.core.models.hybrid.hybrid_model.HybridModel`` (its stack a
    ``TokenIdsHybridStack``): the micro-batch's ids (``models/token_ids.py``) go to the stack
    when this chunk holds token-indexed layers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.decoder, TokenIdsHybridStack):
            raise TypeError("TokenIdsHybridModel needs a TokenIdsHybridStack stack spec")
        self.token_layers_here = any(isinstance(m, TokenContextTransformerLayer)
                                     for m in self.decoder.layers)

    @property
    def needs_token_ids(self) -> bool:
        """This chunk holds token-indexed layers (the forward step reads ids for them)."""
        return self.token_layers_here

    def forward(self, input_ids, position_ids, attention_mask, *args, token_rows=None,
                token_ids_checked=False, **kwargs):
        if self.token_layers_here:
            self.decoder.take_token_ids(self.block_context(input_ids, token_rows,
                                                           token_ids_checked))
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            self.decoder.take_token_ids(None)
