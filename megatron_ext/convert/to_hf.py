"""``python -m megatron_ext.convert to-hf --load CKPT_DIR --out HF_DIR``: Megatron -> Hugging Face.

Reads a ``torch_dist`` checkpoint of any TP/PP/EP/DP layout (tensors are stored under their global
shapes; STEM tables managed on the host or sharded by vocabulary are saved under the same key and
shape as ordinary ones, ``stem/runtime/checkpoint.py``) tensor by tensor, and writes a Hugging Face
directory: ``config.json``, ``generation_config.json``, sharded safetensors with
``model.safetensors.index.json``, the tokenizer, and for families without a native Hugging Face
class the self-contained ``configuration_megatron_ext.py`` / ``modeling_megatron_ext.py``.

Which class each family becomes, the tensor names and the math: ``docs/convert.md``.

Nothing is half-written: the directory is built beside ``--out`` under a temporary name and renamed
when complete. ``--out`` never overlaps ``--load``; ``--overwrite`` replaces only a directory an
earlier conversion wrote, and only once the new one is complete. Every model tensor of the
checkpoint must be consumed and every expected one present, else the conversion stops before
writing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from megatron_ext.checkpoint_manifest import (CheckpointError, resolve_checkpoint_dir,
                                              unverified_note)
from megatron_ext.checkpoint_manifest import verify as verify_manifest
from megatron_ext.checkpoint_reader import MegatronCheckpoint
from megatron_ext.convert.hf_code.configuration_megatron_ext import MegatronExtConfig
from megatron_ext.convert.output import (DTYPES, check_output_path, check_separate,
                                         staged_directory, write_record)
from megatron_ext.convert.output import progress as progress_bar
from megatron_ext.models.fused_layout import split_gated_fc1, split_qkv
from megatron_ext.models.hybrid_pattern import MLP_SYMBOLS, HybridLayers
from megatron_ext.models.registry import families, get_family

HF_CODE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_code")
HF_CODE_FILES = ("configuration_megatron_ext.py", "modeling_megatron_ext.py")
# What a conversion records about itself, every file it wrote included: --overwrite replaces only
# a directory that holds this record and nothing it does not list (convert/output.py).
RECORD = "megatron_ext_conversion.json"
AUTO_MAP = {"AutoConfig": "configuration_megatron_ext.MegatronExtConfig",
            "AutoModelForCausalLM": "modeling_megatron_ext.MegatronExtForCausalLM"}

# Per-layer entries that are training state, not weights: Sigma's previous-global-batch
# statistics (the Top-1 / global LBL gradient uses them; inference does not).
TRAINING_STATE = re.compile(r"\.router\.sigma_prev_[a-z]+$")

# A layer's tensors of its attention half (the rest belong to its MLP half): on the hybrid path
# the halves are two layers of the pattern.
ATTENTION_PARTS = ("input_layernorm.", "self_attention.")


def log(msg: str) -> None:
    print(f"[to-hf] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# what the checkpoint holds


@dataclasses.dataclass
class ModelDescription:
    family: str
    num_layers: int
    hidden: int
    num_heads: int
    num_groups: int
    head_dim: int
    padded_vocab: int
    vocab: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    gated: bool
    act: str          # "silu" | "gelu"
    qk_norm: bool
    mlp_layers: List[dict]
    iteration: Optional[int]
    rope_scaling_factor: Optional[float] = None  # Llama-3 RoPE scaling (--use-rope-scaling)
    # Checkpoint layer (``decoder.layers.<i>``) of each Hugging Face layer's attention and MLP:
    # the same index on the GPT path, the i-th ``*`` and the i-th ``-``/``E`` position of
    # --hybrid-layer-pattern on the hybrid path (``hf_layer_positions``).
    attention_positions: List[int] = dataclasses.field(default_factory=list)
    mlp_positions: List[int] = dataclasses.field(default_factory=list)
    hybrid_layer_pattern: Optional[str] = None
    final_norm: str = "decoder.final_layernorm.weight"

    @property
    def native(self) -> Optional[str]:
        """The native Hugging Face architecture, or None for the exported code."""
        types = {m["type"] for m in self.mlp_layers}
        if types == {"dense"} and self.gated and self.act == "silu":
            return "Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"
        if types == {"moe"} and self.qk_norm and self.gated and self.act == "silu" and \
                len({(m["top_k"], m["num_experts"], m["intermediate_size"])
                     for m in self.mlp_layers}) == 1:
            return "Qwen3MoeForCausalLM"
        return None


def _refuse(cond: bool, msg: str) -> None:
    if cond:
        raise CheckpointError(msg)


def unpadded(t: torch.Tensor, dim: int, width: int, name: str) -> torch.Tensor:
    """``t``'s first ``width`` entries along ``dim``. Entries past them are a padded width's
    (StructMoE's ``--structmoe-ffn-pad-to``): zeros in a model trained with it, refused
    otherwise, since the exported model would then compute something else."""
    if t.shape[dim] == width:
        return t
    pad = t.narrow(dim, width, t.shape[dim] - width)
    _refuse(bool(pad.any()), f"{name}: its columns past {width} (the stored padding of "
            f"{t.shape[dim]}) are not zero, so the model is not the width-{width} model the "
            "export describes")
    return t.narrow(dim, 0, width).contiguous()


def hf_layer_positions(pattern: str) -> Tuple[List[int], List[int]]:
    """(attention positions, MLP positions) of a hybrid-path checkpoint's layers, Hugging Face
    layer ``i`` taking the i-th of each. A Llama-style layer is attention then MLP, so the
    pattern (pipes dropped) must be ``*`` followed by one MLP symbol (``-`` or ``E``), repeated;
    anything else has no Hugging Face layout here and is refused."""
    try:
        layers = HybridLayers.parse(pattern)
    except ValueError as exc:
        raise CheckpointError(f"the checkpoint's {exc}; to-hf converts patterns of '*' "
                              "followed by '-' or 'E', repeated") from None
    s = layers.symbols
    pairs = [s[k: k + 2] for k in range(0, len(s), 2)]
    if any(len(p) != 2 or p[0] != "*" or p[1] not in MLP_SYMBOLS for p in pairs):
        raise CheckpointError(
            f"the checkpoint's --hybrid-layer-pattern {pattern!r} has no Hugging Face layout: "
            "a converted layer is one attention and one MLP block, so to-hf converts patterns "
            "of '*' followed by '-' or 'E', repeated (e.g. '*-*-*-*-'; pipes '|' anywhere)")
    return layers.attention_positions, layers.mlp_positions


def describe(ck: MegatronCheckpoint, vocab: Optional[int] = None) -> ModelDescription:
    """The architecture from the checkpoint's args (and tensor shapes where they are the truth)."""
    a = ck.args
    family = getattr(a, "model_family", "gpt")
    _refuse(getattr(a, "normalization", "RMSNorm") != "RMSNorm",
            f"--normalization {a.normalization}: only RMSNorm models convert")
    _refuse(getattr(a, "position_embedding_type", "rope") != "rope",
            f"--position-embedding-type {a.position_embedding_type}: only RoPE models convert")
    _refuse(getattr(a, "add_bias_linear", False) or getattr(a, "add_qkv_bias", False),
            "linear biases (no --disable-bias-linear / --add-qkv-bias) are not supported")
    _refuse(getattr(a, "rotary_percent", 1.0) != 1.0,
            f"--rotary-percent {a.rotary_percent}: partial RoPE is not supported")
    _refuse(bool(getattr(a, "rotary_interleaved", False)),
            "--rotary-interleaved is not supported (Hugging Face rotates halves)")
    _refuse(bool(getattr(a, "apply_residual_connection_post_layernorm", False)),
            "--apply-residual-connection-post-layernorm is not supported")
    _refuse(getattr(a, "multi_latent_attention", False), "MLA is not supported")
    _refuse(bool(getattr(a, "layernorm_zero_centered_gamma", False)),
            "--apply-layernorm-1p (zero-centred norm weights) is not supported")
    _refuse(bool(getattr(a, "qk_l2_norm", False)), "--qk-l2-norm is not supported")
    _refuse(getattr(a, "rope_type", None) not in (None, "rope"),
            f"--rope-type {getattr(a, 'rope_type', None)}: only plain RoPE converts")
    _refuse(bool(getattr(a, "mtp_num_layers", None)), "multi-token prediction is not supported")
    gated = bool(getattr(a, "swiglu", False))
    act = "silu" if gated else "gelu"
    _refuse(not gated and (getattr(a, "squared_relu", False) or
                           getattr(a, "openai_gelu", False) or getattr(a, "onnx_safe", False)),
            "only SwiGLU and exact GELU activations are supported")
    heads = a.num_attention_heads
    groups = a.num_query_groups if getattr(a, "group_query_attention", False) else heads
    head_dim = a.kv_channels or a.hidden_size // heads
    pattern = getattr(a, "hybrid_layer_pattern", None)
    if pattern:  # the hybrid path: --num-layers counts every symbol of the pattern
        attention, mlps = hf_layer_positions(pattern)
        n, final_norm = len(attention), "decoder.final_norm.weight"
    else:
        n, final_norm = a.num_layers, "decoder.final_layernorm.weight"
        attention = mlps = list(range(n))
    padded = ck.shape("embedding.word_embeddings.weight")[0]
    true_vocab = vocab if vocab is not None else padded
    _refuse(true_vocab > padded, f"--vocab-size {true_vocab} exceeds the checkpoint's "
            f"embedding rows ({padded})")

    try:
        fam = get_family(family)
    except ValueError:
        raise CheckpointError(f"--model-family {family!r}: unknown family") from None
    _refuse(fam.hf_mlp_layers is None,
            f"--model-family {family}: the family has no Hugging Face mapping")
    # The family's MLP of every layer, as the exported config describes it.
    mlp = fam.hf_mlp_layers(a, ck.iteration, gated, _refuse)
    _refuse(len(mlp) != n, f"--model-family {family}: its Hugging Face mapping describes "
            f"{len(mlp)} MLP blocks, the checkpoint has {n}" +
            (f" (--hybrid-layer-pattern {pattern!r})" if pattern else ""))
    return ModelDescription(
        family=family, num_layers=n, hidden=a.hidden_size, num_heads=heads, num_groups=groups,
        head_dim=head_dim, padded_vocab=padded, vocab=true_vocab, eps=float(a.layernorm_epsilon),
        rope_theta=float(a.rotary_base), max_positions=a.max_position_embeddings,
        tied=not a.untie_embeddings_and_output_weights, gated=gated, act=act,
        qk_norm=bool(a.qk_layernorm), mlp_layers=mlp, iteration=ck.iteration,
        rope_scaling_factor=float(getattr(a, "rope_scaling_factor", 8.0))
        if getattr(a, "use_rope_scaling", False) else None,
        attention_positions=list(attention), mlp_positions=list(mlps),
        hybrid_layer_pattern=pattern or None, final_norm=final_norm)


# ---------------------------------------------------------------------------------------------
# the tensor plan: Hugging Face name -> how to compute it from the checkpoint


@dataclasses.dataclass
class Job:
    name: str
    shape: Tuple[int, ...]
    make: Callable[[], torch.Tensor]


class Plan:
    """Every Hugging Face tensor with the checkpoint tensors it reads; validated up front."""

    def __init__(self, ck: MegatronCheckpoint, desc: ModelDescription):
        self.ck, self.desc = ck, desc
        self.jobs: List[Job] = []
        self.used: Set[str] = set()
        self.missing: List[str] = []
        self.bad_shape: List[str] = []
        self._cache: Dict[Tuple[int, str], torch.Tensor] = {}

    # -- checkpoint access (records use, checks presence and shape) -------------------------

    def _need(self, key: str, index: Optional[int], shape: Tuple[int, ...]) -> bool:
        if not self.ck.has(key):
            self.missing.append(key if index is None else f"{key} (layer {index})")
            return False
        self.used.add(key)
        have = self.ck.shape(key)
        if index is not None:
            have = have[1:]
            if self.ck.shape(key)[0] != self.desc.num_layers:
                self.bad_shape.append(f"{key}: {self.ck.shape(key)}, first axis != "
                                      f"{self.desc.num_layers} layers")
        if tuple(have) != tuple(shape):
            self.bad_shape.append(f"{key}: checkpoint {tuple(have)}, expected {tuple(shape)}")
            return False
        return True

    def position(self, i: int, name: str) -> int:
        """The checkpoint layer holding Hugging Face layer ``i``'s tensor ``name``: its attention
        part (``input_layernorm``, ``self_attention``) or its MLP part (the rest: the pre-MLP
        norm, ``mlp``), two layers of the pattern on the hybrid path."""
        d = self.desc
        return (d.attention_positions if name.startswith(ATTENTION_PARTS)
                else d.mlp_positions)[i]

    def layer(self, i: int, names: Sequence[str], shape: Tuple[int, ...]):
        """A reader of Hugging Face layer ``i``'s tensor, under the first of ``names`` the
        checkpoint has (the local and Transformer Engine specs name the layer norms
        differently)."""
        for name in names:
            try:
                key, index = self.ck.layer_key(self.position(i, name), name)
            except KeyError:
                continue
            if self._need(key, index, shape):
                return lambda key=key, index=index: self.ck.read(key, index)
            return None
        self.missing.append(f"decoder.layers.{self.position(i, names[0])}.{names[0]}")
        return None

    def whole(self, key: str, shape: Tuple[int, ...]):
        if self._need(key, None, shape):
            return lambda: self.ck.read(key)
        return None

    def add(self, name: str, shape: Tuple[int, ...], make) -> None:
        if make is not None:
            self.jobs.append(Job(name, tuple(shape), make))

    # -- the model ----------------------------------------------------------------------------

    def build(self) -> "Plan":
        d = self.desc
        h, V, P = d.hidden, d.vocab, d.padded_vocab
        rows = lambda f: (lambda: f()[:V])  # noqa: E731 - drop Megatron's padded vocab rows
        emb = self.whole("embedding.word_embeddings.weight", (P, h))
        self.add("model.embed_tokens.weight", (V, h), emb and rows(emb))
        for i in range(d.num_layers):
            self._attention(i)
            self._mlp(i, d.mlp_layers[i])
        self.add("model.norm.weight", (h,), self.whole(d.final_norm, (h,)))
        if not d.tied:
            out = self.whole("output_layer.weight", (P, h))
            self.add("lm_head.weight", (V, h), out and rows(out))
        self._check()
        return self

    def split(self, key: Tuple[int, str], read, fn, part: int):
        """Part ``part`` of ``fn(read())``, computing ``fn`` once for all parts of a tensor."""
        def make():
            if key not in self._cache:
                self._cache[key] = fn(read())
            parts = self._cache[key]
            if part == len(parts) - 1:
                del self._cache[key]
            return parts[part]
        return make

    def _attention(self, i: int) -> None:
        d = self.desc
        h, nh, ng, hd = d.hidden, d.num_heads, d.num_groups, d.head_dim
        p = f"model.layers.{i}."
        self.add(p + "input_layernorm.weight", (h,), self.layer(
            i, ["self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"], (h,)))
        qkv = self.layer(i, ["self_attention.linear_qkv.weight"], ((nh + 2 * ng) * hd, h))
        if qkv is not None:
            fn = lambda t: split_qkv(t, nh, ng, hd)  # noqa: E731
            for j, (name, rows) in enumerate((("q", nh), ("k", ng), ("v", ng))):
                self.add(p + f"self_attn.{name}_proj.weight", (rows * hd, h),
                         self.split((i, "qkv"), qkv, fn, j))
        self.add(p + "self_attn.o_proj.weight", (h, nh * hd),
                 self.layer(i, ["self_attention.linear_proj.weight"], (h, nh * hd)))
        if d.qk_norm:
            for name in ("q", "k"):
                self.add(p + f"self_attn.{name}_norm.weight", (hd,),
                         self.layer(i, [f"self_attention.{name}_layernorm.weight"], (hd,)))
        self.add(p + "post_attention_layernorm.weight", (h,), self.layer(
            i, ["mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"], (h,)))

    def fc(self, i: int, prefix: str, width: int, halves: Sequence[str],
           stored: Optional[int] = None) -> None:
        """``linear_fc1`` as one or two (gate, up) Hugging Face projections. ``stored``: the
        checkpoint's width of each half when it is padded past ``width`` (``unpadded``)."""
        h = self.desc.hidden
        p = f"model.layers.{i}.mlp."
        s = width if stored is None else stored
        fc1 = self.layer(i, [f"{prefix}linear_fc1.weight"], (len(halves) * s, h))
        name = f"decoder.layers.{i}.{prefix}linear_fc1"
        if len(halves) == 2:
            def gate_up(t):  # each half without its padding (unpadded: as it is when none)
                return tuple(unpadded(x, 0, width, name) for x in split_gated_fc1(t))
            for j, half in enumerate(halves):
                self.add(p + f"{half}.weight", (width, h),
                         fc1 and self.split((i, prefix + "fc1"), fc1, gate_up, j))
        else:
            self.add(p + f"{halves[0]}.weight", (width, h), self.unpad(fc1, 0, width, name))

    def down_proj(self, i: int, f: int, stored: Optional[int] = None) -> None:
        h = self.desc.hidden
        fc2 = self.layer(i, ["mlp.linear_fc2.weight"], (h, f if stored is None else stored))
        self.add(f"model.layers.{i}.mlp.down_proj.weight", (h, f),
                 self.unpad(fc2, 1, f, f"decoder.layers.{i}.mlp.linear_fc2"))

    @staticmethod
    def unpad(read, dim: int, width: int, name: str):
        """A reader of ``read()``'s first ``width`` entries along ``dim`` (all of it when that is
        its size), refusing padding that is not zero."""
        if read is None:
            return None
        return lambda: unpadded(read(), dim, width, name)

    def _mlp(self, i: int, m: dict) -> None:
        """The layer's MLP: a dense one here, another type by the family that exports it
        (``Family.hf_mlp_tensors``)."""
        kind, f = m["type"], m.get("intermediate_size")
        if kind == "dense":
            self.fc(i, "mlp.", f, ("gate_proj", "up_proj") if self.desc.gated else ("up_proj",))
            self.down_proj(i, f)
            return

        for family in families():
            if kind in family.hf_mlp_tensors:
                family.hf_mlp_tensors[kind](self, i, m)
                return
        raise CheckpointError(f"layer {i}: unknown MLP type {kind!r}")

    def _check(self) -> None:
        extra = sorted(k for k in self.ck.tensor_keys()
                       if k not in self.used and not TRAINING_STATE.search(k))
        problems = []
        if self.missing:
            problems.append("missing tensors: " + ", ".join(self.missing[:20]) +
                            (f" (+{len(self.missing) - 20} more)" if len(self.missing) > 20
                             else ""))
        if self.bad_shape:
            problems.append("wrong shapes: " + "; ".join(self.bad_shape[:20]))
        if extra:
            problems.append("tensors this conversion does not know (a different model or an "
                            "unsupported option): " + ", ".join(extra[:20]) +
                            (f" (+{len(extra) - 20} more)" if len(extra) > 20 else ""))
        if problems:
            raise CheckpointError(
                f"{self.ck.dir} does not match the {self.desc.family} model its args describe "
                f"({self.desc.num_layers} layers" +
                (f", --hybrid-layer-pattern {self.desc.hybrid_layer_pattern!r}"
                 if self.desc.hybrid_layer_pattern else "") +
                f", hidden {self.desc.hidden}):\n  " +
                "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# writing


class ShardWriter:
    """Safetensors shards of at most ``max_bytes`` each (a larger tensor gets its own shard),
    written as tensors arrive so that memory holds one shard at a time."""

    def __init__(self, directory: str, max_bytes: int):
        self.dir, self.max_bytes = directory, max_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: List[Tuple[str, List[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, os.path.join(self.dir, path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards ``model-0000i-of-0000n.safetensors`` and write the index."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.dir, path), os.path.join(self.dir, final))
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def hf_config(desc: ModelDescription, dtype: torch.dtype, tokens: Dict[str, Optional[int]]):
    """The Hugging Face config object of the target class."""
    common = dict(
        vocab_size=desc.vocab, hidden_size=desc.hidden, num_hidden_layers=desc.num_layers,
        num_attention_heads=desc.num_heads, num_key_value_heads=desc.num_groups,
        head_dim=desc.head_dim, rms_norm_eps=desc.eps, max_position_embeddings=desc.max_positions,
        tie_word_embeddings=desc.tied, **{k: v for k, v in tokens.items() if v is not None})
    rope = {"rope_type": "default", "rope_theta": desc.rope_theta}
    native = desc.native
    if desc.rope_scaling_factor is not None:
        if native not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            raise CheckpointError("--use-rope-scaling converts for dense models only (the "
                                  "exported code has no RoPE scaling)")
        # Upstream's RotaryEmbedding._apply_scaling: Llama 3's rule with these fixed parameters.
        rope = {"rope_type": "llama3", "rope_theta": desc.rope_theta,
                "factor": desc.rope_scaling_factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if native in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        cls = LlamaConfig if native == "LlamaForCausalLM" else Qwen3Config
        extra = dict(attention_bias=False) if native == "Qwen3ForCausalLM" else \
            dict(attention_bias=False, mlp_bias=False)
        cfg = cls(intermediate_size=desc.mlp_layers[0]["intermediate_size"], hidden_act="silu",
                  rope_parameters=rope, **extra, **common)
    elif native == "Qwen3MoeForCausalLM":
        m = desc.mlp_layers[0]
        # Sigma routes with softmax-then-top-k and uses the raw probabilities as weights:
        # Qwen3-MoE with norm_topk_prob=False is exactly that.
        cfg = Qwen3MoeConfig(
            intermediate_size=m["intermediate_size"], moe_intermediate_size=m["intermediate_size"],
            num_experts=m["num_experts"], num_experts_per_tok=m["top_k"], norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", attention_bias=False,
            rope_parameters=rope, output_router_logits=False, **common)
    else:
        cfg = MegatronExtConfig(
            hidden_act=desc.act, gated_mlp=desc.gated, qk_norm=desc.qk_norm,
            rope_theta=desc.rope_theta, mlp_layers=[
                {k: v for k, v in m.items() if not k.startswith("_")}  # "_": the export's own
                for m in desc.mlp_layers], **common)
        cfg.auto_map = dict(AUTO_MAP)
    cfg.architectures = [native or "MegatronExtForCausalLM"]
    cfg.dtype = dtype
    return cfg


def tokenizer_info(ck: MegatronCheckpoint, tokenizer_dir: Optional[str], vocab: Optional[int]):
    """(true vocabulary size, HF tokenizer or None) from the checkpoint's tokenizer flags."""
    a = ck.args
    path = tokenizer_dir or (getattr(a, "tokenizer_model", None)
                             if getattr(a, "tokenizer_type", None) == "HuggingFaceTokenizer"
                             else None)
    tok = None
    if path is not None:
        if not os.path.isdir(path):
            raise CheckpointError(f"tokenizer {path}: not a directory (the checkpoint was trained "
                                  "with it; pass --tokenizer DIR where it is on this machine)")

        tok = AutoTokenizer.from_pretrained(path)
    if vocab is None:
        if tok is not None:
            vocab = len(tok)
        elif getattr(a, "tokenizer_type", None) == "NullTokenizer" and a.vocab_size:
            vocab = int(a.vocab_size)
        else:
            raise CheckpointError(
                f"cannot tell the true vocabulary size of tokenizer type {a.tokenizer_type!r}: "
                "pass --vocab-size N (and --tokenizer DIR for the tokenizer files)")
    return vocab, tok


def convert(load: str, out: str, step: Optional[int] = None, dtype: str = "auto",
            max_shard_size: str = "2GB", tokenizer: Optional[str] = None,
            vocab_size: Optional[int] = None, overwrite: bool = False,
            progress: bool = True, verify: bool = True) -> str:
    """Convert and return ``out``. See the module docstring. ``verify``: check the checkpoint's
    files against its checksum manifest first (megatron_ext/checkpoint_manifest.py)."""
    # Through a symlink, the folder it names is what gets replaced (the link stays).
    shown, out = out, os.path.realpath(out)
    check_separate(load, "--load", shown, "--out")  # before anything is read or written
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{out} exists; choose a new --out (or pass --overwrite)")
    check_output_path(out, replace_record=RECORD if overwrite else None)
    if verify:
        folder, _ = resolve_checkpoint_dir(load, step)
        start = time.time()
        manifest = verify_manifest(folder)  # before DCP reads a damaged file
        log(unverified_note(folder) if manifest is None else
            f"{folder}: {len(manifest['files'])} files match their checksums "
            f"({manifest['bytes'] / 2**20:.1f} MiB, {time.time() - start:.1f} s)")
    ck = MegatronCheckpoint(load, step)
    vocab, tok = tokenizer_info(ck, tokenizer, vocab_size)
    desc = describe(ck, vocab)
    plan = Plan(ck, desc).build()
    target = DTYPES[dtype] if dtype != "auto" else ck.dtype("embedding.word_embeddings.weight")
    log(f"{ck.dir} (iteration {ck.iteration}): {desc.family}, {desc.num_layers} layers, hidden "
        f"{desc.hidden}, vocab {desc.vocab} (padded {desc.padded_vocab}) -> "
        f"{desc.native or 'MegatronExtForCausalLM (exported code)'}, {target}")
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if eos is None and getattr(ck.args, "tokenizer_type", None) == "NullTokenizer":
        eos = desc.vocab - 1  # Megatron's NullTokenizer: end of document is the last id
    tokens = {"eos_token_id": eos, "bos_token_id": getattr(tok, "bos_token_id", None),
              "pad_token_id": getattr(tok, "pad_token_id", None)}
    config = hf_config(desc, target, tokens)

    with staged_directory(out, replace_record=RECORD if overwrite else None) as tmp:
        writer = ShardWriter(tmp, parse_size(max_shard_size))
        jobs = plan.jobs
        start = time.time()
        with progress_bar(len(jobs), "to-hf", progress) as bar:
            for job in jobs:
                t = job.make()
                if tuple(t.shape) != job.shape:  # the plan and the tensor disagree: a bug
                    raise RuntimeError(f"{job.name}: made {tuple(t.shape)}, planned {job.shape}")
                writer.add(job.name, t.to(target))
                bar.update(1)
        writer.finish()
        config.save_pretrained(tmp)

        GenerationConfig(**{k: v for k, v in tokens.items() if v is not None}).save_pretrained(tmp)
        if desc.native is None:
            for name in HF_CODE_FILES:
                shutil.copyfile(os.path.join(HF_CODE_DIR, name), os.path.join(tmp, name))
        if tok is not None:
            tok.save_pretrained(tmp)
        write_record(tmp, RECORD, {
            "source": ck.dir, "iteration": ck.iteration, "family": desc.family,
            "architecture": config.architectures[0], "padded_vocab": desc.padded_vocab,
            "hybrid_layer_pattern": desc.hybrid_layer_pattern, "mlp_layers": desc.mlp_layers})
    log(f"wrote {out}: {len(jobs)} tensors, {writer.total_bytes / 2**20:.1f} MiB in "
        f"{len(writer.files)} shard(s), {time.time() - start:.1f} s")
    return out


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected e.g. 2GB, 500MB, 1GiB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.convert to-hf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="Megatron --save directory or one iter_* folder")
    p.add_argument("--out", required=True, help="Hugging Face directory to create")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: the latest)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="weights' dtype (auto: the checkpoint's)")
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer directory (default: the checkpoint's "
                        "--tokenizer-model for HuggingFaceTokenizer)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="true vocabulary size (default: from the tokenizer)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if an earlier conversion wrote it (and nothing else is "
                        "in it); the new output is built beside it and swapped in at the end")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-verify-checkpoint", action="store_true",
                   help="read the checkpoint without checking its files against the checksum "
                        "manifest written beside it at save time")
    a = p.parse_args(argv)
    try:
        convert(a.load, a.out, step=a.ckpt_step, dtype=a.dtype, max_shard_size=a.max_shard_size,
                tokenizer=a.tokenizer, vocab_size=a.vocab_size, overwrite=a.overwrite,
                progress=not a.no_progress, verify=not a.no_verify_checkpoint)
    except (CheckpointError, ValueError, OSError) as e:  # OSError: a full disk, say
        print(f"to-hf: error: {e}", file=sys.stderr)
        return 2
    return 0
