"""A JSON report of one training run: layout, per-iteration wall time and tokens, FLOPs, memory.

With ``launch/pretrain.py --ext-run-report PATH`` the training run (``training/session.py``)
makes a :class:`RunReport` and adds its hook to Megatron's training log (``training/log_hooks.py``).
The hook runs on every rank at every iteration and records

* the wall time since the previous iteration (``time.perf_counter``; on a GPU after a
  ``torch.cuda.synchronize`` so queued kernels are counted in the iteration that issued them). The
  first recorded iteration's time runs from the report's making, before ``pretrain``, and so
  includes start-up (model build, data loaders, the first step's allocations): it is flagged
  ``startup`` and throughput must leave it out;
* the tokens of the iteration: ``get_num_microbatches() x micro batch x data-parallel size x
  sequence length``, the global batch of *this* iteration (a ``--rampup-batch-size`` ramp changes
  the number of micro-batches);
* training (forward + backward) FLOPs per token from ``planning/estimate.py``. Sigma's
  progressive sparsification changes the experts a token uses during training, so its value is
  taken per iteration with that iteration's top-k.

When training ends, rank 0 writes ``PATH`` (temp file + ``os.replace``: a reader never sees half a
report) with the peak memory of every rank: GPU ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` and, on every device, the process's peak resident set size
(``resource.getrusage(...).ru_maxrss``), all in bytes. ``launch/scaling.py`` turns reports into
tokens/s/GPU, TFLOP/s/GPU and MFU; ``docs/scaling.md`` describes the fields.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.num_microbatches_calculator import get_num_microbatches

from megatron_ext.models.registry import family_config
from megatron_ext.planning.estimate import estimate_from_args
from megatron_ext.planning.model_shape import ModelShape, family_terms, training_flops_per_token

SCHEMA_VERSION = 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_info() -> Dict[str, object]:
    if torch.cuda.is_available():
        return {"type": "cuda", "name": torch.cuda.get_device_name(),
                "count_visible": torch.cuda.device_count()}
    # torch.get_num_threads(): the intra-op threads one rank computes with (OMP_NUM_THREADS);
    # the harness measures its CPU peak with the same number.
    return {"type": "cpu", "name": _cpu_name(), "threads_per_rank": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}


def max_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def local_memory() -> List[int]:
    """``[max allocated, max reserved, max RSS]`` of this rank in bytes (-1: not on a GPU)."""
    if torch.cuda.is_available():
        return [int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved()),
                max_rss_bytes()]
    return [-1, -1, max_rss_bytes()]


def gather_memory() -> List[List[int]]:
    """:func:`local_memory` of every rank, in rank order (a collective: every rank must call it)."""
    mine = local_memory()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    # A tensor all_gather works on gloo and NCCL alike; NCCL needs the tensor on the GPU.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [[int(v) for v in t.tolist()] for t in out]


def memory_summary(per_rank: List[List[int]], complete: bool = True) -> Dict[str, object]:
    gpu = per_rank[0][0] >= 0
    rows = []
    for rank, (alloc, reserved, rss) in enumerate(per_rank):
        row = {"rank": rank, "max_rss_bytes": rss}
        if gpu:
            row.update(max_allocated_bytes=alloc, max_reserved_bytes=reserved)
        rows.append(row)
    out: Dict[str, object] = {
        "kind": "cuda" if gpu else "cpu",
        "ranks_reported": len(rows),
        "all_ranks": complete,
        "per_rank": rows,
        "max_rss_bytes": max(r[2] for r in per_rank),
    }
    if gpu:
        out["max_allocated_bytes"] = max(r[0] for r in per_rank)
        out["max_reserved_bytes"] = max(r[1] for r in per_rank)
        # What decides whether a layout fits: what the caching allocator took from the device.
        out["peak_bytes"], out["peak_metric"] = out["max_reserved_bytes"], "max_memory_reserved"
    else:
        out["peak_bytes"], out["peak_metric"] = out["max_rss_bytes"], "ru_maxrss"
    return out


def write_json_atomic(path: str, payload: Dict[str, object]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run_report.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class FlopsPerToken:
    """Training FLOPs per token of the model being trained, per iteration (None, with ``error``
    set, where the estimate does not cover the run: the report must never stop a training)."""

    def __init__(self, args):
        self.at_start: Optional[float] = None
        self.error: Optional[str] = None
        self._varies = False
        try:
            self.at_start = float(estimate_from_args(args).train_flops_per_token)
            # A family whose FLOPs per token change during training (Sigma's sparsification).
            self._terms = family_terms(args.model_family)
            self._args, self._cfg = args, family_config(args)
            if self._terms.topks_at(args, self._cfg, 0) is not None:
                self._varies = True
                self._spec = ModelShape.from_args(args)
        except Exception as exc:
            self.at_start, self.error = None, f"{type(exc).__name__}: {exc}"
            if _rank() == 0:
                print(f"megatron-ext: run report without FLOPs per token ({self.error})",
                      file=sys.stderr)

    def __call__(self, iteration: int) -> Optional[float]:
        if not self._varies or self.at_start is None:
            return self.at_start
        # The step that ends at `iteration` ran with `iteration - 1` completed iterations.
        topks = self._terms.topks_at(self._args, self._cfg, iteration - 1)
        return float(training_flops_per_token(self._spec, topks).total)


class RunReport:
    def __init__(self, path: str):
        self.path = path
        self.iterations: List[Dict[str, object]] = []
        self.last = time.perf_counter()
        self.flops: Optional[FlopsPerToken] = None
        self.args = None
        self.written = False

    # -- per iteration -------------------------------------------------------------------------

    def hook(self, args, iteration, total_loss_dict, writer, wandb_writer) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.flops is None:
            self.args = args
            self.flops = FlopsPerToken(args)
        sequences = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        self.iterations.append({
            "iteration": int(iteration), "seconds": seconds,
            "sequences": int(sequences), "tokens": int(sequences * args.seq_length),
            "train_flops_per_token": self.flops(int(iteration)),
            "startup": not self.iterations,
        })
        # The end of training is the hook call of the last iteration: every rank reaches it in
        # step (the iteration count is the same everywhere) while the process groups still exist,
        # so the memory of all ranks can be gathered there. The end of the run (at_exit, from
        # TrainingSession.close) cannot do that: by then Megatron may have torn the groups down
        # or other ranks may already have exited (a collective would hang), so it is only the
        # fallback for runs that stop early (--exit-duration-in-mins, a signal, a crash), with
        # rank 0's own numbers.
        exit_interval = getattr(args, "exit_interval", None)
        if not self.written and (iteration >= args.train_iters
                                 or (exit_interval and iteration % exit_interval == 0)):
            self.finish(gather_memory(), finished_by="last_iteration")

    # -- at the end ----------------------------------------------------------------------------

    def payload(self, per_rank_memory: List[List[int]], finished_by: str) -> Dict[str, object]:
        a = self.args
        complete = finished_by == "last_iteration"
        layout = {
            "world_size": a.world_size, "tp": a.tensor_model_parallel_size,
            "pp": a.pipeline_model_parallel_size, "cp": a.context_parallel_size,
            "ep": a.expert_model_parallel_size,
            "etp": getattr(a, "expert_tensor_parallel_size", None),
            "dp": a.data_parallel_size, "micro_batch_size": a.micro_batch_size,
            "global_batch_size": a.global_batch_size, "seq_length": a.seq_length,
            "num_microbatches": get_num_microbatches(),
            "sequence_parallel": bool(getattr(a, "sequence_parallel", False)),
        }
        return {
            "schema_version": SCHEMA_VERSION,
            "complete": complete,
            "finished_by": finished_by,
            "preset": getattr(a, "preset", None) or getattr(a, "sigma_preset", None),
            "model_family": getattr(a, "model_family", None),
            "train_iters": a.train_iters,
            "layout": layout,
            "device": device_info(),
            "params_dtype": str(getattr(a, "params_dtype", "")).replace("torch.", ""),
            "train_flops_per_token": self.flops.at_start,
            "flops_source": "megatron_ext.planning.estimate (forward + backward, per token)",
            "flops_error": self.flops.error,
            "iterations": self.iterations,
            "memory": memory_summary(per_rank_memory, complete=complete),
        }

    def finish(self, per_rank_memory: List[List[int]], finished_by: str) -> None:
        self.written = True
        if _rank() == 0:
            try:
                write_json_atomic(self.path, self.payload(per_rank_memory, finished_by))
            except OSError as exc:  # a full disk must not turn a finished training into a crash
                print(f"megatron-ext: run report not written to {self.path}: {exc}",
                      file=sys.stderr)

    def at_exit(self) -> None:
        if self.written or self.args is None or _rank() != 0:
            return
        try:
            self.finish([local_memory()], finished_by="atexit")
        except Exception as exc:  # never turn a clean exit into a traceback
            print(f"megatron-ext: run report not written: {exc}", file=sys.stderr)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
