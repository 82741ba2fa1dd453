"""The host's time per training step of the routed families, at a shape where compute is ~0.

    .venv/bin/python benchmarks/host_overhead.py                 # CPU or GPU, 8 tiny layers
    .venv/bin/python benchmarks/host_overhead.py --json host_overhead.json

Is a family's step slower because its GPU work is, or because the host takes longer to issue it?
At a tiny shape (8 layers, H = 64, 16 tokens, vocabulary 256) the kernels take next to nothing,
so a step's time is the host's: Python, Megatron's modules, autograd and each op's dispatch and
launch. Two comparisons, each the same GPT built by the family's step benchmark with only the
family's piece changed:

* StructMoE (``benchmarks/structmoe_step.py``'s ``build``): dense against each routed backend
  (``--backends``; triton on a GPU only);
* Sigma (``benchmarks/sigma_step.py``'s ``build``): upstream's ``TopKRouter`` with
  ``aux_loss`` against ``SigmaRouter`` with the global LBL and its end of the global batch.

Each side's step (forward, LM loss, backward) is timed by ``benchmarks/common.py``'s ``timed``
in ``--repeats`` alternating runs (A B B A): ``host_ms``, the time until the step returned
(without the device sync), and ``step_ms``, with it; on the CPU the two are equal. Per side
other than the baseline: the extra host time per step and per layer in each run
(``extra_host_ms_per_layer_runs``), and the host-time ratio (``host_ratio_runs``).

On the CPU every torch call also passes through the CPU backend's ``TorchFunctionMode``
(``megatron_ext/compat/cpu.py``: CUDA device arguments rewritten to the CPU; never installed
with a GPU), which inflates both sides. It cannot be switched off for the step (Megatron makes
tensors with ``device="cuda"`` inside it), so its share is estimated: its calls per step per
side, counted in one step, times its cost per call, measured on a plain op with and without the
mode (``compat``; absent on a GPU).

On a GPU the same run gives each side's host time per step at a shape whose kernels take
microseconds: set against ``structmoe_step.py``'s and ``sigma_step.py``'s ``step_ms`` at the
real shapes (``host_ms`` there too), it says how much of those steps the host alone would take.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (RunSetup, add_run_args, alternate_timed, medians,  # noqa: E402
                    report_json, run_ratios, timed, wrap_ddp)

STRUCTMOE_BACKENDS = ("dense-masked", "grouped", "reference", "triton")


def _structmoe_models(args, dtype, device) -> Dict[str, torch.nn.Module]:
    import structmoe_step

    shape = argparse.Namespace(layers=args.layers, hidden=args.hidden, heads=args.heads,
                               ffn=args.ffn, experts=args.experts, rank=args.rank,
                               topk=args.topk, seq=args.seq, vocab=args.vocab)
    models = {}
    for name in ("dense", *args.backends):
        torch.manual_seed(0)
        models[name] = wrap_ddp(structmoe_step.build(
            shape, dtype, None if name == "dense" else name).to(device))
    return models


def _sigma_models(args, dtype, device) -> Dict[str, torch.nn.Module]:
    import sigma_step

    shape = argparse.Namespace(layers=args.layers, hidden=args.hidden, heads=args.heads,
                               groups=args.groups, experts=args.sigma_experts,
                               expert_ffn=args.sigma_expert_ffn, topk=args.topk, seq=args.seq,
                               vocab=args.vocab)
    models = {}
    for name in ("upstream", "sigma"):
        torch.manual_seed(0)
        models[name] = wrap_ddp(sigma_step.build(shape, dtype, name).to(device))
        models[name].train()
    return models


def compat_calls(step: Callable[[], None]) -> int:
    """Calls of the CPU backend's ``TorchFunctionMode`` in one ``step()`` (0 when it is not
    installed): the mode is swapped for a counting copy of itself for that step."""
    from megatron_ext.compat import cpu

    mode = cpu._mode
    if mode is None:
        return 0
    count = [0]

    class Counting(type(mode)):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            count[0] += 1
            return super().__torch_function__(func, types_, args, kwargs)

    mode.__exit__(None, None, None)
    try:
        with Counting():
            step()
    finally:
        mode.__enter__()
    return count[0]


def compat_us_per_call(calls: int = 20000, rounds: int = 5) -> float:
    """Microseconds the CPU backend's mode adds to one torch call: a loop of a small op
    (``Tensor.add``, no device argument, so it runs the same without the mode) timed with the
    mode and with it suspended, in alternating rounds, the best round of each."""
    from megatron_ext.compat import cpu

    mode = cpu._mode
    if mode is None:
        return 0.0
    x = torch.zeros(4)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            x.add(1.0)
        return time.perf_counter() - t0

    with_mode, without = [], []
    for _ in range(rounds):
        with_mode.append(loop())
        mode.__exit__(None, None, None)
        try:
            without.append(loop())
        finally:
            mode.__enter__()
    return 1e6 * (min(with_mode) - min(without)) / calls


def measure(models: Dict[str, torch.nn.Module], base: str, layers: int, steps, run: RunSetup,
            count_compat: bool) -> dict:
    """One family's sides (``steps``: each side's step): host and step times per run, the extra
    host time of each side over ``base`` per step and per layer, the host-time ratios, and the
    compat mode's calls."""
    step_runs, host_runs = alternate_timed(
        {name: (lambda name=name, m=m: timed(steps[name], m.zero_grad_buffer, run.reps,
                                             run.warmup))
         for name, m in models.items()}, run.repeats)
    extra = run_ratios(host_runs, base, lambda t, b: t - b)
    per_layer = {name: [x / layers for x in v] for name, v in extra.items()}
    ratio = run_ratios(host_runs, base)
    out = {"base": base, "host_ms_runs": host_runs, "host_ms": medians(host_runs),
           "step_ms_runs": step_runs, "step_ms": medians(step_runs),
           "extra_host_ms_runs": extra, "extra_host_ms": medians(extra),
           "extra_host_ms_per_layer_runs": per_layer,
           "extra_host_ms_per_layer": medians(per_layer),
           "host_ratio_runs": ratio, "host_ratio": medians(ratio)}
    if count_compat:
        calls = {}
        for name, m in models.items():
            m.zero_grad_buffer()
            calls[name] = compat_calls(steps[name])
        out["compat_calls_per_step"] = calls
    return out


def main(argv: List[str] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2, help="Sigma's query groups")
    parser.add_argument("--ffn", type=int, default=224, help="dense D_ff of the StructMoE pair")
    parser.add_argument("--experts", type=int, default=16, help="StructMoE's L")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--sigma-experts", type=int, default=8)
    parser.add_argument("--sigma-expert-ffn", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--backends", nargs="+", choices=STRUCTMOE_BACKENDS,
                        default=["triton", "dense-masked", "grouped"] if gpu else
                        ["dense-masked", "grouped"])
    parser.add_argument("--families", default="structmoe,sigma",
                        help="comma-separated: structmoe, sigma")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads (default 1: at this shape there is nothing to "
                             "share, and on a loaded machine OpenMP threads wait for each other "
                             "in every op; seen on the 2-core development machine, dense-masked: "
                             "1.7 s per step with 2 threads at a load of about 25, 26-63 ms with "
                             "1 or 2 at a load of 7-10)")
    add_run_args(parser, gpu_reps=50, cpu_reps=20)
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    for f in families:
        if f not in ("structmoe", "sigma"):
            raise SystemExit(f"--families: {f!r} is not one of structmoe, sigma")
    if args.warmup is None:
        args.warmup = 3

    run = RunSetup(args)
    if not gpu:
        torch.set_num_threads(args.threads)
    device = run.device
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=g).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq, device=device).unsqueeze(0)
    inputs = (tokens, position_ids, labels)
    count_compat = not gpu
    device_name = torch.cuda.get_device_name(0) if gpu else \
        f"cpu ({torch.get_num_threads()} threads)"
    summary = {"device": device_name, "dtype": run.dtype_name, "layers": args.layers,
               "hidden": args.hidden, "tokens": args.seq, "vocab": args.vocab,
               "reps": run.reps, "warmup": run.warmup, "repeats": run.repeats}
    print(f"Host time per step at a tiny shape | {device_name} {run.dtype_name} | "
          f"{args.layers} layers, H={args.hidden}, {args.seq} tokens, vocab {args.vocab}")
    import sigma_step
    import structmoe_step

    # Per family: its models, its baseline side, and a side's step as its step benchmark runs it.
    builders = {"structmoe": (_structmoe_models, "dense",
                              lambda name, m: structmoe_step.step_fn(m, *inputs)),
                "sigma": (_sigma_models, "upstream",
                          lambda name, m: sigma_step.step_fn(name, m, *inputs))}
    for family in families:
        build, base, step_of = builders[family]
        models = build(args, run.dtype, device)
        steps = {name: step_of(name, m) for name, m in models.items()}
        r = measure(models, base, args.layers, steps, run, count_compat)
        summary[family] = r
        for name, host in r["host_ms"].items():
            line = f"  {family:9s} {name:13s}: host {host:8.2f} ms/step"
            if gpu:
                line += f" (step {r['step_ms'][name]:.2f})"
            if name != base:
                line += (f", {r['extra_host_ms_per_layer'][name]:+.3f} ms/layer over {base} "
                         f"(x{r['host_ratio'][name]:.3f}; runs " + " / ".join(
                             f"{x:+.3f}" for x in r["extra_host_ms_per_layer_runs"][name]) + ")")
            if count_compat:
                line += f"  | compat calls/step {r['compat_calls_per_step'][name]}"
            print(line)
    if count_compat:
        us = compat_us_per_call()
        est = {f: {name: calls * us / 1e3
                   for name, calls in summary[f]["compat_calls_per_step"].items()}
               for f in families}
        summary["compat"] = {
            "us_per_call": us, "est_ms_per_step": est,
            "note": "the CPU backend's TorchFunctionMode (never on a GPU): calls per step "
                    "counted, cost per call measured on Tensor.add with and without it"}
        print(f"  CPU backend's torch-function mode: {us:.2f} us per call; estimated ms per "
              "step: " + "; ".join(f"{name} {ms:.2f}" for f in families
                                    for name, ms in est[f].items()))
    report_json(summary, run.json_path)
    return summary


if __name__ == "__main__":
    main()
