"""The CPU backend: active without CUDA, never installed when CUDA is present."""

from __future__ import annotations

import json
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


# What each entry of cpu.PATCHES promises, as code that fails before install() and passes after it
# (keyed by the start of the entry's target). Stand-ins replace the Megatron functions that the
# backend wraps (set before install, so it wraps them): their wrapping is what is checked.
PATCH_CHECKS = {
    "TorchFunctionMode": "assert torch.zeros(1, device='cuda').device.type == 'cpu'\n"
                         "assert torch.ones(1).to('cuda:0').device.type == 'cpu'",
    "Tensor.cuda": "assert torch.ones(1).cuda().device.type == 'cpu'",
    "Tensor.type": "assert torch.ones(1).type() == 'torch.cuda.FloatTensor'\n"
                   "assert torch.ones(1).type(torch.float64).dtype == torch.float64",
    "Tensor.record_stream": "t = torch.ones(2)\nassert t.pin_memory() is t\n"
                            "assert not torch.empty(2, pin_memory=True).is_pinned()\n"
                            "assert t.record_stream(None) is None",
    "torch.cuda.device_count": "assert torch.cuda.device_count() == 1\n"
                               "assert torch.cuda.current_device() == 0\n"
                               "torch.cuda.set_device(0); torch.cuda.synchronize()\n"
                               "assert torch.cuda.is_initialized()",
    # With NVML's check (set by importing deepspeed) is_available() asks device_count(), which the
    # backend makes 1: false before install (no GPU), and must stay false after it.
    "torch.cuda.is_available": "os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'\n"
                               "assert torch.cuda.is_available() is False",
    "torch.cuda.Stream": "s = torch.cuda.Stream(); e = torch.cuda.Event(); e.record()\n"
                         "s.wait_event(e); torch.cuda.current_stream().wait_stream(s)\n"
                         "torch.cuda.set_stream(torch.cuda.default_stream())\n"
                         "with torch.cuda.stream(s): pass\nassert e.query() and s.query()",
    "torch.cuda memory": "assert torch.cuda.max_memory_allocated() == 0\n"
                         "assert torch.cuda.memory_reserved() == 0\n"
                         "assert torch.cuda.get_device_properties(0).total_memory == 0\n"
                         "assert torch.cuda.get_device_name() == 'cpu'\n"
                         "assert torch.cuda.get_device_capability() == (0, 0)",
    "torch.cuda RNG": "torch.cuda.manual_seed(3); a = torch.rand(2)\n"
                      "torch.cuda.set_rng_state(torch.cuda.get_rng_state())\n"
                      "torch.default_generator.manual_seed(3); assert torch.equal(a, torch.rand(2))\n"
                      "g = torch.cuda.default_generators[0]; s = g.get_state(); b = torch.rand(1)\n"
                      "g.set_state(s); assert torch.equal(b, torch.rand(1))",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state":
        "s = mrandom._get_cuda_rng_state(); a = torch.rand(2)\n"
        "mrandom._set_cuda_rng_state(s); assert torch.equal(a, torch.rand(2))",
    "megatron.training.initialize.initialize_megatron":
        "seen.clear(); mtraining.initialize_megatron(); minit.initialize_megatron()\n"
        "assert seen == [{'allow_no_cuda': True}] * 2",
    "megatron.training.initialize._warmup_jit_function":
        "warmed.clear(); s = torch.get_rng_state(); minit._warmup_jit_function()\n"
        "assert warmed == [] and torch.equal(s, torch.get_rng_state())",
    "torch.utils.data.DataLoader.__iter__":
        "s = torch.get_rng_state(); iter(torch.utils.data.DataLoader(range(4)))\n"
        "assert torch.equal(s, torch.get_rng_state())",
    "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu":
        "import numpy\nfor f in (moe_utils.maybe_move_tensor_to_cpu, td.maybe_move_tensor_to_cpu):\n"
        "    assert isinstance(f(torch.ones(2), as_numpy=True), numpy.ndarray)",
    "megatron.core.tensor_parallel.mappings._gather_along_first_dim":
        "assert mappings._gather_along_first_dim is not ORIGINAL['gather']\n"
        "assert mappings._reduce_scatter_along_first_dim is not ORIGINAL['reduce_scatter']",
    "logging filter": "r = logging.LogRecord(mrandom.__name__, logging.WARNING, '', 0, "
                      "'CPU RNG state changed within GPU RNG context', None, None)\n"
                      "assert not logging.getLogger(mrandom.__name__).filter(r)",
}


def _check_of(patch):
    keys = [k for k in PATCH_CHECKS if patch.target.startswith(k)]
    assert len(keys) == 1, f"no check (or several) for the CPU patch {patch.target!r}"
    return keys[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is for CPU-only machines")
def test_every_listed_patch_is_in_effect():
    """Each entry of ``PATCHES`` (with its reason) describes what ``install()`` changes: its
    check passes in a fresh interpreter after ``install()``, and fails before it (but the one
    that keeps an answer the stand-ins would change)."""
    assert all(p.target and p.reason for p in cpu.PATCHES)
    keys = [_check_of(p) for p in cpu.PATCHES]
    assert sorted(keys) == sorted(PATCH_CHECKS)  # no check for a patch that is gone
    stdout = run_python(f"""
        import json, logging, os, torch
        import megatron.core.tensor_parallel.mappings as mappings
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.moe.token_dispatcher as td
        import megatron.training.initialize as minit
        import megatron.training.training as mtraining
        seen = []
        minit.initialize_megatron = mtraining.initialize_megatron = \\
            lambda *a, **k: seen.append(k)
        warmed = []  # the stand-in warm-up's calls (each draws, as upstream's does)
        minit._warmup_jit_function = lambda *a, **k: warmed.append(torch.rand(3))
        ORIGINAL = {{"gather": mappings._gather_along_first_dim,
                    "reduce_scatter": mappings._reduce_scatter_along_first_dim}}
        checks = {PATCH_CHECKS!r}

        def passes(code):
            env = dict(os.environ)
            try:
                exec(code, dict(globals()))
                return True
            except Exception:
                return False
            finally:
                os.environ.clear(); os.environ.update(env)

        before = {{k: passes(c) for k, c in checks.items()}}
        from megatron_ext.compat import cpu
        assert cpu.install()
        after = {{k: passes(c) for k, c in checks.items()}}
        print(json.dumps({{"before": before, "after": after}}))
    """)
    result = json.loads(stdout.strip().splitlines()[-1])
    assert [k for k, ok in result["after"].items() if not ok] == [], result
    # Only the check of a patch that keeps a CPU machine's answer holds before install().
    assert [k for k, ok in result["before"].items() if ok] == ["torch.cuda.is_available"]


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
                     "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                     "--no-gradient-reduce-div-fusion"]
    assert argv == ["--num-layers", "2", "--distributed-backend=nccl", "--no-rope-fusion", *added]
    _, added = cpu.default_flags([])
    assert added[:2] == ["--distributed-backend", "gloo"] and len(added) == 8
    monkeypatch.setattr(cpu, "_INSTALLED", False)
    assert cpu.default_flags(["--seed", "1"]) == (["--seed", "1"], [])
