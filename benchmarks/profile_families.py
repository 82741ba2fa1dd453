"""A PyTorch-profiler trace of each family benchmark's step against its baseline's, one command.

    .venv/bin/python benchmarks/profile_families.py --out OUT [--json OUT.json]  # GPU
    .venv/bin/python benchmarks/profile_families.py --out OUT --shape tiny  # CPU: the code path

Runs each family benchmark with ``--profile OUT/<benchmark>`` (``benchmarks/common.py``'s
``profile_sides``), one process each, in turn, each under ``--timeout`` seconds:

* ``structmoe_step``: the 0.9B-shaped GPT step, dense against each StructMoE backend and
  dense-masked with ``D'_ff`` stored padded (``--pad-to 128``, as the runner's timing step);
* ``stem_mlp``: the MLP's forward + backward, dense SwiGLU against STEM (PyTorch path, and the
  fused kernel on a GPU with Triton);
* ``sigma_step``: 8 layers at sequence 4096, upstream's aux-loss router against Sigma's.

Each side runs its warm-up, then ``--steps`` profiled steps (CPU and CUDA activities), and
leaves ``OUT/<benchmark>/trace_<side>.json.gz`` (at most 20 MB each; over it the trace keeps only
the GPU's timeline, see ``common.keep_trace``) and ``OUT/<benchmark>/profile.json``: per side the
summary of ``megatron_ext/tools/trace_summary.py`` (GPU time per kernel, the main stream's idle
time, the host's synchronisations), and per side against its baseline where the extra time goes:
per kernel name the difference in milliseconds per step, the rows adding up to the difference of
the totals. ``--json`` gathers every benchmark's ``profile.json`` (or its failure: status and
reason) in one file, rewritten after each benchmark; the script exits 1 when one failed, after
writing it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import failure_reason  # noqa: E402

# Per benchmark: its script and the flags of the shape profiled (the ones the runner's timing
# steps use; the scripts' own defaults on a GPU), and of a tiny shape for the CPU.
BENCHMARKS = {
    "structmoe_step": ("benchmarks/structmoe_step.py", ["--pad-to", "128"],
                       ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128",
                        "--experts", "4", "--rank", "8", "--seq", "32", "--vocab", "256",
                        "--warmup", "1", "--backends", "dense-masked", "--pad-to", "128"]),
    "stem_mlp": ("benchmarks/stem_mlp.py", [],
                 ["--hidden", "64", "--ffn", "128", "--vocab", "256", "--tokens", "64",
                  "--warmup", "1"]),
    "sigma_step": ("benchmarks/sigma_step.py", ["--layers", "8", "--seq", "4096"],
                   ["--layers", "2", "--hidden", "64", "--heads", "4", "--groups", "2",
                    "--experts", "8", "--expert-ffn", "32", "--seq", "32", "--vocab", "256",
                    "--warmup", "1"]),
}


def command(name: str, out: str, shape: str, steps: int) -> list:
    script, full, tiny = BENCHMARKS[name]
    return [sys.executable, script, *(tiny if shape == "tiny" else full),
            "--profile", os.path.join(out, name), "--profile-steps", str(steps)]


def profile_one(name: str, out: str, shape: str, steps: int, timeout: float) -> dict:
    """One benchmark profiled in its own process: its ``profile.json`` with ``status`` "ok", or
    ``status`` "failed"/"timeout" and ``reason``; its output in ``OUT/<name>/log.txt``."""
    run_dir = os.path.join(out, name)
    os.makedirs(run_dir, exist_ok=True)
    result_path = os.path.join(run_dir, "profile.json")
    if os.path.exists(result_path):  # an earlier call's: not this one's
        os.remove(result_path)
    argv = command(name, out, shape, steps)
    t0 = time.time()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        try:
            rc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1")
                                ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = round(time.time() - t0, 1)
    with open(os.path.join(run_dir, "log.txt")) as f:
        text = f.read()
    if rc is None:
        return {"status": "timeout", "reason": f"no profile within --timeout={timeout:g} s",
                "seconds": seconds}
    if rc != 0 or not os.path.exists(result_path):
        return {"status": "failed", "seconds": seconds,
                "reason": failure_reason(text, rc) if rc else "exit 0 without profile.json"}
    with open(result_path) as f:
        return {"status": "ok", "seconds": seconds, **json.load(f)}


def write(results: dict, path) -> None:
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the traces and profiles")
    parser.add_argument("--json", default=None, help="every benchmark's profile in one file")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                        help=f"comma list of {', '.join(BENCHMARKS)}")
    parser.add_argument("--shape", choices=["full", "tiny"], default="full",
                        help="tiny: a CPU-sized run of the same code")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per side")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds per benchmark, start-up and trace export included")
    args = parser.parse_args(argv)
    names = [n for n in args.benchmarks.split(",") if n]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"--benchmarks: {unknown} are not among {', '.join(BENCHMARKS)}")
    results = {}
    for name in names:
        print(f"[profile] {name}: {' '.join(command(name, args.out, args.shape, args.steps))}",
              flush=True)
        r = profile_one(name, args.out, args.shape, args.steps, args.timeout)
        results[name] = r
        write(results, args.json)
        if r["status"] != "ok":
            print(f"[profile] {name}: {r['status']}: {r['reason']} "
                  f"(log {os.path.join(args.out, name, 'log.txt')})", flush=True)
            continue
        print(f"[profile] {name}: {r['seconds']} s", flush=True)
        from megatron_ext.tools.trace_summary import describe_diff

        for side, d in r["diffs"].items():
            print(f"  {side} vs {r['base']}, per step:")
            for line in describe_diff(d, r["base"], side):
                print("    " + line, flush=True)
    failed = [f"{n} ({r['status']})" for n, r in results.items() if r["status"] != "ok"]
    if failed:
        print(f"[profile] not profiled: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
