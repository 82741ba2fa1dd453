"""Checkpoints lose nothing (issue 49, items 2, 4, 5):

* one training per ``--save``: a directory in use by a live run is refused with one line naming
  the holder; a lock whose holder is gone is taken over, one of another host that cannot be
  checked is refused with the way to clear it (``training/save_lock.py``);
* a save that fails on a full device stops with one line naming the folder and the cause, the
  unfinished iteration removed and the tracker still naming the last complete checkpoint
  (``checkpoint_state.py``, ``training/checkpoint_hooks.py``);
* a ``--load`` with no complete checkpoint is refused unless ``--ext-allow-fresh-start``
  (``training/preflight.py``);
* a resume that builds another model than the checkpoint's (STEM variant, layers, FFN width;
  StructMoE's and Sigma's shapes and routing) is refused naming both values before upstream's
  loader reads a tensor; settings that do not change the model stay free
  (``models/saved_settings.py``, each family's ``check_checkpoint``).

The trainings: two 2-rank launches (the lock, the full device) and one 1-rank launch of a STEM
checkpoint and its resumes (tests/multirank.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from multirank import ROOT, TINY_GPT, Launches, require_ok
from tests_helpers import parse_tiny_args

from megatron_ext import checkpoint_manifest as cm
from megatron_ext import checkpoint_state as cs
from megatron_ext.training import save_lock
from megatron_ext.training.save_lock import LOCK_NAME, SaveLock, SaveLockError

FULL_DISK = os.path.join(ROOT, "tests", "dist", "full_disk.py")
STEM = TINY_GPT + ["--model-family", "stem", "--stem-ratio", "1/2",
                   "--stem-table-placement", "cpu"]  # STEM layers 1 and 3, managed tables
LOCAL = ("ext4", "rw,relatime,rw")
NFS_LOCAL_LOCKS = ("nfs4", "rw,relatime,rw,vers=4.2,local_lock=flock")


# -- the save lock -------------------------------------------------------------------------------
HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from megatron_ext.training.save_lock import SaveLock
SaveLock().acquire({save!r}, log=print)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path/ck``'s lock until the test ends."""
    save = str(tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT, save=save)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield save, proc
    proc.stdin.close()
    proc.wait(timeout=30)


def _record(save):
    with open(os.path.join(save, LOCK_NAME)) as f:
        return json.loads(f.read() or "{}")


def test_a_save_dir_in_use_is_refused_naming_the_holder(holder):
    save, proc = holder
    with pytest.raises(SaveLockError, match=rf"--save={re.escape(save)} is in use by another "
                       rf"training \(host {re.escape(socket.gethostname())}, pid {proc.pid}, "
                       r"started .*: python\S* -c\); two trainings saving into one directory "
                       "overwrite each other's checkpoints"):
        SaveLock().acquire(save, log=print, mount=LOCAL)


def test_the_lock_goes_with_its_holder_and_a_clean_exit_clears_the_record(holder):
    """The kernel drops the flock when the holder ends (here: it exits at once, as a killed one
    would, without clearing its record): the next run takes the lock over and says so."""
    save, proc = holder
    proc.kill()
    proc.wait()
    lines = []
    lock = SaveLock()
    lock.acquire(save, log=lines.append, mount=LOCAL)
    assert len(lines) == 1 and re.match(
        rf"--save={re.escape(save)}: took over the lock of a training that ended without "
        rf"releasing it \(host .*, pid {proc.pid}, .*no longer running\)", lines[0]), lines
    assert _record(save)["pid"] == os.getpid()
    lock.acquire(save, log=lines.append, mount=LOCAL)  # again in this process: already held
    lock.release_all()
    assert _record(save) == {} and len(lines) == 1
    SaveLock().acquire(save, log=lines.append, mount=LOCAL)  # a clean release: nothing to say
    assert len(lines) == 1


def _leave_record(save, **fields):
    """A lock file whose record a run left without clearing it (no flock held)."""
    os.makedirs(save, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": "then",
              "command": "pretrain.py", "boot_id": save_lock._boot_id(),
              "process_start": save_lock._process_start(os.getpid())}
    record.update(fields)
    with open(os.path.join(save, LOCK_NAME), "w") as f:
        json.dump(record, f)


def test_where_locks_are_not_shared_a_record_of_another_host_is_refused(tmp_path):
    """NFS with host-local locks: a free flock says nothing of a run on another host; the
    record is refused with the way to clear it. On a local disk a free flock proves the holder
    gone, whatever host name it recorded (a container's)."""
    save = str(tmp_path / "ck")
    _leave_record(save, host="node-7", pid=4242)
    with pytest.raises(SaveLockError, match=rf"--save={re.escape(save)} is locked by a training "
                       r"on another host \(host node-7, pid 4242, .*\), which this host cannot "
                       r"check \(nfs4 filesystem does not share its locks between hosts\): if "
                       rf"that training is no longer running, delete {re.escape(save)}/"
                       f"{LOCK_NAME} and start again"):
        SaveLock().acquire(save, log=print, mount=NFS_LOCAL_LOCKS)
    lines = []
    SaveLock().acquire(save, log=lines.append, mount=LOCAL)
    assert "took over the lock" in lines[0] and "host node-7" in lines[0]


def test_where_locks_are_not_shared_a_live_process_of_this_host_is_refused(tmp_path):
    """Without a shared flock (or any: ENOLCK) the record decides on this host: a live process
    (here this one, recorded as if another run) is refused; a dead one, or a pid now given to
    another process (another start time), is taken over."""
    save = str(tmp_path / "ck")
    _leave_record(save)
    with pytest.raises(SaveLockError, match="is in use by another training"):
        SaveLock().acquire(save, log=print, mount=NFS_LOCAL_LOCKS)
    _leave_record(save, process_start=-1)  # the same pid, another process
    lines = []
    SaveLock().acquire(save, log=lines.append, mount=NFS_LOCAL_LOCKS)
    assert "took over the lock" in lines[0]


def test_a_filesystem_without_flock_falls_back_to_the_record(tmp_path, monkeypatch):
    import errno

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(save_lock.fcntl, "flock", no_flock)
    save = str(tmp_path / "ck")
    _leave_record(save, host="node-7")
    with pytest.raises(SaveLockError, match=r"cannot check \(lustre filesystem has no flock\)"):
        SaveLock().acquire(save, log=print, mount=("lustre", "rw"))
    os.remove(os.path.join(save, LOCK_NAME))  # what the message says to do
    SaveLock().acquire(save, log=print, mount=("lustre", "rw"))
    assert _record(save)["pid"] == os.getpid()


def test_mounts_and_which_share_their_locks(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=x\n"
        "40 22 0:50 / /mnt/nfs rw,relatime - nfs4 srv:/export rw,vers=4.2,local_lock=none\n"
        "41 40 0:51 / /mnt/nfs/scratch\\040x rw - nfs srv:/s rw,vers=3,nolock\n")
    assert save_lock.mount_of("/mnt/nfs/ck", str(mountinfo))[0] == "nfs4"
    assert save_lock.mount_of("/mnt/nfs/scratch x/ck", str(mountinfo))[0] == "nfs"
    assert save_lock.mount_of("/mnt/nfsother", str(mountinfo))[0] == "overlay"
    shared = save_lock.locks_shared_between_hosts
    assert shared("overlay", "rw") and shared("ext4", "rw") and shared("gpfs", "rw")
    assert shared(*save_lock.mount_of("/mnt/nfs/ck", str(mountinfo)))
    assert not shared(*save_lock.mount_of("/mnt/nfs/scratch x/ck", str(mountinfo)))
    assert not shared("nfs4", "rw,local_lock=flock") and not shared("beegfs", "rw")
    assert shared("lustre", "rw,flock") and not shared("lustre", "rw,localflock")


# -- complete and unfinished checkpoints -----------------------------------------------------
def _iteration(save, it, complete=True):
    folder = cm.iteration_dir(save, it)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 100)
    if complete:
        with open(os.path.join(folder, ".metadata"), "wb") as f:
            f.write(b"m")
    return folder


def _track(save, text):
    with open(os.path.join(save, cm.TRACKER), "w") as f:
        f.write(text)


def test_what_megatron_would_load(tmp_path):
    save = str(tmp_path / "ck")
    _iteration(save, 2, complete=False)
    assert cs.unloadable_reason(save) == (
        f"no {cm.TRACKER}; iter_0000002 is unfinished (no .metadata: a save that stopped "
        "part-way)")
    assert "is unfinished" in cs.unloadable_reason(save, step=2)
    assert cs.unloadable_reason(save, step=3) == f"{cm.iteration_dir(save, 3)} is missing"
    _iteration(save, 1)
    assert cs.unloadable_reason(save, step=1) is None
    _track(save, "1")
    assert cs.unloadable_reason(save) is None
    _track(save, "2")  # a tracker naming an unfinished folder (written over)
    assert "iter_0000002 is unfinished" in cs.unloadable_reason(save)
    os.makedirs(os.path.join(save, "release", "mp_rank_00"))
    _track(save, "release")  # a legacy-format release checkpoint
    assert cs.unloadable_reason(save) is None


def test_a_load_without_a_complete_checkpoint_is_refused_unless_asked(tmp_path):
    from megatron_ext.training.preflight import check_load_dir

    save = str(tmp_path / "ck")
    _iteration(save, 2, complete=False)
    other = str(tmp_path / "other")
    for target in (other, save):  # a typo'd --load, or the auto-resume --load == --save
        with pytest.raises(ValueError, match=rf"--load={re.escape(save)}: no complete "
                           r"checkpoint there \(no latest_checkpointed_iteration.txt; "
                           r"iter_0000002 is unfinished .*\): Megatron would load nothing "
                           r"and train from scratch.*--ext-allow-fresh-start"):
            check_load_dir(save, target)
    assert "training starts from scratch (--ext-allow-fresh-start)" in check_load_dir(
        save, other, allow_fresh=True)
    # The first launch of an auto-resume job: nothing there yet, or only this plugin's files.
    first = tmp_path / "first"
    assert "no checkpoint there yet" in check_load_dir(str(first), str(first))
    first.mkdir()
    (first / LOCK_NAME).write_text("")
    assert "no checkpoint there yet" in check_load_dir(str(first), str(first))
    _iteration(save, 1)
    _track(save, "1")
    assert check_load_dir(save, other) is None
    with pytest.raises(ValueError, match="iter_0000002 is unfinished"):
        check_load_dir(save, other, step=2)


class _WorkerFailure(RuntimeError):
    """What Megatron's writer raises: the worker's error reduced to its type."""


def test_the_line_of_a_failed_save(tmp_path):
    save = str(tmp_path / "ck")
    _iteration(save, 1)
    _track(save, "1")
    partial = _iteration(save, 2, complete=False)
    removed = cs.remove_partial(save, 2)
    assert removed == 100 and not os.path.exists(partial)
    assert cs.remove_partial(save, 1) is None  # the tracker names it: kept
    exc = _WorkerFailure("Worker failure: An error is caught while starting worker 0, error: "
                         "<class 'RuntimeError'>")
    line = cs.failed_save_message(save, 2, exc, free=0, removed=removed)
    assert line == (f"no space left on device writing {partial}: 0 bytes free; removed the "
                    f"unfinished iter_0000002 (100 bytes); {cm.TRACKER} names iteration 1, "
                    "whose checkpoint is unchanged. Stopped; free space on that device, then "
                    f"resume with --load {save}")
    # The errno where the error still has it, with room on the device (a quota).
    import errno

    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert cs.failed_save_message(save, 2, quota, 10 << 30, None).startswith(
        f"no space left on device writing {partial}: {10 << 30} bytes free; {cm.TRACKER}")
    from torch.distributed.checkpoint.api import CheckpointException

    gathered = CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on "
                                                         "device"), None)})
    assert cs.failed_save_message(save, 2, gathered, 10 << 30, None).startswith(
        f"no space left on device writing {partial}")
    other = cs.failed_save_message(save, 2, PermissionError(13, "Permission denied"), 10 << 30,
                                   None)
    assert other.startswith(f"saving {partial} failed: PermissionError: [Errno 13] Permission "
                            "denied;") and "fix the cause" in other


# -- the settings a checkpoint's model was built with ---------------------------------------------
def _save_args(folder, args):
    """A checkpoint of one tiny tensor with ``args`` in its common state, as Megatron saves."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    path = cm.iteration_dir(folder, 1)
    os.makedirs(path)
    dist_checkpointing.save({"args": args, "iteration": 1,
                             "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, path)
    _track(folder, "1")
    return folder


SIGMA = ["--model-family", "sigma", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
         "--moe-router-topk", "1"]
STRUCTMOE = ["--model-family", "structmoe"]


@pytest.mark.parametrize("family,saved,resumed,message", [
    ("sigma", SIGMA, SIGMA[:3] + ["8"] + SIGMA[4:],
     "--num-experts: 4 in the checkpoint, 8 in this run"),
    ("sigma", SIGMA, SIGMA[:-1] + ["2"], "--moe-router-topk: 1 in the checkpoint, 2 in this run"),
    ("structmoe", STRUCTMOE, STRUCTMOE + ["--structmoe-fusion", "glu"],
     "--structmoe-fusion: additive in the checkpoint, glu in this run"),
    ("structmoe", STRUCTMOE, STRUCTMOE + ["--structmoe-rank", "8"],
     "--structmoe-rank: 16 in the checkpoint, 8 in this run; StructMoE D'_ff"),
    # D'_ff = 16 at this shape (Eq. 8), stored as 128: the tensors' width differs.
    ("structmoe", STRUCTMOE, STRUCTMOE + ["--structmoe-ffn-pad-to", "128"],
     "StructMoE D'_ff as stored (--structmoe-ffn-pad-to): 16 in the checkpoint, 128 in this run"),
    ("stem", ["--model-family", "stem", "--stem-layers", "1,3"],
     ["--model-family", "stem", "--stem-ratio", "1/2", "--stem-variant", "dagger"],
     "--stem-variant: up in the checkpoint, dagger in this run"),
    ("gpt", [], ["--ffn-hidden-size", "96"], "--ffn-hidden-size: 128 in the checkpoint, 96"),
    ("gpt", [], ["--model-family", "structmoe"],
     "--model-family: gpt in the checkpoint, structmoe in this run"),
])
def test_a_resume_that_builds_another_model_is_refused(mcore_single_rank, tmp_path, family,
                                                       saved, resumed, message):
    """Each family's check (and the settings of every model) against the args a checkpoint
    holds; in one line naming both values. Without a STEM model to hand, STEM's table checks
    find no tables and its settings decide."""
    from megatron_ext.training.checkpoint_hooks import check_checkpoint

    load = _save_args(str(tmp_path / "ck"), parse_tiny_args(saved))
    args = parse_tiny_args(resumed)
    args.ckpt_step = None
    with pytest.raises(cm.CheckpointError, match=rf"--load={re.escape(load)}: the checkpoint "
                       rf"holds another model than this run builds \(.*{re.escape(message)}"):
        check_checkpoint([], args, load)


@pytest.mark.parametrize("saved,resumed", [
    (SIGMA, SIGMA + ["--sigma-lbl", "top1", "--sigma-lbl-coeff", "0.1"]),
    (STRUCTMOE, STRUCTMOE + ["--structmoe-backend", "reference", "--structmoe-init", "megatron",
                             "--structmoe-aux-loss-coeff", "0"]),
    # A padding multiple that stores the same width (D'_ff = 16 is a multiple of 8).
    (STRUCTMOE, STRUCTMOE + ["--structmoe-ffn-pad-to", "8"]),
    ([], ["--lr", "1e-2", "--seed", "7", "--hidden-dropout", "0.1"]),
])
def test_settings_that_keep_the_model_stay_free(mcore_single_rank, tmp_path, saved, resumed):
    """(STEM's: test_settings_that_keep_the_stem_model_are_free_on_resume, with its tables.)"""
    from megatron_ext.training.checkpoint_hooks import check_checkpoint

    load = _save_args(str(tmp_path / "ck"), parse_tiny_args(saved))
    args = parse_tiny_args(resumed)
    args.ckpt_step = args.no_load_optim = None
    check_checkpoint([], args, load)


def test_settings_an_older_checkpoint_lacks_are_not_compared():
    from megatron_ext.models.saved_settings import differences

    from megatron_ext.stem.family import SETTINGS

    old = argparse.Namespace(ffn_hidden_size=128, stem_ratio="1/2", stem_layers=None,
                             num_layers=4)  # no stem_variant
    new = parse_tiny_args(["--model-family", "stem", "--stem-variant", "gate",
                           "--stem-layers", "1,2"])
    assert differences(old, new, SETTINGS) == [
        "STEM layers (MLP blocks, from --stem-layers/--stem-ratio): [1, 3] in the checkpoint, "
        "[1, 2] in this run"]


# -- trainings ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint_safety")
    ck = {name: str(tmp / f"ck_{name}") for name in ("locked", "full", "stem", "partial")}
    # A live training's lock on "locked": this test process's.
    held = SaveLock()
    held.acquire(ck["locked"], log=print)
    # A folder of one unfinished save (its files, no .metadata, no tracker), as a killed run
    # leaves it.
    _iteration(ck["partial"], 2, complete=False)

    launches = Launches(str(tmp))
    save_each = ["--save-interval", "1", "--train-iters", "3"]
    launches.add("locked", TINY_GPT + save_each + ["--save", ck["locked"]], fails=True)
    launches.add("full", TINY_GPT + save_each + ["--save", ck["full"]], entry=FULL_DISK,
                 fails=True)
    # Saved at iteration 2 of 3 (and 3, at the end); resumed from 2 with the same schedule.
    resume = STEM + ["--train-iters", "3", "--load", ck["stem"], "--ckpt-step", "2"]
    one = dict(nproc=1)
    launches.add("stem", STEM + ["--train-iters", "3", "--save", ck["stem"],
                                 "--save-interval", "2"], **one)
    launches.add("stem_gate", resume + ["--stem-variant", "gate"], fails=True, **one)
    launches.add("stem_dagger", resume + ["--stem-variant", "dagger"], fails=True, **one)
    launches.add("stem_ffn", resume + ["--ffn-hidden-size", "96"], fails=True, **one)
    # What does not change the model: where the rows live, who steps them, how.
    launches.add("stem_placement", resume + ["--stem-table-sharding", "vocab",
                                             "--stem-row-ownership", "contiguous",
                                             "--no-stem-prefetch", "--stem-kernel", "torch",
                                             "--stem-init", "normal"], **one)
    launches.add("partial", STEM + ["--train-iters", "3", "--load", ck["partial"]],
                 fails=True, **one)
    out = launches.run()
    held.release_all()
    out["ck"] = ck
    return out


def _one_line(run, line):
    """``line`` is on the screen once (rank 0's), with no traceback."""
    assert run.returncode != 0, run.log[-3000:]
    assert run.log.count(line) == 1, run.log[-4000:]
    assert "Traceback" not in run.log, run.log[-4000:]


@pytest.mark.multirank
def test_a_second_training_on_a_save_dir_in_use_is_refused(runs):
    """Before: both trainings saved into the directory and exited 0."""
    ck = runs["ck"]["locked"]
    _one_line(runs["locked"], f"megatron-ext: --save={ck} is in use by another training (host "
                              f"{socket.gethostname()}, pid {os.getpid()}")
    assert sorted(os.listdir(ck)) == [LOCK_NAME]  # nothing of the refused run


@pytest.mark.multirank
def test_a_full_device_stops_the_save_in_one_line_keeping_the_last_checkpoint(runs):
    """Before: torch's "unexpected pos" and a CheckpointException traceback on both ranks, the
    unfinished iter_0000002 left behind."""
    ck = runs["ck"]["full"]
    run = runs["full"]
    _one_line(run, f"megatron-ext: no space left on device writing {ck}/iter_0000002: 0 bytes "
                   "free; removed the unfinished iter_0000002 (")
    assert re.search(rf"{cm.TRACKER} names iteration 1, whose checkpoint is unchanged\. Stopped; "
                     rf"free space on that device, then resume with --load {re.escape(ck)}\n",
                     run.log)
    assert not os.path.exists(cm.iteration_dir(ck, 2))
    assert cm.read_tracker(ck) == "1" and cs.unloadable_reason(ck) is None
    assert cm.verify(cm.iteration_dir(ck, 1)) is not None  # its manifest matches


@pytest.mark.multirank
@pytest.mark.parametrize("name,line", [
    # Before: loaded the up tables as gate tables and trained, exit 0.
    ("stem_gate", "--stem-variant: up in the checkpoint, gate in this run"),
    # Before: Megatron's shape-mismatch traceback.
    ("stem_dagger", "--stem-variant: up in the checkpoint, dagger in this run"),
    # Before: this message inside a ValueError traceback.
    ("stem_ffn", "decoder.layers.1.mlp.table has shape [vocab, d_ff] = [1024, 128], but this "
                 "model's tables are [1024, 96]"),
])
def test_a_resume_with_another_stem_model_is_refused_before_loading(runs, name, line):
    run = runs[name]
    assert run.returncode != 0 and "Traceback" not in run.log, run.log[-4000:]
    found = [ln for ln in run.log.splitlines() if line in ln]
    assert len(found) == 1 and found[0].startswith("megatron-ext: "), run.log[-4000:]
    assert "loading distributed checkpoint" not in run.log  # upstream's loader never started


@pytest.mark.multirank
def test_settings_that_keep_the_stem_model_are_free_on_resume(runs):
    require_ok(runs["stem"])
    assert sorted(require_ok(runs["stem_placement"]).losses) == [3]


@pytest.mark.multirank
def test_a_load_of_an_unfinished_save_is_refused_at_start(runs):
    """Before: the start-up check passed (an iter_* folder), Megatron found no tracker, "will
    start from random", and trained from scratch, exit 0."""
    ck = runs["ck"]["partial"]
    _one_line(runs["partial"], f"megatron-ext: --load={ck}: no complete checkpoint there")
