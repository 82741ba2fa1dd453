"""What the checksum manifest adds to a checkpoint save (megatron_ext/checkpoint_manifest.py).

A ``torch.distributed.checkpoint`` save (the format under Megatron's ``torch_dist``) of a state
dict of ``--size-mib`` MiB in ``--files`` files is the baseline, measured in the same run:

- ``submit``: what the saving thread pays (handing the folder to the manifest thread);
- ``hash``: the manifest thread's time for the whole checkpoint (off the training thread);
- ``save while hashing``: a second save while the thread hashes the first (the next save
  interval's save cannot be slowed by more than this: the disk and the CPU are shared);
- ``verify``: the load-time check, with 1 and ``--threads`` hashing threads.

    .venv/bin/python benchmarks/checkpoint_manifest.py [--size-mib 1024] [--files 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext import checkpoint_manifest as cm  # noqa: E402


def state_dict(size_mib: int, files: int):
    per = size_mib * 2**20 // 4 // files
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(per, generator=g) for i in range(files)}


def save(sd, folder: str, files: int) -> float:
    start = time.perf_counter()
    writer = dcp.FileSystemWriter(folder, thread_count=files, sync_files=True)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="manifest_bench_", dir=a.dir)
    sd = state_dict(a.size_mib, a.files)
    rows = {k: [] for k in ("save", "submit", "hash", "save while hashing", "verify 1 thread",
                            f"verify {a.threads} threads")}
    try:
        for r in range(a.repeats):
            first, second = os.path.join(root, f"a{r}"), os.path.join(root, f"b{r}")
            rows["save"].append(save(sd, first, a.files))
            writer = cm.ManifestWriter(log=lambda line: None)
            t = time.perf_counter()
            writer.submit(first, r)
            rows["submit"].append(time.perf_counter() - t)
            rows["save while hashing"].append(save(sd, second, a.files))
            writer.wait()
            writer.close()
            rows["hash"].append(writer.written[0]["seconds"])
            t = time.perf_counter()
            cm.verify(first, threads=1)
            rows["verify 1 thread"].append(time.perf_counter() - t)
            t = time.perf_counter()
            cm.verify(first, threads=a.threads)
            rows[f"verify {a.threads} threads"].append(time.perf_counter() - t)
            shutil.rmtree(first)
            shutil.rmtree(second)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(rows["save"])
    print(f"checkpoint of {a.size_mib} MiB in {a.files} files, {a.repeats} repeats (median); "
          f"torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"{'step':<22} {'seconds':>9} {'vs save':>9}")
    for name, values in rows.items():
        m = statistics.median(values)
        print(f"{name:<22} {m:9.4f} {m / base:8.3f}x")
    mib = a.size_mib
    print(f"hashing throughput: {mib / statistics.median(rows['hash']):.0f} MiB/s on one thread; "
          f"the saving thread pays {1e3 * statistics.median(rows['submit']):.2f} ms per save")


if __name__ == "__main__":
    main()
