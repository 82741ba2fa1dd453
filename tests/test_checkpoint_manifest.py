"""The checksum manifest beside a checkpoint (megatron_ext/checkpoint_manifest.py): written
after a save, off the caller's thread; a truncated, overwritten or missing file is named; an
asynchronous save's manifest waits for the tracker. The trainer's and the converter's use of it:
test_parallel_stem.py (resume, damaged resume) and test_convert_to_hf.py."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest
import torch

from megatron_ext import checkpoint_manifest as cm
from megatron_ext.training.checkpoint_hooks import share


def make_checkpoint(folder, sizes=(5000, 70000, 12)):
    """A folder of files like a DCP checkpoint's (two .distcp, metadata, a nested file)."""
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    g = torch.Generator().manual_seed(0)
    names = ["__0_0.distcp", "__1_0.distcp", ".metadata"]
    for name, size in zip(names, sizes):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    with open(os.path.join(folder, "sub", "common.pt"), "wb") as f:
        f.write(b"common")
    return names + [os.path.join("sub", "common.pt")]


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    folder = str(tmp_path / "iter_0000004")
    names = make_checkpoint(folder)
    m = cm.write_manifest(folder, 4)
    assert sorted(m["files"]) == sorted(names)
    for name in names:  # against hashlib on the whole file, read at once
        data = open(os.path.join(folder, name), "rb").read()
        assert m["files"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert m["bytes"] == sum(e["size"] for e in m["files"].values())
    on_disk = json.load(open(os.path.join(folder, cm.MANIFEST)))
    assert on_disk["files"] == m["files"] and on_disk["iteration"] == 4
    assert not [n for n in os.listdir(folder) if ".tmp" in n]  # renamed into place
    assert cm.verify(folder)["files"] == m["files"]
    # writing again (a re-save) does not list the manifest itself
    assert sorted(cm.write_manifest(folder, 4)["files"]) == sorted(names)


@pytest.mark.parametrize("threads", [1, 3])
def test_damage_is_named(tmp_path, threads):
    folder = str(tmp_path / "iter_0000002")
    make_checkpoint(folder)
    cm.write_manifest(folder, 2)
    target = os.path.join(folder, "__1_0.distcp")
    original = open(target, "rb").read()

    with open(target, "r+b") as f:  # 4 KiB of garbage in the middle: same size
        f.seek(30000)
        f.write(b"\xa5" * 4096)
    with pytest.raises(cm.CheckpointError, match=r"__1_0\.distcp: its SHA-256 differs") as e:
        cm.verify(folder, threads=threads)
    assert f"checkpoint {folder} is damaged" in str(e.value)
    assert "--no-verify-checkpoint" in str(e.value)

    with open(target, "wb") as f:  # truncated
        f.write(original[:40000])
    with pytest.raises(cm.CheckpointError, match=r"__1_0\.distcp: 40000 bytes, the manifest "
                                                 r"says 70000 \(truncated"):
        cm.verify(folder, threads=threads)

    os.remove(target)
    os.remove(os.path.join(folder, "sub", "common.pt"))
    problems = cm.check_files(folder, cm.read_manifest(folder), threads=threads)
    assert len(problems) == 2 and all("missing" in p for p in problems)
    assert "__1_0.distcp" in problems[0] and "common.pt" in problems[1]
    with pytest.raises(cm.CheckpointError, match=r"\(and 1 more\)"):
        cm.verify(folder, threads=threads)

    with open(target, "wb") as f:  # put back: verifies again
        f.write(original)
    with open(os.path.join(folder, "sub", "common.pt"), "wb") as f:
        f.write(b"common")
    cm.verify(folder, threads=threads)


def test_no_manifest_and_a_broken_manifest(tmp_path):
    folder = str(tmp_path / "iter_0000001")
    make_checkpoint(folder)
    assert cm.verify(folder) is None
    assert "loaded unverified" in cm.unverified_note(folder)
    with open(os.path.join(folder, cm.MANIFEST), "w") as f:
        f.write('{"files": ')
    with pytest.raises(cm.CheckpointError, match=f"{cm.MANIFEST}: unreadable checksum manifest"):
        cm.verify(folder)


def test_writer_hashes_off_the_caller_thread_and_waits_for_an_async_tracker(tmp_path):
    save = str(tmp_path / "ck")
    sync_folder, async_folder = cm.iteration_dir(save, 3), cm.iteration_dir(save, 6)
    make_checkpoint(sync_folder)
    make_checkpoint(async_folder)
    lines = []
    writer = cm.ManifestWriter(log=lines.append)
    callers = []
    writer.POLL_S = 0.01
    real = cm.write_manifest

    def spy(folder, iteration):
        callers.append(threading.current_thread().name)
        return real(folder, iteration)

    cm.write_manifest = spy
    try:
        with open(os.path.join(save, cm.TRACKER), "w") as f:
            f.write("3")
        writer.submit(sync_folder, 3)
        writer.submit(async_folder, 6, save_dir=save)  # not finalized: tracker still says 3
        assert writer.wait(timeout=0.5) is False  # the asynchronous one waits for its tracker
        assert os.path.exists(os.path.join(sync_folder, cm.MANIFEST))
        assert not os.path.exists(os.path.join(async_folder, cm.MANIFEST))
        assert writer.pending() == 1
        with open(os.path.join(save, cm.TRACKER), "w") as f:
            f.write("6")
        assert writer.wait(timeout=30)
        assert cm.verify(async_folder)["iteration"] == 6
        assert callers == ["megatron-ext-manifest"] * 2
        assert len(writer.written) == 2 and "off the training thread" in lines[0]

        # an asynchronous save that is never finalized: close() stops waiting, no manifest
        never = cm.iteration_dir(save, 9)
        make_checkpoint(never)
        writer.submit(never, 9, save_dir=save)
        writer.close()
        assert not os.path.exists(os.path.join(never, cm.MANIFEST))
        assert "not finalized" in writer.errors[-1]
    finally:
        cm.write_manifest = real


def test_release_and_iteration_folders_resolve(tmp_path):
    save = tmp_path / "ck"
    make_checkpoint(str(save / "release"))
    (save / cm.TRACKER).write_text("release")
    assert cm.resolve_checkpoint_dir(str(save)) == (str(save / "release"), None)
    make_checkpoint(str(save / "iter_0000012"))
    (save / cm.TRACKER).write_text("12")
    assert cm.resolve_checkpoint_dir(str(save)) == (str(save / "iter_0000012"), 12)
    with pytest.raises(cm.CheckpointError, match="no checkpoint of iteration 5"):
        cm.resolve_checkpoint_dir(str(save), 5)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_ranks_share_the_files_once_each(world):
    sizes = [70000, 5, 5000, 12, 900, 70000, 3]
    shares = [share(sizes, r, world) for r in range(world)]
    flat = sorted(i for s in shares for i in s)
    assert flat == list(range(len(sizes)))  # every file once
    loads = [sum(sizes[i] for i in s) for s in shares]
    if world >= 2:  # the two large files go to different ranks
        assert max(loads) <= 70000 + 5000 + 900 + 12 + 5 + 3
        assert sum(1 for s in shares if 0 in s or 5 in s) == 2
