"""Checks at start-up, before Megatron builds anything, of paths and settings that would otherwise
fail late or as tracebacks: the indexed datasets named by the data flags, the checkpoint
directory, and an asynchronous save that cannot run here."""

from __future__ import annotations

import os
from typing import List, Optional

from megatron.core.datasets.object_storage_utils import is_object_storage_path
from megatron.training.utils import has_nvrx_checkpointing_async_support

from megatron_ext.checkpoint_manifest import TRACKER
from megatron_ext.data_paths import data_args_list, dataset_prefixes, per_split_lists

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


def check_load_dir(load: Optional[str], save: Optional[str]) -> Optional[str]:
    """``--load`` names a checkpoint. Megatron warns and trains from scratch when it does not
    (then saves into the mistyped directory): refused unless ``--load`` is also ``--save`` (the
    auto-resume pattern, whose first run finds nothing), for which a line to print is returned."""
    if not load or has_checkpoint(load):
        return None
    if save and os.path.realpath(load) == os.path.realpath(save):
        return (f"--load={load}: no checkpoint there yet: training starts from scratch (the "
                "directory is also --save, so a later run resumes from it)")
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
