"""Configuration of models exported by megatron-ext (STEM, StructMoE, Sigma with per-layer top-k).

Self-contained: imports only ``transformers``. ``python -m megatron_ext.convert to-hf`` copies it
next to the weights and ``config.json`` names it in ``auto_map`` (see ``docs/convert.md``).

``mlp_layers`` holds one entry per decoder layer:

    {"type": "dense", "intermediate_size": F}
    {"type": "stem", "variant": "up" | "gate" | "dagger", "intermediate_size": F}
    {"type": "structmoe", "intermediate_size": D, "num_experts": L, "rank": r, "top_k": k,
     "fusion": "additive" | "glu"}
    {"type": "moe", "num_experts": E, "top_k": k, "intermediate_size": f}
"""

from transformers import PretrainedConfig

# The keys each MLP type needs (besides "type").
MLP_KEYS = {
    "dense": ("intermediate_size",),
    "stem": ("intermediate_size", "variant"),
    "structmoe": ("intermediate_size", "num_experts", "rank", "top_k", "fusion"),
    "moe": ("intermediate_size", "num_experts", "top_k"),
}
STEM_VARIANTS = ("up", "gate", "dagger")
FUSIONS = ("additive", "glu")
ACTIVATIONS = ("silu", "gelu")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")


class MegatronExtConfig(PretrainedConfig):
    """A Llama-style decoder whose MLP differs per layer (``mlp_layers``).

    ``gated_mlp`` selects ``down(act(gate x) * up x)`` (SwiGLU / GeGLU) over ``down(act(up x))``;
    ``hidden_act`` is ``"silu"`` or ``"gelu"`` (exact, erf-based GELU, Megatron's default).
    """

    model_type = "megatron_ext"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=32000, hidden_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, head_dim=None,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                 tie_word_embeddings=False, hidden_act="silu", gated_mlp=True, qk_norm=False,
                 initializer_range=0.02, mlp_layers=None, use_cache=True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = (num_attention_heads if num_key_value_heads is None
                                    else num_key_value_heads)
        self.head_dim = head_dim
        if head_dim is None and isinstance(hidden_size, int) and \
                isinstance(num_attention_heads, int) and num_attention_heads > 0:
            self.head_dim = hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.qk_norm = qk_norm
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        if mlp_layers is None:
            # A plain dense model, so that ``MegatronExtConfig()`` works (Hugging Face needs it).
            mlp_layers = [{"type": "dense", "intermediate_size": 4 * hidden_size}
                          for _ in range(num_hidden_layers if isinstance(num_hidden_layers, int)
                                         else 0)]
        self.mlp_layers = [dict(m) if isinstance(m, dict) else m for m in mlp_layers]
        self._validate()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _validate(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE rotates halves, it must be even")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads={self.num_key_value_heads} (GQA)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r}: expected > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r}: expected > 0")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r}: expected one of {ACTIVATIONS}")
        if not isinstance(self.mlp_layers, list) or \
                len(self.mlp_layers) != self.num_hidden_layers:
            n = len(self.mlp_layers) if isinstance(self.mlp_layers, list) else self.mlp_layers
            raise ValueError(f"mlp_layers has {n} entries: expected one per layer "
                             f"(num_hidden_layers={self.num_hidden_layers})")
        for i, m in enumerate(self.mlp_layers):
            self._validate_layer(i, m)

    def _validate_layer(self, i, m):
        where = f"mlp_layers[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}={m!r}: expected a dict with a 'type' key")
        kind = m.get("type")
        if kind not in MLP_KEYS:
            raise ValueError(f"{where}.type={kind!r}: expected one of {sorted(MLP_KEYS)}")
        missing = [k for k in MLP_KEYS[kind] if k not in m]
        if missing:
            raise ValueError(f"{where} ({kind}) lacks {missing}")
        for key in ("intermediate_size", "num_experts", "rank", "top_k"):
            if key in MLP_KEYS[kind]:
                _positive_int(f"{where}.{key}", m[key])
        if kind == "stem" and m["variant"] not in STEM_VARIANTS:
            raise ValueError(f"{where}.variant={m['variant']!r}: expected one of {STEM_VARIANTS}")
        if kind == "structmoe" and m["fusion"] not in FUSIONS:
            raise ValueError(f"{where}.fusion={m['fusion']!r}: expected one of {FUSIONS}")
        if kind in ("structmoe", "moe") and m["top_k"] > m["num_experts"]:
            raise ValueError(f"{where}.top_k={m['top_k']}: must be <= "
                             f"num_experts={m['num_experts']}")
        # STEM replaces one input of the gated product (Eq. 4 of the STEM paper) and Sigma's
        # experts are SwiGLU: neither exists without a gated MLP (megatron-ext refuses both).
        if kind in ("stem", "moe") and not self.gated_mlp:
            raise ValueError(f"{where}.type={kind!r} needs gated_mlp=True")
