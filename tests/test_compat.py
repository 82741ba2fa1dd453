"""The CPU backend: active without CUDA, never installed when CUDA is present."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_ext.compat import cpu


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_every_patch_has_a_reason():
    assert len(cpu.PATCHES) >= 10
    assert all(p.target and len(p.reason) > 20 for p in cpu.PATCHES)


def test_inert_when_cuda_is_available():
    # A fresh interpreter where CUDA reports available: install() must change nothing.
    stdout = run_python("""
        import torch
        torch.cuda.is_available = lambda: True
        before = (torch.cuda.device_count, torch.cuda.current_device, torch.Tensor.type,
                  torch.cuda.get_rng_state, torch.cuda.Stream)
        import megatron.core.tensor_parallel.random as r
        set_state = r._set_cuda_rng_state
        from megatron_ext.compat import cpu
        assert cpu.install() is False
        assert not cpu.is_installed()
        after = (torch.cuda.device_count, torch.cuda.current_device, torch.Tensor.type,
                 torch.cuda.get_rng_state, torch.cuda.Stream)
        assert before == after
        assert r._set_cuda_rng_state is set_state
        assert torch._C._is_torch_function_mode_enabled() is False or \
            torch.overrides._get_current_function_mode() is None
        print("INERT")
    """)
    assert "INERT" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_not_installed_on_a_gpu_machine():
    assert cpu.install() is False
    assert not cpu.is_installed()
    assert torch.zeros(1, device="cuda").is_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is for CPU-only machines")
def test_active_without_cuda():
    stdout = run_python("""
        import torch
        from megatron_ext.compat import cpu
        assert cpu.install() is True and cpu.is_installed()
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda:0").device.type == "cpu"
        assert torch.ones(2).to(torch.device("cuda"), None, False).device.type == "cpu"
        assert torch.ones(2).to(torch.float64, False).dtype == torch.float64  # bool is no device
        assert torch.empty(4, pin_memory=True).device.type == "cpu"
        assert torch.ones(2).pin_memory().device.type == "cpu"
        m = torch.nn.Linear(2, 2).to(torch.device("cuda"))
        assert m.weight.device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.cuda.device_count() == 1
        # The 'CUDA' RNG is the CPU generator: forking it changes what CPU dropout draws.
        from megatron.core import tensor_parallel
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(1); a = torch.rand(4)
        torch.manual_seed(1)
        with tracker.fork():
            b = torch.rand(4)
        c = torch.rand(4)
        assert not torch.equal(a, b) and torch.equal(a, c)
        print("ACTIVE")
    """)
    assert "ACTIVE" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is for CPU-only machines")
@pytest.mark.multirank
def test_initial_weights_do_not_depend_on_the_micro_batch_size(tmp_path):
    """Same global batch (8 sequences) as 4 micro-batches of 2 or 2 of 4: the first loss is the
    loss of the same initial model on the same tokens (Megatron's JIT warm-up draws tensors of
    micro-batch size from the generator the CPU backend maps 'CUDA' onto)."""
    from multirank import TINY_GPT, require_ok, torchrun

    flags = TINY_GPT + ["--train-iters", "2"]
    two = require_ok(torchrun("mbs2", str(tmp_path), flags, nproc=1))
    four = require_ok(torchrun("mbs4", str(tmp_path), flags + ["--micro-batch-size", "4"],
                               nproc=1))
    assert abs(two.losses[1] - four.losses[1]) <= 1e-5


def test_cpu_defaults_fill_only_what_the_user_left_out(monkeypatch):
    """Without CUDA the entry point adds the CPU backend's flags (gloo, CPU initialization, no
    fused kernels) that the command line lacks; a flag the user gives wins; with the backend not
    installed (a CUDA machine) nothing is added."""
    monkeypatch.setattr(cpu, "_INSTALLED", True)
    argv, added = cpu.default_flags(["--num-layers", "2", "--distributed-backend=nccl",
                                     "--no-rope-fusion"])
    assert added == ["--use-cpu-initialization", "--no-gradient-accumulation-fusion",
                     "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion"]
    assert argv == ["--num-layers", "2", "--distributed-backend=nccl", "--no-rope-fusion", *added]
    _, added = cpu.default_flags([])
    assert added[:2] == ["--distributed-backend", "gloo"] and len(added) == 7
    monkeypatch.setattr(cpu, "_INSTALLED", False)
    assert cpu.default_flags(["--seed", "1"]) == (["--seed", "1"], [])
