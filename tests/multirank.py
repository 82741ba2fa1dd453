"""Run ``launch/pretrain.py`` as several gloo ranks (as torchrun starts them) and read back the loss
curve."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from rank_server import clock_ticks, start_rank, suite_env, sweep_sessions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")

# A tiny model on Megatron's mock data, deterministic: dropout off.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seed", "1234",
    "--ckpt-format", "torch_dist",
    # gloo, CPU initialization and no fused CUDA kernels: the CPU backend's defaults
    # (megatron_ext/compat/cpu.py, CPU_DEFAULT_FLAGS).
]


# Rendezvous ports of the launches: below the kernel's ephemeral range (32768-60999 on Linux), so
# that no socket opened by another launch's ranks (gloo binds its connections to ephemeral ports)
# can take one between its choice and rank 0's bind, as a port from bind(0) could when test files
# run in parallel (scripts/test.sh: pytest-xdist). Each xdist worker counts up through a block of
# its own from a random start (two test sessions on one machine rarely meet), skipping ports in use.
_PORT_BLOCK = 1500
_next_port = None


def launch_port() -> int:
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 8) * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        if _next_port is None or not low <= _next_port < low + _PORT_BLOCK:
            _next_port = low + random.randrange(_PORT_BLOCK)
        port = _next_port
        _next_port = low + (port + 1 - low) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}..{low + _PORT_BLOCK - 1}")


@dataclass
class Run:
    name: str
    returncode: int
    log: str
    losses: Dict[int, float]
    scalars: Dict[str, List] = None  # every tensorboard tag: [(step, value), ...]

    def curve(self, iterations: Sequence[int]) -> List[float]:
        return [self.losses[i] for i in iterations]


def launch_ranks(argv: Sequence[str], nproc: int, env: Optional[Dict[str, str]] = None,
                 timeout: int = 600, fork: bool = True) -> Tuple[int, str]:
    """Run ``python argv`` as ``nproc`` ranks on this machine, as torchrun's static rendezvous
    would start them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``), without torchrun's agent process, whose start-up and
    shutdown added seconds to every launch, and, unless ``env`` adds to the environment or
    ``fork`` is False, forked from a process that has imported torch and Megatron
    (``tests/rank_server.py``). When a rank fails the others are stopped, as torchrun does, and
    once the ranks are done so is every process they left in their sessions
    (``rank_server.sweep_sessions``). Returns the first non-zero exit status (0 if none) and the
    ranks' output, rank 0 first. A launch past ``timeout`` seconds is stopped and
    raises ``subprocess.TimeoutExpired``."""
    port = launch_port()
    base = dict(suite_env(), **(env or {}))
    outputs = []
    for _ in range(nproc):
        fd, path = tempfile.mkstemp(prefix="rank", suffix=".log")
        os.close(fd)
        outputs.append(path)
    procs = []
    since = clock_ticks() - 1  # start times in ticks round down: one tick of margin
    for rank in range(nproc):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        procs.append(start_rank(argv, rank_env, ROOT, outputs[rank], fork))

    def stop_all() -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.wait()
        # What a rank started and left running (its session outlives it): ended too, whether the
        # rank failed, was stopped or exited cleanly.
        sweep_sessions([p.pid for p in procs], since)

    deadline = time.monotonic() + timeout
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                time.sleep(1.0)  # let the others report the failure too, then stop them
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                stop_all()
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            time.sleep(0.05)
    finally:
        stop_all()
    log = ""
    for path in outputs:
        with open(path) as f:
            log += f.read()
        os.unlink(path)
    return status, log


def torchrun(name: str, workdir: str, flags: Sequence[str], nproc: int = 2,
             timeout: int = 600, env: Optional[Dict[str, str]] = None,
             entry: str = PRETRAIN) -> Run:
    """One training launch; its tensorboard scalars go to ``workdir/name/tb``. ``env`` is added to
    the environment of the launch; ``entry``: the script the ranks run (``launch/pretrain.py``,
    or a wrapper of it that takes the same flags)."""
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    out_dir = os.path.join(workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    tb = os.path.join(out_dir, "tb")
    argv = [entry, *flags, "--tensorboard-dir", tb, "--tensorboard-log-interval", "1"]
    returncode, log = launch_ranks(argv, nproc, env, timeout)
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(f"({nproc} ranks) {sys.executable} " + " ".join(argv) + "\n" + log)
    losses: Dict[int, float] = {}
    scalars: Dict[str, List] = {}
    if returncode == 0:
        scalars = read_tensorboard_scalars(tb)
        losses = dict(scalars.get("lm loss", []))  # none when the run trains no step
    return Run(name, returncode, log, losses, scalars)


MULTI_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist", "multi_config.py")


def plan_item_logs(item: dict, nproc: int) -> Tuple[List[str], bool]:
    """The ranks' logs of one item of a ``multi_config.py`` plan that exist, and whether every
    rank finished it (``MULTI-CONFIG OK <name>``)."""
    logs = []
    for rank in range(nproc):
        path = os.path.join(item["log_dir"], f"rank{rank}.log")
        if os.path.exists(path):
            with open(path) as f:
                logs.append(f.read())
    done = len(logs) == nproc and all(f"MULTI-CONFIG OK {item['name']}" in t for t in logs)
    return logs, done


def torchrun_many(workdir: str, items: Sequence[tuple], nproc: int = 2,
                  timeout: int = 600, env: Optional[Dict[str, str]] = None) -> Dict[str, Run]:
    """``torchrun`` of each ``(name, flags)`` or ``(name, flags, options)`` in order, all in one
    launch of ``nproc`` ranks (``tests/dist/multi_config.py``: one start-up, Megatron's state torn
    down between trainings; ``options``: its ``expect_failure`` and ``thread_guard``). Each
    ``Run`` is what ``torchrun`` would give, its log being its ranks' output; a training after a
    failed one is not run (return code -1), unless that one was expected to fail.
    ``timeout`` is per training."""
    from megatron_ext.tools.metrics import read_tensorboard_scalars

    plan, dirs = [], {}
    for name, flags, *options in items:
        out_dir = dirs[name] = os.path.join(workdir, name)
        os.makedirs(out_dir, exist_ok=True)
        argv = [*flags, "--tensorboard-dir", os.path.join(out_dir, "tb"),
                "--tensorboard-log-interval", "1"]
        plan.append({"name": name, "argv": argv, "log_dir": os.path.join(out_dir, "ranks"),
                     **(options[0] if options else {})})
    plan_path = os.path.join(workdir, f"plan_{items[0][0]}.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    # The guard wraps torch.distributed before Megatron imports it: ranks exec'd, not forked
    # from the server that has imported Megatron (tests/rank_server.py).
    fork = not any(item.get("thread_guard") for item in plan)
    status, launch_log = launch_ranks([MULTI_CONFIG, plan_path], nproc, env,
                                      timeout * len(items), fork=fork)
    runs: Dict[str, Run] = {}
    for item in plan:
        name, out_dir = item["name"], dirs[item["name"]]
        logs, done = plan_item_logs(item, nproc)
        log = "".join(logs)
        failed = re.search(rf"MULTI-CONFIG FAILED {re.escape(name)} status (\d+)", log)
        if failed:  # an expected failure, the launch went on
            returncode, done = int(failed.group(1)), True
        else:
            returncode = 0 if done else (status or 1) if logs else -1
        if not done:
            log += f"\n[launch of {len(plan)} trainings, status {status}]\n" + launch_log
        with open(os.path.join(out_dir, "log.txt"), "w") as f:
            f.write(f"({nproc} ranks, in one launch with {[p['name'] for p in plan]}) "
                    f"{sys.executable} {PRETRAIN} " + " ".join(item["argv"]) + "\n" + log)
        losses: Dict[int, float] = {}
        scalars: Dict[str, List] = {}
        if returncode == 0:
            scalars = read_tensorboard_scalars(os.path.join(out_dir, "tb"))
            losses = dict(scalars.get("lm loss", []))
        runs[name] = Run(name, returncode, log, losses, scalars)
    return runs


class Launches:
    """The trainings of a test module, added in the order they must run (a resume after the
    run that saves its checkpoint). ``run()`` launches them: consecutive ones with the same rank
    count and environment share one launch (``torchrun_many``); one with another ``entry`` or
    ``alone=True`` runs by itself (``torchrun``). ``fails=True``: a training expected to fail;
    with one rank it stays in the shared launch, which goes on after it, with several it runs by
    itself (a rank that fails alone would leave the others waiting in a collective).
    ``thread_guard=True``: every collective of its launch is wrapped and its log gets each rank's
    calls (``tests/dist/thread_guard.py``)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.items: List[tuple] = []

    def add(self, name: str, flags: Sequence[str], nproc: int = 2,
            env: Optional[Dict[str, str]] = None, entry: str = PRETRAIN,
            alone: bool = False, fails: bool = False, thread_guard: bool = False) -> None:
        options = {}
        if fails and nproc == 1:
            options["expect_failure"] = True
        elif fails:
            alone = True
        if thread_guard:
            if alone or entry != PRETRAIN:
                raise ValueError(f"{name}: thread_guard runs in a shared launch of PRETRAIN")
            options["thread_guard"] = True
        self.items.append((name, list(flags), nproc, dict(env or {}), entry, alone, options))

    def run(self) -> Dict[str, Run]:
        runs: Dict[str, Run] = {}
        group: List[tuple] = []

        def flush():
            if group:
                nproc, env = group[0][2], group[0][3]
                runs.update(torchrun_many(self.workdir, [(g[0], g[1], g[6]) for g in group],
                                          nproc, env=env))
                group.clear()

        for item in self.items:
            name, flags, nproc, env, entry, alone, _ = item
            if alone or entry != PRETRAIN:
                flush()
                runs[name] = torchrun(name, self.workdir, flags, nproc=nproc, env=env or None,
                                      entry=entry)
                continue
            if group and (group[0][2], group[0][3]) != (nproc, env):
                flush()
            group.append(item)
        flush()
        return runs


def assert_close_curves(a: Run, b: Run, iterations: Sequence[int], tol: float = 1e-5) -> None:
    ca, cb = a.curve(iterations), b.curve(iterations)
    diffs = [abs(x - y) for x, y in zip(ca, cb)]
    assert max(diffs) <= tol, f"{a.name} vs {b.name}: {ca} vs {cb} (max diff {max(diffs):.2e})"


def assert_close_scalars(a: Run, b: Run, tag: str, iterations: Sequence[int],
                         rel: float = 1e-5) -> None:
    """The tensorboard scalar ``tag`` of ``a`` and ``b`` at ``iterations``, within ``rel`` of
    ``b``'s (e.g. ``grad-norm``: a wrong gradient shows in it at the step it is made, before the
    losses it moves)."""
    va, vb = dict(a.scalars[tag]), dict(b.scalars[tag])
    diffs = [abs(va[i] - vb[i]) / abs(vb[i]) for i in iterations]
    assert max(diffs) <= rel, (f"{a.name} vs {b.name}, {tag}: {[va[i] for i in iterations]} vs "
                               f"{[vb[i] for i in iterations]} (max relative diff "
                               f"{max(diffs):.2e})")


def assert_teardown_left_only_the_default_group(runs) -> None:
    """Every training of ``runs`` (a fixture's ``{name: Run}``, other values ignored, or Runs;
    each in a shared launch) left only the default process group registered after its teardown,
    and every rank as many gloo threads as the default group has (``MULTI-CONFIG LEFT`` lines,
    ``tests/dist/multi_config.py``): a group still referenced after its training, or a model kept
    alive with its groups, shows as more threads, and over a launch as a growing count."""
    threads = {}
    runs = runs.values() if isinstance(runs, dict) else runs
    for run in (r for r in runs if isinstance(r, Run)):
        name = run.name
        found = re.findall(r"MULTI-CONFIG LEFT process groups (\d+) gloo threads (\d+)", run.log)
        assert found, f"{name}: no teardown report (not in a shared launch?)"
        for rank, (groups, count) in enumerate(found):
            assert int(groups) == 1, (name, rank, int(groups))
            threads.setdefault(int(count), []).append((name, rank))
    assert len(threads) == 1 and min(threads) > 0, {k: v[:4] for k, v in threads.items()}


def require_ok(run: Run) -> Run:
    assert run.returncode == 0, f"{run.name} failed:\n{run.log[-6000:]}"
    return run
