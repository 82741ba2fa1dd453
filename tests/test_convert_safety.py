"""to-hf never loses data: an --out that is, holds or lies inside --load is refused (symlinks
resolved) and the checkpoint stays as it was; --overwrite replaces only a folder an earlier
conversion wrote (its megatron_ext_conversion.json lists every file) and leaves it intact when the
new conversion fails; a read-only --out, its parent, or a mount point is refused at start, before
the checkpoint is read. Every refusal is one line on stderr and exit code 2.

On synthetic torch_dist checkpoints (tests/test_convert_plan.py: no Megatron run). The tests run
as root, where permission bits do not stop writes: /sys is the read-only place (sysfs creates no
files, even for root, while os.access says it is writable), so the probe write is what refuses it.
"""

from __future__ import annotations

import os

import pytest

from megatron_ext.convert import output, to_hf
from test_convert_plan import SHAPE, args_for, llama_tensors, write_checkpoint

RECORD = "megatron_ext_conversion.json"


def snapshot(directory) -> dict:
    """{relative path: bytes} of every file under ``directory`` (symlinks not followed)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files


def leftovers(parent) -> list:
    return [n for n in os.listdir(parent) if ".partial-" in n or ".replaced-" in n]


@pytest.fixture
def ck(tmp_path):
    return write_checkpoint(str(tmp_path / "ck"), args_for(**SHAPE), llama_tensors(**SHAPE))


@pytest.fixture
def refused(capsys):
    """``to-hf ARGS`` in-process: exit code 2 and one line on stderr, the last one, no traceback,
    nothing read from the checkpoint when ``at_start``; returns that line."""
    def run(*args, at_start=True):
        capsys.readouterr()  # what earlier calls printed
        assert to_hf.main([*args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("to-hf: error: ")]
        assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
        assert "Traceback" not in err, err
        if at_start:  # the description line follows the reading of the checkpoint's args
            assert "(iteration 7)" not in err and "match their checksums" not in err, err
        return errors[0]
    return run


def test_out_overlapping_load_is_refused_and_the_checkpoint_kept(ck, tmp_path, refused):
    """The reported loss: --load D --out D --overwrite printed "wrote D" and D's checkpoint was
    gone. Now every overlap, through symlinks too, is refused naming both paths."""
    before = snapshot(ck)
    link = tmp_path / "link"
    link.symlink_to(ck)
    iteration = os.path.join(ck, "iter_0000007")
    cases = [
        (["--load", ck, "--out", ck, "--overwrite"], f"--out {ck} is --load {ck}"),
        (["--load", ck, "--out", ck], f"--out {ck} is --load {ck}"),
        (["--load", ck, "--out", os.path.join(ck, "hf")],
         f"--out {ck}/hf lies inside --load {ck}"),
        (["--load", iteration, "--out", ck, "--overwrite"],
         f"--out {ck} holds --load {iteration}"),
        (["--load", str(link), "--out", os.path.join(ck, "hf")],
         f"--out {ck}/hf lies inside --load {link} (= {ck})"),
        (["--load", ck, "--out", str(link), "--overwrite"], f"--out {link} (= {ck}) is --load"),
    ]
    for args, message in cases:
        line = refused(*args)
        assert message in line, line
        assert snapshot(ck) == before
    assert sorted(os.listdir(tmp_path)) == ["ck", "link"]


def test_overwrite_replaces_only_an_earlier_conversion(ck, tmp_path, refused, monkeypatch):
    """--overwrite of a folder holding a file the conversion did not write, or of a folder no
    conversion wrote, is refused naming what is there; a conversion that fails midway leaves the
    earlier output as it was; one that succeeds replaces it with nothing left beside it."""
    hf = str(tmp_path / "hf")
    assert to_hf.main(["--load", ck, "--out", hf, "--no-progress"]) == 0
    first = snapshot(hf)
    assert RECORD in first

    with open(os.path.join(hf, "notes.txt"), "w") as f:
        f.write("mine")
    line = refused("--load", ck, "--out", hf, "--overwrite")
    assert f"--out {hf}: --overwrite replaces only what an earlier conversion wrote" in line
    assert "notes.txt" in line and snapshot(hf) == {**first, "notes.txt": b"mine"}
    os.remove(os.path.join(hf, "notes.txt"))

    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"x")
    line = refused("--load", ck, "--out", str(other), "--overwrite")
    assert f"--out {other}: not the output of an earlier conversion (no {RECORD}" in line
    assert "data.bin" in line and snapshot(other) == {"data.bin": b"x"}

    original = to_hf.ShardWriter.add

    def broken(self, name, tensor):  # the disk fills up after the first shard, say
        if self.files:
            raise OSError(28, "No space left on device")
        original(self, name, tensor)

    monkeypatch.setattr(to_hf.ShardWriter, "add", broken)
    line = refused("--load", ck, "--out", hf, "--overwrite", "--max-shard-size", "20KB",
                   at_start=False)
    assert "No space left on device" in line
    assert snapshot(hf) == first and leftovers(tmp_path) == []
    monkeypatch.setattr(to_hf.ShardWriter, "add", original)

    assert to_hf.main(["--load", ck, "--out", hf, "--overwrite", "--dtype", "bf16",
                       "--no-progress"]) == 0
    second = snapshot(hf)
    assert second != first and b'"bfloat16"' in second["config.json"]
    assert leftovers(tmp_path) == []
    # The new output is itself replaceable: its record lists what it wrote.
    assert to_hf.main(["--load", ck, "--out", hf, "--overwrite", "--no-progress"]) == 0
    assert snapshot(hf) == first


def test_unwritable_out_is_refused_at_start(ck, tmp_path, refused, monkeypatch):
    """/sys (no file can be created there, though os.access says yes) as --out's parent; an
    earlier output that is a mount point (renaming it aside fails with "Device or resource busy")
    or that cannot be written into (its old files could not be removed)."""
    line = refused("--load", ck, "--out", "/sys/megatron_ext_hf")
    assert line.startswith("to-hf: error: --out /sys/megatron_ext_hf: cannot write in /sys (")
    hf = str(tmp_path / "hf")
    assert to_hf.main(["--load", ck, "--out", hf, "--no-progress"]) == 0
    first = snapshot(hf)

    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: p == hf or ismount(p))
    line = refused("--load", ck, "--out", hf, "--overwrite")
    assert f"--out {hf} is a mount point" in line
    monkeypatch.setattr(os.path, "ismount", ismount)

    access = os.access  # as root only a read-only file system makes this False
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == hf else access(p, m))
    line = refused("--load", ck, "--out", hf, "--overwrite")
    assert f"--out {hf}: cannot write in {hf} (read-only file system or no permission)" in line
    assert snapshot(hf) == first and leftovers(tmp_path) == []


def test_failed_swap_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    """staged_directory with a record: the earlier folder is renamed aside, the new one renamed
    in, the earlier one removed; if renaming the new one in fails, the earlier one goes back."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    output.write_record(str(target), RECORD, {})
    before = snapshot(target)

    replace = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the new folder into place
            raise OSError(5, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(OSError, match="Input/output error"):
        with output.staged_directory(str(target), replace_record=RECORD) as tmp:
            with open(os.path.join(tmp, "b.txt"), "w") as f:
                f.write("new")
            output.write_record(tmp, RECORD, {})
    assert len(calls) == 3 and snapshot(target) == before and leftovers(tmp_path) == []

    monkeypatch.setattr(os, "replace", replace)
    with output.staged_directory(str(target), replace_record=RECORD) as tmp:
        with open(os.path.join(tmp, "b.txt"), "w") as f:
            f.write("new")
        output.write_record(tmp, RECORD, {})
    assert sorted(snapshot(target)) == ["b.txt", RECORD] and leftovers(tmp_path) == []
