"""MoE experts as grouped GEMMs without Transformer Engine (``--moe-grouped-gemm`` on the local
backend).

Extends upstream's ``megatron.core.transformer.moe.experts.TEGroupedMLP``: its ``linear_fc1`` and
``linear_fc2`` are built through the ``GroupedLinearFc1Builder``/``GroupedLinearFc2Builder``
protocols (``forward(x, tokens_per_expert: list[int]) -> (out, bias)``, ``backward_dw()``), which
upstream fills with Transformer Engine's ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``. Without TE (our GPU machines have none, nor the ``grouped_gemm``
package) upstream's local spec builds ``SequentialMLP`` instead, whatever the flag says: one small
GEMM per expert and direction. Here the two linears are PyTorch's grouped GEMM
(``torch._grouped_mm``, the kernel torchtitan trains MoE with), with a per-expert ``torch.mm``
loop of the same math where it cannot run; TEGroupedMLP around them (activation, probabilities,
recompute) is upstream's, unchanged.

Each linear holds one stacked weight ``[local experts, out, in]`` (each expert's slice is the
``nn.Linear`` layout ``SequentialMLP``'s ``ColumnParallelLinear``/``RowParallelLinear`` hold), so
no forward copies the experts' weights into a stack. As upstream's expert linears with
``explicit_expert_comm``, there is no communication inside: the dispatcher moves the tokens;
fc1 is column-parallel over the expert-TP group (its output split), fc2 row-parallel (its input
split). The checkpoint is ``SequentialMLP``'s, key for key and offset for offset
(``sharded_state_dict``), so a checkpoint saved with sequential experts loads into grouped ones
and back, optimizer state included, and ``checkpoint_reader``/the converters read it unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.utils import (
    cat_with_oom_fallback,
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide, get_pg_rank, get_pg_size

from megatron_ext.models.log import print_rank_0

GEMM_CHOICES = ("auto", "grouped_mm", "loop")
# torch's grouped GEMM (2.8 on; ``torch.nn.functional.grouped_mm`` is its public name from 2.10).
_GROUPED_MM = getattr(torch, "_grouped_mm", None)
# The kernel reads its operands with TMA: every row stride a multiple of 16 bytes (torch checks
# it on the CPU too: "strides should be multiple of 16 bytes").
_ALIGN_BYTES = 16


def unsupported(cfg) -> Optional[str]:
    """Why the grouped experts cannot build a model of ``cfg`` (Megatron's args or a
    ``TransformerConfig``: the same attribute names), in one line naming the flag; None when
    they can."""
    why = None
    if getattr(cfg, "fp8", None):
        why = f"--fp8-format {cfg.fp8} (FP8 needs Transformer Engine's grouped linears)"
    elif getattr(cfg, "fp4", None):
        why = f"--fp4-format {cfg.fp4} (FP4 needs Transformer Engine's grouped linears)"
    elif getattr(cfg, "add_bias_linear", False):
        why = "expert biases (drop --add-bias-linear, or give --disable-bias-linear)"
    elif getattr(cfg, "delay_wgrad_compute", False):
        why = "--delay-wgrad-compute (a Transformer Engine feature)"
    elif getattr(cfg, "overlap_dispatch_backward_with_experts_wgrad", False):
        why = "--overlap-dispatch-backward-with-experts-wgrad (needs delayed weight gradients)"
    elif getattr(cfg, "moe_latent_size", None) is not None:
        why = f"--moe-latent-size {cfg.moe_latent_size}"
    elif getattr(cfg, "moe_mlp_glu_interleave_size", None) is not None:
        # An interleaved fc1 would not be SequentialMLP's [gate; up] layout the checkpoint keeps.
        why = f"--moe-mlp-glu-interleave-size {cfg.moe_mlp_glu_interleave_size}"
    elif getattr(cfg, "fine_grained_activation_offloading", False) and \
            "expert_fc1" in (getattr(cfg, "offload_modules", None) or ()):
        why = "--offload-modules expert_fc1 (keeps TE's original input)"
    if why is None:
        return None
    return (f"--moe-grouped-gemm without Transformer Engine builds torch grouped-GEMM experts "
            f"(megatron_ext/models/grouped_experts.py), which do not support {why}; drop "
            "--moe-grouped-gemm for sequential experts")


def grouped_experts_builder(gemm: str = "auto"):
    """The experts builder (``MoESubmodules.experts``): upstream's ``TEGroupedMLP`` over our
    grouped linears. ``gemm``: ``auto`` (grouped_mm where it runs, else the loop), or one of the
    two paths forced (tests, benchmarks)."""
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"grouped experts gemm={gemm!r}: choose one of {', '.join(GEMM_CHOICES)}")
    return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=functools.partial(GroupedColumnLinear, gemm=gemm),
        linear_fc2=functools.partial(GroupedRowLinear, gemm=gemm)))


@functools.lru_cache(maxsize=None)  # each distinct line once per process
def _say_once(line: str) -> None:
    print_rank_0(f"megatron-ext: {line}")


@functools.lru_cache(maxsize=None)  # one check per dtype and process
def _cpu_grouped_mm_works(dtype: torch.dtype) -> bool:
    """torch's grouped GEMM runs on the CPU in ``dtype``, forward and backward, with an empty
    group, and agrees with ``torch.mm`` (torch 2.14 does; earlier CPU builds may lack the
    kernel). On the CPU a failure is an exception, caught here; on CUDA a kernel's failure is a
    device-side assert that ends the process, so CUDA is decided from torch's source instead
    (``grouped_mm_problem``)."""
    if _GROUPED_MM is None:
        return False
    counts = [3, 0, 5]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 8, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), 8, 8, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(sum(counts), 8, generator=g).to(dtype)
    try:
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out = _GROUPED_MM(x, w.transpose(1, 2), offs=offs)
        out.backward(grad)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref_x = x.detach().clone().requires_grad_()
    ref_w = w.detach().clone().requires_grad_()
    ref = torch.cat([xe @ ref_w[e].t() for e, xe in enumerate(ref_x.split(counts))])
    ref.backward(grad)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    return all(torch.allclose(a.float(), b.float(), **tol)
               for a, b in ((out, ref), (x.grad, ref_x.grad), (w.grad, ref_w.grad)))


def grouped_mm_problem(x: torch.Tensor, weight: torch.Tensor,
                       counts: Sequence[int]) -> Optional[str]:
    """Why torch's grouped GEMM cannot run ``x`` (tokens sorted by expert, ``counts`` per expert)
    through ``weight`` ``[experts, out, in]``, in a few words; None when it can.

    What torch (2.11 on our GPU machines, the same code through 2.14) does on CUDA, from
    ``aten/src/ATen/native/cuda/GroupedBlas.cpp``: its CUTLASS grouped kernel runs for bf16 on
    sm90 and sm100 only; any other dtype or device it computes by a per-group loop after copying
    the offsets to the host (a synchronisation per GEMM), so our own loop, which has the counts
    on the host already, is no slower there. Token groups need no padding: an expert's rows
    start at ``offset * in`` elements, 16-byte aligned when ``in`` is, and the weight-gradient
    GEMM torch's backward issues (column-major grad^T times row-major input) accepts empty and
    unaligned groups (``GroupMMCommon.cuh``). On sm100 an empty group got wrong (non-zero)
    weight gradients (pytorch/pytorch#172439, open), so there a call with an empty expert loops.
    """
    if _GROUPED_MM is None:
        return f"torch {torch.__version__} has no _grouped_mm"
    if sum(counts) == 0:
        # No token at all (an EP rank's experts can get none): the loop's empty GEMMs still give
        # every weight its (zero) gradient; torch refuses a zero-length contraction dimension.
        return "no tokens in this call"
    size = x.element_size()
    out_features, in_features = weight.shape[1], weight.shape[2]
    if (in_features * size) % _ALIGN_BYTES or (out_features * size) % _ALIGN_BYTES:
        return (f"rows of {in_features} and {out_features} {x.dtype} values are not multiples "
                f"of {_ALIGN_BYTES} bytes")
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            return f"{x.dtype} on CUDA (torch's grouped kernel is bf16; it loops otherwise)"
        major = torch.cuda.get_device_capability(x.device)[0]
        if major == 10 and 0 in counts:
            return "an expert without tokens on sm100 (pytorch/pytorch#172439)"
        if major not in (9, 10):
            return f"sm{major}x (torch's grouped kernel is sm90/sm100; it loops otherwise)"
        return None
    if not _cpu_grouped_mm_works(x.dtype):
        return f"this torch's CPU grouped_mm fails its check in {x.dtype}"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous, freshly aligned gradient: torch's grouped
    GEMM backward refuses an expanded one (``loss.sum()``'s stride-0 gradient: "Invalid
    strides/sizes") and needs 16-byte aligned rows."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if grad.data_ptr() % _ALIGN_BYTES:
            grad = grad.clone()
        return grad


def _offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """Each expert's end row, int32, on ``device``: from pinned memory without waiting on a
    GPU (a pageable host-to-device copy would synchronise the stream)."""
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if device.type != "cuda":
        return ends
    return ends.pin_memory().to(device, non_blocking=True)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
                   gemm: str = "auto") -> tuple:
    """``x`` (rows sorted by expert, ``counts`` per expert) times each expert's ``weight[e]``
    transposed: ``(out, path)``, ``path`` the GEMM that ran and why (``grouped_mm``, or ``loop``
    with its reason)."""
    problem = grouped_mm_problem(x, weight, counts) if gemm != "loop" else "forced"
    if gemm == "grouped_mm" and problem is not None:
        raise RuntimeError(f"grouped experts: torch grouped_mm cannot run this call: {problem}")
    if problem is None:
        x = x.contiguous()
        if x.data_ptr() % _ALIGN_BYTES:
            x = x.clone()
        out = _GROUPED_MM(x, weight.transpose(1, 2), offs=_offsets(counts, x.device))
        return _ContiguousGrad.apply(out), "grouped_mm"
    # The reference: SequentialMLP's math, expert by expert (its linears' F.linear).
    parts = [torch.mm(xe, weight[e].t()) for e, xe in enumerate(torch.split(x, list(counts)))]
    out = torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])
    return out, f"loop ({problem})"


class GroupedLinear(torch.nn.Module):
    """The experts' fc1 or fc2 as one grouped GEMM over a stacked weight ``[E_local, out, in]``
    (upstream's ``TEGroupedLinear`` without Transformer Engine). ``parallel_mode``: ``column``
    (fc1: output split over the expert-TP group) or ``row`` (fc2: input split)."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *,
                 parallel_mode: str, config, init_method: Callable, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 name: Optional[str] = None, gemm: str = "auto"):
        super().__init__()
        # TEGroupedMLP asks for biases exactly when the config has them: the config says it all.
        problem = unsupported(config)
        if problem:
            raise ValueError(problem)
        if not is_expert:
            raise ValueError("grouped linears are expert linears (is_expert=True)")
        if gemm not in GEMM_CHOICES:
            raise ValueError(f"grouped experts gemm={gemm!r}: choose one of "
                             f"{', '.join(GEMM_CHOICES)}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.config = config
        self.gemm = gemm
        self.parallel_mode = parallel_mode
        self.num_local_experts = num_local_experts
        self._tp_group = pg_collection.expt_tp
        self._ep_group = pg_collection.ep
        self._expt_dp_group = pg_collection.expt_dp
        tp_size, tp_rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)
        # As ColumnParallelLinear/RowParallelLinear with is_expert: the expert-TP split.
        if parallel_mode == "column":
            out_local, in_local, partition_dim = divide(output_size, tp_size), input_size, 0
        elif parallel_mode == "row":
            out_local, in_local, partition_dim = output_size, divide(input_size, tp_size), 1
        else:
            raise ValueError(f"parallel_mode={parallel_mode!r}: column or row")
        self.in_features, self.out_features = in_local, out_local
        # The checkpoint's TP axis within one expert's [out, in] (SequentialMLP's linears').
        self._tp_axis = partition_dim
        # fc1 of a gated unit holds [gate; up] halves per TP shard: SequentialMLP's MLP saves it
        # through upstream's apply_swiglu_sharded_factory, and so does this linear.
        self._swiglu = parallel_mode == "column" and bool(config.gated_linear_unit)

        dtype = config.params_dtype
        if config.use_cpu_initialization:
            self.weight = torch.nn.Parameter(
                torch.empty(num_local_experts, out_local, in_local, dtype=dtype))
        else:
            self.weight = torch.nn.Parameter(torch.empty(
                num_local_experts, out_local, in_local, device=torch.cuda.current_device(),
                dtype=dtype))
        if config.perform_initialization:
            self._initialize(init_method, output_size, input_size, partition_dim, tp_rank,
                             tp_size)
        # Upstream's expert-parameter attributes (TE's _set_expert_parameter_attributes): split
        # over the expert-TP group (every shard counts in the gradient norm), reduced over the
        # expert-data-parallel group by DDP where EP or an expert-TP of its own is used.
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True,
                                             dim=partition_dim + 1, stride=1)
        use_expert_pgs = config.expert_model_parallel_size > 1 or \
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        self.weight.allreduce = not use_expert_pgs
        self.last_path: Optional[str] = None
        self._register_load_state_dict_pre_hook(self._drop_per_expert_extra_states,
                                                with_module=True)

    def _initialize(self, init_method, output_size, input_size, partition_dim, tp_rank,
                    tp_size) -> None:
        """Each expert as SequentialMLP's linear initializes its own: the same ``init_method``
        on a 2-D ``[out, in]`` (fan-based methods see an expert's shape), on the CPU from the full
        master weight split over expert-TP (``_initialize_affine_weight_cpu``), on a GPU under the
        expert-parallel RNG (``_initialize_affine_weight_gpu``'s ``is_expert`` fork). Same
        distribution; not the same draws, which SequentialMLP interleaves fc1 and fc2 of each
        expert."""
        per_partition = self.out_features if partition_dim == 0 else self.in_features
        if self.config.use_cpu_initialization:
            for expert in self.weight.data:
                _initialize_affine_weight_cpu(
                    expert, output_size, input_size, per_partition, partition_dim, init_method,
                    rank=tp_rank, world_size=tp_size, skip_set_tensor_parallel_attributes=True)
            return
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for expert in self.weight.data:
                init_method(expert)

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int]):
        out, path = grouped_linear(x, self.weight, tokens_per_expert, self.gemm)
        if path != self.last_path:
            linear = "fc1" if self.parallel_mode == "column" else "fc2"
            _say_once(f"grouped experts, {linear}: {path}")
            self.last_path = path
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (``--delay-wgrad-compute`` is refused)."""

    # ``_extra_state`` as ColumnParallelLinear's (None): SequentialMLP's checkpoint holds one per
    # expert, and a checkpoint of ours must load into it.
    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass

    def _drop_per_expert_extra_states(self, module, state_dict, prefix, *args) -> None:
        """The loaded ``_extra_state1..`` (one per expert, as ``sharded_state_dict`` names them)
        have no place in this module's state: dropped before ``load_state_dict`` sees them."""
        for i in range(1, self.num_local_experts):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """SequentialMLP's checkpoint entries (``TEGroupedMLP.sharded_state_dict`` renames
        ``{prefix}`` to ``...experts.{prefix}``, as for TE's grouped linears): each expert's
        weight at its global expert index on a prepended axis, split over expert-TP like
        ``ColumnParallelLinear``/``RowParallelLinear`` (the gated fc1's halves through
        ``apply_swiglu_sharded_factory``, as ``MLP``), replicas counted over the expert-DP group;
        and one ``_extra_state`` object per expert.

        The weight is one ``ShardedTensorFactory`` over the stacked parameter (not per-expert
        views): optimizers find a parameter's entry by identity (``id(entry.data)``), and the
        factory splits the optimizer's state tensors into the same per-expert entries, so Adam's
        moments are saved as SequentialMLP's are."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise NotImplementedError("grouped experts: singleton_local_shards checkpoints (the "
                                      "training's torch_dist format does not use them)")
        dp_cp_group = metadata["dp_cp_group"]
        experts = self.num_local_experts
        first = get_pg_rank(self._ep_group) * experts
        total = get_pg_size(self._ep_group) * experts
        ep_axis = len(sharded_offsets)
        replica = (0, 0, get_pg_rank(self._expt_dp_group))

        def expert_offsets(i: int) -> tuple:
            return (*sharded_offsets, (ep_axis, first + i, total))

        def expert_entry(key: str, t: torch.Tensor, i: int, replica_id):
            (sh,) = make_sharded_tensors_for_checkpoint(
                {"weight": t}, "", {"weight": self._tp_axis}, expert_offsets(i),
                tp_group=self._tp_group, dp_cp_group=dp_cp_group).values()
            sh.key, sh.replica_id = key, replica_id
            if not self._swiglu:
                return sh
            return apply_swiglu_sharded_factory(sh, expert_offsets(i), False,
                                                tp_group=self._tp_group,
                                                dp_group=dp_cp_group).build()

        def build(key, t, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("grouped experts: a flattened optimizer state "
                                          "(fully_sharded_model_space) is not supported")
            return [expert_entry(key, t[i], i, replica_id) for i in range(experts)]

        def merge(per_expert):
            parts = [cat_with_oom_fallback(p) if self._swiglu else p for p in per_expert]
            return torch.stack(parts)

        out = {f"{prefix}weight": ShardedTensorFactory(f"{prefix}weight", self.weight, build,
                                                       merge, replica)}
        for i in range(experts):
            (obj,) = make_sharded_tensors_for_checkpoint(
                {"_extra_state": self.get_extra_state()}, prefix, {}, expert_offsets(i),
                tp_group=self._tp_group, dp_cp_group=dp_cp_group).values()
            obj.replica_id = (*obj.replica_id[:2], replica[2])
            out[f"{prefix}_extra_state{i if i else ''}"] = obj
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, {self.parallel_mode}-parallel, "
                f"gemm={self.gemm}")


class GroupedColumnLinear(GroupedLinear):
    """fc1 (``GroupedLinearFc1Builder``): column-parallel over the expert-TP group."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, **kwargs):
        super().__init__(num_local_experts, input_size, output_size, parallel_mode="column",
                         **kwargs)


class GroupedRowLinear(GroupedLinear):
    """fc2 (``GroupedLinearFc2Builder``): row-parallel over the expert-TP group."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, **kwargs):
        super().__init__(num_local_experts, input_size, output_size, parallel_mode="row",
                         **kwargs)
