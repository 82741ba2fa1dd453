"""Total and active parameters of a Sigma model (printed at build time).

Per layer (no biases, RMSNorm weights only, head dim ``d``, ``n_q`` heads, ``n_kv`` query groups)::

    attention   H (n_q + 2 n_kv) d  +  n_q d H  +  2 d        (QKV, output projection, QK-norm)
    norms       2 H                                          (input and pre-MLP RMSNorm)
    router      N_E H
    experts     N_E x 3 H F                                  (SwiGLU: gate, up, down)

plus the embedding ``V H`` (twice when the output layer is untied) and the final norm ``H``.
Active parameters per token count ``k_l`` experts in layer ``l`` instead of ``N_E``; like the
report's "0.5B activated" they are given without the embedding and output layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class SigmaBudget:
    num_layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    num_experts: int
    expert_ffn: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config, vocab: int, tied: bool,
                    num_layers: Optional[int] = None) -> "SigmaBudget":
        """``num_layers``: the Sigma layers (attention + MoE blocks); ``config.num_layers``
        counts every symbol of a hybrid pattern (8 for ``*E*E*E*E``), so the hybrid path passes
        the ``E`` count."""
        groups = config.num_query_groups or config.num_attention_heads
        return cls(num_layers or config.num_layers, config.hidden_size,
                   config.num_attention_heads, groups, config.kv_channels, config.num_moe_experts,
                   config.moe_ffn_hidden_size, vocab, tied)

    @property
    def expert(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    @property
    def layer_dense(self) -> int:
        """Everything of one layer but its experts."""
        h, d = self.hidden, self.kv_channels
        attention = h * (self.heads + 2 * self.query_groups) * d + self.heads * d * h + 2 * d
        return attention + 2 * h + self.num_experts * h

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def non_embedding(self) -> int:
        return self.num_layers * (self.layer_dense + self.num_experts * self.expert) + self.hidden

    @property
    def total(self) -> int:
        return self.non_embedding + self.embedding

    def active(self, layer_topks: Sequence[int]) -> int:
        """Non-embedding parameters one token uses with top-k ``layer_topks[l]`` in layer l."""
        if len(layer_topks) != self.num_layers:
            raise ValueError(f"{len(layer_topks)} top-k values for {self.num_layers} layers")
        return self.num_layers * self.layer_dense + sum(layer_topks) * self.expert + self.hidden

    def describe(self, target_topks: Sequence[int], initial_topks: Sequence[int]) -> str:
        text = (f"Sigma MoE parameters: total {self.total:,} ({_b(self.total)}; without embedding "
                f"and output layer {self.non_embedding:,}), active per token "
                f"{self.active(target_topks):,} ({_b(self.active(target_topks))}, without "
                f"embeddings)")
        if tuple(initial_topks) != tuple(target_topks):
            text += (f"; before the sparsification switch {self.active(initial_topks):,} "
                     f"({_b(self.active(initial_topks))})")
        return text


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
