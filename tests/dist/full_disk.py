"""``launch/pretrain.py`` whose ``--save`` device fills up during the save of iteration 2.

Megatron's checkpoint writer (``dist_checkpointing.strategies.filesystem_async``) opens each
``.distcp`` file with ``open``; inside ``iter_0000002`` it gets Python's buffered writer over a
raw file on a device with 4 KiB left (``FullDevice``); from then on ``os.statvfs`` reports no free
bytes on that device. The failure travels the writer's own way from there (torch's zip
writer: "[enforce fail at inline_container.cc:672] . unexpected pos", as on a full tmpfs; the
writer's worker error; DCP's ``CheckpointException`` on every rank). Every other file, and every
other write, is untouched. Flags as for ``launch/pretrain.py`` (``--save`` among them)."""

from __future__ import annotations

import errno
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402

FILLS_IN = "iter_0000002"
ROOM_BYTES = 4096
SAVE = os.path.realpath(sys.argv[sys.argv.index("--save") + 1])
FULL = {"now": False}


class FullDevice(io.RawIOBase):
    """A file on a device with ``ROOM_BYTES`` left, at the level of ``write(2)``: a write that
    does not fit writes what fits and returns its count, the next one fails with ENOSPC. Python's
    buffered writer on top of it does what it does on a real full device."""

    def __init__(self, path: str):
        self._file = io.FileIO(path, "wb")
        self._room = ROOM_BYTES
        self.name = path

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._room:
            FULL["now"] = True
            if self._room == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        written = self._file.write(view[:self._room])
        self._room -= written
        return written

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        super().close()


_open = open
_statvfs = os.statvfs


def filling_open(file, mode="r", *args, **kwargs):
    if mode == "wb" and os.path.realpath(str(file)).startswith(
            os.path.join(SAVE, FILLS_IN) + os.sep):
        return io.BufferedWriter(FullDevice(str(file)))
    return _open(file, mode, *args, **kwargs)


def statvfs(path):
    st = _statvfs(path)
    if FULL["now"] and os.path.realpath(path).startswith(SAVE):
        return os.statvfs_result(tuple(st)[:3] + (0, 0) + tuple(st)[5:])
    return st


filesystem_async.open = filling_open  # the writer's own name for open
os.statvfs = statvfs

if __name__ == "__main__":
    from megatron_ext.training.entry import main

    main()
