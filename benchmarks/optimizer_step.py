"""The optimizer step without Transformer Engine and Apex, as megatron-core 0.19 falls back to
torch for it, against the plugin's replacements, in one run (``docs/scaling.md``, "The optimizer
step without Transformer Engine and Apex").

    .venv/bin/python benchmarks/optimizer_step.py                 # GPU: dense_1b's parameters
    .venv/bin/python benchmarks/optimizer_step.py --preset dense_cpu   # a CPU smoke run

The parameters are the preset's fp32 main parameters, one tensor per model parameter (what
Megatron's distributed optimizer steps at DP=1), with fp32 gradients. Three parts of the step, each
timed on its own, both sides in alternating runs (A B B A), each ratio per run:

* ``adam``: ``torch.optim.AdamW`` as Megatron builds it (lr, betas, eps, weight decay of the
  preset) with torch's default implementation (upstream: foreach on CUDA) against the fused one
  (``--ext-adam-impl auto`` on a GPU, ``megatron_ext/training/adam_impl.py``);
* ``norm``: the gradient norm by upstream's stand-in (``local_multi_tensor_l2_norm``: a host read
  per tensor) against ours (``torch._foreach_norm``, ``compat/upstream_fixes.py``);
* ``clip``: the clipped gradients scaled by upstream's stand-in (``local_multi_tensor_scale``)
  against ours (``torch._foreach_mul_``).

The ``step`` line adds the three parts' medians per run: upstream's fallback against ours, the
optimizer's share of a training step that a training run's own time does not separate. Prints
ms per part and side and the ratios (ours / upstream, lower is better); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_order, timed  # noqa: E402


def parameter_shapes(flags: dict, vocab: int) -> List[tuple]:
    """The model parameters of a GPT preset's flags (Megatron's local layer: fused QKV, gated
    fc1, RMSNorm weights, untied embedding and output layer), one shape each."""
    h, f, layers = flags["hidden-size"], flags["ffn-hidden-size"], flags["num-layers"]
    heads = flags["num-attention-heads"]
    groups = flags.get("num-query-groups", heads) if flags.get("group-query-attention") else heads
    kv = flags.get("kv-channels", h // heads)
    qkv = (heads + 2 * groups) * kv
    per_layer = [(h,), (qkv, h), (h, heads * kv), (h,),
                 ((2 if flags.get("swiglu") else 1) * f, h), (h, f)]
    shapes = [(vocab, h)] + per_layer * layers + [(h,)]
    if flags.get("untie-embeddings-and-output-weights"):
        shapes.append((vocab, h))
    return shapes


def load_preset(name: str) -> tuple:
    """The preset's flags and its vocabulary (the tokenizer's, or ``vocab-size``)."""
    from megatron_ext.training.presets import load_preset_file

    preset = load_preset_file(name)
    flags = preset["flags"]
    vocab = (preset.get("tokenizer") or {}).get("vocab_size") or flags.get("vocab-size")
    if not vocab:
        raise SystemExit(f"--preset {name}: no vocabulary size (tokenizer.vocab_size)")
    return flags, int(vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None,
                        help="a GPT preset of launch/presets (default: dense_1b on a GPU, "
                             "dense_cpu on the CPU)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed calls per part, side and run (default 10 on GPU, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of every side, every other one in the reverse order")
    parser.add_argument("--max-norm", type=float, default=None,
                        help="the clip's max norm (default: 0.1 of the gradients' norm, so "
                             "every step clips)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron_ext.compat import cpu, upstream_fixes
    from megatron_ext.training import adam_impl

    cpu.install()  # without a GPU: upstream's stand-in puts its norm on device="cuda"

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    preset = args.preset or ("dense_1b" if gpu else "dense_cpu")
    reps = args.reps or (10 if gpu else 3)
    flags, vocab = load_preset(preset)
    shapes = parameter_shapes(flags, vocab)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"optimizer step: {preset}, {len(shapes)} tensors, {n / 1e6:,.1f} M fp32 parameters, "
          f"{torch.cuda.get_device_name() if gpu else 'CPU'}", flush=True)

    g = torch.Generator(device=device).manual_seed(0)

    def tensors(scale: float) -> List[torch.Tensor]:
        return [torch.randn(s, generator=g, device=device) * scale for s in shapes]

    params = [torch.nn.Parameter(t) for t in tensors(0.02)]
    grads = tensors(1e-3)
    for p, gr in zip(params, grads):
        p.grad = gr
    hyper = dict(lr=float(flags.get("lr", 3e-4)), weight_decay=float(flags.get("weight-decay", 0.1)),
                 betas=(float(flags.get("adam-beta1", 0.9)), float(flags.get("adam-beta2", 0.95))),
                 eps=float(flags.get("adam-eps", 1e-8)))
    # Both sides step the same tensors (their values drift a little per step; the time does not
    # depend on them); each optimizer keeps its own moments.
    upstream_adam = torch.optim.AdamW(params, **hyper)
    ours_adam = torch.optim.AdamW(params, **hyper)
    if gpu:
        adam_impl.select(ours_adam, "fused")
    fused = all(group["fused"] for group in ours_adam.param_groups)
    ours_norm = upstream_fixes._l2_norm_without_host_reads(local_multi_tensor_l2_norm)
    ours_scale = upstream_fixes._scale_in_few_launches(local_multi_tensor_scale)
    total = float(ours_norm(0, None, [grads], False)[0])
    max_norm = args.max_norm if args.max_norm is not None else 0.1 * total
    coeff = max_norm / (total + 1e-6)

    sides: Dict[str, Dict[str, Callable[[], None]]] = {
        "adam": {"upstream": upstream_adam.step, "ours": ours_adam.step},
        "norm": {"upstream": lambda: local_multi_tensor_l2_norm(0, None, [grads], False)[0].sum(),
                 "ours": lambda: ours_norm(0, None, [grads], False)[0].sum()},
        # Scale by coeff, then back by its inverse: the gradients stay about where they were.
        "clip": {"upstream": lambda: (local_multi_tensor_scale(0, None, [grads, grads], coeff),
                                      local_multi_tensor_scale(0, None, [grads, grads], 1 / coeff)),
                 "ours": lambda: (ours_scale(0, None, [grads, grads], coeff),
                                  ours_scale(0, None, [grads, grads], 1 / coeff))},
    }

    def measure(fn: Callable[[], None]) -> float:
        return 1e3 * statistics.median(timed(fn, lambda: None, reps, args.warmup))

    runs: Dict[str, Dict[str, List[float]]] = {}
    for part, pair in sides.items():
        ms = {name: [0.0] * args.repeats for name in pair}
        for rep, name in run_order(list(pair), args.repeats):
            ms[name][rep] = measure(pair[name])
        if part == "clip":  # two scalings per call, one per clipped step
            ms = {name: [t / 2 for t in v] for name, v in ms.items()}
        runs[part] = ms
    runs["step"] = {name: [sum(runs[p][name][r] for p in sides) for r in range(args.repeats)]
                    for name in ("upstream", "ours")}
    result = {"preset": preset, "device": torch.cuda.get_device_name() if gpu else "cpu",
              "parameters": n, "tensors": len(shapes), "fused_adam": fused,
              "repeats": args.repeats, "reps": reps, "parts": {}}
    for part, ms in runs.items():
        ratios = [o / u for o, u in zip(ms["ours"], ms["upstream"])]
        result["parts"][part] = {"upstream_ms": ms["upstream"], "ours_ms": ms["ours"],
                                 "ratio_runs": ratios,
                                 "upstream_median_ms": statistics.median(ms["upstream"]),
                                 "ours_median_ms": statistics.median(ms["ours"])}
        print(f"  {part:5s}: upstream {statistics.median(ms['upstream']):9.2f} ms, ours "
              f"{statistics.median(ms['ours']):9.2f} ms, ours/upstream per run "
              f"{', '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    if not fused:
        print("  (adam: ours is torch's default off the GPU, as --ext-adam-impl auto runs it)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
