"""Run ``launch/pretrain.py`` under torchrun with gloo and read back the loss curve."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_ext.compat.standalone import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "launch", "pretrain.py")

# A tiny model on Megatron's mock data, deterministic: dropout off, CPU initialization.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--distributed-backend", "gloo",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--seed", "1234",
    "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
    "--ckpt-format", "torch_dist",
]


@dataclass
class Run:
    name: str
    returncode: int
    log: str
    losses: Dict[int, float]
    scalars: Dict[str, List] = None  # every tensorboard tag: [(step, value), ...]

    def curve(self, iterations: Sequence[int]) -> List[float]:
        return [self.losses[i] for i in iterations]


def torchrun(name: str, workdir: str, flags: Sequence[str], nproc: int = 2,
             timeout: int = 600, env: Optional[Dict[str, str]] = None) -> Run:
    """One training launch; its tensorboard scalars go to ``workdir/name/tb``. ``env`` is added to
    the environment of the launch."""
    from megatron_ext.training.metrics import read_tensorboard_scalars

    out_dir = os.path.join(workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    tb = os.path.join(out_dir, "tb")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", PRETRAIN, *flags,
           "--tensorboard-dir", tb, "--tensorboard-log-interval", "1"]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout + proc.stderr
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    losses: Dict[int, float] = {}
    scalars: Dict[str, List] = {}
    if proc.returncode == 0:
        scalars = read_tensorboard_scalars(tb)
        losses = dict(scalars.get("lm loss", []))  # none when the run trains no step
    return Run(name, proc.returncode, log, losses, scalars)


def assert_close_curves(a: Run, b: Run, iterations: Sequence[int], tol: float = 1e-5) -> None:
    ca, cb = a.curve(iterations), b.curve(iterations)
    diffs = [abs(x - y) for x, y in zip(ca, cb)]
    assert max(diffs) <= tol, f"{a.name} vs {b.name}: {ca} vs {cb} (max diff {max(diffs):.2e})"


def require_ok(run: Run) -> Run:
    assert run.returncode == 0, f"{run.name} failed:\n{run.log[-6000:]}"
    return run
