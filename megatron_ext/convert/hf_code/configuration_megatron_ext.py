"""Configuration of models exported by megatron-ext (STEM, StructMoE, Sigma with per-layer top-k).

Self-contained: imports only ``transformers``. Copied next to the weights by
``python -m megatron_ext.convert to-hf``; ``config.json`` names it in ``auto_map``.

``mlp_layers`` has one entry per decoder layer:

    {"type": "dense", "intermediate_size": F}
    {"type": "stem", "variant": "up" | "gate" | "dagger", "intermediate_size": F}
    {"type": "structmoe", "intermediate_size": D, "num_experts": L, "rank": r, "top_k": k,
     "fusion": "additive" | "glu"}
    {"type": "moe", "num_experts": E, "top_k": k, "intermediate_size": f}
"""

from transformers import PretrainedConfig

MLP_TYPES = {
    "dense": ("intermediate_size",),
    "stem": ("intermediate_size", "variant"),
    "structmoe": ("intermediate_size", "num_experts", "rank", "top_k", "fusion"),
    "moe": ("intermediate_size", "num_experts", "top_k"),
}
STEM_VARIANTS = ("up", "gate", "dagger")
FUSIONS = ("additive", "glu")


class MegatronExtConfig(PretrainedConfig):
    model_type = "megatron_ext"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=32000, hidden_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=None, head_dim=None,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                 hidden_act="silu", gated_mlp=True, qk_norm=False, initializer_range=0.02,
                 mlp_layers=None, tie_word_embeddings=False, use_cache=True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.gated_mlp = gated_mlp
        self.qk_norm = qk_norm
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        if mlp_layers is None:
            mlp_layers = [{"type": "dense", "intermediate_size": 4 * hidden_size}
                          for _ in range(num_hidden_layers)]
        self.mlp_layers = [dict(m) for m in mlp_layers]
        self._validate()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _validate(self):
        if self.hidden_act not in ("silu", "gelu"):
            raise ValueError(f"hidden_act={self.hidden_act!r}: expected 'silu' or 'gelu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible "
                             f"by num_key_value_heads={self.num_key_value_heads}")
        if len(self.mlp_layers) != self.num_hidden_layers:
            raise ValueError(f"mlp_layers has {len(self.mlp_layers)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        for i, m in enumerate(self.mlp_layers):
            kind = m.get("type")
            if kind not in MLP_TYPES:
                raise ValueError(f"mlp_layers[{i}].type={kind!r}: expected one of "
                                 f"{sorted(MLP_TYPES)}")
            missing = [k for k in MLP_TYPES[kind] if k not in m]
            if missing:
                raise ValueError(f"mlp_layers[{i}] ({kind}) lacks {missing}")
            if kind == "stem" and m["variant"] not in STEM_VARIANTS:
                raise ValueError(f"mlp_layers[{i}].variant={m['variant']!r}: expected one of "
                                 f"{STEM_VARIANTS}")
            if kind == "stem" and not self.gated_mlp:
                raise ValueError(f"mlp_layers[{i}]: STEM needs gated_mlp=True")
            if kind == "structmoe" and m["fusion"] not in FUSIONS:
                raise ValueError(f"mlp_layers[{i}].fusion={m['fusion']!r}: expected one of "
                                 f"{FUSIONS}")
            if kind in ("structmoe", "moe") and not 1 <= m["top_k"] <= m["num_experts"]:
                raise ValueError(f"mlp_layers[{i}].top_k={m['top_k']}: must be in "
                                 f"[1, num_experts={m['num_experts']}]")
