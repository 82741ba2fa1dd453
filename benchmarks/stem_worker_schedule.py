"""How long a step's micro-batches wait for their host rows while the sparse table step of the
previous step runs on the host worker: the whole step as one task (``--chunk-elements 0``: the
schedule before the background lane, where a read queued behind all of it) against the step left
with the store and run in chunks (``stem/runtime/optimizer.py``, ``OwedStep``), in one run.

The real components run: ``StemTables`` with host shards, ``RowAdamW`` (CPU kernel), the host
worker and the forward step's read-ahead; ids are a Zipf(``--zipf``) stream over the rank's
rows; a micro-batch's compute is a sleep of ``--compute-ms`` (the worker has the cores to itself,
as on a GPU machine where the model computes on the GPU). Per step it reports the time the
training thread waited for each micro-batch's rows (exposed fetch), for the table step at the
next step's start (exposed optimizer), and the step time against the compute alone.

``--training-thread python``: the compute is Python running on the training thread for
``--compute-ms`` instead (it holds the GIL, as a training thread launching a model's kernels
does), and the chunked schedule runs twice, with the GIL switch interval the worker sets
(``--stem-gil-switch-ms``, ``stem/runtime/worker.py``) and with Python's own 5 ms, each time a Python
thread keeps the GIL the worker waits for.

    .venv/bin/python benchmarks/stem_worker_schedule.py                 # 2 tables x 32768 x 2048
    .venv/bin/python benchmarks/stem_worker_schedule.py --rows 16032 --width 8192   # 1B, DP=8
    .venv/bin/python benchmarks/stem_worker_schedule.py --training-thread python --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import report_json  # noqa: E402


def layer_table(number: int, table: torch.Tensor):
    """A STEM layer's table as ``StemTables`` knows it."""
    from megatron_ext.stem.runtime.tables import LayerTable

    return LayerTable(number, table, table.dtype, table.shape[0])


PYTHON_SWITCH_INTERVAL_S = 0.005  # Python's default


def compute(a) -> None:
    """One micro-batch's compute on the training thread: a sleep (the GPU computes, the thread
    waits and releases the GIL), or Python running for as long (it holds the GIL, as a thread
    launching a model's kernels does)."""
    if a.training_thread == "sleep":
        time.sleep(a.compute_ms / 1e3)
        return
    until = time.perf_counter() + a.compute_ms / 1e3
    x = 0
    while time.perf_counter() < until:
        for i in range(200):
            x += i


def run(mode_chunk: int, a, ids_steps, seed: int, switch_s: float) -> dict:
    from megatron.core import parallel_state

    from megatron_ext.stem.runtime import worker

    sys.setswitchinterval(PYTHON_SWITCH_INTERVAL_S)  # each run from Python's own
    host = worker.HostWorker(switch_s)               # the worker's (applied when it runs)

    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW
    from megatron_ext.stem.runtime.schedule import OwedStep, TableSteps
    from megatron_ext.stem.runtime.tables import StemTables
    from megatron_ext.stem.runtime.read_ahead import TableReadAhead

    OwedStep.CHUNK_ELEMENTS = mode_chunk if mode_chunk > 0 else 1 << 62
    g = torch.Generator().manual_seed(seed)
    layers = [layer_table(n, torch.randn(a.rows, a.width, generator=g) * 0.02)
              for n in range(1, a.tables + 1)]
    tables = StemTables(layers, StemConfig(placement="cpu", sharding="vocab", prefetch=True),
                        a.rows, parallel_state.get_data_parallel_group(), host)
    adam = RowAdamW(tables.store.shards, mode="sparse", lazy=tables.store.lazy)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    steps = TableSteps("sparse", host)  # the table optimizer's row steps and their drain
    read_ahead = TableReadAhead(tables)
    most = len(torch.unique(torch.cat([mb.reshape(-1) for mb in ids_steps[0]]))) * 2
    noise = [torch.randn(most, a.width, generator=g) * 1e-3 for _ in layers]  # row gradients
    batches = iter([(mb,) for step in ids_steps for mb in step])
    mbs = len(ids_steps[0])
    rows_per_step, per_step = [], []
    for s in range(len(ids_steps)):
        waits, step_ids = [], []
        start = time.perf_counter()
        for m in range(mbs):
            t = time.perf_counter()
            batch, _ = read_ahead.take(lambda: next(batches), mbs,
                                       next_step=s + 1 < len(ids_steps))
            waits.append(time.perf_counter() - t)
            compute(a)  # the micro-batch computes (on the GPU)
            step_ids.append(batch[0].reshape(-1))
        t = time.perf_counter()
        steps.drain([tables])  # the previous table step's rest
        drained = time.perf_counter() - t
        # The step's row gradients summed per touched row (what collect_grads hands over).
        touched = torch.unique(torch.cat(step_ids))
        local = tables.ownership.local_index(touched)
        grads = [(local, noise[j][: touched.numel()]) for j in range(len(layers))]
        rows_per_step.append(touched.numel())
        if s + 1 < len(ids_steps):
            plan = adam.begin_step(hyper)
            t = time.perf_counter()
            steps.step_table(tables, adam, plan, grads, None)
            submit = time.perf_counter() - t
        else:
            submit = 0.0
        per_step.append({"waits_ms": [1e3 * w for w in waits], "drain_ms": 1e3 * drained,
                         "step_ms": 1e3 * (time.perf_counter() - start),
                         "submit_ms": 1e3 * submit})
    host.close()
    return {"rows": rows_per_step, "steps": per_step, "switch_ms": 1e3 * sys.getswitchinterval()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32768, help="rows of each table this rank owns")
    p.add_argument("--width", type=int, default=2048, help="d_ff of a table row")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--compute-ms", type=float, default=60.0, help="one micro-batch's compute")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2, help="steps left out of the medians")
    p.add_argument("--chunk-elements", type=int, default=1 << 22,
                   help="the background chunk of the new schedule")
    p.add_argument("--training-thread", choices=("sleep", "python"), default="sleep",
                   help="what the training thread does while a micro-batch computes: sleep "
                        "(releases the GIL) or run Python (holds it)")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="the worker's GIL switch interval (default: --stem-gil-switch-ms's)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    a = p.parse_args()

    from megatron_ext.compat.standalone import init_single_rank

    init_single_rank()
    g = torch.Generator().manual_seed(0)
    weights = torch.arange(1, a.rows + 1, dtype=torch.float64) ** -a.zipf
    perm = torch.randperm(a.rows, generator=g)  # hot ids spread over the rows
    ids_steps = [[perm[torch.multinomial(weights, a.tokens, replacement=True, generator=g)]
                  .view(1, -1) for _ in range(a.micro_batches)] for _ in range(a.steps)]
    from megatron_ext.stem.runtime import worker

    switch_s = worker.DEFAULT_SWITCH_INTERVAL_S if a.gil_switch_ms is None else \
        a.gil_switch_ms / 1e3
    schedules = [("whole step, one task", 0, switch_s), ("owed step, chunks", a.chunk_elements,
                                                          switch_s)]
    if a.training_thread == "python":
        schedules.append(("owed step, chunks, Python's switch", a.chunk_elements, 0.0))
    results = {}
    for name, chunk, switch in schedules:
        results[name] = run(chunk, a, ids_steps, seed=1, switch_s=switch)
    ideal = a.micro_batches * a.compute_ms
    print(f"{a.tables} tables x {a.rows} rows x {a.width}, {a.micro_batches} micro-batches of "
          f"{a.tokens} Zipf({a.zipf}) ids, compute {a.compute_ms:.0f} ms each "
          f"({a.training_thread} on the training thread); medians of steps "
          f"{a.skip + 1}-{a.steps}; {os.cpu_count()} cores, torch {torch.__version__}")
    rows = statistics.median(results["whole step, one task"]["rows"][a.skip:])
    print(f"touched rows per step: {rows:.0f} ({rows * a.width * a.tables / 1e6:.1f} M "
          "row-parameters stepped on the host)")
    head = ["schedule", "GIL switch ms", "step ms", "vs compute",
            "fetch waited ms (per micro-batch)", "drain ms"]
    print(" | ".join(head))
    summary = {}
    for name, r in results.items():
        steps = r["steps"][a.skip:]
        step = statistics.median(s["step_ms"] for s in steps)
        waits = [statistics.median(s["waits_ms"][m] for s in steps)
                 for m in range(a.micro_batches)]
        drain = statistics.median(s["drain_ms"] for s in steps)
        print(f"{name} | {r['switch_ms']:g} | {step:.1f} | {step / ideal:.3f}x | "
              f"{' / '.join(f'{w:.1f}' for w in waits)} | {drain:.1f}")
        summary[name] = {"step_ms": round(step, 2), "vs_compute": round(step / ideal, 4),
                         "fetch_waited_ms": [round(w, 2) for w in waits],
                         "drain_ms": round(drain, 2), "gil_switch_ms": r["switch_ms"]}
    old, new = (summary[k]["step_ms"] for k in list(results)[:2])
    summary["ratio_chunks_vs_one_task"] = round(new / old, 4)
    summary["touched_rows"] = rows
    summary["training_thread"] = a.training_thread
    print(f"step time, chunks vs one task: {new / old:.3f}x")
    if "owed step, chunks, Python's switch" in summary:
        slow = summary["owed step, chunks, Python's switch"]["step_ms"]
        summary["ratio_worker_switch_vs_python"] = round(new / slow, 4)
        print(f"step time, the worker's GIL switch interval vs Python's: {new / slow:.3f}x")
    report_json(summary, a.json)


if __name__ == "__main__":
    main()
