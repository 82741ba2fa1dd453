"""Which checkpoint of a ``--save``/``--load`` directory is complete, and what a failed save leaves.

Megatron writes an iteration's folder (``iter_0000002``) from every rank, then, once every rank
is done, the tracker (``latest_checkpointed_iteration.txt``) naming it. A ``torch_dist`` (or
``torch_dcp``, ``fsdp_dtensor``) folder is complete when DCP's ``.metadata`` is there: the
coordinator writes it after every rank's files. A save that stopped part-way (a full disk, a
killed run) leaves a folder without it and no new tracker; Megatron's loader then finds no tracker,
warns "could not find the metadata file" and trains from scratch, or fails on the missing file.

``unloadable_reason`` says why a directory ``--load`` names holds nothing Megatron will load (the
start-up check refuses it: ``training/preflight.py``); ``failed_save_message`` and
``remove_partial`` are what the trainer does when a save fails (``training/checkpoint_hooks.py``).

Only the standard library is needed here.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Iterable, Optional

from megatron_ext.checkpoint_manifest import TRACKER, iteration_dir, read_tracker

# Megatron's folder for non-persistent checkpoints inside --load (checkpointing.py,
# _NON_PERSISTENT_CKPT_SUBDIR); it has a tracker of its own.
NON_PERSISTENT = "non_persistent"
DCP_METADATA = ".metadata"
# Free bytes below which a failed write is put down to a full device when the error itself no
# longer says so: Megatron's checkpoint writer reports a worker's failure as "Worker failure: ...
# <class 'RuntimeError'>", and torch's zip writer one of its own ("[enforce fail at
# inline_container.cc:672] . unexpected pos 704 vs 598") without the errno. A write fails on a
# full device when the next block does not fit: what is left is under a block of the writer.
LOW_SPACE_BYTES = 64 << 20
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_complete(folder: str) -> bool:
    """``folder`` (an ``iter_*`` or ``release`` directory) holds a finished checkpoint: DCP's
    ``.metadata`` (torch_dist, torch_dcp, fsdp_dtensor), or the legacy ``torch`` format's
    ``mp_rank_*`` files (whose completeness only the tracker tells)."""
    if os.path.isfile(os.path.join(folder, DCP_METADATA)):
        return True
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n.startswith("mp_rank_") for n in names)


def unloadable_reason(load_dir: str, step: Optional[int] = None) -> Optional[str]:
    """Why Megatron's loader would load nothing from ``load_dir`` (None: it finds a complete
    checkpoint). ``step``: ``--ckpt-step`` (read without the tracker)."""
    if os.path.isfile(os.path.join(load_dir, NON_PERSISTENT, TRACKER)):
        return None  # Megatron loads the non-persistent checkpoint (or a later persistent one)
    if step is None:
        text = read_tracker(load_dir)
        if text is None:
            partial = sorted(d for d in _iteration_dirs(load_dir)
                             if not is_complete(os.path.join(load_dir, d)))
            found = (f"; {', '.join(partial)} {'is' if len(partial) == 1 else 'are'} "
                     "unfinished (no .metadata: a save that stopped part-way)") if partial else ""
            return f"no {TRACKER}{found}"
        if text == "release":
            folder = iteration_dir(load_dir, None)
        elif text.isdigit():
            folder = iteration_dir(load_dir, int(text))
        else:
            return None  # Megatron's own message names the bad tracker
    else:
        folder = iteration_dir(load_dir, step)
    if not os.path.isdir(folder):
        return f"{folder} is missing"
    if not is_complete(folder):
        return f"{folder} is unfinished (no .metadata: a save that stopped part-way)"
    return None


def _iteration_dirs(path: str) -> Iterable[str]:
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return [n for n in names if re.fullmatch(r"iter_\d+", n) and
            os.path.isdir(os.path.join(path, n))]


def free_bytes(path: str) -> Optional[int]:
    """Bytes an unprivileged writer may still use on the device of ``path`` (None: unknown)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _errnos(exc: BaseException, seen=None) -> set:
    """Every errno in ``exc``, its causes and contexts, and the failures a DCP
    ``CheckpointException`` gathered from the ranks."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return set()
    seen.add(id(exc))
    found = {exc.errno} if isinstance(exc, OSError) and exc.errno else set()
    for inner in (exc.__cause__, exc.__context__):
        if isinstance(inner, BaseException):
            found |= _errnos(inner, seen)
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack)
        if isinstance(inner, BaseException):
            found |= _errnos(inner, seen)
    if "No space left on device" in str(exc):
        found.add(errno.ENOSPC)
    return found


def _size(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def remove_partial(save_dir: str, iteration: Optional[int]) -> Optional[int]:
    """Remove the folder of a save of ``iteration`` that failed, unless the tracker names it (an
    earlier complete save of that iteration the failed one wrote over: its checksum manifest tells
    what was damaged). Returns the bytes removed (None: nothing removed). The tracker is not
    touched."""
    folder = iteration_dir(save_dir, iteration)
    tracked = read_tracker(save_dir)
    if not os.path.isdir(folder) or tracked == ("release" if iteration is None else
                                               str(iteration)):
        return None
    size = _size(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return size


def failed_save_message(save_dir: str, iteration: Optional[int], exc: BaseException,
                        free: Optional[int], removed: Optional[int]) -> str:
    """One line: the folder a save failed writing, the cause (a full device, with the bytes
    free, where the error or the device says so), what became of the folder and what the tracker
    names."""
    folder = iteration_dir(save_dir, iteration)
    no_space = bool(_errnos(exc) & set(NO_SPACE_ERRNOS)) or (
        free is not None and free < LOW_SPACE_BYTES)
    if no_space:
        cause = (f"no space left on device writing {folder}: "
                 f"{'?' if free is None else free} bytes free")
    else:
        text = str(exc).strip().splitlines()
        cause = f"saving {folder} failed: {type(exc).__name__}: {text[0] if text else ''}"
        if type(exc).__name__ == "CheckpointException":  # DCP's: the ranks' errors, reduced
            cause += " (the checkpoint writer's own error is logged above)"
    if removed is not None:
        cause += f"; removed the unfinished {os.path.basename(folder)} ({removed} bytes)"
    tracked = read_tracker(save_dir)
    cause += (f"; {TRACKER} names iteration {tracked}, whose checkpoint is unchanged"
              if tracked else "; no earlier checkpoint in this directory")
    fix = "free space on that device" if no_space else "fix the cause"
    return f"{cause}. Stopped; {fix}, then resume with --load {save_dir}"
