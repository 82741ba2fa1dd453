"""``python -m megatron_ext.convert from-hf --hf HF_DIR --save CKPT_DIR``: Hugging Face -> Megatron.

Imports a dense Llama-style Hugging Face checkpoint (``LlamaForCausalLM``, or ``Qwen3ForCausalLM``
whose QK-norm becomes Megatron's ``--qk-layernorm``; ``config.json`` + safetensors) into a Megatron
``torch_dist`` checkpoint that ``launch/pretrain.py --load CKPT_DIR`` resumes from under any
TP/PP layout. Optionally chosen layers become STEM layers (mid-training insertion, the STEM paper's
1B experiment): ``--stem-layers 1,3`` or ``--stem-ratio 1/2`` with ``--stem-variant up|gate|dagger``
select them exactly as the training flags do; the initialisation rule is in ``docs/convert.md``
("from-hf: STEM insertion").

How: the Megatron model is built in this process by megatron.training itself (its argument
parser with our ``add_extension_args``, ``initialize_megatron`` at world size 1 with TP=PP=1,
``get_model`` with our ``model_provider``), so the checkpoint has exactly the keys, sharding
metadata and args a training run writes; its plain state dict is filled from the Hugging Face
tensors (``layout.merge_qkv`` / ``layout.merge_gated_fc1`` give the fused layouts) and saved with
``megatron.training.checkpointing.save_checkpoint``. A ``torch_dist`` checkpoint stores every
tensor with its global shape, so the TP=1 save loads under any TP/PP.

The checkpoint is a *release* checkpoint by default (``release/``, tracker ``release``): Megatron
loads its weights only, starts at iteration 0 with a fresh optimizer, LR schedule and RNG, with
no extra flag. ``--iteration N`` writes ``iter_N`` instead (then pass ``--finetune`` to start at
0, or ``--no-load-optim --no-load-rng`` to continue the iteration count from N).

Vocabulary: the true vocabulary (``config.vocab_size``) is padded with zero rows by Megatron's
rule at TP=1 (``--make-vocab-size-divisible-by``, default 128). A run under another TP loads it
when it pads to the same row count; ``CKPT_DIR/from_hf.json`` lists a working
``--make-vocab-size-divisible-by`` per TP and the model flags to train with.

Refused, with the config field named: other architectures, biases (``attention_bias``,
``mlp_bias``), activations other than SiLU, sliding-window attention, partial RoPE, RoPE scaling
other than Llama 3's with factor 8, tensors the importer does not map.

Nothing is half-written: the checkpoint is built beside ``--save`` under a temporary name and
renamed when complete; an existing non-empty ``--save`` is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
from megatron.core.enums import ModelType
from megatron.core.utils import unwrap_model

# Modules, not their functions: the CPU layer and the checkpoint hooks replace these functions
# after this module is imported (compat/cpu.py, training/checkpoint_hooks.py).
from megatron.training import checkpointing, get_args, global_vars, initialize
from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.training import get_model
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from megatron_ext.checkpoint_manifest import iteration_dir, write_manifest
from megatron_ext.compat import cpu, upstream_fixes
from megatron_ext.compat.standalone import free_port
from megatron_ext.convert.output import (DTYPES, check_output_path, check_separate,
                                         staged_directory)
from megatron_ext.convert.output import progress as progress_bar
from megatron_ext.models.fused_layout import merge_gated_fc1, merge_qkv
from megatron_ext.stem.config import RATIOS, VARIANTS, StemConfig, parse_layers
from megatron_ext.training.arguments import add_extension_args, validate_extension_args
from megatron_ext.training.model_provider import model_provider

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# Llama 3.x RoPE scaling maps to Megatron's --use-rope-scaling --rope-scaling-factor F; GPTModel
# leaves the other parameters of upstream's apply_rope_scaling at these values.
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA3_FIXED = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
INFO_FILE = "from_hf.json"
TABLE_CHUNK_ROWS = 4096  # vocabulary rows per step of a STEM table's initialisation


class ConversionError(ValueError):
    """A Hugging Face checkpoint or option that cannot be imported; the message says why."""


def log(msg: str) -> None:
    print(f"[from-hf] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the Hugging Face side


@dataclasses.dataclass
class HFModel:
    """What ``config.json`` says, checked against what this importer maps."""

    architecture: str
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: int
    llama3_rope: bool
    rope_factor: Optional[float]
    max_positions: int
    tied: bool
    qk_norm: bool
    dtype: Optional[str]


def _refuse(cond: bool, msg: str) -> None:
    if cond:
        raise ConversionError(msg)


def describe_hf(hf_dir: str) -> HFModel:
    """Read and check ``HF_DIR/config.json``; every refusal names the config field."""
    path = os.path.join(hf_dir, "config.json")
    _refuse(not os.path.isfile(path), f"{hf_dir}: no config.json (not a Hugging Face model "
                                      "directory)")
    with open(path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = archs[0] if len(archs) == 1 else None
    if arch is None and model_type in ARCHITECTURES.values():
        arch = {v: k for k, v in ARCHITECTURES.items()}[model_type]
    _refuse(arch not in ARCHITECTURES,
            f"config.json: architectures={archs} (model_type={model_type!r}): only "
            f"{' and '.join(ARCHITECTURES)} import (dense Llama-style models)")
    # transformers normalises old and new spellings (rope_scaling / rope_parameters, head_dim).

    cfg = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    _refuse(cfg.model_type != ARCHITECTURES[arch],
            f"config.json: model_type={cfg.model_type!r} does not match architectures={archs}")
    act = getattr(cfg, "hidden_act", "silu")
    _refuse(act != "silu", f"config.json: hidden_act={act!r}: only SiLU-gated (SwiGLU) MLPs "
                           "import (Megatron --swiglu)")
    for field in ("attention_bias", "mlp_bias"):
        _refuse(bool(getattr(cfg, field, False)),
                f"config.json: {field}=true: biased linear layers do not import (the Megatron "
                "models here are --disable-bias-linear)")
    _refuse(bool(getattr(cfg, "use_sliding_window", False)),
            "config.json: use_sliding_window=true: sliding-window attention does not import")
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    _refuse(bool(other), f"config.json: layer_types holds {other}: only full attention imports")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    _refuse(partial not in (None, 1.0),
            f"config.json: partial_rotary_factor={partial}: only full RoPE imports")
    if not rope:  # transformers 4 spelling
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3 = rope_type == "llama3"
    if llama3:
        given = {k: rope.get(k) for k in LLAMA3_FIXED}
        bad = {k: v for k, v in given.items() if v is None or float(v) != float(LLAMA3_ROPE[k])}
        _refuse(bool(bad) or rope.get("factor") is None,
                f"config.json: rope_parameters (llama3 scaling) {bad or rope}: Megatron's llama3 "
                "RoPE scaling (--use-rope-scaling --rope-scaling-factor) imports only with "
                f"{ {k: LLAMA3_ROPE[k] for k in LLAMA3_FIXED} } and a factor")
    else:
        _refuse(rope_type != "default",
                f"config.json: rope_parameters.rope_type={rope_type!r}: only the default RoPE "
                "and llama3 scaling import")
    theta = float(rope.get("rope_theta", 10000.0))
    _refuse(theta != int(theta), f"config.json: rope_theta={theta}: Megatron's --rotary-base is "
                                 "an integer")
    heads = int(cfg.num_attention_heads)
    groups = int(getattr(cfg, "num_key_value_heads", None) or heads)
    _refuse(heads % groups != 0, f"config.json: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={groups}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModel(
        architecture=arch, num_layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size),
        ffn=int(cfg.intermediate_size), num_heads=heads, num_groups=groups,
        head_dim=int(head_dim), vocab=int(cfg.vocab_size), eps=float(cfg.rms_norm_eps),
        rope_theta=int(theta), llama3_rope=llama3,
        rope_factor=float(rope["factor"]) if llama3 else None,
        max_positions=int(cfg.max_position_embeddings),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM", dtype=str(dtype) if dtype else None)


class HFWeights:
    """The safetensors of a Hugging Face directory (one file or an index of shards), read one
    tensor at a time."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise ConversionError(
                f"{hf_dir}: no model.safetensors or model.safetensors.index.json (only "
                "safetensors are read; re-save with save_pretrained(safe_serialization=True))")
        self._files = {}
        self._where: Dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            path = os.path.join(hf_dir, name)
            _refuse(not os.path.isfile(path), f"{path}: missing (named by the safetensors index)")
            handle = safe_open(path, framework="pt")
            self._files[name] = handle
            for key in handle.keys():
                self._where[key] = name

    @property
    def names(self) -> List[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(f"tensor {name} is missing from the safetensors")
        return self._files[self._where[name]].get_tensor(name)

    def shape(self, name: str):
        if name not in self._where:
            raise ConversionError(f"tensor {name} is missing from the safetensors")
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())


def expected_hf_shapes(m: HFModel) -> Dict[str, tuple]:
    """Every tensor the importer reads, with its shape (docs/convert.md, "Tensor names")."""
    h, f, hd = m.hidden, m.ffn, m.head_dim
    shapes = {"model.embed_tokens.weight": (m.vocab, h), "model.norm.weight": (h,)}
    if not m.tied:
        shapes["lm_head.weight"] = (m.vocab, h)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (m.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (m.num_groups * hd, h),
            p + "self_attn.v_proj.weight": (m.num_groups * hd, h),
            p + "self_attn.o_proj.weight": (h, m.num_heads * hd),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
        if m.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def check_hf_tensors(m: HFModel, w: HFWeights) -> None:
    """Every expected tensor present with its shape, nothing else (a bias, an MoE...)."""
    expected = expected_hf_shapes(m)
    for name, shape in expected.items():
        found = w.shape(name)
        _refuse(found != shape, f"tensor {name} has shape {list(found)}; config.json implies "
                                f"{list(shape)}")
    # Tied models sometimes store lm_head as well; rotary inverse frequencies are buffers.
    ignorable = {"lm_head.weight"} if m.tied else set()
    extra = [n for n in w.names if n not in expected and n not in ignorable
             and not n.endswith("rotary_emb.inv_freq")]
    _refuse(bool(extra), f"tensors this importer does not map: {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''} ({len(extra)} in all)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (docs/convert.md)."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# ---------------------------------------------------------------------------------------------
# STEM insertion


@dataclasses.dataclass
class StemInsertion:
    layers: List[int]
    variant: str
    init_scale: float
    ratio: Optional[str]
    explicit: Optional[str]

    def flags(self) -> List[str]:
        """The training flags that select the same layers and variant."""
        sel = ["--stem-layers", self.explicit] if self.explicit else ["--stem-ratio", self.ratio]
        return ["--model-family", "stem", *sel, "--stem-variant", self.variant]


def stem_insertion(num_layers: int, layers: Optional[str], ratio: Optional[str], variant: str,
                   init_scale: float) -> Optional[StemInsertion]:
    """The STEM layers, chosen with the training code's own rule (``StemConfig``)."""
    if layers is None and ratio is None:
        _refuse(variant is not None or init_scale is not None,
                "--stem-variant/--stem-init-scale need --stem-layers or --stem-ratio (which "
                "layers become STEM layers)")
        return None
    variant = variant or "up"
    _refuse(layers is not None and ratio is not None,
            "--stem-layers and --stem-ratio exclude each other here: give one")
    if init_scale is None:
        init_scale = 1.0
    _refuse(not math.isfinite(init_scale) or init_scale <= 0,
            f"--stem-init-scale={init_scale}: must be > 0 (a zero table zeroes a STEM layer "
            "and the gradient of its gate)")
    _refuse(variant == "dagger" and init_scale != 1.0,
            "--stem-init-scale with --stem-variant dagger: dagger tables start at zero (the "
            "model is unchanged at insertion), there is nothing to scale")
    parsed = parse_layers(layers) if layers is not None else None
    stem = StemConfig(ratio=ratio or "1/3", layers=parsed, variant=variant,
                      init="zeros" if variant == "dagger" else "fan-in")
    chosen = stem.stem_layers(num_layers)
    _refuse(not chosen, f"--stem-ratio {ratio} selects no layer of this {num_layers}-layer "
                        "model")
    explicit = ",".join(str(i) for i in chosen) if layers is not None else None
    return StemInsertion(chosen, variant, init_scale, ratio, explicit)


def fill_stem_table(dest: torch.Tensor, proj: torch.Tensor, norm_weight: torch.Tensor,
                    embed: torch.Tensor, eps: float, scale: float, bar=None) -> None:
    """``dest[t] = scale * W · RMSNorm_l(E[t])`` for the true vocabulary, zero for padded rows.

    ``W`` is the dense layer's up-projection (variant up) or gate (variant gate), RMSNorm_l the
    layer's pre-MLP norm with its weight, E the input embedding (docs/convert.md)."""
    vocab = embed.shape[0]
    proj = proj.float()
    dest[vocab:].zero_()
    for start in range(0, vocab, TABLE_CHUNK_ROWS):
        stop = min(vocab, start + TABLE_CHUNK_ROWS)
        rows = rms_norm(embed[start:stop], norm_weight, eps) @ proj.t()
        if scale != 1.0:
            rows = rows * scale
        dest[start:stop].copy_(rows)
        if bar is not None:
            bar.update(stop - start)


# ---------------------------------------------------------------------------------------------
# the Megatron side


def model_flags(m: HFModel, stem: Optional[StemInsertion], divisible_by: int) -> List[str]:
    """Megatron flags that define this architecture (the conversion's and the training run's)."""
    flags = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden),
             "--ffn-hidden-size", str(m.ffn), "--num-attention-heads", str(m.num_heads)]
    if m.num_groups != m.num_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(m.num_groups)]
    if m.head_dim * m.num_heads != m.hidden:  # Megatron's default kv-channels is hidden/heads
        flags += ["--kv-channels", str(m.head_dim)]
    flags += ["--max-position-embeddings", str(m.max_positions),
              "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
              "--norm-epsilon", repr(m.eps), "--position-embedding-type", "rope",
              "--rotary-base", str(m.rope_theta)]
    if m.llama3_rope:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{m.rope_factor:g}"]
    if not m.tied:
        flags += ["--untie-embeddings-and-output-weights"]
    if m.qk_norm:
        flags += ["--qk-layernorm"]
    flags += ["--make-vocab-size-divisible-by", str(divisible_by)]
    if stem is not None:
        flags += stem.flags()
    return flags


def conversion_flags(m: HFModel, stem: Optional[StemInsertion], divisible_by: int,
                     dtype: str, save: str) -> List[str]:
    """The whole command line of the in-process Megatron (TP=PP=1, one rank)."""
    flags = model_flags(m, stem, divisible_by) + [
        "--seq-length", str(min(m.max_positions, 4096)),
        "--micro-batch-size", "1", "--global-batch-size", "1",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        # The true vocabulary; Megatron pads it (--make-vocab-size-divisible-by x TP).
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab),
        "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-rope-fusion",
        "--ckpt-format", "torch_dist", "--save", save, "--save-interval", "1",
        "--no-save-optim", "--no-save-rng",
    ]
    if stem is not None and stem.variant == "dagger":
        flags += ["--stem-init", "zeros"]
    if dtype != "fp32":
        flags += [f"--{dtype}"]
    if not torch.cuda.is_available():
        flags += ["--distributed-backend", "gloo"]
    return flags


def padded_vocab(vocab: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's rule (``vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def vocab_flags_by_tp(vocab: int, padded: int, divisible_by: int,
                      tps: Sequence[int] = (1, 2, 4, 8)) -> Dict[int, Optional[int]]:
    """For each TP size, a ``--make-vocab-size-divisible-by`` that pads ``vocab`` to exactly
    ``padded`` rows (the checkpoint's), or None when no value can."""
    out = {}
    for tp in tps:
        if padded_vocab(vocab, divisible_by, tp) == padded:
            out[tp] = divisible_by
        elif padded % tp == 0 and vocab <= padded:  # then ceil(vocab / padded) * padded == padded
            out[tp] = padded // tp
        else:
            out[tp] = None
    return out


def _single_process_env() -> None:
    """``initialize_megatron`` reads torchrun's variables; one rank on the loopback interface."""
    world = os.environ.get("WORLD_SIZE")
    _refuse(world not in (None, "1"),
            f"WORLD_SIZE={world}: from-hf runs as one process (do not start it under torchrun)")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(name, "0")
    os.environ["WORLD_SIZE"] = "1"
    # Megatron requires it for TP communication ordering; harmless here (TP=1).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Megatron prints its whole argument list and more; keep it unless it fails."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except BaseException:
        sys.stderr.write(buf.getvalue()[-20000:])
        raise


def build_megatron_model(flags: Sequence[str]):
    """Megatron's args and the model, built by megatron.training at world size 1, TP=PP=1.

    Uses megatron.training's own argument parser (with our ``add_extension_args``),
    ``initialize_megatron`` and ``get_model`` with our ``model_provider``: the model has the
    same modules, checkpoint keys and sharding metadata as in a training run."""
    _refuse(getattr(global_vars, "_GLOBAL_ARGS", None) is not None,
            "Megatron is already initialised in this process: run from-hf in a fresh process")
    _single_process_env()

    cpu.install()  # no-op with a GPU; without one it lets initialize_megatron run on the CPU
    upstream_fixes.install()  # e.g. the wheel's prebuilt dataset helpers (initialize compiles)

    argv = sys.argv
    sys.argv = ["from-hf"] + list(flags)
    try:
        # megatron.training 0.19 parses (and validates) before initialising, as pretrain does.
        with cpu.grouped_gemm_validation():  # --moe-grouped-gemm on the CPU backend
            parse_and_validate_args(extra_args_provider=add_extension_args)
    except AssertionError as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConversionError(f"Megatron refused the generated arguments: {exc or ''} "
                              f"({os.path.basename(where.filename)}:{where.lineno}: "
                              f"{where.line})") from None
    finally:
        sys.argv = argv
    args = get_args()
    try:
        validate_extension_args(args)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    initialize.initialize_megatron()
    config = core_transformer_config_from_args(args)
    # Every tensor is overwritten from the Hugging Face weights (checked in fill_model): skip
    # drawing random values, which for large vocabularies and STEM tables takes minutes.
    config.perform_initialization = False
    model = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False,
                      config=config)
    return args, model


def megatron_sources(m: HFModel, w: HFWeights, stem: Optional[StemInsertion],
                     progress: bool = False) -> Dict[str, Callable[[torch.Tensor], None]]:
    """For each Megatron (TP=1) state-dict key, a function that fills that tensor."""
    def copy(name: str):
        return lambda dest: dest.copy_(w.get(name))

    def padded_rows(name: str):
        def fill(dest):
            dest[:m.vocab].copy_(w.get(name))
            dest[m.vocab:].zero_()
        return fill

    def qkv(p: str):
        return lambda dest: dest.copy_(merge_qkv(
            w.get(p + "q_proj.weight"), w.get(p + "k_proj.weight"), w.get(p + "v_proj.weight"),
            m.num_heads, m.num_groups, m.head_dim))

    def fc1(p: str):
        return lambda dest: dest.copy_(merge_gated_fc1(w.get(p + "gate_proj.weight"),
                                                       w.get(p + "up_proj.weight")))

    def table(i: int):
        def fill(dest):
            if stem.variant == "dagger":  # exact at insertion: W_u x + 0
                dest.zero_()
                return
            proj = "up_proj" if stem.variant == "up" else "gate_proj"
            bar = progress_bar(m.vocab, f"layer {i} STEM table", progress, unit="row",
                               leave=False)
            fill_stem_table(dest, w.get(f"model.layers.{i}.mlp.{proj}.weight"),
                            w.get(f"model.layers.{i}.post_attention_layernorm.weight"),
                            w.get("model.embed_tokens.weight"), m.eps, stem.init_scale, bar)
            bar.close()
        return fill

    out = {"embedding.word_embeddings.weight": padded_rows("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": copy("model.norm.weight")}
    if not m.tied:
        out["output_layer.weight"] = padded_rows("lm_head.weight")
    stem_layers = set(stem.layers) if stem is not None else set()
    for i in range(m.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = copy(hf + "input_layernorm.weight")
        out[mg + "self_attention.linear_qkv.weight"] = qkv(hf + "self_attn.")
        out[mg + "self_attention.linear_proj.weight"] = copy(hf + "self_attn.o_proj.weight")
        if m.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = copy(hf + "self_attn.q_norm.weight")
            out[mg + "self_attention.k_layernorm.weight"] = copy(hf + "self_attn.k_norm.weight")
        out[mg + "pre_mlp_layernorm.weight"] = copy(hf + "post_attention_layernorm.weight")
        out[mg + "mlp.linear_fc2.weight"] = copy(hf + "mlp.down_proj.weight")
        if i not in stem_layers or stem.variant == "dagger":
            out[mg + "mlp.linear_fc1.weight"] = fc1(hf + "mlp.")  # [gate; up]
        elif stem.variant == "up":  # the table replaces W_up: fc1 is the gate
            out[mg + "mlp.linear_fc1.weight"] = copy(hf + "mlp.gate_proj.weight")
        else:  # gate: the table replaces W_gate: fc1 is the up-projection
            out[mg + "mlp.linear_fc1.weight"] = copy(hf + "mlp.up_proj.weight")
        if i in stem_layers:
            out[mg + "mlp.table"] = table(i)
    return out


def fill_model(model, sources: Dict[str, Callable[[torch.Tensor], None]], progress: bool) -> int:
    """Fill the model's plain state dict; every tensor exactly once."""
    (module,) = unwrap_model(model)
    state = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(state) - set(sources))
    unknown = sorted(set(sources) - set(state))
    if missing or unknown:  # the model provider and this mapping disagree: a bug, not input
        raise RuntimeError(f"Megatron model keys without a source: {missing}; sources without "
                           f"a key: {unknown}")
    bar = progress_bar(len(sources), "from-hf", progress)
    with torch.no_grad():
        for key, fill in sources.items():
            dest = state[key]
            # state_dict() tensors share storage with the parameters; fill in place.
            fill(dest)
            bar.update(1)
    bar.close()
    return len(sources)


def save_megatron(model, iteration: Optional[int]) -> None:
    """megatron.training's own ``save_checkpoint`` (torch_dist, no optimizer, no RNG)."""
    checkpointing.save_checkpoint(iteration or 0, model, None, None, 0, release=iteration is None)


# ---------------------------------------------------------------------------------------------
# the command


def convert(hf_dir: str, save: str, stem_layers: Optional[str] = None,
            stem_ratio: Optional[str] = None, stem_variant: Optional[str] = None,
            stem_init_scale: Optional[float] = None, dtype: str = "fp32",
            divisible_by: int = 128, iteration: Optional[int] = None, progress: bool = True,
            verbose: bool = False) -> str:
    """Convert and return ``save``. Runs Megatron in this process: once per process."""
    start = time.time()
    try:  # the paths first: nothing read or written when they cannot work
        check_separate(hf_dir, "--hf", save, "--save")
        check_output_path(save, "--save")
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    save = os.path.abspath(save)
    _refuse(os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)),
            f"{save} exists and is not empty; choose a new --save directory")
    _refuse(iteration is not None and iteration < 0, f"--iteration={iteration}: must be >= 0")
    _refuse(divisible_by < 1, f"--make-vocab-size-divisible-by={divisible_by}: must be >= 1")
    _refuse(not os.path.isdir(hf_dir), f"--hf {hf_dir}: no such directory")
    m = describe_hf(hf_dir)
    weights = HFWeights(hf_dir)
    check_hf_tensors(m, weights)
    try:
        stem = stem_insertion(m.num_layers, stem_layers, stem_ratio, stem_variant,
                              stem_init_scale)
    except ValueError as exc:  # StemConfig's messages name the flag
        raise ConversionError(str(exc)) from None
    padded = padded_vocab(m.vocab, divisible_by)
    log(f"{hf_dir}: {m.architecture}, {m.num_layers} layers, hidden {m.hidden}, ffn {m.ffn}, "
        f"heads {m.num_heads}/{m.num_groups} (head dim {m.head_dim}), vocab {m.vocab} "
        f"(padded {padded}), {'tied' if m.tied else 'untied'} embeddings"
        + (f"; STEM ({stem.variant}) layers {stem.layers}" if stem else ""))

    try:
        with staged_directory(save) as tmp:
            flags = conversion_flags(m, stem, divisible_by, dtype, tmp)
            log("building the Megatron model (megatron.training, one process, TP=PP=1)")
            with _quiet(verbose):
                args, model = build_megatron_model(flags)
            _refuse(args.padded_vocab_size != padded, "Megatron padded the vocabulary to "
                    f"{args.padded_vocab_size}, expected {padded}")
            log(f"filling {sum(p.numel() for p in model[0].parameters()) / 1e6:.1f} M "
                "parameters from the Hugging Face tensors")
            n = fill_model(model, megatron_sources(m, weights, stem, progress), progress)
            t = time.time()
            log(f"saving the torch_dist checkpoint "
                f"({'release' if iteration is None else f'iteration {iteration}'})")
            with _quiet(verbose):
                save_megatron(model, iteration)
            manifest = write_manifest(iteration_dir(tmp, iteration), iteration)
            log(f"saved in {time.time() - t:.1f} s (checksum manifest: {len(manifest['files'])} "
                f"files, {manifest['seconds']:.1f} s of it)")
            info = describe_result(hf_dir, save, m, stem, divisible_by, padded, iteration,
                                   dtype)
            with open(os.path.join(tmp, INFO_FILE), "w") as f:
                json.dump(info, f, indent=2)
            if os.path.isdir(save):  # an empty directory
                os.rmdir(save)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    log(f"wrote {save}: {n} tensors in {time.time() - start:.1f} s")
    log("train from it with launch/pretrain.py and these model flags (plus your usual ones):\n  "
        + " ".join(info["pretrain_flags"]))
    log(info["vocab_note"])
    return save


def training_tokenizer(hf_dir: str, m: HFModel):
    """The tokenizer flags to suggest and the vocabulary size Megatron will pad in training:
    ``len(tokenizer)`` for Megatron's HuggingFaceTokenizer (it can be below config.vocab_size),
    config.vocab_size for NullTokenizer."""
    if any(os.path.isfile(os.path.join(hf_dir, f))
           for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        try:
            size = len(AutoTokenizer.from_pretrained(hf_dir))
            return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                    os.path.abspath(hf_dir)], size
        except Exception as exc:  # the weights do not need it; say so and go on
            log(f"the tokenizer in {hf_dir} did not load ({type(exc).__name__}: {exc}); "
                "suggesting NullTokenizer flags")
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab)], m.vocab


def describe_result(hf_dir, save, m: HFModel, stem: Optional[StemInsertion], divisible_by,
                    padded, iteration, dtype) -> dict:
    """``from_hf.json``: what was imported and how to train from it."""
    tokenizer, train_vocab = training_tokenizer(hf_dir, m)
    by_tp = vocab_flags_by_tp(train_vocab, padded, divisible_by)
    # A release checkpoint needs no flag; an iter_N one --finetune (or --no-load-optim
    # --no-load-rng to keep counting from N): it holds no optimizer or RNG state.
    load = ["--load", save] + (["--finetune"] if iteration is not None else [])
    notes = ", ".join(f"TP={tp}: " + (f"--make-vocab-size-divisible-by {d}" if d else
                                      "not loadable") for tp, d in by_tp.items())
    return {
        "source": os.path.abspath(hf_dir),
        "architecture": m.architecture,
        "checkpoint": "release" if iteration is None else f"iter_{iteration:07d}",
        "dtype": dtype,
        "vocab_size": m.vocab,
        "tokenizer_vocab_size": train_vocab,
        "padded_vocab_size": padded,
        "stem": None if stem is None else {
            "layers": stem.layers, "variant": stem.variant, "init_scale": stem.init_scale,
            "rule": ("zero table (dagger: unchanged at insertion)" if stem.variant == "dagger"
                     else f"U_l[t] = {stem.init_scale} * "
                          f"{'W_up' if stem.variant == 'up' else 'W_gate'}^l . "
                          "RMSNorm_l(E[t]) (RMSNorm_l: the layer's pre-MLP norm)")},
        "pretrain_flags": model_flags(m, stem, divisible_by) + tokenizer + load,
        "make_vocab_size_divisible_by_per_tp": {str(k): v for k, v in by_tp.items()},
        "vocab_note": (f"the checkpoint's vocabulary has {padded} rows ({m.vocab} + zero "
                       f"padding); the training run must pad its {train_vocab}-token "
                       f"vocabulary to the same size: {notes}"),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.convert from-hf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + "
                                               "safetensors)")
    p.add_argument("--save", required=True, help="Megatron checkpoint directory to create "
                                                 "(pretrain's --load)")
    p.add_argument("--stem-layers", default=None,
                   help="0-based layers that become STEM layers, e.g. 1,3 (never 0)")
    p.add_argument("--stem-ratio", default=None, choices=RATIOS,
                   help="STEM layers by the training rule: 1/3 -> (i+1)%%3==0, 1/2 -> "
                        "(i+1)%%2==0, full -> all but 0")
    p.add_argument("--stem-variant", default=None, choices=VARIANTS,
                   help="up (default): the table replaces W_up; gate: it replaces W_gate; "
                        "dagger: W_up kept, a zero table added")
    p.add_argument("--stem-init-scale", type=float, default=None,
                   help="multiplies the initial table rows W·RMSNorm(E[t]) (up/gate; default 1)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="dtype of the saved weights (default fp32: lossless from bf16/fp16; "
                        "Megatron casts on load)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Megatron's vocabulary padding at TP=1 (default 128, Megatron's)")
    p.add_argument("--iteration", type=int, default=None,
                   help="write iter_N instead of a release checkpoint (load it with "
                        "--finetune, or --no-load-optim --no-load-rng to keep counting from N)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show Megatron's own output")
    a = p.parse_args(argv)
    try:
        convert(a.hf, a.save, stem_layers=a.stem_layers, stem_ratio=a.stem_ratio,
                stem_variant=a.stem_variant, stem_init_scale=a.stem_init_scale, dtype=a.dtype,
                divisible_by=a.make_vocab_size_divisible_by, iteration=a.iteration,
                progress=not a.no_progress, verbose=a.verbose)
    except ConversionError as e:
        print(f"from-hf: error: {e}", file=sys.stderr)
        return 2
    return 0
