"""Helpers for the conversion tests: train a checkpoint, get Megatron's logits for it under a
layout, convert it, and get the Hugging Face model's logits."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Sequence

import torch

from multirank import (
    MULTI_CONFIG,
    ROOT,
    TINY_GPT,
    launch_ranks,
    plan_item_logs,
    require_ok,
    torchrun,
)
from rank_server import run_python

VOCAB = 1000  # TINY_GPT's --vocab-size (Megatron pads it to 1024)
SEQ = 64


TIED = "--tied"  # in a test's flags: drop TINY_GPT's --untie-embeddings-and-output-weights


def base(flags: Sequence[str]) -> list:
    """TINY_GPT + ``flags``, with tied embeddings when ``flags`` holds :data:`TIED`."""
    flags = list(flags)
    gpt = list(TINY_GPT)
    if TIED in flags:
        flags.remove(TIED)
        gpt.remove("--untie-embeddings-and-output-weights")
    return gpt + flags


def tokens(seed: int = 0, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def train_flags(workdir: str, name: str, flags: Sequence[str], iters: int = 2,
                extra: Sequence[str] = ()) -> tuple:
    """The flags of a short training run that saves its last iteration, and its --save
    directory (``train``; or add them to a ``multirank.Launches``)."""
    save = os.path.join(workdir, name, "ckpt")
    return base(flags) + ["--train-iters", str(iters), "--save", save, "--save-interval",
                          str(iters), *extra], save


def train(workdir: str, name: str, flags: Sequence[str], nproc: int = 2, iters: int = 2,
          extra: Sequence[str] = ()) -> str:
    """A short training run that saves its last iteration; returns the --save directory."""
    full, save = train_flags(workdir, name, flags, iters, extra)
    require_ok(torchrun(name, workdir, full, nproc=nproc))
    return save


def megatron_logits(workdir: str, name: str, flags: Sequence[str], load: str, ids: torch.Tensor,
                    nproc: int = 2, step: Optional[int] = None) -> torch.Tensor:
    """``megatron_ext.convert.megatron_logits`` under torchrun: ``[b, s, V]`` fp32 (true vocab)."""
    out_dir = os.path.join(workdir, name)
    os.makedirs(out_dir, exist_ok=True)
    tok_path, out_path = os.path.join(out_dir, "tokens.pt"), os.path.join(out_dir, "logits.pt")
    torch.save(ids, tok_path)
    argv = ["-m", "megatron_ext.convert.megatron_logits", "--logits-tokens", tok_path,
            "--logits-out", out_path, *base(flags), "--load", load,
            *(["--ckpt-step", str(step)] if step is not None else [])]
    status, log = launch_ranks(argv, nproc)
    with open(os.path.join(out_dir, "log.txt"), "w") as f:
        f.write(f"({nproc} ranks) " + " ".join(argv) + "\n" + log)
    assert status == 0, f"{name} failed:\n{log[-6000:]}"
    return torch.load(out_path)[..., :VOCAB]


def megatron_logits_many(workdir: str, items: Sequence[tuple], nproc: int = 2
                         ) -> Dict[str, torch.Tensor]:
    """``megatron_logits`` of each ``(name, flags, load, ids, step)`` in order, all in one launch
    of ``nproc`` ranks (``tests/dist/multi_config.py``: one start-up, Megatron's state torn down
    between them). Returns ``{name: [b, s, V] fp32 logits}``; a failure names the item and its
    ranks' output."""
    plan, outs = [], {}
    for name, flags, load, ids, step in items:
        out_dir = os.path.join(workdir, name)
        os.makedirs(out_dir, exist_ok=True)
        tok_path, outs[name] = (os.path.join(out_dir, "tokens.pt"),
                                os.path.join(out_dir, "logits.pt"))
        torch.save(ids, tok_path)
        argv = ["--logits-tokens", tok_path, "--logits-out", outs[name], *base(flags),
                "--load", load, *(["--ckpt-step", str(step)] if step is not None else [])]
        plan.append({"name": name, "module": "megatron_ext.convert.megatron_logits",
                     "argv": argv, "log_dir": os.path.join(out_dir, "ranks")})
    plan_path = os.path.join(workdir, f"logits_plan_{items[0][0]}.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    status, launch_log = launch_ranks([MULTI_CONFIG, plan_path], nproc, timeout=300 * len(plan))
    logits = {}
    for item in plan:
        logs, done = plan_item_logs(item, nproc)
        assert done, (f"{item['name']} failed (launch status {status}):\n"
                      + "".join(logs)[-6000:] + launch_log[-3000:])
        logits[item["name"]] = torch.load(outs[item["name"]])[..., :VOCAB]
    return logits


def reference_logits(checkpoints: Dict[str, tuple], cases: Dict[str, tuple], workdir: str,
                     extra: Sequence[tuple] = ()) -> Dict[str, torch.Tensor]:
    """Megatron's logits (on ``tokens()``) of every case of a conversion test's ``cases``
    (``{case: (model flags, training layout, {evaluation layout: flags}, architecture)}``) under
    each of its evaluation layouts, as ``"<case>_<layout>"``, and of the ``extra`` items
    (``(name, flags, checkpoint case, ids, step)``), in one launch (``megatron_logits_many``).
    A case whose training failed (``checkpoints[case]``: its ``Run`` and --save directory) is
    left out: its test reports the failure."""
    items = []
    for case, (model, _, layouts, _) in cases.items():
        run, ck = checkpoints[case]
        if run.returncode == 0:
            items += [(f"{case}_{name}", model + flags, ck, tokens(), None)
                      for name, flags in layouts.items()]
    for name, flags, case, ids, step in extra:
        run, ck = checkpoints[case]
        if run.returncode == 0:
            items.append((name, flags, ck, ids, step))
    return megatron_logits_many(workdir, items)


def trained(checkpoints: Dict[str, tuple], name: str) -> str:
    """The checkpoint folder of training ``name`` (``{name: (Run, save)}``), which must have
    succeeded."""
    run, save = checkpoints[name]
    require_ok(run)
    return save


def to_hf(load: str, out: str, *args: str) -> str:
    proc = run_python(["-m", "megatron_ext.convert", "to-hf", "--load", load, "--out", out,
                       "--no-progress", *args], cwd=ROOT)
    assert proc.returncode == 0, f"to-hf failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def hf_model(path: str, remote: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote,
                                                dtype=torch.float32).eval()


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()
