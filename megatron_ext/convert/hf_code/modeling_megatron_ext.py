"""Models exported by megatron-ext: a Llama-style decoder whose MLP differs per layer.

Self-contained: imports only ``torch`` and ``transformers`` (it is copied next to the weights).
The math of every MLP type is the one megatron-ext trains (``docs/convert.md`` of megatron-ext):

* ``dense``: ``down(act(gate x) * up x)`` (gated) or ``down(act(up x))``.
* ``stem`` (Eqs. 4-5 of the STEM paper), ``U`` a per-layer table indexed by the token id ``t``:
  up: ``down(act(gate x) * U[t])``; gate: ``down(act(U[t]) * up x)``;
  dagger: ``down(act(gate x) * (up x + U[t]))``.
* ``structmoe`` (Eqs. 5-6 of the StructMoE paper): fp32 router ``p = softmax(x W_R^T)``, top-k
  experts with weights ``p_l`` (not renormalised), ``R = sum_l p_l x A_l B_l``; additive:
  ``down(act(gate x + R) * up x)``; glu: ``down(act(gate x) * up x * (1 + R))`` (non-gated:
  ``act(up x + R)`` / ``act(up x) * (1 + R)``).
* ``moe`` (Sigma MoE): fp32 router, softmax then top-k (pre-softmax routing, weights not
  renormalised), SwiGLU experts.

Attention: GQA, optional per-head RMSNorm of q and k (QK-norm) before RoPE (halves rotated),
causal, scale ``1/sqrt(head_dim)``.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megatron_ext import MegatronExtConfig  # the file beside this one


def _act(name):
    return F.silu if name == "silu" else F.gelu  # exact GELU, as Megatron's default


class MegatronExtRMSNorm(nn.Module):
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
    """RoPE angles. The frequencies are computed on every call, not kept in a buffer:
    ``from_pretrained`` builds the model on the meta device and does not restore non-persistent
    buffers (a zero ``inv_freq`` would silently turn RoPE off)."""

    def __init__(self, head_dim, theta):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids):
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                device=position_ids.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        angles = position_ids.float()[..., None] * inv_freq  # [b, s, hd/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _rotate(x, cos, sin):
    """x [b, heads, s, hd]; cos/sin [b, s, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


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
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MegatronExtDenseMLP(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        h, f = config.hidden_size, spec["intermediate_size"]
        self.gated = config.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)
        self.act = _act(config.hidden_act)

    def forward(self, x, token_ids=None):
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class MegatronExtStemMLP(nn.Module):
    """Eq. 4 (up, gate) and Eq. 5 (dagger) of the STEM paper."""

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
        self.act = _act(config.hidden_act)

    def forward(self, x, token_ids=None):
        if token_ids is None:
            raise ValueError("STEM layers look up rows by token id: call the model with "
                             "input_ids (inputs_embeds alone cannot be used)")
        rows = self.stem_table(token_ids).to(x.dtype)
        if self.variant == "up":
            inner = self.act(self.gate_proj(x)) * rows
        elif self.variant == "gate":
            inner = self.act(rows) * self.up_proj(x)
        else:
            inner = self.act(self.gate_proj(x)) * (self.up_proj(x) + rows)
        return self.down_proj(inner)


def _route(x, router_weight, top_k):
    """fp32 softmax router, top-k of the probabilities (not renormalised)."""
    probs = torch.softmax(x.float() @ router_weight.float().t(), dim=-1)
    return torch.topk(probs, top_k, dim=-1)


class MegatronExtStructMoEMLP(nn.Module):
    """Eqs. 5-6 of the StructMoE paper: a routed low-rank update of the up-projection."""

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
        self.act = _act(config.hidden_act)

    def routed(self, x):
        """``R(x) = sum_{l in topk} p_l x A_l B_l`` (Eq. 5), in fp32."""
        flat = x.reshape(-1, x.shape[-1]).float()
        weights, experts = _route(flat, self.router.weight, self.top_k)
        codes = torch.einsum("nh,nkhr->nkr", flat, self.lore_a.float()[experts])
        update = torch.einsum("nkr,nkrd->nd", codes * weights[..., None],
                              self.lore_b.float()[experts])
        return update.view(*x.shape[:-1], -1).to(x.dtype)

    def forward(self, x, token_ids=None):
        r = self.routed(x)
        up = self.up_proj(x)
        if self.gated:
            gate = self.gate_proj(x)
            inner = self.act(gate + r) * up if self.fusion == "additive" \
                else self.act(gate) * up * (1.0 + r)
        else:
            inner = self.act(up + r) if self.fusion == "additive" else self.act(up) * (1.0 + r)
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
    """Sigma MoE layer: softmax-then-top-k routing in fp32, weights = the probabilities."""

    def __init__(self, config, spec):
        super().__init__()
        self.top_k = spec["top_k"]
        self.gate = nn.Linear(config.hidden_size, spec["num_experts"], bias=False)
        self.experts = nn.ModuleList(
            MegatronExtExpert(config.hidden_size, spec["intermediate_size"],
                              _act(config.hidden_act)) for _ in range(spec["num_experts"]))

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


class MegatronExtPreTrainedModel(PreTrainedModel):
    config_class = MegatronExtConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegatronExtDecoderLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
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
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = h.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if isinstance(past_key_values, Cache) else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=h.device).unsqueeze(0).expand(b, s)
        cos, sin = self.rotary(position_ids)
        mask = self._mask(attention_mask, b, s, past, h)
        for layer in self.layers:
            h = layer(h, input_ids, cos, sin, mask, past_key_values if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h),
                                       past_key_values=past_key_values if use_cache else None)

    @staticmethod
    def _mask(attention_mask, b, s, past, h):
        """Additive ``[b, 1, s, past + s]`` mask: causal, and padded keys (2-D mask) hidden.
        Rows with every key hidden (padding queries) get a finite minimum, not NaN."""
        total = past + s
        q_pos = torch.arange(past, total, device=h.device)[:, None]
        allowed = torch.arange(total, device=h.device)[None, :] <= q_pos  # [s, total]
        allowed = allowed[None, None].expand(b, 1, s, total)
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be 2-D [batch, keys]")
            allowed = allowed & attention_mask[:, None, None, -total:].bool()
        mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device)
        return mask.masked_fill(~allowed, torch.finfo(h.dtype).min)


class MegatronExtForCausalLM(MegatronExtPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = MegatronExtModel(config)
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
                logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache)
        h = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=out.past_key_values)
