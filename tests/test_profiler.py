"""``--ext-profile-all-threads`` (``megatron_ext/training/profiler.py``): the profiler Megatron
builds records the ranges and operators of every thread, not only of the thread that started it;
the flag without Megatron's PyTorch profiler is refused; without the flag upstream's profiler is
back. The end-to-end trace of a tiered STEM run: tests/test_parallel_stem_tables.py."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.profiler

from megatron_ext.training import profiler


def _ranges_of_a_side_thread(path) -> set:
    """Profile (with whatever ``torch.profiler.profile`` is now) a side thread's range and
    matmul while the main thread waits for it; the names in the exported trace."""
    go, done = threading.Event(), threading.Event()

    def side():
        go.wait()
        with torch.profiler.record_function("stem/side-range"):
            x = torch.randn(64, 64)
            (x @ x).sum()
        done.set()

    thread = threading.Thread(target=side)
    thread.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("main-range"):
            go.set()
            done.wait(timeout=30)
    thread.join()
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        return {str(e.get("name")) for e in json.load(f)["traceEvents"]}


def _args(**kw):
    base = dict(ext_profile_all_threads=True, profile=True, use_pytorch_profiler=True)
    base.update(kw)
    return SimpleNamespace(**base)


def test_every_thread_is_recorded_with_the_flag_only(tmp_path):
    try:
        assert profiler.install(_args())
        names = _ranges_of_a_side_thread(tmp_path / "all.json")
        assert {"main-range", "stem/side-range", "aten::mm"} <= names
        assert not profiler.install(_args(ext_profile_all_threads=False))
        assert torch.profiler.profile is profiler._UPSTREAM
        names = _ranges_of_a_side_thread(tmp_path / "upstream.json")
        assert "main-range" in names and "stem/side-range" not in names
    finally:
        profiler.uninstall()


@pytest.mark.parametrize("missing", ["profile", "use_pytorch_profiler"])
def test_flag_needs_megatrons_pytorch_profiler(missing):
    with pytest.raises(ValueError, match="add --profile --use-pytorch-profiler"):
        profiler.install(_args(**{missing: False}))
    assert torch.profiler.profile is profiler._UPSTREAM
