"""What the conversion tools share: dtype names, a staged output directory, a progress bar."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Iterator

import torch
from tqdm import tqdm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_output_path(target: str, flag: str = "--out") -> None:
    """Fail before any work when ``target`` cannot be created: its nearest existing ancestor is
    a file, or not writable (a read-only file system). Raises ``ValueError`` naming the path;
    creates nothing."""
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
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {target}: cannot write in {ancestor} (read-only file system or "
                         "no permission)")


@contextlib.contextmanager
def staged_directory(target: str) -> Iterator[str]:
    """A fresh directory beside ``target`` to write into; renamed to ``target`` when the block
    ends normally, removed on any exception, so ``target`` is never half-written. The caller
    refuses or clears an existing ``target`` (inside the block, before it ends: ``os.replace``
    only replaces an absent or empty directory)."""
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
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def progress(total: int, desc: str, enabled: bool = True, **kwargs):
    """A tqdm bar on stderr (a no-op one when ``enabled`` is false)."""
    kwargs.setdefault("unit", "tensor")
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, **kwargs)
