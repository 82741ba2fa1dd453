"""The sparse table step of host rows first written after this process forked, with the rows and
moments where the store allocates them (``stem/runtime/host_memory.py``: mappings kept from child
processes, ``MADV_DONTFORK``) against plain torch tensors (shared with the child copy-on-write),
in one run; also the store's mappings as they were before 2026-11-27 (huge pages, shared with the
child).

Megatron builds its data loader, and forks the loader's workers, after the model and the
optimizer: every page of host rows the table step writes for the first time after that fork is
copied (a huge page split) unless the mapping is kept from the child. On the GPU machine of
2026-11-27 the table step inside training ran about 25x slower than the same kernel alone
(docs/results/gpu_2026-11-27_h200/README.md); this shows the mechanism on any Linux host.

    .venv/bin/python benchmarks/stem_fork_cow.py
    .venv/bin/python benchmarks/stem_fork_cow.py --rows 128256 --width 8192   # a 1B table

Per variant: the step of ``--batch-rows`` fresh rows before any fork, then a child is forked
(it sleeps), then steps of fresh rows (first written since the fork) and of the same rows again;
medians of ``--reps`` steps. The last line is the summary as JSON.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import report_json  # noqa: E402


def run(variant: str, a) -> dict:
    from megatron_ext.stem.runtime import host_memory
    from megatron_ext.stem.runtime.row_adam import AdamHyper, LazyRows, RowAdamW

    g = torch.Generator().manual_seed(0)
    keep = host_memory._CAN_KEEP_FROM_CHILDREN
    if variant != "plain torch":  # as TableStore and the sparse optimizer allocate them
        # "huge pages, shared": the store's mappings as they were before 2026-11-27 (advised
        # onto huge pages, not kept from children)
        host_memory._CAN_KEEP_FROM_CHILDREN = keep and variant == "store"
        shard = host_memory.empty((a.rows, a.width)).normal_(generator=g)
        lazy = None
    else:  # plain torch tensors: the rows, and moments made by torch.zeros_like
        shard = torch.empty(a.rows, a.width).normal_(generator=g)
        lazy = LazyRows([shard], huge_pages=False)
        lazy.exp_avg, lazy.exp_avg_sq = [torch.zeros_like(shard)], [torch.zeros_like(shard)]
    try:
        adam = RowAdamW([shard], mode="sparse", lazy=lazy)
    finally:
        host_memory._CAN_KEEP_FROM_CHILDREN = keep
    if adam.kernel != "rowwise":
        raise SystemExit("the CPU row kernel cannot be built here")
    hyper = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1)
    grad = torch.randn(a.batch_rows, a.width, generator=g)
    order = torch.randperm(a.rows, generator=g)
    need = (3 * a.reps + 2) * a.batch_rows
    if need > a.rows:
        raise SystemExit(f"--rows must be at least {need} (fresh rows for every timed step)")
    batches = iter(order.split(a.batch_rows))

    def step(rows) -> float:
        plan = adam.begin_step(hyper)
        start = time.perf_counter()
        adam.step_rows(0, rows.sort().values, grad, plan)
        return time.perf_counter() - start

    for _ in range(2):  # the kernel built, the caches warm
        step(next(batches))
    before = [step(next(batches)) for _ in range(a.reps)]
    pid = os.fork()
    if pid == 0:  # the child: a data loader worker that never reads the tables
        time.sleep(3600)
        os._exit(0)
    try:
        fresh = [next(batches) for _ in range(a.reps)]
        after = [step(rows) for rows in fresh]
        again = [step(rows) for rows in fresh]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"before_fork_ms": ms(before), "first_write_after_fork_ms": ms(after),
            "again_ms": ms(again), "kept_from_children_bytes":
            host_memory.flagged_bytes([shard, *adam.exp_avg, *adam.exp_avg_sq], "dc")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch-rows", type=int, default=512, help="rows per step (fresh each)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from megatron_ext_kernels import row_adam_cpu

    results = {v: run(v, a) for v in ("plain torch", "huge pages, shared", "store")}
    print(f"sparse step of {a.batch_rows} rows x {a.width} of a {a.rows}-row shard, "
          f"{row_adam_cpu.threads()} threads, medians of {a.reps}; torch {torch.__version__}")
    print("tensors | before fork ms | rows first written after a fork ms | same rows again ms "
          "| bytes kept from children")
    for name, r in results.items():
        print(f"{name} | {r['before_fork_ms']:.2f} | {r['first_write_after_fork_ms']:.2f} | "
              f"{r['again_ms']:.2f} | {r['kept_from_children_bytes']}")
    summary = dict(results)
    ratios = {name: round(r["first_write_after_fork_ms"] / r["before_fork_ms"], 3)
              for name, r in results.items()}
    summary["ratio_after_fork"] = ratios
    print("first write after a fork vs before: " +
          ", ".join(f"{name} {ratio}x" for name, ratio in ratios.items()))
    report_json(summary, a.json)


if __name__ == "__main__":
    main()
