"""Helpers shared by the benchmarks: device sync, Megatron DDP wrapping, a timing loop."""

from __future__ import annotations

import time
from typing import Callable, List

import torch


def corpus(prefix: str, vocab=None):
    """The token ids of an indexed dataset (``.bin`` read whole, int64) and its vocabulary
    (``vocab``, else the data-prep manifest's beside it); a clear exit when it is not there."""
    import json
    import os

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not os.path.exists(prefix + ".bin"):
        raise SystemExit(f"no tokenized corpus at {prefix}: run launch/main_job.py (its data "
                         "step) or pass --data-prefix")
    if vocab is None:
        with open(os.path.join(os.path.dirname(prefix), "manifest.json")) as f:
            vocab = int(json.load(f)["tokenizer_vocab_size"])
    dtype = IndexedDataset(prefix).index.dtype
    ids = np.asarray(np.memmap(prefix + ".bin", dtype=dtype, mode="r")).astype(np.int64)
    return torch.from_numpy(ids), vocab


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wrap_ddp(module):
    """Megatron's ``DistributedDataParallel`` around ``module`` as in training (gradients land
    in ``main_grad`` buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)


def timed(step: Callable[[], None], reset: Callable[[], None], reps: int,
          warmup: int) -> List[float]:
    """Seconds of ``reps`` calls of ``step`` after ``warmup`` untimed ones; ``reset`` runs before
    each call, outside the timing (e.g. zeroing the grad buffer, done once per global batch in
    training)."""
    times = []
    for i in range(warmup + reps):
        reset()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def add_run_args(parser, gpu_reps: int, cpu_reps: int) -> None:
    """The flags every step benchmark takes: dtype, repetitions, warm-up, JSON output."""
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"default: {gpu_reps} on GPU, {cpu_reps} on CPU")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.set_defaults(_gpu_reps=gpu_reps, _cpu_reps=cpu_reps)


class RunSetup:
    """Single-rank Megatron state and the run settings resolved from :func:`add_run_args`."""

    def __init__(self, args, quiet: bool = True):
        import logging
        import warnings

        from megatron_ext.compat.standalone import init_single_rank

        if quiet:
            warnings.filterwarnings("ignore")
            logging.getLogger("megatron").setLevel(logging.WARNING)
        init_single_rank()
        gpu = torch.cuda.is_available()
        self.dtype_name = args.dtype or ("bf16" if gpu else "fp32")
        self.dtype = torch.bfloat16 if self.dtype_name == "bf16" else torch.float32
        self.reps = args.reps or (args._gpu_reps if gpu else args._cpu_reps)
        self.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
        self.device = torch.device("cuda" if gpu else "cpu")
        self.json_path = args.json

    def write_json(self, summary) -> None:
        write_json(summary, self.json_path)


def write_json(summary, path) -> None:
    """``summary`` as indented JSON at ``path`` (nothing without a path)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


def report_json(summary, path) -> None:
    """The summary as the last line of the output (one JSON object), and at ``path``."""
    import json

    print(json.dumps(summary))
    write_json(summary, path)
