"""One training per ``--save`` directory: a lock file in it, held by rank 0 for the process's life.

Two trainings started with the same ``--save`` overwrote each other's checkpoints silently (every
rank writes its own files of an iteration; the tracker names whichever run finished last). Rank 0
takes an exclusive ``flock`` on ``DIR/megatron_ext_save.lock`` before anything of the run is
written there (``checkpoint_hooks`` takes it right after Megatron's initialization, before its
progress log and the first save) and tells the other ranks whether it got it: every rank stops
when it did not, rank 0 with one line naming the holder.

The kernel drops a ``flock`` when its holder dies, however it dies (``kill -9``, an OOM kill), so
a crashed run leaves no stuck lock. The file also holds a record of its holder (host, pid, start
time, command), cleared at a clean exit. A record found under a free lock is a run that ended
without clearing it: on a filesystem whose locks every host sees (a local disk; NFS whose locks
go to the server, ``local_lock=none``; Lustre mounted with ``flock``; GPFS) the free lock proves
it is over, and the lock is taken over with a line saying so. Elsewhere (NFS with ``nolock`` or
``local_lock=flock``, BeeGFS, CIFS, ...: each host's locks are its own; or a filesystem without
``flock``) a free lock proves nothing about another host: a record of a process on this host that
no longer runs is taken over, one of another host is refused with the line that says how to
clear it (delete the lock file once that run is known to be over).

Standard library only."""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Callable, Dict, Optional, Tuple

LOCK_NAME = "megatron_ext_save.lock"
# Filesystems on one machine: a flock there is seen by every process that can open the file.
LOCAL_FILESYSTEMS = frozenset((
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs", "jfs",
    "reiserfs", "bcachefs", "nilfs2", "vfat", "exfat", "ntfs", "ntfs3", "hfsplus", "apfs"))
# flock() answers these where the filesystem has no locks (NFSv3 without lockd, Lustre without
# -o flock): the record alone decides then.
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class SaveLockError(RuntimeError):
    """``--save`` is in use, or locked by a run this host cannot check; the message says what
    to do."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> Optional[int]:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22),
    which tells a process from a later one given the same pid; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)[:400],
            "boot_id": _boot_id(), "process_start": _process_start(os.getpid())}


def holder_running(record: dict) -> bool:
    """Whether the process of ``record`` (one of this host) still runs: its pid is alive and, where
    /proc tells, it is the same process (same boot, same start time), not a later one given the
    same pid."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _process_start(pid)
    if start is not None or os.path.isdir("/proc"):
        return (start is not None and record.get("boot_id") == _boot_id()
                and record.get("process_start") == start)
    try:  # no /proc (not Linux): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(record: dict) -> str:
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started "
            f"{record.get('started', '?')}: {record.get('command', '?')}")


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> Tuple[str, str]:
    """The filesystem type and its options (mount and superblock options, comma-joined) of the
    mount holding ``path``: the longest mount point above it in ``mountinfo``. ``("", "")``
    where that cannot be read."""
    real = os.path.realpath(path)
    best, found = -1, ("", "")
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, found = len(point), (tail[0], f"{fields[5]},{tail[2]}")
    return found


def locks_shared_between_hosts(fstype: str, options: str) -> bool:
    """Whether a free ``flock`` on this filesystem means no process on any host holds it."""
    opts = set(options.split(","))
    if fstype in LOCAL_FILESYSTEMS or fstype == "gpfs":
        return True
    if fstype in ("nfs", "nfs4"):  # flock goes to the server unless the mount keeps it local
        return "nolock" not in opts and "local_lock=flock" not in opts and \
            "local_lock=all" not in opts
    if fstype == "lustre":
        return "flock" in opts
    return False


class SaveLock:
    """The locks this process holds, by ``--save`` directory (several trainings of one process,
    ``tests/dist/multi_config.py``, may save into one directory in turn)."""

    def __init__(self) -> None:
        self.held: Dict[str, int] = {}
        atexit.register(self.release_all)

    def acquire(self, save_dir: str, log: Callable[[str], None] = print,
                mount: Optional[Tuple[str, str]] = None) -> None:
        """Take ``save_dir``'s lock for this process or raise ``SaveLockError``. ``mount``: the
        filesystem type and options (default: read from /proc/self/mountinfo)."""
        real = os.path.realpath(save_dir)
        if real in self.held:
            return
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._take(fd, save_dir, path, log, mount_of(save_dir) if mount is None else mount)
        except BaseException:
            os.close(fd)  # closing drops a flock this call took
            raise
        self.held[real] = fd

    def _take(self, fd: int, save_dir: str, path: str, log, mount: Tuple[str, str]) -> None:
        fstype, options = mount
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except BlockingIOError:
            raise SaveLockError(
                f"--save={save_dir} is in use by another training ({describe(_read(fd))}); two "
                "trainings saving into one directory overwrite each other's checkpoints: wait "
                "for it to end, or give this one another --save") from None
        except OSError as exc:
            if exc.errno not in NO_FLOCK:
                raise
            flocked = False
        record = _read(fd)
        if record:
            here = record.get("host") == socket.gethostname()
            if flocked and locks_shared_between_hosts(fstype, options):
                pass  # the free lock proves its holder is gone, whichever host it ran on
            elif here and holder_running(record):
                raise SaveLockError(
                    f"--save={save_dir} is in use by another training ({describe(record)}); two "
                    "trainings saving into one directory overwrite each other's checkpoints: "
                    "wait for it to end, or give this one another --save")
            elif not here:
                why = (f"{fstype or 'this'} filesystem does not share its locks between hosts"
                       if flocked else f"{fstype or 'this'} filesystem has no flock")
                raise SaveLockError(
                    f"--save={save_dir} is locked by a training on another host "
                    f"({describe(record)}), which this host cannot check ({why}): if that "
                    f"training is no longer running, delete {path} and start again; else give "
                    "this one another --save")
            log(f"--save={save_dir}: took over the lock of a training that ended without "
                f"releasing it ({describe(record)}; no longer running)")
        mine = this_process()
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
        os.fsync(fd)

    def release_all(self) -> None:
        """At a clean exit: clear the records (a later run then finds the lock unclaimed) and
        drop the locks."""
        for fd in self.held.values():
            try:
                os.ftruncate(fd, 0)
                os.close(fd)
            except OSError:
                pass
        self.held.clear()


def _read(fd: int) -> dict:
    """The holder record in the lock file (empty: none, or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data.decode() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}

