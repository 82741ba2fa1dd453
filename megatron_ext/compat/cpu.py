"""CPU backend for Megatron-Core: lets `megatron.training.pretrain` run on CPU-only machines with gloo.

Megatron-Core assumes CUDA in many places. This module is the one place where the plugin bends
those assumptions, and it is only ever installed when ``torch.cuda.is_available()`` is false:
:func:`install` is a no-op on a machine with a GPU (tested in ``tests/test_compat.py``).

Every patch is listed in :data:`PATCHES` with the reason it is needed. The approach:

* A :class:`torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` arguments (factory
  functions, ``Tensor.to``, ``Tensor.cuda``) to the CPU, which covers the hundreds of
  ``device="cuda"`` / ``torch.cuda.current_device()`` literals across megatron.
* The ``torch.cuda`` runtime API that Megatron calls (device count/selection, synchronize,
  streams, events, memory statistics, device properties, the RNG) is replaced by CPU
  equivalents. The "CUDA" RNG maps onto the CPU default generator, so Megatron's
  model-parallel RNG tracker (``tensor_parallel.random``) forks the generator that CPU dropout
  actually uses.
* A few Megatron functions are wrapped: ``initialize_megatron`` gets ``allow_no_cuda=True``,
  the JIT warm-up is skipped (nothing it compiles is used before its first call), a data
  loader's new iterator leaves the generator as it found it (the "CUDA" generator is the CPU one
  here), and the MoE dispatcher's split sizes become host lists for gloo's all-to-all.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import List

import megatron.core.tensor_parallel.mappings as mappings
import megatron.core.tensor_parallel.random as mrandom
import megatron.core.transformer.moe.moe_utils as moe_utils
import megatron.core.transformer.moe.token_dispatcher as td
import megatron.training.initialize as minit
import megatron.training.training as mtraining
import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    target: str
    reason: str


PATCHES: List[Patch] = [
    Patch("TorchFunctionMode: device='cuda' -> cpu",
          "megatron allocates with device='cuda' / torch.cuda.current_device() literals everywhere "
          "(buffers, masks, RNG, loss reductions, DDP grad buffers)."),
    Patch("Tensor.cuda", "megatron moves batches and scalars with .cuda(); on CPU it is the identity."),
    Patch("Tensor.type",
          "optimizer and clip_grads assert param.type() == 'torch.cuda.FloatTensor'; a CPU tensor "
          "reports its CUDA type name when called without arguments."),
    Patch("Tensor.record_stream / Tensor.pin_memory / pin_memory=True",
          "record_stream has no CPU meaning; pinning host memory needs a CUDA runtime, so "
          "pin_memory() is the identity and factory calls get pin_memory=False."),
    Patch("torch.cuda.device_count/current_device/set_device/synchronize/is_initialized",
          "_initialize_distributed sets the device and seeds the model-parallel RNG only when "
          "device_count() > 0; one virtual device keeps those paths alive."),
    Patch("torch.cuda.is_available -> False",
          "with PYTORCH_NVML_BASED_CUDA_CHECK=1 (which importing deepspeed sets) is_available() "
          "answers from device_count(), the stand-in above, and would report a GPU: the "
          "DataLoader then pins memory in a thread and DeepSpeed picks its CUDA accelerator."),
    Patch("torch.cuda.Stream/Event/current_stream/stream/default_stream/set_stream",
          "timers, DDP overlap and the optimizer use streams and events; on CPU all work is "
          "synchronous, so they are no-ops."),
    Patch("torch.cuda memory statistics and get_device_properties/get_device_name/get_device_capability",
          "validate_args and the training log query device properties and memory."),
    Patch("torch.cuda RNG API (get/set_rng_state, manual_seed[_all], default_generators)",
          "Megatron's CudaRNGStatesTracker forks the CUDA generator around dropout and TP-sharded "
          "initialization; mapped onto the CPU default generator."),
    Patch("megatron.core.tensor_parallel.random._set_cuda_rng_state / _get_cuda_rng_state",
          "they reach torch.cuda.default_generators through _lazy_call, which does not exist on CPU."),
    Patch("megatron.training.initialize.initialize_megatron(allow_no_cuda=True)",
          "pretrain() calls it without the flag and it asserts CUDA."),
    Patch("megatron.training.initialize._warmup_jit_function skipped",
          "it compiles bias_swiglu (or bias_gelu) and bias_dropout_add with torch.compile before "
          "training, ~1.7 s per process (2-4 s with two ranks on two cores): on the CPU the "
          "SwiGLU fusion is off (CPU_DEFAULT_FLAGS), so that compile is never used, and "
          "bias_dropout_add is compiled at its first call for the arguments the layers pass "
          "(the warm-up's bias tensor is not what a model without linear biases passes). It "
          "also drew its tensors from the 'CUDA' generator, the CPU one here, in sizes that "
          "depend on the micro-batch size and TP (a wrapper restored the state before)."),
    Patch("torch.utils.data.DataLoader.__iter__ keeps the generator state",
          "a new iterator of a data loader without a generator of its own draws its workers' base "
          "seed from the CPU generator, which here is also dropout's ('CUDA') generator. "
          "pretrain() builds the iterators after load_checkpoint restored the saved random "
          "state (with --dataloader-type cyclic, in the first step), so a resumed run's dropout "
          "started draws off the uninterrupted run's; on a GPU the draws touch only the CPU "
          "generator, which no step draws from."),
    Patch("megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
          "gloo all_to_all_single needs split sizes as host lists; the GPU path only moves "
          "tensors with is_cuda, which is false here."),
    Patch("megatron.core.tensor_parallel.mappings._gather_along_first_dim / "
          "_reduce_scatter_along_first_dim with split sizes",
          "the alltoall MoE dispatcher under TP gathers and reduce-scatters tokens in uneven "
          "per-rank chunks; gloo's all_gather needs equal sizes and gloo has no reduce_scatter. "
          "Uneven chunks are padded to the largest for the gather, and the reduce-scatter is an "
          "all-reduce of which each rank keeps its chunk (same sums)."),
    Patch("logging filter on megatron.core.tensor_parallel.random",
          "with one CPU generator, dropout inside an RNG fork changes the 'CPU' state and "
          "Megatron warns on every fork."),
]

_INSTALLED = False


def is_installed() -> bool:
    return _INSTALLED


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int) and not isinstance(device, bool):
        # torch treats a bare int device as a CUDA ordinal.
        return True
    return False


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if ("device" in kwargs and _is_cuda_device(kwargs["device"])) or kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            # Tensor.to(device, ...) / Module-style .to(device, dtype, non_blocking): only the
            # first argument after the tensor can be a device.
            args = (args[0], "cpu") + tuple(args[2:])
        elif name == "cuda":
            return args[0]
        elif name == "pin_memory" and args:
            return args[0]
        return func(*args, **kwargs)


class _FakeStream:
    """A CUDA stream stand-in: everything on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")
        self.cuda_stream = 0

    def synchronize(self):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _FakeEvent()

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self._time = time
        self._t = None

    def record(self, stream=None):
        self._t = self._time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


class _DeviceProperties:
    name = "cpu"
    major = 0
    minor = 0
    total_memory = 0
    multi_processor_count = os.cpu_count() or 1
    uuid = "cpu"


class _FakeGenerator:
    """`torch.cuda.default_generators[i]` stand-in backed by the CPU default generator."""

    def get_state(self):
        return torch.get_rng_state()

    def set_state(self, state):
        torch.set_rng_state(state)

    def manual_seed(self, seed):
        torch.default_generator.manual_seed(int(seed))
        return self

    def initial_seed(self):
        return torch.initial_seed()

    def seed(self):
        return torch.seed()


class _RngForkWarningFilter(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_saved: list = []


def _set(obj, name: str, value) -> None:
    _saved.append((obj, name, getattr(obj, name, None)))
    setattr(obj, name, value)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    _set(cuda, "device_count", lambda: 1)
    _set(cuda, "is_available", lambda: False)
    _set(cuda, "current_device", lambda: 0)
    _set(cuda, "set_device", lambda device: None)
    _set(cuda, "synchronize", lambda device=None: None)
    _set(cuda, "is_initialized", lambda: True)
    _set(cuda, "init", lambda: None)
    _set(cuda, "empty_cache", lambda: None)
    _set(cuda, "ipc_collect", lambda: None)
    _set(cuda, "Stream", _FakeStream)
    _set(cuda, "Event", _FakeEvent)
    _default_stream = _FakeStream()
    _set(cuda, "current_stream", lambda device=None: _default_stream)
    _set(cuda, "default_stream", lambda device=None: _default_stream)
    _set(cuda, "set_stream", lambda stream: None)
    _set(cuda, "stream", lambda stream=None: contextlib.nullcontext(stream))
    _set(cuda, "device", lambda device=None: contextlib.nullcontext())
    _set(cuda, "get_device_properties", lambda device=None: _DeviceProperties())
    _set(cuda, "get_device_name", lambda device=None: "cpu")
    _set(cuda, "get_device_capability", lambda device=None: (0, 0))
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        _set(cuda, stat, lambda device=None: 0)
    _set(cuda, "reset_peak_memory_stats", lambda device=None: None)
    _set(cuda, "reset_max_memory_allocated", lambda device=None: None)
    _set(cuda, "memory_stats", lambda device=None: {})
    _set(cuda, "mem_get_info", lambda device=None: (0, 0))
    # RNG: the CPU default generator plays the CUDA generator.
    get_state = lambda device="cuda": torch.get_rng_state()  # noqa: E731
    set_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)  # noqa: E731
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly.
    seed_fn = lambda seed: torch.default_generator.manual_seed(int(seed)) and None  # noqa: E731
    for mod in (cuda, cuda.random):
        _set(mod, "get_rng_state", get_state)
        _set(mod, "set_rng_state", set_state)
        _set(mod, "manual_seed", seed_fn)
        _set(mod, "manual_seed_all", seed_fn)
        _set(mod, "get_rng_state_all", lambda: [torch.get_rng_state()])
        _set(mod, "set_rng_state_all", lambda states: torch.set_rng_state(states[0]))
    _set(cuda, "default_generators", (_FakeGenerator(),))


def _patch_tensor() -> None:
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original_type(self, dtype, non_blocking, **kwargs)

    _set(torch.Tensor, "type", type_)
    # record_stream parses its stream argument (a torch.Stream; here a _FakeStream) before any
    # TorchFunctionMode sees the call, so the mode cannot make it a no-op: "unknown parameter
    # type" (tests/test_compat.py, test_every_listed_patch_is_in_effect).
    _set(torch.Tensor, "record_stream", lambda self, stream: None)


def _patch_data_loader() -> None:
    """A data loader's new iterator leaves the CPU generator as it found it (``PATCHES``: that
    generator is dropout's here)."""
    original_iter = torch.utils.data.DataLoader.__iter__

    @functools.wraps(original_iter)
    def data_loader_iter(self):
        if self.generator is not None:  # its seed comes from its own generator
            return original_iter(self)
        state = torch.get_rng_state()
        try:
            return original_iter(self)
        finally:
            torch.set_rng_state(state)

    _set(torch.utils.data.DataLoader, "__iter__", data_loader_iter)


def _patch_megatron() -> None:
    _set(mrandom, "_set_cuda_rng_state",
         lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    _set(mrandom, "_get_cuda_rng_state",
         lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    logging.getLogger(mrandom.__name__).addFilter(_RngForkWarningFilter())

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    _set(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _patch_uneven_sequence_parallel_collectives()
    _set(td, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    original_init = minit.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    _set(minit, "initialize_megatron", initialize_megatron)
    _set(mtraining, "initialize_megatron", initialize_megatron)

    @functools.wraps(minit._warmup_jit_function)
    def warmup_jit_function(*args, **kwargs):
        """Nothing to warm up on the CPU (``PATCHES``): the fusions compile at first use."""

    _set(minit, "_warmup_jit_function", warmup_jit_function)


def _patch_uneven_sequence_parallel_collectives() -> None:
    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(output_split_sizes)
        padded = input_.new_zeros((rows,) + tuple(input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None,
                                       use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[:group.rank()])
        return total[start:start + input_split_sizes[group.rank()]].clone()

    _set(mappings, "_gather_along_first_dim", gather_along_first_dim)
    _set(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_along_first_dim)


_mode: _CudaToCpuMode | None = None

# Megatron flags a CPU run needs, given by default when the CPU backend is active (no CUDA); a
# flag the user gives wins. (flag, value or None, the flags that count as the user's choice)
CPU_DEFAULT_FLAGS = [
    ("--distributed-backend", "gloo", ("--distributed-backend",)),  # NCCL needs GPUs
    ("--use-cpu-initialization", None, ("--use-cpu-initialization",)),
    # Fused CUDA kernels (Apex / Transformer Engine / nvFuser): the unfused paths compute the same.
    ("--no-gradient-accumulation-fusion", None, ("--no-gradient-accumulation-fusion",)),
    ("--no-masked-softmax-fusion", None, ("--no-masked-softmax-fusion",)),
    ("--no-bias-swiglu-fusion", None, ("--no-bias-swiglu-fusion",)),
    ("--no-rope-fusion", None, ("--no-rope-fusion",)),
    # Megatron-FSDP divides gradients inside the reduction with NCCL's PREMUL_SUM, which gloo
    # refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); without the fusion it scales the
    # gradients, then sums (megatron_fsdp/param_and_grad_buffer.py gradient_reduce_preprocessing,
    # the path bf16 gradients take on a GPU too). DDP does not read the flag.
    ("--no-gradient-reduce-div-fusion", None, ("--no-gradient-reduce-div-fusion",)),
]


def default_flags(argv: List[str]) -> tuple:
    """``argv`` with the CPU backend's defaults added where the user gave none (only while the
    backend is installed: never with CUDA), and the flags added."""
    if not _INSTALLED:
        return list(argv), []
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    added: List[str] = []
    for flag, value, choices in CPU_DEFAULT_FLAGS:
        if not given.intersection(choices):
            added += [flag] if value is None else [flag, value]
    return list(argv) + added, added


@contextlib.contextmanager
def grouped_gemm_validation():
    """Inside: the device reports compute capability (8, 0), not the backend's (0, 0), while
    Megatron validates the flags. ``validate_args`` asserts capability >= 8 for
    ``--moe-grouped-gemm`` (its only reading of the capability), a check for the CUDA
    grouped-GEMM kernels of Transformer Engine and ``grouped_gemm``; on the CPU the flag builds
    the torch grouped experts (``models/grouped_experts.py``), which need none, and a dry run
    (``training/dry_run.py``, with or without this backend installed) plans for GPUs it does not
    have. With CUDA present: nothing (the device's own capability is checked)."""
    if torch.cuda.is_available():
        yield
        return
    reported = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (8, 0)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = reported


def install() -> bool:
    """Install the CPU backend if (and only if) CUDA is unavailable. Returns whether it is active."""
    global _INSTALLED, _mode
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    _patch_tensor()
    _patch_data_loader()
    _patch_megatron()
    _mode = _CudaToCpuMode()
    _mode.__enter__()
    _INSTALLED = True
    logger.info("megatron_ext CPU backend installed (%d patches)", len(PATCHES))
    return True
