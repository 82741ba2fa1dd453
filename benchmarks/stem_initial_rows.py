"""Start-up memory of managed STEM tables on one rank: each STEM layer's initial values drawn as
Megatron's CPU initialisation draws them (the full-width ``[vocab, F]`` master, this TP rank's
columns kept for the whole vocabulary, the rank's rows sliced from them when the store is built)
against ``stem/initial_rows.py`` (the master drawn a block of rows at a time, only the rank's
rows kept), in one run, each in a fresh process. Both give the same values, which the run checks
(a checksum of the kept rows).

    .venv/bin/python benchmarks/stem_initial_rows.py                          # 1B shape, DP=8
    .venv/bin/python benchmarks/stem_initial_rows.py --dp 1 --vocab 32768     # smaller

Reported per way: the process's peak resident memory over what it held before drawing (the
rank's part of model build), the seconds it took, and the ratio of the new way to the old.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    """One way, in this process: draw every layer, keep this rank's rows, as the model build
    and the store do."""
    import torch
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from megatron_ext.stem.initial_rows import InitialRows, draw_rows
    from megatron_ext.stem.runtime.ownership import RowOwnership

    torch.set_num_threads(1)
    keep = RowOwnership(args.vocab, args.dp, "interleaved").owned_ids(args.rank)
    init = lambda t: torch.nn.init.normal_(t, mean=0.0, std=0.02)  # noqa: E731
    part = args.width // args.tp
    before = current_rss_bytes()
    torch.manual_seed(1234)
    start = time.perf_counter()
    drawn = []
    for _ in range(args.layers):  # model build: every STEM layer of the chunk draws its table
        if args.way == "full":
            table = torch.empty(args.vocab, part)
            _initialize_affine_weight_cpu(table, args.vocab, args.width, part, 1, init,
                                          params_dtype=torch.float32, rank=0,
                                          world_size=args.tp,
                                          skip_set_tensor_parallel_attributes=True)
            drawn.append(InitialRows(table))
        else:
            drawn.append(draw_rows(args.vocab, args.width, 0, args.tp, init, keep))
    owned = []
    for rows in drawn:  # the store: each layer's owned rows, the drawn values let go
        owned.append(rows.values[rows.rows(keep)])
    del drawn, rows
    seconds = time.perf_counter() - start
    checksum = float(sum(t.double().sum() for t in owned))
    return {"way": args.way, "peak_bytes": peak_rss_bytes() - before, "seconds": seconds,
            "kept_bytes": sum(t.numel() * 4 for t in owned), "checksum": checksum}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--width", type=int, default=8192, help="d_ff")
    p.add_argument("--layers", type=int, default=2, help="STEM layers of the rank's chunk")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks sharing the rows")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--way", choices=["full", "blocks"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.way is not None:
        print(json.dumps(child(args)))
        return 0
    need = args.layers * args.vocab * args.width // args.tp * 4 + args.vocab * args.width * 4
    print(f"{args.layers} STEM layers x [{args.vocab}, {args.width}/{args.tp}], DP={args.dp} "
          f"(rank {args.rank}); the full draw needs about {need / 2**30:.1f} GiB", flush=True)
    results = {}
    for way in ("full", "blocks"):
        cmd = [sys.executable, os.path.abspath(__file__), "--way", way] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "width", "layers", "dp", "rank", "tp")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"the {way} way failed (exit code {out.returncode}: out of memory?)")
        results[way] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[way]
        print(f"  {way:<7} peak {r['peak_bytes'] / 2**30:7.2f} GiB over the start, "
              f"{r['seconds']:6.1f} s, kept {r['kept_bytes'] / 2**30:.2f} GiB", flush=True)
    full, blocks = results["full"], results["blocks"]
    if blocks["checksum"] != full["checksum"]:
        raise SystemExit(f"the two ways kept different values (checksums {full['checksum']!r} "
                         f"and {blocks['checksum']!r})")
    summary = {"peak_ratio": blocks["peak_bytes"] / full["peak_bytes"],
               "time_ratio": blocks["seconds"] / full["seconds"], **results,
               "shape": {k: getattr(args, k) for k in ("vocab", "width", "layers", "dp", "tp")}}
    print(f"blocks vs full: peak memory {summary['peak_ratio']:.3f}x, time "
          f"{summary['time_ratio']:.3f}x (same values: checksum {full['checksum']:.6g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps({"peak_ratio": round(summary["peak_ratio"], 4),
                      "time_ratio": round(summary["time_ratio"], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
