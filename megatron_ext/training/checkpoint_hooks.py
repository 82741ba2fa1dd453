"""Checksum manifests for the trainer's checkpoints (``megatron_ext/checkpoint_manifest.py``).

The replacements below are made from upstream's functions by the ``wrap_*`` makers;
``training/upstream_seams.py`` puts them in place (its table lists each with its reason).

Wraps ``megatron.training.training.save_checkpoint`` (the name ``pretrain`` and
``save_checkpoint_and_time`` call): after upstream's save of a persistent checkpoint, rank 0
hands the folder to the training run's manifest writer (``TrainingSession.manifests``), whose
thread hashes it once complete (at once for a synchronous
save, whose tracker upstream has written before returning; for ``--async-save`` when the
tracker names the iteration). Non-persistent checkpoints (``--non-persistent-save-interval``)
are replaced by the next one and get no manifest.

Wraps ``megatron.training.training.load_checkpoint``: before upstream reads, the ranks check the
folder it will read against its manifest, each rank hashing its share of the files (the largest
first, to the least loaded rank), and all of them stop with one line naming the first damaged
file (``--no-verify-checkpoint`` loads without the check); then the family checks that the
checkpoint fits the model (``Family.check_checkpoint``: STEM's table shapes).

Wraps ``gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint`` (which upstream's
``load_checkpoint`` calls for a GPT checkpoint loaded by a ``HybridModel`` run): a family with
heterogeneous layers saved its GPT-path checkpoints with one key per layer, which
``models/hybrid_checkpoint.py`` retargets instead.

Wraps ``training.initialize_megatron`` (what ``pretrain`` calls first): once the ranks are up and
before anything is written into ``--save``, rank 0 takes that directory's lock (``save_lock``) and
tells the others whether it got it; all of them stop when it did not.

A save that fails (a full device: torch's "unexpected pos" or a ``CheckpointException`` naming no
cause) stops the training with one line naming the folder and the cause; rank 0 removes the
unfinished iteration folder, and the tracker, which upstream writes only after a whole save, still
names the last complete checkpoint (``checkpoint_state``).

Before upstream's loader reads a tensor, the settings every model has are compared with those the
checkpoint was saved with (``models/saved_settings.py``), then the family's own
(``Family.check_checkpoint``); a refusal there is one line (``CheckpointError``).
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence

import torch
from megatron.training import get_args, get_tokenizer
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext import checkpoint_manifest as cm
from megatron_ext import checkpoint_state
from megatron_ext.models import saved_settings
from megatron_ext.models.hybrid_checkpoint import retarget_to_layered_gpt_checkpoint
from megatron_ext.models.registry import family_of
from megatron_ext.training.save_lock import SaveLock, SaveLockError


def log(line: str) -> None:
    print(f"megatron-ext: {line}", flush=True)


def share(sizes: Sequence[int], rank: int, world: int) -> List[int]:
    """Indices of the files ``rank`` hashes: largest first, each to the least loaded rank
    (ties to the lowest rank); every rank computes the same split."""
    load = [0] * world
    mine = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += sizes[i]
        if r == rank:
            mine.append(i)
    return mine


def _load_folder(load_dir: str, step: Optional[int]) -> Optional[str]:
    """The folder upstream's ``load_checkpoint`` will read, or None when it finds none (upstream
    then says so itself)."""
    try:
        folder, _ = cm.resolve_checkpoint_dir(load_dir, step)
    except cm.CheckpointError:
        return None
    return folder


def verify_distributed(folder: str) -> Optional[dict]:
    """Every rank of the default group checks its share of ``folder``; raises
    ``CheckpointError`` on all of them when any file is damaged. Returns the manifest (None
    without one)."""
    manifest = cm.read_manifest(folder)
    if manifest is None:
        return None
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = sorted(manifest["files"])
    mine = [names[i] for i in share([manifest["files"][n]["size"] for n in names], rank, world)]
    problems = cm.check_files(folder, manifest, mine)
    if world > 1:
        gathered: List[Optional[List[str]]] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [p for part in gathered for p in (part or [])]
    if problems:
        raise cm.CheckpointError(cm.damaged_message(folder, sorted(problems)))
    return manifest


def _rank_world():
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def lock_save_dir(save: Optional[str], locks: SaveLock) -> None:
    """Rank 0 takes ``--save``'s lock (held in ``locks``, the training session's); every rank
    raises ``CheckpointError`` (the same line) when it could not. Collective over the default
    group."""
    if not save:
        return
    rank, world = _rank_world()
    problem: List[Optional[str]] = [None]
    if rank == 0:
        try:
            locks.acquire(save, log=log)
        except SaveLockError as exc:
            problem = [str(exc)]
        except OSError as exc:
            problem = [f"--save={save}: cannot take its lock file ({exc.strerror or exc})"]
    if world > 1:
        torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise cm.CheckpointError(problem[0])


def failed_save(save_dir: str, iteration: Optional[int], exc: BaseException) -> str:
    """The line a failed save stops with; rank 0 also removes the unfinished iteration folder.
    DCP raises its ``CheckpointException`` on every rank once the ranks' writes are over (it
    gathers their results first), so no rank writes into the folder any more; the other ranks
    then wait for rank 0's removal (torchrun stops the other ranks when the first one exits: a
    long removal could be cut off before rank 0 prints the line). Another error (rank 0's
    ``common.pt``) may be rank 0's alone, while the others wait in DCP's collectives: no wait
    then."""
    free = checkpoint_state.free_bytes(save_dir)  # before the removal gives some back
    rank, world = _rank_world()
    removed = checkpoint_state.remove_partial(save_dir, iteration) if rank == 0 else None
    message = checkpoint_state.failed_save_message(save_dir, iteration, exc, free, removed)
    if world > 1 and isinstance(exc, CheckpointException):
        torch.distributed.barrier()
    return message


def check_checkpoint(model, margs, load_dir: str,
                     tokenizer_vocab_size: Optional[int] = None) -> None:
    """The model the checkpoint holds is the one this run builds: the settings of every model,
    then the family's check (STEM: its tables' shapes and layers), each refusal one line."""
    family = family_of(margs)
    try:
        saved_settings.check(load_dir, margs.ckpt_step, margs, saved_settings.COMMON)
        if family.check_checkpoint is not None:
            family.check_checkpoint(model, margs, family.config_from_args(margs), load_dir,
                                    margs.ckpt_step, tokenizer_vocab_size)
    except ValueError as exc:  # the family's checks name the flags; no traceback around them
        raise cm.CheckpointError(str(exc)) from None


def wrap_initialize_megatron(upstream: Callable, locks: SaveLock) -> Callable:
    def initialize_megatron(*args, **kwargs):
        result = upstream(*args, **kwargs)
        # Before pretrain writes into --save (its progress log, the first checkpoint).
        lock_save_dir(get_args().save, locks)
        return result

    return initialize_megatron


def wrap_retarget(upstream: Callable) -> Callable:
    def retarget(sharded_state_dict, layer_maps):
        # The current run's family saved its GPT-path checkpoints (model_provider).
        if family_of(get_args()).heterogeneous_layers:
            return retarget_to_layered_gpt_checkpoint(sharded_state_dict, layer_maps)
        return upstream(sharded_state_dict, layer_maps)

    return retarget


def wrap_save_checkpoint(upstream: Callable, manifests: cm.ManifestWriter) -> Callable:
    """``save_checkpoint`` that hands each persistent checkpoint to ``manifests`` (the training
    run's writer, ``TrainingSession.manifests``)."""

    def save_checkpoint(iteration, *args, **kwargs):
        margs = get_args()
        persistent = margs.save and not kwargs.get("non_persistent_ckpt", False)
        step = None if kwargs.get("release", False) else iteration
        try:
            result = upstream(iteration, *args, **kwargs)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            if not persistent:
                raise
            raise cm.CheckpointError(failed_save(margs.save, step, exc)) from None

        if _rank_world()[0] == 0 and persistent:
            manifests.submit(cm.iteration_dir(margs.save, step), step,
                             save_dir=margs.save if margs.async_save else None)
        return result

    return save_checkpoint


def wrap_load_checkpoint(upstream: Callable) -> Callable:
    def load_checkpoint(model, *args, **kwargs):
        margs = get_args()
        load_dir = getattr(margs, kwargs.get("load_arg", "load"), None)
        folder = _load_folder(load_dir, margs.ckpt_step) if load_dir else None
        if folder is not None and not margs.no_verify_checkpoint:
            start = time.perf_counter()
            manifest = verify_distributed(folder)
            if int(os.environ.get("RANK", "0")) == 0:
                if manifest is None:
                    log(cm.unverified_note(folder))
                else:
                    log(f"checkpoint {folder}: {len(manifest['files'])} files match their "
                        f"checksums ({manifest['bytes'] / 2**20:.1f} MiB, "
                        f"{time.perf_counter() - start:.2f} s)")
        if load_dir:
            check_checkpoint(model, margs, load_dir,
                             getattr(get_tokenizer(), "vocab_size", None))
        return upstream(model, *args, **kwargs)

    return load_checkpoint
