"""Checks at start-up, before Megatron builds anything, of paths and settings that would otherwise
fail late or as tracebacks: the indexed datasets named by the data flags, the checkpoint
directory, an asynchronous save that cannot run here, the parallel layout against the number of
ranks, a resume whose learning-rate schedule differs from the checkpoint's, a resume at another
model-parallel layout of a distributed-optimizer state that cannot follow it, and the memory the
managed STEM tables need against the memory available.

A check raises ``ValueError`` with the one line to show; ``entry.py`` prints it through
``megatron_ext.training.refusal.refuse`` (printed once per node, every rank exits): a new check
raises the same way, or calls ``refuse`` itself where its outcome depends on the rank."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shlex
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import dist_checkpointing
from megatron.core.datasets.object_storage_utils import is_object_storage_path
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training import checkpointing, global_vars
from megatron.training.training import get_optimizer_param_scheduler
from megatron.training.utils import has_nvrx_checkpointing_async_support

from megatron_ext.checkpoint_manifest import TRACKER
from megatron_ext.checkpoint_state import unloadable_reason
from megatron_ext.data_paths import data_args_list, dataset_prefixes, per_split_lists
from megatron_ext.models import saved_settings
from megatron_ext.models.grouped_experts import unsupported as grouped_experts_unsupported
from megatron_ext.planning.estimate import LABELS, table_memory
from megatron_ext.planning.layout import Layout, validate_layout
from megatron_ext.planning.model_shape import ModelShape
from megatron_ext.stem.runtime.host_memory import available_bytes
from megatron_ext.stem.initial_rows import BLOCK_BYTES
from megatron_ext.training.refusal import launch_rank, refuse

DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
# Files that hold the data flags' lists: a blend, or a JSON of the train/valid/test blends.
DATA_FILE_FLAGS = ("data_args_path", "per_split_data_args_path")


# Flags a training cannot start without, which Megatron reports as a traceback: its validation
# asserts ``args.micro_batch_size is not None``; its tokenizer builder raises for a None type.
# (attribute, flag, what to give)
REQUIRED = (
    ("micro_batch_size", "--micro-batch-size", "the samples of one micro-batch on each "
     "data-parallel rank, e.g. --micro-batch-size 1"),
    ("tokenizer_type", "--tokenizer-type", "e.g. HuggingFaceTokenizer with --tokenizer-model "
     "DIR, or NullTokenizer with --vocab-size N for --mock-data"),
)
FROM_CHECKPOINT = ("tokenizer_type",)  # --use-checkpoint-args reads these from the checkpoint


def check_required_flags(args) -> None:
    """The flags a training cannot start without, named in one line before Megatron's validation
    (which asserts on them without a message)."""
    from_checkpoint = FROM_CHECKPOINT if getattr(args, "use_checkpoint_args", False) else ()
    missing = [f"{flag} ({what})" for attr, flag, what in REQUIRED
               if getattr(args, attr, None) is None and attr not in from_checkpoint]
    if missing:
        raise ValueError("missing " + "; ".join(missing))


def _file_prefixes(flag: str, path: str) -> List[str]:
    """The dataset prefixes of a ``--data-args-path`` file (a blend list) or of a
    ``--per-split-data-args-path`` JSON (``train``/``valid``/``test`` lists or strings)."""
    if not os.path.isfile(path):
        raise ValueError(f"--{flag.replace('_', '-')}: {path} does not exist")
    if flag == "data_args_path":
        return dataset_prefixes(data_args_list(path))
    try:
        splits = per_split_lists(path)
    except ValueError as exc:
        raise ValueError(f"--{flag.replace('_', '-')}: {path} is not JSON ({exc})") from None
    if not isinstance(splits, dict):
        return []
    return [prefix for split in ("train", "valid", "test")
            for prefix in dataset_prefixes(splits.get(split))]


def check_data_paths(args) -> None:
    """Every prefix of ``--data-path`` / ``--{train,valid,test}-data-path``, and of the files
    ``--data-args-path`` / ``--per-split-data-args-path`` name, has its ``.bin`` and ``.idx``
    (Megatron's indexed dataset); else one line naming the flag and the missing file. Paths in
    object storage (``s3://``, ``msc://``) are left to Megatron."""
    if getattr(args, "mock_data", False):
        return
    named = [(flag, prefix) for flag in DATA_FLAGS
             for prefix in dataset_prefixes(getattr(args, flag, None))]
    # Object storage (s3://, msc://) is Megatron's to reach: only local files are checked.
    named += [(flag, prefix) for flag in DATA_FILE_FLAGS if getattr(args, flag, None)
              and not is_object_storage_path(getattr(args, flag))
              for prefix in _file_prefixes(flag, getattr(args, flag))]
    for flag, prefix in named:
        if is_object_storage_path(prefix):
            continue
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ValueError(
                    f"--{flag.replace('_', '-')}: no indexed dataset at {prefix} ({prefix}"
                    f"{suffix} does not exist; a prefix names the files without .bin/.idx)")


def check_save_dir(save: Optional[str], rank: int = 0) -> None:
    """``--save`` can be created and written now, not only at the first save many iterations
    later. Each rank writes and removes a probe file of its own (torch_dist writes from every
    rank)."""
    if not save:
        return
    probe = os.path.join(save, f".megatron_ext_write_check.{rank}")
    try:
        os.makedirs(save, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"--save={save}: cannot create or write the checkpoint directory "
                         f"({exc.strerror or exc}); checkpoints would fail at the first save")


def has_checkpoint(path: str) -> bool:
    """``path`` holds a Megatron checkpoint: its tracker file, an ``iter_*`` or ``release``
    directory (``--ckpt-step`` reads an ``iter_*`` directory without the tracker)."""
    if not os.path.isdir(path):
        return False
    return any(name == TRACKER or name == "release" or
               (name.startswith("iter_") and os.path.isdir(os.path.join(path, name)))
               for name in os.listdir(path))


def check_load_dir(load: Optional[str], save: Optional[str], step: Optional[int] = None,
                   allow_fresh: bool = False) -> Optional[str]:
    """``--load`` names a checkpoint. Megatron warns and trains from scratch when it does not
    (then saves into the mistyped directory): refused unless ``--load`` is also ``--save`` (the
    auto-resume pattern, whose first run finds nothing), for which a line to print is returned.
    A directory with checkpoint folders but none complete (a save that stopped part-way:
    ``checkpoint_state.unloadable_reason``) is refused even then, unless ``allow_fresh``
    (``--ext-allow-fresh-start``); ``step``: ``--ckpt-step``."""
    if not load:
        return None
    if has_checkpoint(load):
        problem = unloadable_reason(load, step or None)  # Megatron ignores --ckpt-step 0
        if problem is None:
            return None
        if allow_fresh:
            return (f"--load={load}: no complete checkpoint there ({problem}): training starts "
                    "from scratch (--ext-allow-fresh-start)")
        raise ValueError(f"--load={load}: no complete checkpoint there ({problem}): Megatron "
                         "would load nothing and train from scratch. Load another directory or "
                         "iteration (--ckpt-step), or pass --ext-allow-fresh-start to start from "
                         "scratch")
    if save and os.path.realpath(load) == os.path.realpath(save):
        return (f"--load={load}: no checkpoint there yet: training starts from scratch (the "
                "directory is also --save, so a later run resumes from it)")
    if allow_fresh:
        return (f"--load={load}: no checkpoint there: training starts from scratch "
                "(--ext-allow-fresh-start)")
    raise ValueError(f"--load={load}: no checkpoint there (no {TRACKER}, iter_* or release "
                     "directory); a mistyped path would train from scratch. Check the path, or "
                     "give the same directory to --save to start there and resume later")


def check_async_save(args, cpu_backend: bool, nvrx_available=None) -> None:
    """``--async-save`` as Megatron will run it (after its validation, which turns it off, with a
    warning, without ``--use-persistent-ckpt-worker``), refused at start-up where its first save
    would fail after training has begun:

    * on the CPU backend: Megatron's persistent checkpoint worker
      (``dist_checkpointing.strategies.async_utils``) selects a CUDA device when it starts; without
      one it exits, and the ranks wait for it until the process group times out;
    * with ``--async-strategy nvrx`` (Megatron's default) and no nvidia-resiliency-ext: Megatron
      checks that only for the torch_dcp and fsdp_dtensor formats, and torch_dist fails at the
      first save (``get_async_strategy``).

    ``nvrx_available``: whether that package's async API is importable (default: Megatron's own
    ``has_nvrx_checkpointing_async_support``)."""
    if not getattr(args, "async_save", False):
        return
    if cpu_backend:
        raise ValueError("--async-save needs a GPU: Megatron's checkpoint worker selects a CUDA "
                         "device when it starts, and without one it exits while the ranks wait "
                         "for it; on the CPU backend save synchronously (drop --async-save)")
    if getattr(args, "async_strategy", "mcore") == "nvrx":
        if nvrx_available is None:
            nvrx_available = has_nvrx_checkpointing_async_support()
        if not nvrx_available:
            raise ValueError("--async-save with --async-strategy nvrx (Megatron's default) needs "
                             "nvidia-resiliency-ext, which is not installed: install it, or pass "
                             "--async-strategy mcore (Megatron's own asynchronous writer)")


def check_fully_sharded(args, cpu_backend: bool) -> None:
    """Sharded data parallelism (``--use-megatron-fsdp``, ``--use-torch-fsdp2``) refused at
    start-up where it would fail or train differently from DDP (measured on 2-4 CPU ranks,
    megatron-core 0.19.2; docs/scaling.md, "Megatron-FSDP"):

    * ``--use-torch-fsdp2`` on the CPU backend: torch's ``fully_shard`` expects every parameter
      on ``cuda:0`` and stops when the model is wrapped;
    * ``--use-megatron-fsdp`` with ``--save``/``--load``: its ``fsdp_dtensor`` save does not
      complete (with ``--swiglu`` ``handle_swiglu_in_state_dict`` looks up
      ``module.module.<name>`` and fails at the first checkpoint; without it the ranks waited on
      each other in ``preprocess_state_dict_for_uneven_dtensor``);
    * ``--use-megatron-fsdp`` with experts whose data-parallel group is one rank while the
      dense parameters have several, and more than one micro-batch per step: such an expert
      gradient buffer is not sharded, so Megatron-FSDP reduces it in place every micro-batch
      and its division by the data-parallel size (``gradient_reduce_preprocessing``) lands on
      the gradients already accumulated: micro-batch ``i`` of ``n`` ends up scaled by
      ``DP**-(n-i+1)`` instead of ``1/DP`` (Sigma at EP=2 on 2 ranks, 4 micro-batches: each
      expert's squared gradient norm up to 98% below DDP's, the loss 7e-5 off by step 6)."""
    if getattr(args, "use_torch_fsdp2", False) and cpu_backend:
        raise ValueError("--use-torch-fsdp2 needs CUDA: torch's fully_shard expects every "
                         "parameter on cuda:0; on the CPU backend shard with "
                         "--use-megatron-fsdp --ckpt-format fsdp_dtensor, or drop the flag")
    if not getattr(args, "use_megatron_fsdp", False):
        return
    for flag, path in (("--save", args.save), ("--load", args.load)):
        if path:
            raise ValueError(
                f"--use-megatron-fsdp with {flag} {path}: megatron-core 0.19.2's fsdp_dtensor "
                "checkpoints do not complete here (with --swiglu its save fails at the first "
                "checkpoint, without it the ranks wait on each other); train runs that save "
                "with --use-distributed-optimizer and torch_dist instead, or drop --save/--load")
    if not args.num_experts or getattr(args, "calculate_per_token_loss", False):
        return
    pp = args.pipeline_model_parallel_size
    expert_dp = args.world_size // (pp * args.expert_model_parallel_size *
                                    (args.expert_tensor_parallel_size or 1))
    dp = args.data_parallel_size * args.context_parallel_size
    micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if expert_dp == 1 and dp > 1 and micro_batches > 1:
        family = getattr(args, "model_family", None)
        raise ValueError(
            f"--use-megatron-fsdp with --expert-model-parallel-size "
            f"{args.expert_model_parallel_size}"
            + (f" (--model-family {family})" if family else "")
            + f" leaves each expert one data-parallel rank while DP={dp} accumulates "
            f"{micro_batches} micro-batches per step: Megatron-FSDP divides the expert "
            "gradients it has accumulated by DP again at every micro-batch; use one "
            f"micro-batch per step (--global-batch-size "
            f"{args.micro_batch_size * args.data_parallel_size}), an expert parallelism that "
            "leaves the experts several data-parallel ranks, or DDP (drop --use-megatron-fsdp)")


def check_grouped_experts(args) -> None:
    """``--moe-grouped-gemm`` on the local backend builds the torch grouped experts
    (``models/grouped_experts.py``): what they do not support (FP8, expert biases, delayed
    weight gradients, ...) refused in one line, not as each rank's exception in the model
    build. With Transformer Engine, upstream's grouped experts: nothing to check here."""
    if args.moe_grouped_gemm and args.num_experts and \
            args.transformer_impl != "transformer_engine":
        problem = grouped_experts_unsupported(args)
        if problem:
            raise ValueError(problem)


def check_layout(args) -> None:
    """The parallel sizes against the ranks torchrun started (``WORLD_SIZE``), by Megatron's rules
    (``planning/layout.py``), in one line naming the flags. Megatron checks TP x PP x CP in its
    validation, but EP only when it builds its process groups: ``--expert-model-parallel-size 3``
    on 2 ranks was a ``RuntimeError`` traceback ("world_size (2) is not divisible by
    expert_tensor_model_pipeline_parallel size (3)") on every rank."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, ep = args.context_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # Megatron's default: TP
    try:
        validate_layout(Layout(world_size=args.world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                               global_batch=None, check=False))
    except ValueError as exc:
        raise ValueError(
            f"{args.world_size} ranks with --tensor-model-parallel-size {tp} "
            f"--pipeline-model-parallel-size {pp} --context-parallel-size {cp} "
            f"--expert-model-parallel-size {ep}"
            + (f" --expert-tensor-parallel-size {etp}" if etp != tp else "")
            + f": {exc}; change the sizes or the number of ranks (torchrun --nproc_per_node, "
            "--nnodes)") from None


# The words of Megatron's OptimizerParamScheduler._check_and_set assertion.
_SCHEDULE_MISMATCH = re.compile(r"class input value (.*) and checkpoint ?value (.*) for (.*) do "
                                r"not match")


# ``common`` of the resume checks not given: they read the checkpoint's common state themselves.
_UNREAD = object()


def check_resume(args) -> None:
    """The resume checks on the checkpoint's common state, read once for all: the model's
    settings every family has (``saved_settings.COMMON``: the family, widths, layers), then
    :func:`check_schedule_resume`, :func:`check_bucket_layout_resume`. The model comes first:
    another model's checkpoint was refused for its schedule, with advice to override it, and
    for the model only once the model was built (the trainer's load check, which also runs the
    family's own checks)."""
    common = _saved_common_state(args) if args.load else None
    saved = (common or {}).get("args")
    # Megatron saves a training's whole args; ones without a model width hold no model to
    # compare (the family is then read as gpt's, Megatron's own).
    if getattr(saved, "hidden_size", None) is not None:
        saved_settings.check(args.load, getattr(args, "ckpt_step", None), args,
                             saved_settings.COMMON, saved=saved)
    check_schedule_resume(args, common)
    check_bucket_layout_resume(args, common)


def check_schedule_resume(args, common=_UNREAD) -> None:
    """A resume whose learning-rate schedule (warm-up, decay, their lengths, the rates, weight
    decay) differs from the checkpoint's, refused before the model is built: Megatron asserts
    on it in ``OptimizerParamScheduler.load_state_dict`` after building the model, as a
    traceback. The usual case: a longer ``--train-iters``, which lengthens the weight-decay
    ramp, the decay unless ``--lr-decay-iters`` is given, and a ``--lr-warmup-fraction``
    warm-up with it.

    This run's schedule is upstream's own (``get_optimizer_param_scheduler``, on a copy of the
    arguments and an optimizer without parameters) and is compared by upstream's own
    ``load_state_dict`` with the checkpoint's, read from its common state (what
    ``--use-checkpoint-args`` reads before anything is built; torch_dist checkpoints). A
    checkpoint that cannot be read here is left to the load, which verifies it first and names
    what is wrong."""
    if (not args.load or args.finetune or args.no_load_optim
            or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler):
        return
    saved = _schedule_state(_common_state(args, common))
    if saved is None:
        return
    try:
        with _quiet_scheduler():
            ours = _schedule(args)
            if ours is not None:
                ours.load_state_dict(dict(saved))
    except AssertionError as exc:
        found = _SCHEDULE_MISMATCH.search(str(exc))
        if found:
            ours_value, saved_value, name = (_number(v) for v in found.groups())
            what = f"{name}: {saved_value} in the checkpoint, {ours_value} with these flags"
            if "iterations" in name:  # upstream's name; the values are samples
                what += (" (in samples, iterations x --global-batch-size: --train-iters sets the "
                         "decay and weight-decay lengths, --lr-warmup-fraction a share of the "
                         "decay's)")
        else:
            what = " ".join(str(exc).split())
        raise ValueError(
            f"--load={args.load}: the checkpoint's learning-rate schedule differs from these "
            f"flags': {what}; pass --override-opt_param-scheduler to go on with these flags' "
            "schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        ) from None


def _number(text: str) -> str:
    """A value of upstream's message, floats without their rounding noise (2.4000000000000004)."""
    try:
        return f"{float(text):.10g}"
    except ValueError:
        return text


def check_bucket_layout_resume(args, common=_UNREAD) -> None:
    """A resume whose model-parallel layout differs from the checkpoint's, of a
    distributed-optimizer state saved in Megatron's bucket layout (``dp_reshardable``, the
    default without ``--dist-ckpt-optim-fully-reshardable``), refused before the model is built:
    that layout follows the optimizer's buffers, which only a change of the data-parallel size
    leaves loadable. Another expert-parallel or expert-TP size (the buffers split into a dense
    and an expert optimizer, ``chained_0.``/``chained_1.`` keys) failed in Megatron's load with a
    KeyError listing every key of the checkpoint; another TP or PP size with Megatron's
    RuntimeError after the model was built, which advises ``--ckpt-fully-parallel-save`` (not
    the flag that helps). The other optimizer states resume at another EP size
    (``compat/upstream_fixes.py``, ``optimizer_state_across_expert_parallel_sizes``). The line
    names the command that re-saves the checkpoint in the fully reshardable format at its own
    layout (``tools/reshardable.py``), from which this layout resumes with Adam's state."""
    if not args.load or args.finetune or args.no_load_optim:
        return
    state = _common_state(args, common)
    saved_args = (state or {}).get("args")
    # Megatron's own check compares TP and PP, after the model is built; EP and expert-TP,
    # which split the expert optimizer's buffers, it does not compare (the KeyError).
    def etp(a):  # unset: Megatron's validate_args makes it the TP size; a model without experts
        if not getattr(args, "num_experts", None):  # has none to split
            return None
        return getattr(a, "expert_tensor_parallel_size", None) or \
            getattr(a, "tensor_model_parallel_size", None)

    def named(name):
        return lambda a: getattr(a, name, None)

    changed = [(flag, size(saved_args), size(args)) for flag, size in (
        ("--tensor-model-parallel-size", named("tensor_model_parallel_size")),
        ("--pipeline-model-parallel-size", named("pipeline_model_parallel_size")),
        ("--expert-model-parallel-size", named("expert_model_parallel_size")),
        ("--expert-tensor-parallel-size", etp))]
    changed = [(flag, then, now) for flag, then, now in changed
               if then is not None and now is not None and then != now]
    if not changed or getattr(saved_args, "no_save_optim", False):
        return
    sharding = optimizer_sharding(state)
    if sharding is None or sharding in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return
    then = " ".join(f"{flag} {value}" for flag, value, _ in changed)
    now = " ".join(f"{flag} {value}" for flag, _, value in changed)
    converted = reshardable_save(args.load)
    raise ValueError(
        f"--load={args.load}: its distributed-optimizer state was saved at {then} in Megatron's "
        f"bucket layout ({sharding}), which {now} cannot load; to keep Adam's moments and step, "
        f"re-save it in the fully reshardable format with "
        f"`{reshardable_command(args.load, converted, getattr(args, 'ckpt_step', None))}` "
        f"and resume with --load {shlex.quote(converted)}; or resume at {then}, or pass "
        "--no-load-optim (the weights load, Adam's moments and step start afresh)")


def optimizer_sharding(common: dict) -> Optional[str]:
    """How a checkpoint's distributed-optimizer state is laid out (``dp_reshardable``, Megatron's
    bucket layout, or one of ``DistributedOptimizer.checkpoint_fully_reshardable_formats``), from
    its common state's content metadata; None where it records none."""
    return (dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}).get(
        "distrib_optim_sharding_type")


RESHARDABLE_TOOL = "python -m megatron_ext.tools.reshardable"


def reshardable_save(load: str) -> str:
    """Where the refusal above suggests writing ``load``'s fully reshardable copy."""
    return os.path.normpath(load) + "_reshardable"


def reshardable_command(load: str, save: str, step: Optional[int] = None) -> str:
    """The command that re-saves ``load`` (iteration ``step``, else its latest) as ``save`` in
    the fully reshardable format (``megatron_ext/tools/reshardable.py``)."""
    words = ["--load", load, "--save", save] + (["--ckpt-step", str(step)] if step else [])
    return " ".join([RESHARDABLE_TOOL, *(shlex.quote(w) for w in words)])


def _common_state(args, common):
    """``common`` as a resume check was given it, else the checkpoint's, read now."""
    return _saved_common_state(args) if common is _UNREAD else common


def _schedule_state(state: Optional[dict]) -> Optional[dict]:
    """The scheduler state in the common state of the checkpoint ``--load`` (``--ckpt-step``)
    would resume; None where there is none to compare (no checkpoint, a release checkpoint,
    whose optimizer Megatron does not load, another format)."""
    if state is None:
        return None
    return state.get("opt_param_scheduler", state.get("lr_scheduler"))


def _saved_common_state(args) -> Optional[dict]:
    """The common state of the torch_dist checkpoint ``--load`` (``--ckpt-step``) would resume;
    None where there is none (no checkpoint, a release checkpoint, whose optimizer Megatron does
    not load, another format)."""
    if not has_checkpoint(args.load):
        return None
    iteration, release = -1, False
    tracker = checkpointing.get_checkpoint_tracker_filename(args.load)
    # Unreadable pieces are the load's to report (its manifest check names them): no comparison.
    try:
        if os.path.isfile(tracker):
            iteration, release = checkpointing.read_metadata(tracker)
        if getattr(args, "ckpt_step", None):
            iteration, release = args.ckpt_step, False
        if release or iteration == -1:
            return None
        folder = checkpointing.get_checkpoint_name(args.load, iteration, release,
                                                   return_base_dir=True)
        if not dist_checkpointing.check_is_distributed_checkpoint(folder):
            return None
        return dist_checkpointing.load_common_state_dict(folder)
    except Exception:  # noqa: BLE001 - see above: the load reports it
        return None


def _schedule(args):
    """Upstream's scheduler for these arguments, built on a copy (it sets ``lr_decay_iters``);
    None where upstream refuses the schedule itself (it says so when it builds it later)."""
    previous = global_vars.get_args()
    global_vars.set_args(copy.copy(args))
    try:
        # An optimizer without parameter groups: the scheduler sets no learning rate on it.
        return get_optimizer_param_scheduler(SimpleNamespace(param_groups=[]))
    except (AssertionError, ValueError, TypeError):
        return None
    finally:
        global_vars.set_args(previous)


@contextlib.contextmanager
def _quiet_scheduler():
    """Upstream's scheduler logs each value it builds and loads: not for this comparison."""
    logger = logging.getLogger(OptimizerParamScheduler.__module__)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _stage_of(rank: int, args, world_size: int) -> int:
    """The pipeline stage of global rank ``rank`` in Megatron's rank order (``tp-cp-ep-dp-pp``,
    or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``)."""
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    if getattr(args, "use_tp_pp_dp_mapping", False):
        return (rank // (tp * cp)) % pp
    return rank // (world_size // pp)


def table_memory_needs(args, world_size: Optional[int] = None, cuda: Optional[bool] = None
                       ) -> List[Tuple[Dict[str, float], Dict[str, float]]]:
    """Per pipeline stage, what one rank's managed tables need at start-up: (GPU bytes, host
    bytes) by part, the estimate's arithmetic (``planning/estimate.py`` ``table_memory``, that of
    ``--dry-run``). Host memory also holds, while the model is built, every drawn row of the
    rank's tables (``stem/initial_rows.py`` draws on the CPU, a GPU placement included) and the
    drawing's two blocks; without CUDA every part is host memory."""
    world_size = world_size or args.world_size
    cuda = torch.cuda.is_available() if cuda is None else cuda
    layout = Layout.from_args(args, world_size)
    if not layout.stem_managed:  # tables that are parameters are Megatron's to allocate
        return []
    spec = ModelShape.from_args(args)
    needs = []
    for stage in range(layout.pp):
        gpu, host = table_memory(spec, layout, stage)
        if not cuda:
            for key, value in gpu.items():
                host[key] = host.get(key, 0) + value
            gpu = {}
        drawn = gpu.get("stem_tables", 0) + host.get("stem_tables", 0)
        if drawn and drawn + 2 * BLOCK_BYTES > sum(host.values()):
            host = {"stem_tables": drawn, "stem_drawing_buffers": 2 * BLOCK_BYTES}
        needs.append((gpu, host))
    return needs


_ROOM_ADVICE = ("shard the rows over more data-parallel ranks (--stem-table-sharding vocab), "
                "keep more of them in the GPU tier (--stem-table-placement tiered, "
                "--stem-gpu-tier), or use fewer STEM layers (--stem-ratio, --stem-layers)")


def _parts(needs: Dict[str, float]) -> str:
    labels = dict(LABELS, stem_drawing_buffers="STEM drawing buffers")
    return " + ".join(f"{labels.get(k, k)} {_gib(v)}" for k, v in needs.items() if v)


def check_table_memory(args, world_size: Optional[int] = None, cuda: Optional[bool] = None,
                       available: Optional[int] = None, gpu_free: Optional[int] = None) -> None:
    """The managed STEM tables' memory against what is available, before anything is drawn:
    ``stem/initial_rows.py`` draws the rows when the model is built, and a size the allocator
    refuses failed there as a traceback (32.8 GB asked of a smaller machine), one it grants but
    cannot back got the run OOM-killed; the room check of ``stem/runtime/store.py`` comes after.

    Host: the ranks of this node (``LOCAL_WORLD_SIZE`` from ``RANK - LOCAL_RANK`` on), each by
    its pipeline stage, together against ``available`` (default
    ``host_memory.available_bytes``: MemAvailable + SwapFree within the cgroup's limit), the
    same on every rank of the node, printed by its local rank 0. GPU: this rank's part against
    its device's free memory (``gpu_free``, default ``torch.cuda.mem_get_info``), printed by
    each rank that lacks it."""
    world_size = world_size or args.world_size
    cuda = torch.cuda.is_available() if cuda is None else cuda
    needs = table_memory_needs(args, world_size, cuda)
    if not needs:
        return
    rank, local = launch_rank(), launch_rank("LOCAL_RANK")
    on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    first = rank - local
    node_ranks = [r for r in range(first, first + on_node) if 0 <= r < world_size] or [rank]
    host = [needs[_stage_of(r, args, world_size)][1] for r in node_ranks]
    total = sum(sum(h.values()) for h in host)
    if available is None:
        available = available_bytes()
    if available is not None and total > available:
        worst = max(host, key=lambda h: sum(h.values()))
        each = "per rank" if all(h == worst for h in host) else "on the busiest rank"
        together = (f", {_gib(total)} for the {len(node_ranks)} ranks on this node"
                    if len(node_ranks) > 1 else "")
        refuse(f"STEM tables need {_gib(sum(worst.values()))} of host memory {each} at "
               f"start-up ({_parts(worst)}){together}, and {_gib(available)} is available "
               f"(MemAvailable + SwapFree, within the cgroup's limit); {_ROOM_ADVICE}")
    gpu = needs[_stage_of(rank, args, world_size)][0]
    need = sum(gpu.values())
    if cuda and need:
        device = local % max(torch.cuda.device_count(), 1)
        free = torch.cuda.mem_get_info(device)[0] if gpu_free is None else gpu_free
        if need > free:
            refuse(f"STEM tables need {_gib(need)} of GPU memory on rank {rank} "
                   f"({_parts(gpu)}), and GPU {device} has {_gib(free)} free; {_ROOM_ADVICE}",
                   scope="per_rank")
