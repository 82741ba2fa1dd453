"""What the conversion tools share: dtype names, a staged output directory, a progress bar."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Iterator

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def staged_directory(target: str) -> Iterator[str]:
    """A fresh directory beside ``target`` to write into; renamed to ``target`` when the block
    ends normally, removed on any exception, so ``target`` is never half-written. The caller
    refuses or clears an existing ``target`` (inside the block, before it ends: ``os.replace``
    only replaces an absent or empty directory)."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
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
    from tqdm import tqdm

    kwargs.setdefault("unit", "tensor")
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, **kwargs)
