"""What the conversion tools share: dtype names, output checks (never into the source, never over
files a conversion did not write), a staged output directory, a progress bar."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Iterator, List, Optional

import torch
from tqdm import tqdm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _within(path: str, folder: str) -> bool:
    return path != folder and os.path.commonpath([path, folder]) == folder


def check_separate(source: str, source_flag: str, out: str, out_flag: str) -> None:
    """Refuse an output directory that is, holds or lies inside the source directory (symlinks
    resolved): a conversion never writes into its source nor replaces it. Raises ``ValueError``
    naming both paths."""
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if dst == src:
        how = "is"
    elif _within(dst, src):
        how = "lies inside"
    elif _within(src, dst):
        how = "holds"
    else:
        return

    def shown(given: str, real: str) -> str:
        return given if os.path.abspath(given) == real else f"{given} (= {real})"

    raise ValueError(f"{out_flag} {shown(out, dst)} {how} {source_flag} {shown(source, src)}: "
                     "write the output to a separate directory (a conversion never writes into "
                     "or replaces its source)")


def _check_writable(directory: str, flag: str, target: str) -> None:
    """``os.access`` and an actual probe file: root passes permission bits, and some file systems
    (sysfs, a read-only bind on an NFS server) refuse a write that ``os.access`` allows."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {target}: cannot write in {directory} (read-only file system or "
                         "no permission)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megatron_ext_write_check.", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{flag} {target}: cannot write in {directory} ({exc.strerror or exc}: "
                         "a probe file could not be created)") from None


def listing(directory: str) -> List[str]:
    """Every entry under ``directory`` (files, folders, links; not followed), as sorted paths
    relative to it."""
    entries = []
    for root, dirs, files in os.walk(directory):
        entries += [os.path.relpath(os.path.join(root, n), directory) for n in dirs + files]
    return sorted(entries)


def write_record(directory: str, name: str, content: dict) -> None:
    """Write ``content`` as ``directory/name`` (JSON), with ``files``: every entry of
    ``directory``, this record included. Written last: it is what lets a later --overwrite
    replace the directory (``check_replaceable``)."""
    files = sorted(set(listing(directory)) | {name})
    with open(os.path.join(directory, name), "w") as f:
        json.dump({**content, "files": files}, f, indent=2)


def check_replaceable(target: str, record: str, flag: str = "--out") -> None:
    """Refuse to replace ``target`` unless a conversion wrote it: its ``record`` lists every entry
    in it (``write_record``). Raises ``ValueError`` naming what is there."""
    present = listing(target)

    def names(entries: List[str]) -> str:
        return ", ".join(entries[:5]) + (f" (+{len(entries) - 5} more)" if len(entries) > 5
                                        else "")

    try:
        with open(os.path.join(target, record)) as f:
            written = json.load(f)["files"]
        if not isinstance(written, list):
            raise TypeError
    except FileNotFoundError:
        raise ValueError(f"{flag} {target}: not the output of an earlier conversion (no {record}"
                         f"; it holds {names(present) or 'nothing'}): --overwrite replaces only "
                         f"what a conversion wrote; remove it yourself or choose another "
                         f"{flag}") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{flag} {target}: its {record} does not list the files the conversion "
                         "wrote (damaged, or written before --overwrite checked it): remove the "
                         f"directory yourself or choose another {flag}") from None
    foreign = [e for e in present if e not in set(written)]
    if foreign:
        raise ValueError(f"{flag} {target}: --overwrite replaces only what an earlier conversion "
                         f"wrote, and {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
                         f"there {'is' if len(foreign) == 1 else 'are'} not its: "
                         f"{names(foreign)}; move {'it' if len(foreign) == 1 else 'them'} out or "
                         f"choose another {flag}")


def check_output_path(target: str, flag: str = "--out", replace_record: Optional[str] = None
                      ) -> None:
    """Fail before any work when ``target`` cannot be created: its nearest existing ancestor is
    a file, or not writable (a read-only file system). With ``replace_record`` an existing
    ``target`` is to be replaced (--overwrite): it must be a directory a conversion wrote
    (``check_replaceable``), not a mount point (it is renamed aside), and writable (its old
    files are removed). Raises ``ValueError`` naming the path; creates nothing."""
    target = os.path.abspath(target)
    ancestor = target
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if ancestor == target:
        if not os.path.isdir(target):
            raise ValueError(f"{flag} {target}: exists and is not a directory")
        ancestor = os.path.dirname(target)  # the directory is replaced: its parent is written
    elif not os.path.isdir(ancestor):
        raise ValueError(f"{flag} {target}: {ancestor} is a file, not a directory")
    _check_writable(ancestor, flag, target)
    if replace_record is not None and os.path.isdir(target):
        if os.path.ismount(target):
            raise ValueError(f"{flag} {target} is a mount point: --overwrite renames the earlier "
                             f"output aside, which a mount point refuses; choose a folder inside "
                             f"it as {flag}")
        _check_writable(target, flag, target)
        check_replaceable(target, replace_record, flag)


@contextlib.contextmanager
def staged_directory(target: str, replace_record: Optional[str] = None) -> Iterator[str]:
    """A fresh directory beside ``target`` to write into; renamed to ``target`` when the block
    ends normally, removed on any exception, so ``target`` is never half-written.

    Without ``replace_record`` the caller refuses an existing ``target`` (``os.replace`` only
    replaces an absent or empty directory). With it, an existing ``target`` that a conversion
    wrote (checked again here: files may have appeared since the start) is swapped out: renamed
    aside, the new directory renamed in, then the old one removed; if the new one cannot be
    renamed in, the old one goes back. A failure before the swap leaves it untouched."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
    except OSError as exc:
        raise ValueError(f"{target}: cannot create the output directory ({exc.strerror or exc}: "
                         f"{exc.filename or parent})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        yield tmp
        if replace_record is not None and os.path.isdir(target):
            check_replaceable(target, replace_record)
            _swap(tmp, target)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(new: str, target: str) -> None:
    """Replace the directory ``target`` by ``new`` (a sibling) with renames only, the old one
    removed last."""
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.replaced-",
                             dir=os.path.dirname(target))
    try:
        os.replace(target, aside)  # rename(2) replaces the empty directory ``aside``
    except BaseException:
        os.rmdir(aside)
        raise
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)  # the earlier output back in place
        raise
    try:
        shutil.rmtree(aside)
    except OSError as exc:  # the new output is in place: say what is left, do not fail
        print(f"warning: wrote {target}, but the earlier output moved aside to {aside} could not "
              f"be removed ({exc.strerror or exc}): remove it yourself", file=sys.stderr)


def progress(total: int, desc: str, enabled: bool = True, **kwargs):
    """A tqdm bar on stderr (a no-op one when ``enabled`` is false)."""
    kwargs.setdefault("unit", "tensor")
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, **kwargs)
