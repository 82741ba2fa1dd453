"""The host side of a fetch of host-resident STEM rows: rows of an fp32 host shard gathered and
cast to the wire dtype (bf16 in bf16 training, fp16, fp32) straight into a reused buffer, as
``stem/runtime/store.py`` does into the pinned staging buffer before the copy to the GPU. In one run:

- the compiled gather (``kernels/row_adam_cpu.py``, ``gather_rows_``) for each wire
  dtype, against its own fp32 gather (a plain row copy: what the cast may cost on top), and
- torch's ``index_select`` + cast into the same buffer (the store's fallback without a compiler),
- the compiled gather from a copy of the shard on ordinary 4 KiB pages (the store puts host
  shards on transparent huge pages, ``megatron_ext/stem/runtime/host_memory.py``; this is what that saves),
- a fetch's read of rows that owe the sparse optimizer's catch-up (rows untouched for 1 to 60
  iterations, as most host rows are): read as of now into bf16 without writing them
  (``gather_current_rows_``, the store's read since 2026-11-27) against the in-place catch-up
  then the bf16 gather (``catch_up_rows_`` + ``gather_rows_``, the read before).

Rows are a uniform draw from the shard (cold rows, as the host tier of tiered tables holds them),
sorted as the exchange hands them over. Medians of ``--reps``, the variants interleaved.

    .venv/bin/python benchmarks/stem_host_gather.py     # 2000 of 16032 rows x 8192 (1B, DP=8)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-rows", type=int, default=16032)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not 0 < args.rows <= args.shard_rows:
        raise SystemExit(f"--rows must be in 1..--shard-rows ({args.shard_rows}), got {args.rows}")

    from megatron_ext.stem.runtime import host_memory
    from megatron_ext.stem.runtime.row_adam import AdamHyper, RowClock
    from megatron_ext_kernels import row_adam_cpu

    kernel = row_adam_cpu.load()
    if kernel is None:
        raise SystemExit("the compiled row kernels do not build here (no C++ compiler?)")
    g = torch.Generator().manual_seed(0)
    shard = host_memory.empty((args.shard_rows, args.width)).normal_(generator=g)  # as the store
    shard_4k = host_memory.copy(shard, huge=False)
    index = torch.randperm(args.shard_rows, generator=g)[:args.rows].sort().values
    outs = {name: torch.empty(args.rows, args.width, dtype=dt) for name, dt in DTYPES.items()}
    gathered = torch.empty(args.rows, args.width)

    def compiled(name):
        kernel.gather_rows_(shard, index, outs[name])

    def compiled_4k(name):
        kernel.gather_rows_(shard_4k, index, outs[name])

    def with_torch(name):
        torch.index_select(shard, 0, index, out=gathered)
        outs[name].copy_(gathered)

    # The sparse optimizer's state after 80 iterations; every row read owes 1 to 60 of them.
    u = 80
    clock = RowClock()
    for t in range(1, u + 1):
        clock.advance(t, AdamHyper(lr=1e-3 * min(1.0, t / 10), beta1=0.9, beta2=0.95, eps=1e-8,
                                   weight_decay=0.1))
    exp_avg = host_memory.empty(shard.shape).normal_(generator=g).mul_(1e-3)
    exp_avg_sq = host_memory.empty(shard.shape).uniform_(generator=g).mul_(1e-6)
    owing = u - torch.randint(1, 61, (args.shard_rows,), generator=g)
    touched = (owing - torch.randint(0, 10, (args.shard_rows,), generator=g)).clamp(min=0)
    last = owing.clone()
    state = clock.kernel_state(u)

    def read_in_place(name):  # the rows owe again at every repetition (last reset outside)
        kernel.catch_up_rows_(shard, exp_avg, exp_avg_sq, index, last, touched, state)
        kernel.gather_rows_(shard, index, outs[name])

    def read_as_of_now(name):
        kernel.gather_current_rows_(shard, exp_avg, exp_avg_sq, index, last, touched, state,
                                    outs[name])

    variants = {f"{kind} {name}": (fn, name) for name in DTYPES
                for kind, fn in (("compiled", compiled), ("torch", with_torch),
                                 ("compiled-4k", compiled_4k))}
    variants["owing, catch-up in place + gather bf16"] = (read_in_place, "bf16")
    variants["owing, read as of now bf16"] = (read_as_of_now, "bf16")
    times = {v: [] for v in variants}
    for rep in range(args.reps + 1):  # the first round warms up (pages, the kernel's threads)
        for label, (fn, name) in variants.items():
            last.copy_(owing)
            t0 = time.perf_counter()
            fn(name)
            if rep:
                times[label].append(time.perf_counter() - t0)
    last.copy_(owing)  # the read as of now = the catch-up then the gather, bit for bit
    read_as_of_now("bf16")
    now = outs["bf16"].clone()
    read_in_place("bf16")
    assert torch.equal(now.view(torch.int16), outs["bf16"].view(torch.int16))
    for name, dt in DTYPES.items():  # what the compiled gather wrote is the cast, bit for bit
        compiled(name)
        assert torch.equal(outs[name], shard[index].to(dt)), name
    ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
    params = args.rows * args.width
    print(f"STEM host gather | {args.rows} of {args.shard_rows} rows x {args.width} "
          f"({params / 1e6:.1f} M params) | {kernel.team_size(row_adam_cpu.threads())} threads")
    huge = host_memory.huge_bytes([shard]) or 0
    print(f"  shard: {huge / 2**20:.0f} of {shard.numel() * 4 / 2**20:.0f} MiB on huge pages "
          f"(transparent huge pages: {host_memory.thp_setting()})")
    summary = {"rows": args.rows, "shard_rows": args.shard_rows, "width": args.width,
               "threads": kernel.team_size(row_adam_cpu.threads()), "ms": ms,
               "shard_bytes_on_huge_pages": huge}
    base = ms["compiled fp32"]
    for name, dt in DTYPES.items():
        c, t, small = ms[f"compiled {name}"], ms[f"torch {name}"], ms[f"compiled-4k {name}"]
        moved = params * (4 + dt.itemsize) / (c * 1e-3) / 1e9
        summary[f"{name}_vs_fp32_copy"] = c / base
        summary[f"{name}_torch_vs_compiled"] = t / c
        summary[f"{name}_4k_pages_vs_huge"] = small / c
        print(f"  {name}: compiled {c:6.2f} ms ({params / c / 1e6:.2f} G params/s, {moved:.1f} "
              f"GB/s read+written; {c / base:.2f}x its fp32 gather) | torch {t:6.2f} ms "
              f"({t / c:.2f}x the compiled one) | from 4 KiB pages {small:6.2f} ms "
              f"({small / c:.2f}x)")
    before, now_ms = ms["owing, catch-up in place + gather bf16"], ms["owing, read as of now bf16"]
    summary["read_now_vs_catch_up_then_gather"] = now_ms / before
    print(f"  rows owing a catch-up, read to bf16: as of now, written nowhere else {now_ms:6.2f} "
          f"ms | in-place catch-up then gather {before:6.2f} ms -> {now_ms / before:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
