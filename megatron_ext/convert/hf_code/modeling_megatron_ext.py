"""Models exported by megatron-ext: a Llama-style decoder whose MLP differs per layer.

Self-contained: imports only ``torch`` and ``transformers``, because it is copied next to the
weights. The math of every MLP type is the one megatron-ext trains (``docs/convert.md``):

* ``dense``: ``down(act(gate x) * up x)`` (gated) or ``down(act(up x))``.
* ``stem`` (Eqs. 4-5 of the STEM paper), ``U`` a per-layer table indexed by the token id ``t``:
  up: ``down(act(gate x) * U[t])``; gate: ``down(act(U[t]) * up x)``;
  dagger: ``down(act(gate x) * (up x + U[t]))``.
* ``structmoe`` (Eqs. 5-6 of the StructMoE paper): fp32 router ``p = softmax(x W_R^T)``, top-k
  experts with weights ``p_l`` (not renormalised), ``R = sum_l p_l x A_l B_l``; additive:
  ``down(act(gate x + R) * up x)``; glu: ``down(act(gate x) * up x * (1 + R))`` (not gated:
  ``act(up x + R)`` / ``act(up x) * (1 + R)``).
* ``moe`` (Sigma): fp32 router, softmax then top-k (pre-softmax routing, weights are the
  probabilities, not renormalised), SwiGLU experts.

Attention: GQA, optional per-head RMSNorm of q and k (QK-norm) applied before RoPE (halves
rotated, as Megatron's non-interleaved RoPE), causal, scale ``1/sqrt(head_dim)``.
"""

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megatron_ext import MegatronExtConfig  # the file beside this one


def _activation(name):
    # Exact (erf) GELU: Megatron's default when --swiglu is off.
    return F.silu if name == "silu" else F.gelu


class MegatronExtRMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in fp32 like Megatron's fused RMSNorm."""

    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MegatronExtRotary(nn.Module):
    """RoPE angles for the given positions.

    The inverse frequencies are recomputed on every call rather than kept in a buffer:
    ``from_pretrained`` builds the model on the meta device and only re-initialises non-persistent
    buffers of modules it recognises by name, so a custom ``inv_freq`` buffer could come back
    uninitialised and silently switch RoPE off. The cost is a ``head_dim / 2`` vector per step.
    """

    def __init__(self, head_dim, theta):
        super().__init__()
        self.head_dim, self.theta = head_dim, float(theta)

    def forward(self, position_ids):
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                device=position_ids.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        angles = position_ids.float()[..., None] * inv_freq          # [b, s, hd/2]
        angles = torch.cat([angles, angles], dim=-1)                 # halves, not interleaved
        return angles.cos(), angles.sin()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x, cos, sin):
    """x ``[b, heads, s, hd]``; cos/sin ``[b, s, hd]`` (fp32, cast to x's dtype like HF Llama)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class MegatronExtAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        if config.qk_norm:
            self.q_norm = MegatronExtRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = MegatronExtRMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, past_key_values):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv, self.head_dim)
        if self.q_norm is not None:
            # Megatron's --qk-layernorm normalises each head before RoPE.
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        # KV head j serves query heads j*g .. j*g+g-1 (Megatron's query groups, HF's repeat_kv).
        groups = self.num_heads // self.num_kv
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


# ---------------------------------------------------------------------------------------------
# MLPs: one class per entry type of ``config.mlp_layers``; all take (x, token_ids).


class MegatronExtDenseMLP(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        h, f = config.hidden_size, spec["intermediate_size"]
        self.gated = config.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.act = _activation(config.hidden_act)

    def forward(self, x, token_ids=None):
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class MegatronExtStemMLP(nn.Module):
    """Eq. 4 (up, gate) and Eq. 5 (dagger) of the STEM paper: one input of the gated product
    comes from a per-layer table ``U [vocab, F]`` indexed by the token id."""

    def __init__(self, config, spec):
        super().__init__()
        h, f = config.hidden_size, spec["intermediate_size"]
        self.variant = spec["variant"]
        if self.variant in ("up", "dagger"):
            self.gate_proj = nn.Linear(h, f, bias=False)
        if self.variant in ("gate", "dagger"):
            self.up_proj = nn.Linear(h, f, bias=False)
        self.stem_table = nn.Embedding(config.vocab_size, f)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.act = _activation(config.hidden_act)

    def forward(self, x, token_ids=None):
        if token_ids is None:
            raise ValueError("STEM layers look rows up by token id: call the model with input_ids")
        rows = self.stem_table(token_ids).to(x.dtype)
        if self.variant == "up":
            inner = self.act(self.gate_proj(x)) * rows
        elif self.variant == "gate":
            inner = self.act(rows) * self.up_proj(x)
        else:
            inner = self.act(self.gate_proj(x)) * (self.up_proj(x) + rows)
        return self.down_proj(inner)


def _route(x, router_weight, top_k):
    """Router of StructMoE and Sigma: fp32 logits, softmax, top-k of the probabilities; the
    weights are the probabilities themselves (no renormalisation over the selected experts)."""
    probs = torch.softmax(x.float() @ router_weight.float().t(), dim=-1)
    return torch.topk(probs, top_k, dim=-1)


class MegatronExtStructMoEMLP(nn.Module):
    """Eqs. 5-6 of the StructMoE paper: a routed low-rank update ``R`` joins the first layer."""

    def __init__(self, config, spec):
        super().__init__()
        h, d = config.hidden_size, spec["intermediate_size"]
        n, r = spec["num_experts"], spec["rank"]
        self.gated = config.gated_mlp
        self.fusion = spec["fusion"]
        self.top_k = spec["top_k"]
        if self.gated:
            self.gate_proj = nn.Linear(h, d, bias=False)
        self.up_proj = nn.Linear(h, d, bias=False)
        self.down_proj = nn.Linear(d, h, bias=False)
        self.router = nn.Linear(h, n, bias=False)
        self.lore_a = nn.Parameter(torch.empty(n, h, r))
        self.lore_b = nn.Parameter(torch.empty(n, r, d))
        self.act = _activation(config.hidden_act)

    def routed(self, x):
        """``R(x) = sum_{l in topk} p_l x A_l B_l`` (Eq. 5 of the StructMoE paper), in fp32,
        returned in x's dtype. Only the selected experts are computed (loop over experts that
        got tokens), so memory stays linear in the tokens."""
        flat = x.reshape(-1, x.shape[-1]).float()
        weights, experts = _route(flat, self.router.weight, self.top_k)
        update = flat.new_zeros(flat.shape[0], self.lore_b.shape[-1])
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            codes = (flat[token] @ self.lore_a[e].float()) * weights[token, slot, None]
            update.index_add_(0, token, codes @ self.lore_b[e].float())
        return update.view(*x.shape[:-1], -1).to(x.dtype)

    def forward(self, x, token_ids=None):
        r = self.routed(x)
        up = self.up_proj(x)
        if self.gated:
            gate = self.gate_proj(x)
            if self.fusion == "additive":
                inner = self.act(gate + r) * up
            else:
                inner = self.act(gate) * up * (1.0 + r)
        elif self.fusion == "additive":
            inner = self.act(up + r)
        else:
            inner = self.act(up) * (1.0 + r)
        return self.down_proj(inner)


class MegatronExtExpert(nn.Module):
    def __init__(self, hidden, ffn, act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MegatronExtMoEMLP(nn.Module):
    """Sigma MoE layer: ``sum_k p_k expert_k(x)`` over the top-k of the fp32 softmax."""

    def __init__(self, config, spec):
        super().__init__()
        self.top_k = spec["top_k"]
        self.gate = nn.Linear(config.hidden_size, spec["num_experts"], bias=False)
        act = _activation(config.hidden_act)
        self.experts = nn.ModuleList(
            MegatronExtExpert(config.hidden_size, spec["intermediate_size"], act)
            for _ in range(spec["num_experts"]))

    def forward(self, x, token_ids=None):
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = _route(flat, self.gate.weight, self.top_k)
        out = torch.zeros_like(flat)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None].to(flat.dtype)
            out.index_add_(0, token, y)
        return out.view_as(x)


MLP_CLASSES = {"dense": MegatronExtDenseMLP, "stem": MegatronExtStemMLP,
               "structmoe": MegatronExtStructMoEMLP, "moe": MegatronExtMoEMLP}


class MegatronExtDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = MegatronExtRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MegatronExtAttention(config, layer_idx)
        self.post_attention_layernorm = MegatronExtRMSNorm(config.hidden_size,
                                                           config.rms_norm_eps)
        spec = config.mlp_layers[layer_idx]
        self.mlp = MLP_CLASSES[spec["type"]](config, spec)

    def forward(self, h, token_ids, cos, sin, mask, past_key_values):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h), token_ids)


# ---------------------------------------------------------------------------------------------
# models


class MegatronExtPreTrainedModel(PreTrainedModel):
    config_class = MegatronExtConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegatronExtDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        # nn.init is guarded by from_pretrained: weights read from the checkpoint are kept.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MegatronExtRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, MegatronExtStructMoEMLP):
            nn.init.normal_(module.lore_a, mean=0.0, std=std)
            nn.init.normal_(module.lore_b, mean=0.0, std=std)


class MegatronExtModel(MegatronExtPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MegatronExtDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = MegatronExtRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MegatronExtRotary(config.head_dim, config.rope_theta)
        self.has_stem = any(m["type"] == "stem" for m in config.mlp_layers)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None,
                output_hidden_states=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if input_ids is None and self.has_stem:
            raise ValueError("this model has STEM layers, which look rows up by token id: call it "
                             "with input_ids (inputs_embeds alone cannot be used)")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = h.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        cache = past_key_values if use_cache else None
        past = cache.get_seq_length() if isinstance(cache, Cache) else 0
        if position_ids is None:
            # Like HF Llama: positions continue after the cached tokens. generate() passes its
            # own (cumsum of the attention mask - 1), so left padding does not shift them.
            cache_position = kwargs.get("cache_position")  # older callers
            if cache_position is None:
                cache_position = torch.arange(past, past + s, device=h.device)
            position_ids = cache_position.unsqueeze(0)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        cos, sin = self.rotary(position_ids.expand(b, -1))
        mask = self._mask(attention_mask, b, s, past, h)
        hidden_states = (h,) if output_hidden_states else None
        for layer in self.layers:
            h = layer(h, input_ids, cos, sin, mask, cache)
            if output_hidden_states:
                hidden_states += (h,)
        h = self.norm(h)
        if output_hidden_states:
            # As HF Llama: the last entry is the normed output.
            hidden_states = hidden_states[:-1] + (h,)
        return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=cache,
                                       hidden_states=hidden_states)

    @staticmethod
    def _mask(attention_mask, b, s, past, h):
        """Additive ``[b, 1, s, past + s]`` float mask: causal, and padded keys (2-D mask, 1 =
        keep) hidden. A 4-D mask (e.g. from generate() with a static cache) is used as given.
        Rows with every key hidden (padding queries) get a finite minimum, so no NaN."""
        neg = torch.finfo(h.dtype).min
        if attention_mask is not None and attention_mask.dim() == 4:
            if attention_mask.dtype == torch.bool:
                return torch.zeros(attention_mask.shape, dtype=h.dtype,
                                   device=h.device).masked_fill(~attention_mask, neg)
            return attention_mask.to(h.dtype)
        total = past + s
        q_pos = torch.arange(past, total, device=h.device)[:, None]
        allowed = torch.arange(total, device=h.device)[None, :] <= q_pos      # [s, total]
        allowed = allowed[None, None].expand(b, 1, s, total)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != total:
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: "
                                 f"expected [batch, cached + new tokens] = [{b}, {total}]")
            allowed = allowed & attention_mask[:, None, None, :].bool()
        return torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(~allowed,
                                                                                       neg)


class MegatronExtForCausalLM(MegatronExtPreTrainedModel, GenerationMixin):
    # transformers 5.x: {target: source}; only applied when config.tie_word_embeddings is true.
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MegatronExtModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_hidden_states=None, logits_to_keep: Union[int, torch.Tensor] = 0,
                num_items_in_batch: Optional[torch.Tensor] = None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states,
                         cache_position=kwargs.get("cache_position"))
        h = out.last_hidden_state
        # logits_to_keep: an int keeps the last n positions (0 = all), a tensor lists positions.
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep])
        loss = None
        if labels is not None:
            # HF's causal-LM loss: fp32, labels shifted left by one, -100 ignored.
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)
