"""A checksum manifest beside every checkpoint: the size and SHA-256 of each of its files.

``torch.distributed.checkpoint`` (and so Megatron's ``torch_dist`` format) has no checksums: a
truncated ``.distcp`` fails to load with a bare ``EOFError`` naming no file, and bytes overwritten
in the middle of one load silently. Megatron writes the tracker
(``latest_checkpointed_iteration.txt``) once every rank has written its files; the manifest is
written after that, by rank 0, on a thread of its own (``ManifestWriter``), so the training
thread does not wait for the hashing. It is written under a temporary name and renamed: a crash
leaves either a whole manifest or none. A checkpoint without one (older, or the process died
while hashing) loads unverified, with one line saying so.

Verification (``verify``) compares every listed file's size (a truncation is found without
reading) and digest, and names each damaged file. The trainer verifies before Megatron's
``load_checkpoint`` reads (the ranks share the files: ``megatron_ext.training.checkpoint_hooks``),
``to-hf`` before it converts; ``--no-verify-checkpoint`` turns both off.

Only the standard library is needed here: the converter and the trainer both use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# Megatron's tracker file (megatron.training.checkpointing.get_checkpoint_tracker_filename).
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "megatron_ext_manifest.json"
FORMAT = "megatron-ext-checkpoint-manifest/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def iteration_dir(save_dir: str, iteration: Optional[int]) -> str:
    """Megatron's folder name for an iteration (``iter_0000010``), or ``release``."""
    return os.path.join(save_dir, "release" if iteration is None else f"iter_{iteration:07d}")


def read_tracker(save_dir: str) -> Optional[str]:
    """The tracker's text (an iteration number or ``release``), or None without one."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def resolve_checkpoint_dir(path: str, step: Optional[int] = None) -> Tuple[str, Optional[int]]:
    """``path`` is a ``--save`` directory (with the tracker and ``iter_*`` folders) or one
    checkpoint folder. Returns the folder (``--ckpt-step`` ``step``, else the tracker's) and its
    iteration (None for a release checkpoint)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(
            os.path.join(path, MANIFEST)):
        m = re.search(r"iter_(\d+)$", os.path.normpath(path))
        return path, int(m.group(1)) if m else None
    if step is None:
        text = read_tracker(path)
        if text is None:
            raise CheckpointError(
                f"{path}: neither a checkpoint folder (.metadata) nor a --save directory with "
                f"{TRACKER}")
        if text == "release":  # Megatron's release checkpoints (e.g. written by from-hf)
            folder = iteration_dir(path, None)
            if not os.path.isdir(folder):
                raise CheckpointError(f"{folder}: the tracker says 'release' but it is missing")
            return folder, None
        if not text.isdigit():
            raise CheckpointError(f"{os.path.join(path, TRACKER)}: expected an iteration number "
                                  f"or 'release', found {text!r}")
        step = int(text)
    folder = iteration_dir(path, step)
    if not os.path.isdir(folder):
        have = sorted(d for d in os.listdir(path) if d.startswith("iter_"))
        raise CheckpointError(f"{folder}: no checkpoint of iteration {step} (found: {have})")
    return folder, step


def file_digest(path: str) -> str:
    """SHA-256 of the file (``hashlib.file_digest``: its updates release the GIL)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(folder: str) -> List[str]:
    """Every regular file under ``folder`` (relative paths, sorted), the manifest aside."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel == MANIFEST or rel.startswith(MANIFEST + "."):
                continue
            found.append(rel)
    return sorted(found)


def write_manifest(folder: str, iteration: Optional[int] = None) -> dict:
    """Hash every file of the (complete) checkpoint ``folder`` and write its manifest
    atomically. Returns the manifest, with ``bytes`` and ``seconds`` of the hashing."""
    start = time.perf_counter()
    files: Dict[str, dict] = {}
    total = 0
    for rel in checkpoint_files(folder):
        path = os.path.join(folder, rel)
        size = os.path.getsize(path)
        files[rel] = {"size": size, "sha256": file_digest(path)}
        total += size
    manifest = {"format": FORMAT, "iteration": iteration, "files": files, "bytes": total,
                "seconds": round(time.perf_counter() - start, 3)}
    tmp = os.path.join(folder, f"{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    return manifest


def read_manifest(folder: str) -> Optional[dict]:
    """The manifest of ``folder``, or None when it has none. A manifest that cannot be read is
    an error naming it."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"not a {FORMAT} manifest")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable checksum manifest ({exc}); pass "
                              "--no-verify-checkpoint to load the checkpoint unverified") from exc
    return manifest


def _file_problem(folder: str, rel: str, entry: dict) -> Optional[str]:
    path = os.path.join(folder, rel)
    try:
        size = os.path.getsize(path)
    except OSError:
        return f"{path}: missing (the manifest lists {entry['size']} bytes)"
    if size != entry["size"]:
        return (f"{path}: {size} bytes, the manifest says {entry['size']} "
                "(truncated or rewritten)")
    if file_digest(path) != entry["sha256"]:
        return f"{path}: its SHA-256 differs from the manifest's (damaged bytes)"
    return None


def check_files(folder: str, manifest: dict, names: Optional[Sequence[str]] = None,
                threads: int = 1) -> List[str]:
    """Problems (one line each, naming the file) of ``names`` (default: every listed file):
    missing, another size (found without reading), or another digest. ``threads`` hash files
    side by side (hashlib releases the GIL)."""
    listed = manifest["files"]
    names = sorted(listed) if names is None else list(names)
    if threads > 1 and len(names) > 1:
        with ThreadPoolExecutor(min(threads, len(names))) as pool:
            found = list(pool.map(lambda rel: _file_problem(folder, rel, listed[rel]), names))
    else:
        found = [_file_problem(folder, rel, listed[rel]) for rel in names]
    return [p for p in found if p is not None]


def damaged_message(folder: str, problems: Sequence[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"checkpoint {folder} is damaged: {problems[0]}{more}. Load another iteration "
            "(--ckpt-step), or pass --no-verify-checkpoint to load it anyway")


def verify(folder: str, threads: Optional[int] = None) -> Optional[dict]:
    """Check ``folder`` against its manifest in this process (``threads``: default up to 8, one
    per core). Returns the manifest (None when there is none); raises ``CheckpointError`` naming
    the first damaged file."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    if threads is None:
        threads = min(8, os.cpu_count() or 1)
    problems = check_files(folder, manifest, threads=threads)
    if problems:
        raise CheckpointError(damaged_message(folder, problems))
    return manifest


def unverified_note(folder: str) -> str:
    return (f"checkpoint {folder} has no checksum manifest ({MANIFEST}: saved before manifests "
            "were written, or the save's process ended while hashing): loaded unverified")


class ManifestWriter:
    """Writes manifests on one thread of its own, in the order the saves were submitted.

    ``submit(folder, iteration, save_dir)`` returns at once. With ``save_dir`` given (an
    asynchronous save, finalized later by Megatron), the thread first waits until the tracker
    of ``save_dir`` names ``iteration`` or a later one: the checkpoint is complete then.
    ``wait()`` blocks until every submitted manifest is written (the end of training, a test's
    teardown); ``close()`` stops waiting for trackers that will not come (an exit on error)."""

    POLL_S = 0.2

    def __init__(self, log: Callable[[str], None] = print):
        self._log = log
        self._cond = threading.Condition()
        self._queue: List[tuple] = []
        self._busy = False
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.written: List[dict] = []  # per manifest: folder, bytes, seconds
        self.errors: List[str] = []

    def submit(self, folder: str, iteration: Optional[int],
               save_dir: Optional[str] = None) -> None:
        with self._cond:
            self._stop = False
            self._queue.append((folder, iteration, save_dir))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="megatron-ext-manifest",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _tracker_reached(self, save_dir: str, iteration: Optional[int]) -> bool:
        text = read_tracker(save_dir)
        if text is None:
            return False
        if iteration is None:
            return text == "release"
        return text.isdigit() and int(text) >= iteration

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                folder, iteration, save_dir = self._queue.pop(0)
                self._busy = True
            try:
                if save_dir is not None:
                    while not self._tracker_reached(save_dir, iteration):
                        if self._stop:
                            raise RuntimeError("the save was not finalized before the end")
                        time.sleep(self.POLL_S)
                m = write_manifest(folder, iteration)
                self.written.append({"folder": folder, "bytes": m["bytes"],
                                     "seconds": m["seconds"]})
                self._log(f"checksum manifest of {folder}: {len(m['files'])} files, "
                          f"{m['bytes'] / 2**20:.1f} MiB hashed in {m['seconds']:.2f} s "
                          "off the training thread")
            except Exception as exc:  # the checkpoint stays loadable, unverified
                msg = f"no checksum manifest for {folder}: {exc}"
                self.errors.append(msg)
                self._log(msg)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + int(self._busy)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until every submitted manifest is written; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop waiting for trackers; a manifest being hashed is finished first."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
