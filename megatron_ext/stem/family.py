"""STEM as a model family (``--model-family stem``; the contract: ``models/family.py``): its
flags, ``StemConfig`` from them, their checks, the decoder block spec with ``StemMLP`` on the STEM
layers, the checkpoint check, the Hugging Face mapping and the estimate's terms; what a training
does with STEM (the managed tables, their worker and optimizer) is ``stem/run.py``'s
``StemRun``."""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.gpt_checkpoint_interop import gpt_compatible_layer_maps

from megatron_ext.models import hybrid_specs, saved_settings
from megatron_ext.models.family import Family
from megatron_ext.models.hybrid_pattern import mlp_block_count, mlp_layer_indices
from megatron_ext.models.layer import TokenContextMLPLayer
from megatron_ext.models.specs import with_mlp
from megatron_ext.models.terms import MLPTerms
from megatron_ext.stem.runtime import worker
from megatron_ext.stem.runtime.checkpoint import (
    SavedTables,
    check_optimizer_state,
    check_table_shapes,
    saved_tables,
)
from megatron_ext.compiled import check_available
from megatron_ext.stem.config import (
    COMPILES,
    DEFAULT_TIER_COUNT_TOKENS,
    GPU_STEPS,
    HOST_READS,
    INITS,
    KERNELS,
    OPTIMIZERS,
    OWNERSHIPS,
    PLACEMENTS,
    RATIOS,
    SHARDINGS,
    VARIANTS,
    StemConfig,
    parse_layers,
)
from megatron_ext.stem.runtime.hot_rows import parse_tier_size
from megatron_ext.stem.runtime.store import check_host_read
from megatron_ext.stem.mlp import StemMLP
from megatron_ext.stem.specs import decoder_block_spec
from megatron_ext.stem.runtime.ownership import RowOwnership
from megatron_ext.stem.run import StemRun
from megatron_ext_kernels import row_adam_gpu, stem_gate

NAME = "stem"


def add_args(parser: argparse.ArgumentParser) -> None:
    stem = parser.add_argument_group("megatron-ext STEM")
    stem.add_argument("--stem-ratio", choices=RATIOS, default="1/3",
                      help="STEM layers: 1/3 -> (i+1)%%3==0, 1/2 -> (i+1)%%2==0, full -> all but 0")
    stem.add_argument("--stem-layers", type=str, default=None,
                      help="explicit 0-based STEM layers, e.g. 2,5,8 (wins over --stem-ratio)")
    stem.add_argument("--stem-variant", choices=VARIANTS, default="up",
                      help="up: U[t] replaces W_up (paper); gate: U[t] replaces W_gate (ablation); "
                           "dagger: W_up kept and U[t] added (STEM-dagger)")
    stem.add_argument("--stem-init", choices=INITS, default="fan-in",
                      help="table initialisation; default fan-in = N(0, (init_method_std * "
                           "sqrt(hidden))^2), the spread of W_up x at initialisation")
    stem.add_argument("--stem-table-placement", choices=PLACEMENTS, default="gpu",
                      help="gpu: tables are model parameters on the device; cpu: they live in "
                           "host memory, touched rows are copied to the device; tiered: "
                           "the hottest rows (--stem-gpu-tier) on the device with their optimizer "
                           "state, the rest in host memory (needs --stem-table-sharding vocab)")
    stem.add_argument("--stem-gpu-tier", default="10%", metavar="SIZE",
                      help="tiered placement: rows of the GPU tier as a count (50000), a fraction "
                           "(0.1) or a percentage (10%%) of the vocabulary; the most frequent ids "
                           "of the training blend (--data-path, --train-data-path, "
                           "--data-args-path or --per-split-data-args-path), counted at "
                           "start-up (--stem-tier-count-tokens)")
    stem.add_argument("--stem-tier-count-tokens", type=int, default=DEFAULT_TIER_COUNT_TOKENS,
                      metavar="N",
                      help="tiered placement: tokens of the training data each rank counts at "
                           "start-up to choose the GPU tier, in windows spread evenly over each "
                           "dataset and shared among the blend's datasets by their share "
                           "(default %(default)s; 0: every token, one pass over the corpus)")
    stem.add_argument("--stem-table-sharding", choices=SHARDINGS, default="replicated",
                      help="replicated: every data-parallel rank holds all rows; vocab: each "
                           "data-parallel rank owns a share of the rows (--stem-row-ownership)")
    stem.add_argument("--stem-row-ownership", choices=OWNERSHIPS, default="interleaved",
                      help="with vocab sharding: row r on rank r %% dp (interleaved, balanced on "
                           "BPE vocabularies) or contiguous ranges")
    stem.add_argument("--stem-optimizer", choices=OPTIMIZERS, default="dense",
                      help="for cpu or vocab-sharded tables, AdamW on the CPU: dense (every owned "
                           "row each step: torch's AdamW) or sparse (touched rows only; an "
                           "untouched row is brought up to date when next read or stepped: "
                           "AdamW but for eps, which shrinks with sqrt(v) while a row is "
                           "untouched: rows 0.9%% (median) to 3%% (max) of AdamW's move apart "
                           "at gradients 49x eps, less above; docs/stem.md)")

    stem.add_argument("--stem-prefetch", action=argparse.BooleanOptionalAction, default=True,
                      help="cpu/vocab-sharded tables: fetch the next micro-batch's rows in the "
                           "background while the current one computes")
    stem.add_argument("--stem-cpu-threads", type=int, default=0, metavar="N",
                      help="threads of the CPU row kernels (table step, row gather) per rank; 0: "
                           "the cores of the rank's affinity mask / ranks on the node (not "
                           "OMP_NUM_THREADS, which torchrun sets to 1 for several ranks)")
    stem.add_argument("--stem-gil-switch-ms", type=float,
                      default=1e3 * worker.DEFAULT_SWITCH_INTERVAL_S, metavar="MS",
                      help="managed tables: the GIL switch interval (sys.setswitchinterval) the "
                           "tables' host worker sets when it starts, so that its host work is "
                           "not held up for Python's 5 ms each time a Python-bound training "
                           "thread keeps the GIL; 0 leaves Python's own")
    stem.add_argument("--stem-host-huge-pages", action=argparse.BooleanOptionalAction,
                      default=True,
                      help="host-resident table rows and their Adam moments on transparent huge "
                           "pages (madvise; fewer TLB misses for the scattered row reads and "
                           "steps; needs the kernel's THP mode madvise or always)")
    stem.add_argument("--stem-host-read", choices=HOST_READS, default="staged",
                      help="cpu/tiered tables: how host rows reach the GPU; staged: gathered on "
                           "the CPU into pinned staging, then copied; direct: a GPU kernel "
                           "reads them from the host shards, registered page-locked at start-up "
                           "(kernels/host_rows.py; needs CUDA); staged until a GPU run measures "
                           "both (docs/stem.md)")
    stem.add_argument("--stem-gpu-step", choices=GPU_STEPS, default="torch",
                      help="sparse optimizer, rows on the GPU (tiered's GPU tier, managed gpu "
                           "tables): torch = catch-up and AdamW in torch ops (about 28 per "
                           "chunk of rows), triton = one kernel (kernels/row_adam_gpu.py; "
                           "needs CUDA); torch until a GPU run measures both (docs/stem.md)")
    stem.add_argument("--stem-kernel", choices=KERNELS, default="auto",
                      help="lookup-and-gate: triton = the fused kernel "
                           "(kernels/stem_gate.py; no [vocab, d_ff] gradient "
                           "temporary, slower on an H100), torch = the plain-PyTorch path, "
                           "auto = torch (docs/stem.md)")
    stem.add_argument("--stem-compile", choices=COMPILES, default="none",
                      help="gate: torch.compile the PyTorch path's ops after the table gather "
                           "(cast, SiLU, product and their backward; the gather stays eager; "
                           "docs/stem.md); none: eager (the default until a GPU run measures it)")
    stem.add_argument("--stem-dump-tables", default=None, metavar="DIR",
                      help="after training, write each rank's rows of cpu/vocab-sharded tables "
                           "to DIR (inspection and tests)")


def config_from_args(args) -> StemConfig:
    layers = parse_layers(args.stem_layers) if args.stem_layers else None
    return StemConfig(ratio=args.stem_ratio, layers=layers, variant=args.stem_variant,
                      init=args.stem_init, placement=args.stem_table_placement,
                      sharding=args.stem_table_sharding, ownership=args.stem_row_ownership,
                      optimizer=args.stem_optimizer, prefetch=args.stem_prefetch,
                      kernel=args.stem_kernel, gpu_tier=args.stem_gpu_tier,
                      tier_count_tokens=args.stem_tier_count_tokens,
                      host_huge_pages=args.stem_host_huge_pages,
                      host_read=getattr(args, "stem_host_read", "staged"),
                      gpu_step=getattr(args, "stem_gpu_step", "torch"),
                      compile=getattr(args, "stem_compile", "none"))


def stem_config(args) -> Optional[StemConfig]:
    """The STEM options of ``args``, or None when the model is not STEM."""
    return config_from_args(args) if args.model_family == NAME else None


def validate_args(args, tokenizer_vocab_size: Optional[int] = None) -> None:
    stem = config_from_args(args)
    stem.stem_layers(mlp_block_count(args))  # raises for out-of-range layers
    if stem.placement == "tiered":
        # The size against the table's rows where they are known (entry point), else its
        # form alone (dry run).
        rows = getattr(args, "padded_vocab_size", None) or tokenizer_vocab_size
        try:
            parse_tier_size(stem.gpu_tier, rows if rows else 2**62)
        except ValueError as exc:
            raise ValueError(f"--stem-gpu-tier: {exc}") from None
    if args.stem_cpu_threads < 0:
        raise ValueError(f"--stem-cpu-threads={args.stem_cpu_threads}: must be >= 0 (0 = "
                         "automatic)")
    switch_ms = getattr(args, "stem_gil_switch_ms", 1e3 * worker.DEFAULT_SWITCH_INTERVAL_S)
    try:
        worker.check_switch_interval(switch_ms / 1e3)  # the run's worker sets it (stem/run.py)
    except ValueError:
        raise ValueError(f"--stem-gil-switch-ms={switch_ms}: must be >= 0 (0 = Python's "
                         "own)") from None
    if not args.swiglu:
        raise ValueError("--model-family=stem needs a gated activation: pass --swiglu "
                         "(STEM replaces one input of the SwiGLU product)")
    if args.add_bias_linear:
        raise ValueError("--model-family=stem: pass --disable-bias-linear (STEM layers "
                         "have no biases)")

    stem_gate.resolve(stem.kernel)  # --stem-kernel triton where it cannot run
    if stem.compile != "none":
        if stem.kernel == "triton":
            raise ValueError(f"--stem-compile {stem.compile} compiles the PyTorch path, and "
                             "--stem-kernel triton runs the fused kernel instead: pass "
                             "--stem-kernel torch (or auto), or --stem-compile none")
        check_available("--stem-compile")
    check_host_read(stem.host_read, stem.placement, torch.cuda.is_available())
    # Without CUDA the rows of the GPU tier are host tensors, stepped by the CPU row kernel.
    if stem.gpu_step == "triton" and not (torch.cuda.is_available() and row_adam_gpu.available()):
        raise ValueError("--stem-gpu-step triton needs Triton and a CUDA device (it steps the "
                         "rows on the GPU); use --stem-gpu-step torch")
    if args.recompute_granularity == "selective" and "mlp" in (args.recompute_modules or []):
        raise ValueError("--recompute-modules mlp is not supported with STEM layers; use "
                         "--recompute-granularity full")
    if stem.managed_tables:
        where = (f"--stem-table-placement {stem.placement} --stem-table-sharding "
                 f"{stem.sharding}")
        unsupported = [
            ((args.save is not None or args.load is not None)
             and args.ckpt_format != "torch_dist",
             f"--ckpt-format {args.ckpt_format} (their checkpoints are torch_dist)"),
            (args.calculate_per_token_loss, "--calculate-per-token-loss"),
            (args.context_parallel_size > 1, "--context-parallel-size > 1"),
        ]
        for bad, flag in unsupported:
            if bad:
                raise ValueError(f"{where} does not support {flag} yet; use the default "
                                 "--stem-table-placement gpu --stem-table-sharding replicated")


def rows_owned_at_build(stem: StemConfig, vocab_size: int) -> Optional[torch.Tensor]:
    """The global rows a managed table of this rank will hold (vocab sharding: the rows
    ``RowOwnership`` gives this data-parallel rank, as ``StemTables`` will), the only ones whose
    drawn values the STEM MLP keeps; None (every row) for replicated tables and for a model
    built without Megatron's parallel state."""
    if stem.sharding != "vocab" or not parallel_state.model_parallel_is_initialized():
        return None
    return RowOwnership(vocab_size, parallel_state.get_data_parallel_world_size(),
                        stem.ownership).owned_ids(parallel_state.get_data_parallel_rank())


def block_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    stem = config_from_args(args)
    return decoder_block_spec(config, stem, args.padded_vocab_size, use_te, vp_stage=vp_stage,
                              kept_rows=rows_owned_at_build(stem, args.padded_vocab_size))


def hybrid_stack_spec(args, config, use_te: bool, vp_stage: Optional[int] = None):
    """The hybrid path: STEM layer i (``--stem-layers``, ``--stem-ratio``) is the i-th MLP block,
    the i-th ``-`` of ``--hybrid-layer-pattern``, a ``TokenContextMLPLayer`` with a STEM MLP."""
    stem = config_from_args(args)
    stem_ids = set(stem.stem_layers(mlp_block_count(args)))
    kept_rows = rows_owned_at_build(stem, args.padded_vocab_size)

    def mlp_fn(k, dense):
        if k not in stem_ids:
            return dense
        return with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextMLPLayer, stem=stem,
                        vocab_size=args.padded_vocab_size, kept_rows=kept_rows)

    return hybrid_specs.hybrid_stack_spec(config, args.hybrid_layer_pattern, use_te, mlp_fn)


def _saved_layer(args, saved: SavedTables) -> Optional[Callable[[int], int]]:
    """Where upstream's loader reads a layer of this model (its global index: a GPT layer, or a
    pattern position on the hybrid path) from: the same index, or for a GPT-path checkpoint
    into the hybrid path the paired GPT layer (upstream's ``gpt_compatible_layer_maps``: the
    i-th MLP position is GPT layer i, as ``models/hybrid_checkpoint.py`` retargets). None: a
    pairing upstream's loader refuses itself."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern or saved.hybrid_layer_pattern:
        return None if saved.hybrid_layer_pattern and not pattern else (lambda i: i)
    try:
        mlp_to_gpt = gpt_compatible_layer_maps(pattern).mlp_to_gpt
    except ValueError:
        return None
    return lambda i: mlp_to_gpt[i]


def _stem_layers(args):
    layers = parse_layers(args.stem_layers) if args.stem_layers else None
    return StemConfig(ratio=args.stem_ratio, layers=layers).stem_layers(mlp_block_count(args))


# What changes a STEM model on resume (models/saved_settings.py): what its tables do and which
# MLP blocks have one. The tables' width (--ffn-hidden-size) and rows are compared with the
# checkpoint's tensors (check_table_shapes). Placement, sharding, ownership, optimizer, prefetch,
# kernel and init are free: a checkpoint's layout does not depend on them (stem/runtime/checkpoint.py).
SETTINGS = (
    ("--stem-variant", lambda a: a.stem_variant),
    ("STEM layers (MLP blocks, from --stem-layers/--stem-ratio)", _stem_layers),
)


def _table_optimizer(placement: str, sharding: str, mode: str) -> Optional[str]:
    """The optimizer of managed tables (``--stem-optimizer``); None for ordinary tables
    (``StemConfig.managed_tables``), whose state is Megatron's optimizer's and not compared here."""
    return None if (placement == "gpu" and sharding == "replicated") else mode


def check_table_optimizer(saved_args, stem: StemConfig) -> None:
    """Refuse (one line), before upstream's loader reads a tensor, a resume that loads the tables'
    optimizer state of one ``--stem-optimizer`` into the other: the sparse state holds each row's
    last iteration with a gradient, the dense one does not (``load_optimizer_state`` refused it
    too, but inside upstream's loader, as a traceback on every rank)."""
    try:
        then = _table_optimizer(saved_args.stem_table_placement, saved_args.stem_table_sharding,
                                saved_args.stem_optimizer)
    except AttributeError:  # no args, or saved without these flags: the loader still checks
        return
    now = _table_optimizer(stem.placement, stem.sharding, stem.optimizer)
    if then is not None and now is not None and then != now:
        raise ValueError(
            f"--stem-optimizer: {then} in the checkpoint, {now} in this run: the tables' "
            f"optimizer state of one does not load into the other; resume with --stem-optimizer "
            f"{then}, or pass --no-load-optim (the rows load, their moments start anew)")


def check_checkpoint(chunks, args, stem: StemConfig, load_dir: str, step: Optional[int],
                     tokenizer_vocab_size: Optional[int]) -> None:
    """The checkpoint's STEM model is this run's (``SETTINGS``, from the args it was saved
    with); it has this model's STEM tables, in the layers ``--stem-layers`` / ``--stem-ratio``
    choose and with its ``[vocab, d_ff]`` (``check_table_shapes``), looked up where upstream's
    loader reads them (a GPT-path checkpoint into the hybrid path: the paired GPT layers)."""
    saved = saved_tables(load_dir, step)
    if saved is not None:
        check_optimizer_state(saved, stem.optimizer if stem.managed_tables else "ordinary",
                              not (args.no_load_optim or args.finetune))
    saved_settings.check(load_dir, step, args, SETTINGS)
    if not (args.no_load_optim or args.finetune):
        check_table_optimizer(saved_settings.saved_args(load_dir, step), stem)
    saved_layer = _saved_layer(args, saved) if saved is not None else None
    if saved_layer is None:
        return
    expected = {}
    for chunk in chunks:
        for _, module in chunk.named_modules():
            if isinstance(module, StemMLP) and module.layer_number is not None:
                expected[saved_layer(module.layer_number - 1)] = (
                    module.vocab_size, module.config.ffn_hidden_size)
    check_table_shapes(saved, expected, tokenizer_vocab_size)
    # Every STEM layer of the model (all stages), by its global index, and where it is read.
    blocks = stem.stem_layers(mlp_block_count(args))
    pattern = getattr(args, "hybrid_layer_pattern", None)
    layers = [mlp_layer_indices(pattern)[k] for k in blocks] if pattern else blocks
    wanted = sorted(saved_layer(i) for i in layers)
    if sorted(saved.shapes) != wanted:
        where = ("pattern positions" if saved.hybrid_layer_pattern else "layers")
        raise ValueError(
            f"STEM table checkpoint {saved.path}: it holds STEM tables in {where} "
            f"{sorted(saved.shapes)}, but this model's STEM layers (MLP blocks {blocks} from "
            f"--stem-layers/--stem-ratio) read them from {where} {wanted}; load it with the "
            "STEM layers it was trained with")


def hf_mlp_layers(args, iteration, gated: bool, refuse) -> list:
    stem, n, ffn = config_from_args(args), mlp_block_count(args), args.ffn_hidden_size
    layers = set(stem.stem_layers(n))
    return [{"type": "stem", "variant": stem.variant, "intermediate_size": ffn} if i in layers
            else {"type": "dense", "intermediate_size": ffn} for i in range(n)]


def hf_stem_tensors(plan, i: int, m: dict) -> None:
    """A STEM MLP: the projection(s) ``linear_fc1`` holds, the table (the true vocabulary's
    rows) and ``down_proj``."""
    d, f = plan.desc, m["intermediate_size"]
    halves = {"up": ("gate_proj",), "gate": ("up_proj",),
              "dagger": ("gate_proj", "up_proj")}[m["variant"]]
    plan.fc(i, "mlp.", f, halves)
    table = plan.layer(i, ["mlp.table"], (d.padded_vocab, f))
    plan.add(f"model.layers.{i}.mlp.stem_table.weight", (d.vocab, f),
             table and (lambda t=table: t()[: d.vocab]))
    plan.down_proj(i, f)


class StemTerms(MLPTerms):
    """STEM in the estimate: ``up``/``gate`` layers lose one MLP matrix to a ``V x f`` table
    (``dagger`` keeps it), one table row is active per token, managed tables are held beside
    the parameters (host, GPU, or tiered: the GPU tier's rows on the GPU, the others on the
    host), with two fetched-row buffers on the GPU."""

    def spec_fields(self, args, stem) -> dict:
        return dict(stem_layers=tuple(stem.stem_layers(mlp_block_count(args))),
                    stem_variant=stem.variant)

    def layout_fields(self, args, stem) -> dict:
        return dict(stem_managed=bool(stem.managed_tables), stem_placement=stem.placement,
                    stem_sharding=stem.sharding, stem_optimizer=stem.optimizer,
                    stem_ownership=stem.ownership, stem_gpu_tier=stem.gpu_tier)

    def _matrices(self, spec, layer: int) -> int:
        return spec.m - 1 if spec.is_stem(layer) and spec.stem_replaces_matrix() else spec.m

    def mlp_params(self, spec, layer: int, tp: int = 1) -> int:
        h, f, matrices = spec.hidden, spec.ffn, self._matrices(spec, layer)
        n = matrices * h * f // tp
        if spec.bias:
            n += (matrices - 1) * f // tp + h
        return n

    def add_layer_parts(self, spec, layer, parts, tp, ep, etp, managed_tables) -> None:
        if spec.is_stem(layer) and not managed_tables:
            parts.stem_tables += spec.vocab * spec.ffn // tp

    def active_extra(self, spec, layer, topks) -> int:
        return spec.ffn if spec.is_stem(layer) else 0

    def mlp_flops(self, spec, layer, topks) -> float:
        return 6.0 * self._matrices(spec, layer) * spec.hidden * spec.ffn

    def mlp_activation_bytes(self, spec, layout, layer, topks, s, b, sp) -> float:
        if not spec.is_stem(layer):
            return super().mlp_activation_bytes(spec, layout, layer, topks, s, b, sp)
        f = spec.ffn / layout.tp
        return (layout.act_bytes * s * b * f * (4 + (1 if spec.stem_variant == "dagger" else 0))
                + 8 * s * b)

    def table_params(self, spec) -> int:
        return len(spec.stem_layers) * spec.vocab * spec.ffn

    def stage_memory(self, spec, layout, layers, s, b, gpu, host) -> None:
        if not layout.stem_managed:
            return
        rows = math.ceil(spec.vocab / layout.dp) if layout.stem_sharding == "vocab" \
            else spec.vocab
        stem_here = [i for i in layers if spec.is_stem(i)]
        width = (spec.ffn // layout.tp) * len(stem_here)

        def tables(n_rows: int) -> dict:
            elems = n_rows * width
            out = {"stem_tables": 4 * elems, "stem_adam_moments": 8 * elems}
            if layout.stem_optimizer == "dense":
                out["stem_table_gradients"] = 4 * elems
            return out

        if layout.stem_placement == "tiered":
            # The busiest rank's GPU tier: the hot rows spread over the owners (interleaved
            # ownership) or, contiguous, possibly all on one (frequent BPE ids are low ids).
            hot = parse_tier_size(layout.stem_gpu_tier, spec.vocab)
            mine = hot if layout.stem_ownership == "contiguous" else math.ceil(hot / layout.dp)
            mine = min(mine, rows)
            gpu.update(tables(mine))
            host.update(tables(rows - mine))
        else:
            (host if layout.stem_placement == "cpu" else gpu).update(tables(rows))
        fetched = min(spec.vocab, s * b) * (spec.ffn // layout.tp) * len(stem_here)
        gpu["stem_fetched_rows"] = 2 * fetched * layout.act_bytes


FAMILY = Family(NAME, "STEM: token-indexed up-projection tables", block_spec,
                hybrid_stack_spec=hybrid_stack_spec,
                heterogeneous_layers=True, add_args=add_args, config_from_args=config_from_args,
                validate_args=validate_args, check_checkpoint=check_checkpoint,
                start_run=StemRun,
                estimate_terms=StemTerms(), hf_mlp_layers=hf_mlp_layers,
                hf_mlp_tensors={"stem": hf_stem_tensors})
