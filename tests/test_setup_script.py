"""``scripts/setup.sh`` stops with pip's own error when an install fails (each install ended in
``| grep -v ... || true`` before, so a failed install went on and a missing optional package
turned its tests into skips).

The script runs on a copy of itself whose ``.venv/bin/python`` is a stub: ``-m pip`` plays pip
(logging its arguments, failing for the install named in ``FAIL_ON``), ``-c`` succeeds. Nothing
is installed and nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STUB_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$PIP_LOG"
  case "$*" in
    *"$FAIL_ON"*) echo "ERROR: No matching distribution found for bogus-requirement==0"; exit 1;;
  esac
  [ -n "$PIP_WARNS" ] && echo "WARNING: Location 'x' is ignored"
  exit 0
fi
case "$2" in *"$FAIL_IMPORT"*) echo "ModuleNotFoundError" >&2; exit 1;; esac
echo "python 3.12.1 torch stub megatron-core stub"
"""


def run_setup(tmp_path, fail_on="no install fails", pip_warns=False,
              fail_import="no import fails"):
    (tmp_path / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "pip.log"
    log.write_text("")
    env = dict(os.environ, PIP_LOG=str(log), FAIL_ON=fail_on, FAIL_IMPORT=fail_import,
               PIP_WARNS="1" if pip_warns else "")
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=60, env=env)
    return proc, log.read_text().splitlines()


@pytest.mark.parametrize("fail_on", ["-r requirements.txt", "-e ."])
def test_a_failed_install_stops_the_setup_with_pips_error(tmp_path, fail_on):
    proc, calls = run_setup(tmp_path, fail_on=fail_on)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ERROR: No matching distribution found for bogus-requirement==0" in proc.stdout
    assert "[setup] failed: pip install" in proc.stderr and fail_on in proc.stderr
    assert "[setup] ok" not in proc.stdout
    assert fail_on in calls[-1]  # nothing installed after the failure


def test_a_quiet_install_passes_and_warnings_are_filtered(tmp_path):
    """pip -q prints nothing (grep then exits 1, which must not fail the setup); pip's
    "WARNING: Location" lines stay filtered out."""
    for quiet in (True, False):
        proc, calls = run_setup(tmp_path / str(quiet), pip_warns=not quiet)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "[setup] ok" in proc.stdout and "WARNING: Location" not in proc.stdout
        assert [c.split()[-1] for c in calls] == ["requirements.txt", "."]


def test_the_kernels_import_name_is_checked_after_the_install(tmp_path):
    """The kernels' folder is kernels/, importable as megatron_ext_kernels only through the
    install's package_dir mapping (the checkout has no folder of that name): a setup whose
    install does not map it stops with one line instead of saying ok."""
    proc, calls = run_setup(tmp_path, fail_import="import megatron_ext_kernels")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[setup] failed: import megatron_ext_kernels" in proc.stderr
    assert "[setup] ok" not in proc.stdout
    assert calls[-1].split()[-1] == "."  # after the editable install
