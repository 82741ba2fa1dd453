"""The JIT-built CPU extensions' build folder (``kernels/_build_dir.py``): one per
virtualenv, torch version and CPU unless the user chose one."""

import os

import pytest

from megatron_ext_kernels import _build_dir, row_adam_cpu

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu sse avx2 avx512f

processor\t: 1
model name\t: Some Other CPU
flags\t\t: fpu sse
"""


def test_cpu_signature_reads_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    sig = _build_dir.cpu_signature(str(path))
    assert "Intel(R) Xeon(R) CPU @ 2.20GHz" in sig and "avx512f" in sig
    assert "Some Other CPU" not in sig
    assert _build_dir.cpu_signature(str(tmp_path / "missing"))  # falls back to platform


def test_root_is_keyed_by_prefix_and_cpu_and_respects_the_users_choice(tmp_path):
    env = {}
    a = _build_dir.build_root(env, prefix=str(tmp_path / "venv_a"), cpu="x")
    assert a == _build_dir.build_root(env, prefix=str(tmp_path / "venv_a"), cpu="x")
    assert a != _build_dir.build_root(env, prefix=str(tmp_path / "venv_b"), cpu="x")
    assert a != _build_dir.build_root(env, prefix=str(tmp_path / "venv_a"), cpu="y")
    # a virtualenv reached through a symlink (a worktree's .venv) is the same virtualenv
    (tmp_path / "venv_a").mkdir()
    os.symlink(tmp_path / "venv_a", tmp_path / "link")
    assert a == _build_dir.build_root(env, prefix=str(tmp_path / "link"), cpu="x")
    assert _build_dir.build_root({"TORCH_EXTENSIONS_DIR": "/chosen"}, cpu="x") == "/chosen"


@pytest.mark.parametrize("before", [None, "/users/own"])
def test_build_environment_sets_and_restores_the_variable(monkeypatch, tmp_path, before):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if before is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        with _build_dir.build_environment() as root:
            assert os.environ["TORCH_EXTENSIONS_DIR"] == root
            assert root.startswith(str(tmp_path)) and os.path.isdir(root)
        assert "TORCH_EXTENSIONS_DIR" not in os.environ
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", before)
        with _build_dir.build_environment() as root:
            assert root == before
        assert os.environ["TORCH_EXTENSIONS_DIR"] == before


def test_the_row_kernels_are_built_in_that_folder():
    kernels = row_adam_cpu.load()
    if kernels is None:
        pytest.skip("no compiler for the row kernels here")
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        pytest.skip("the user chose the build folder")
    assert os.path.dirname(os.path.dirname(kernels.path)) == _build_dir.build_root()
