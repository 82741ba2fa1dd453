"""Host rows to the GPU, the two reads of ``--stem-host-read`` at the 1B shape's host shard:

- ``staged``: the store's read (``stem/runtime/store.py`` ``gather_rows`` with its
  ``PinnedStaging``): the rows gathered and cast on the CPU by the compiled gather
  (``kernels/row_adam_cpu.py``) into the pinned staging buffer, then one asynchronous copy;
- ``direct``: the same call with ``read="direct"``: a GPU kernel (``kernels/host_rows.py``) reads
  the rows from the shard itself, registered in place with ``cudaHostRegister`` (as the store
  registers its host shards), over the bus.

Both start from the rows' host index, as the store's read does (the index goes to the GPU through
pinned memory), and a read is timed from its call to the GPU's end of it (``synchronize``). The
rows: ``--rows`` distinct rows drawn by a Zipf law (exponent 1.07, the synthetic corpus's) over
the shard's rows, sorted as the exchange hands them over; current rows (nothing owed: the
catch-up is the same CPU work for both reads). Medians of ``--reps`` after ``--warmup``, in
``--repeats`` runs alternating the order (A B, B A), each run's ratio direct / staged. Also the
time ``cudaHostRegister`` takes for the shard: what ``--stem-host-read direct`` adds to start-up
per host shard. The GPU is otherwise idle here: in training the direct read's loads share the
GPU with the model's kernels, the staged read's CPU gather shares the host with the table step.

Without CUDA both read to host memory (the direct read under Triton's interpreter,
``TRITON_INTERPRET=1``): a check that the benchmark runs, not a measurement.

    python benchmarks/stem_host_read.py              # 3420 of 50304 rows x 5632 fp32 -> bf16
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import alternate, sync, timed  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def zipf_rows(shard_rows: int, rows: int, exponent: float = 1.07, seed: int = 0) -> torch.Tensor:
    """``rows`` distinct rows of ``shard_rows``, drawn with weights ``1 / rank ** exponent`` over a
    fixed permutation of the rows (hot rows scattered over the shard, as an owner's rows are),
    sorted."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, shard_rows + 1, dtype=torch.float64) ** -exponent
    ranked = torch.multinomial(weights, rows, replacement=False, generator=g)
    return torch.randperm(shard_rows, generator=g)[ranked].sort().values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-rows", type=int, default=50304)
    parser.add_argument("--width", type=int, default=5632)
    parser.add_argument("--rows", type=int, default=3420)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the wire dtype")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not 0 < args.rows <= args.shard_rows:
        raise SystemExit(f"--rows must be in 1..--shard-rows ({args.shard_rows}), got {args.rows}")

    from megatron_ext.stem.runtime import host_memory
    from megatron_ext.stem.runtime.store import PinnedStaging, gather_rows
    from megatron_ext_kernels import host_rows
    from megatron_ext_kernels._triton_runtime import interpreted

    cuda = torch.cuda.is_available()
    if not cuda and not interpreted():
        raise SystemExit("without CUDA the direct read runs only under TRITON_INTERPRET=1")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    shard = host_memory.empty((args.shard_rows, args.width)).normal_(generator=g)  # as the store
    index = zipf_rows(args.shard_rows, args.rows)
    staging = PinnedStaging() if cuda else None

    class Owner:  # the store, whose life the registration follows
        pass

    owner = Owner()
    register_ms = None
    if cuda:
        sync()
        t0 = time.perf_counter()
        host_rows.register(shard, owner)
        register_ms = 1e3 * (time.perf_counter() - t0)

    def staged():
        return gather_rows([shard], index, device, dtype, staging)

    def direct():
        return gather_rows([shard], index, device, dtype, staging, read="direct")

    want = shard[index].to(dtype)
    for read in (staged, direct):  # both give the rows, bit for bit
        assert torch.equal(read().cpu(), want), read.__name__
    ms = alternate({"staged": lambda: timed(staged, lambda: None, args.reps, args.warmup),
                    "direct": lambda: timed(direct, lambda: None, args.reps, args.warmup)},
                   args.repeats)
    ratios = [d / s for d, s in zip(ms["direct"], ms["staged"])]
    moved = args.rows * args.width
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)"
    print(f"STEM host read | {args.rows} Zipf rows of {args.shard_rows} x {args.width} fp32 "
          f"({shard.numel() * 4 / 2**30:.2f} GiB shard) -> {args.dtype} | {name}")
    for read in ("staged", "direct"):
        med = statistics.median(ms[read])
        print(f"  {read}: {' / '.join(f'{x:.3f}' for x in ms[read])} ms per read "
              f"({moved * dtype.itemsize / (med * 1e-3) / 1e9:.1f} GB/s of rows delivered)")
    print(f"  direct / staged per run: {' / '.join(f'{r:.3f}' for r in ratios)}")
    if register_ms is not None:
        print(f"  cudaHostRegister of the shard: {register_ms:.1f} ms "
              f"({shard.numel() * 4 / 2**30 / (register_ms * 1e-3):.1f} GiB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": args.rows, "shard_rows": args.shard_rows,
                       "width": args.width, "dtype": args.dtype, "ms": ms,
                       "ratios_per_run": ratios, "register_ms": register_ms,
                       "shard_bytes": shard.numel() * 4,
                       "shard_bytes_on_huge_pages": host_memory.huge_bytes([shard])}, f,
                      indent=2)


if __name__ == "__main__":
    main()
