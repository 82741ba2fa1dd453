"""What the managed tables report: the per-iteration traffic and optimizer times to Megatron's
writers (``report_stats``, the STEM run's ``log_report``), the start-up lines on host memory and
the CPU row kernel's thread team, and the table dump after training (``--stem-dump-tables``).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ext.stem.runtime import host_memory
from megatron_ext.stem.runtime.exchange import comm_device
from megatron_ext.stem.runtime.optimizer import StemTablesOptimizer
from megatron_ext.stem.runtime.row_adam import RowAdamW
from megatron_ext.stem.runtime.row_adam import TieredRowAdamW
from megatron_ext.stem.runtime.transfer import to_device
from megatron_ext_kernels import row_adam_cpu



def dump_tables(optimizers: Sequence[StemTablesOptimizer], directory: str) -> None:
    """Write this rank's table rows after training, for inspection and tests:
    ``directory/tables_tp{t}_pp{p}_dp{d}.pt`` = {"layers": [layer numbers], "ids": [owned global
    ids per chunk], "rows": [[rows per layer]]} (sparse: every row brought up to date)."""
    for optimizer in optimizers:
        optimizer.drain()
        payload = {"chunks": [{
            "layers": [layer.layer_number for layer in t.layers],
            "ids": t.owned_ids.clone(),
            "rows": [t.store.read(i).detach().cpu().clone() for i in range(len(t.shards))]}
            for t in optimizer.tables]}
        os.makedirs(directory, exist_ok=True)
        name = (f"tables_tp{ps.get_tensor_model_parallel_rank()}_pp"
                f"{ps.get_pipeline_model_parallel_rank()}_dp{ps.get_data_parallel_rank()}.pt")
        torch.save(payload, os.path.join(directory, name))


def report_stats(optimizers: Sequence[StemTablesOptimizer], args, iteration: int,
                 total_loss_dict: dict, writer, wandb_writer) -> None:
    """Per-iteration table traffic and optimizer time, summed (times: max) over all ranks, to
    Megatron's tensorboard/wandb writers: unique rows fetched, bytes each way for row fetches and
    gradient pushes, the part of the owners' reads and row gradients that is in host memory (what
    crosses between host and device: all of it with host tables, the host tier's rows with
    tiered ones, none with device tables), fetch time the forward step waited for (exposed) and
    background fetch time it did not wait for (hidden, with prefetch), CPU optimizer time and the
    part of it the training thread waited for (exposed; with the overlapped step, the wait of the
    next step's first micro-batch for its rows' step is in the exposed fetch time) and, overlapped,
    the time from the start of the step to the start of that micro-batch's fetch (routing its ids
    and stepping the rows it reads), the part of the optimizer time it waited for the host
    tier's gradients to arrive from the GPU (the copies of ``transfer.stage_to_host``), and the
    time to collect the row gradients and exchange them with their owners; and the CPU row
    kernel's own share of the optimizer time (``RowAdamW.kernel_times``): the row parameters it
    stepped, the seconds of its row loops and of its calls as the worker saw them (their
    difference is the way into and out of the kernel: checks and the GIL taken back). A table
    step that runs in the background (overlapped) is logged with the iteration it overlaps, the
    next one. The first call also prints where the row kernel's team runs
    (``worker_team_report``). A ``log_report`` of the STEM family; collective where Megatron
    makes a writer (``--tensorboard-dir``, ``--wandb-project``), and only the writing rank reads
    the sums back from the GPU; without either, nothing is reduced."""
    summed = ["stem/unique-rows-fetched", "stem/fetch-bytes-to-device", "stem/fetch-bytes-served",
              "stem/grad-bytes-sent", "stem/grad-bytes-received", "stem/fetch-bytes-from-host",
              "stem/grad-bytes-to-host", "stem/optimizer-kernel-params"]
    maxed = ["stem/fetch-seconds-exposed", "stem/fetch-seconds-hidden", "stem/optimizer-seconds",
             "stem/optimizer-seconds-exposed", "stem/optimizer-seconds-before-fetch",
             "stem/optimizer-seconds-grad-wait", "stem/grad-exchange-seconds",
             "stem/optimizer-kernel-loop-seconds", "stem/optimizer-kernel-call-seconds"]
    if not optimizers:  # no managed tables in this run (the same on every rank)
        return
    for optimizer in optimizers:  # once, after the first iteration (communicators made, worker up)
        if not optimizer.team_reported:
            optimizer.team_reported = True
            team = worker_team_report(optimizer)
            if team is not None:
                print(f"[rank {dist.get_rank()}] > {team}", flush=True)
    sums = dict.fromkeys(summed, 0.0)
    maxes = dict.fromkeys(maxed, 0.0)
    for optimizer in optimizers:
        local = dict.fromkeys(maxed, 0.0)  # summed over this rank's chunks
        for t in optimizer.tables:
            st, rb, gb = t.stats, t.row_bytes, t.grad_row_bytes
            for name, value in (("stem/unique-rows-fetched", st["unique_rows"]),
                                ("stem/fetch-bytes-to-device", st["fetch_rows_in"] * rb),
                                ("stem/fetch-bytes-served", st["fetch_rows_out"] * rb),
                                ("stem/grad-bytes-sent", st["grad_rows_out"] * gb),
                                ("stem/grad-bytes-received", st["grad_rows_in"] * gb),
                                ("stem/fetch-bytes-from-host", st["fetch_rows_host"] * rb),
                                ("stem/grad-bytes-to-host", st["grad_rows_host"] * gb)):
                sums[name] += value
            for name, key in (("stem/fetch-seconds-exposed", "fetch_seconds"),
                              ("stem/fetch-seconds-hidden", "fetch_seconds_hidden"),
                              ("stem/optimizer-seconds", "optimizer_seconds"),
                              ("stem/optimizer-seconds-exposed", "optimizer_seconds_exposed"),
                              ("stem/optimizer-seconds-before-fetch",
                               "optimizer_seconds_before_fetch"),
                              ("stem/optimizer-seconds-grad-wait", "optimizer_seconds_grad_wait")):
                local[name] += st[key]
            t.reset_stats()
        local["stem/grad-exchange-seconds"] = optimizer.grad_seconds
        for r in host_row_adams(optimizer):  # the CPU row kernel's own share of the step
            params, loop, call = r.kernel_times.take()
            sums["stem/optimizer-kernel-params"] += params
            local["stem/optimizer-kernel-loop-seconds"] += loop
            local["stem/optimizer-kernel-call-seconds"] += call
        maxes = {name: max(maxes[name], local[name]) for name in maxed}
        optimizer.grad_seconds = 0.0
    if not (getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None)):
        return  # no writer on any rank (Megatron makes them from these flags): nothing to reduce
    # One all-gather rather than an all-reduce each for the sums and the maxima: every
    # collective is a wait for the other ranks.
    device = comm_device(dist.group.WORLD)
    local = to_device(torch.tensor([sums[name] for name in summed] +
                                   [maxes[name] for name in maxed], dtype=torch.float64), device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    if writer is None and wandb_writer is None:  # only the writing rank reads them back
        return
    every = torch.stack(every).cpu()
    values = dict(zip(summed, every[:, :len(summed)].sum(0).tolist()))
    values.update(zip(maxed, every[:, len(summed):].amax(0).tolist()))
    for name, value in values.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value}, iteration)


def host_row_adams(optimizer: StemTablesOptimizer) -> List[RowAdamW]:
    """The row optimizers of host-resident rows (a tiered one's host tier)."""
    return [r.cold if isinstance(r, TieredRowAdamW) else r for r in optimizer.row_adams]


def host_row_tensors(optimizer: StemTablesOptimizer) -> List[torch.Tensor]:
    """The host-resident tensors of the table rows: shards (a tiered one's host tier) and their
    Adam moments."""
    return [t for r in host_row_adams(optimizer) for t in (*r.shards, *r.exp_avg, *r.exp_avg_sq)
            if t.device.type == "cpu"]


def host_memory_report(optimizer: StemTablesOptimizer) -> str:
    tables = sum(t.host_bytes() for t in optimizer.tables)
    moments = 2 * tables
    pages = ""
    if tables:
        if not all(t.store.huge_pages for t in optimizer.tables):
            pages = " (ordinary pages: --no-stem-host-huge-pages)"
        else:
            huge = host_memory.huge_bytes(host_row_tensors(optimizer))
            pages = (f" ({huge / 2**20:.1f} MiB on huge pages, transparent huge pages: "
                     f"{host_memory.thp_setting() or 'unknown'})" if huge is not None else "")

    cores = row_adam_cpu.affinity_cores()  # the CPU optimizer's threads share them
    threads = row_adam_cpu.threads() if optimizer.kernel == "rowwise" else \
        torch.get_num_threads()
    tier = ""
    if optimizer.tiered:
        rows = sum(s.num_hot for s in optimizer.shards)
        hot = 3 * sum(s.hot_bytes() for s in optimizer.shards)  # rows and their two moments
        tier = (f" ({rows:,} in the GPU tier: {hot / 2**20:.1f} MiB with their Adam moments, "
                "on the model's device)")
    return (f"STEM tables on this rank: {len(optimizer.shards)} shards, "
            f"{sum(s.shape[0] for s in optimizer.shards):,} rows{tier}; host memory: tables (fp32, "
            f"also the master copy) {tables / 2**20:.1f} MiB, Adam moments {moments / 2**20:.1f} "
            f"MiB, total {(tables + moments) / 2**20:.1f} MiB{pages}; optimizer "
            f"{optimizer.mode} ({optimizer.kernel} kernel, {threads} CPU "
            f"threads, {cores} cores in this process's affinity mask; row gathers "
            f"{row_adam_cpu.threads()} threads)")


def worker_team_report(optimizer: StemTablesOptimizer) -> Optional[str]:
    """Where the CPU row kernel's OpenMP team runs when the tables' worker starts one (a task
    on the worker, which makes the team the table steps reuse): the worker thread's affinity,
    and the CPUs the team's threads were on after a short spin. A team on fewer CPUs than
    threads steps rows one core's worth at a time; None without host rows on the row kernel."""
    kernels = [r.rowwise for r in host_row_adams(optimizer) if r.rowwise is not None]
    if not kernels:
        return None

    def probe():  # on the worker: its mask, and the team size its calls ask for there
        threads = row_adam_cpu.threads()
        team = kernels[0].team_cpus(threads)
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return (len(cpus) if cpus else os.cpu_count()), team

    worker_cpus, team = optimizer.steps.worker.submit(probe).result()
    return describe_team(team, worker_cpus, os.environ)


def describe_team(team, worker_cpus: int, environ) -> str:
    """The start-up line of ``worker_team_report``: ``team`` as ``team_cpus`` gives it, with a
    warning when its threads may share fewer CPUs than there are threads (a mask narrower than
    the team, or the threads seen on fewer than half as many CPUs)."""
    allowed = sorted({a for _, a in team})
    on = len({c for c, _ in team})
    omp = [f"{k}={v}" for k, v in sorted(environ.items())
           if k.startswith(("OMP_", "GOMP_", "KMP_"))]
    report = (f"CPU row kernel team (started on the tables' worker): {len(team)} threads on "
              f"{on} CPUs, each allowed {'/'.join(map(str, allowed))}; the worker thread allowed "
              f"{worker_cpus}" + (f"; {' '.join(omp)}" if omp else ""))
    known = [a for a in allowed if a > 0]  # -1: the OS would not say
    if (known and min(known) < len(team)) or on < len(team) // 2:
        report += (" -- fewer CPUs than threads: the table step runs a core's worth at a time "
                   "(check the launcher's CPU binding and OMP_PROC_BIND / OMP_PLACES)")
    return report
