"""Checksum manifests for the trainer's checkpoints (``megatron_ext/checkpoint_manifest.py``).

Wraps ``megatron.training.training.save_checkpoint`` (the name ``pretrain`` and
``save_checkpoint_and_time`` call): after upstream's save of a persistent checkpoint, rank 0
hands the folder to ``WRITER``, whose thread hashes it once complete (at once for a synchronous
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
"""

from __future__ import annotations

import atexit
import os
import time
from typing import List, Optional, Sequence

import torch
from megatron.core.dist_checkpointing import gpt_checkpoint_interop
from megatron.training import get_args, get_tokenizer, training

from megatron_ext import checkpoint_manifest as cm
from megatron_ext.models.hybrid_checkpoint import retarget_to_layered_gpt_checkpoint
from megatron_ext.models.registry import family_of


def _log(line: str) -> None:
    print(f"megatron-ext: {line}", flush=True)


WRITER = cm.ManifestWriter(log=_log)
atexit.register(WRITER.close)  # a manifest being hashed at exit is finished


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


def install() -> None:
    retarget_upstream = gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint
    if not getattr(retarget_upstream, "_ext_layered", False):

        def retarget(sharded_state_dict, layer_maps):
            # The current run's family saved its GPT-path checkpoints (model_provider).
            if family_of(get_args()).heterogeneous_layers:
                return retarget_to_layered_gpt_checkpoint(sharded_state_dict, layer_maps)
            return retarget_upstream(sharded_state_dict, layer_maps)

        retarget._ext_layered = True
        gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint = retarget

    save_upstream = training.save_checkpoint
    if not getattr(save_upstream, "_ext_manifest", False):

        def save_checkpoint(iteration, *args, **kwargs):
            result = save_upstream(iteration, *args, **kwargs)

            margs = get_args()

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank == 0 and margs.save and not kwargs.get("non_persistent_ckpt", False):
                release = kwargs.get("release", False)
                folder = cm.iteration_dir(margs.save, None if release else iteration)
                WRITER.submit(folder, None if release else iteration,
                              save_dir=margs.save if margs.async_save else None)
            return result

        save_checkpoint._ext_manifest = True
        training.save_checkpoint = save_checkpoint

    load_upstream = training.load_checkpoint
    if not getattr(load_upstream, "_ext_manifest", False):

        def load_checkpoint(model, *args, **kwargs):
            margs = get_args()
            load_dir = getattr(margs, kwargs.get("load_arg", "load"), None)
            folder = _load_folder(load_dir, margs.ckpt_step) if load_dir else None
            if folder is not None and not margs.no_verify_checkpoint:
                start = time.perf_counter()
                manifest = verify_distributed(folder)
                if int(os.environ.get("RANK", "0")) == 0:
                    if manifest is None:
                        _log(cm.unverified_note(folder))
                    else:
                        _log(f"checkpoint {folder}: {len(manifest['files'])} files match their "
                             f"checksums ({manifest['bytes'] / 2**20:.1f} MiB, "
                             f"{time.perf_counter() - start:.2f} s)")
            family = family_of(margs)
            if load_dir and family.check_checkpoint is not None:
                family.check_checkpoint(model, margs, family.config_from_args(margs), load_dir,
                                        margs.ckpt_step,
                                        getattr(get_tokenizer(), "vocab_size", None))
            return load_upstream(model, *args, **kwargs)

        load_checkpoint._ext_manifest = True
        training.load_checkpoint = load_checkpoint
