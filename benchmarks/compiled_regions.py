"""Kernels each compiled region launches (``--structmoe-compile routed``, ``--sigma-compile
router``, ``--stem-compile gate``; ``megatron_ext/compiled.py``), forward and backward graph, read
from the code Inductor generates for this machine: fused kernels (Triton on a GPU, C++ on the
CPU), extern calls (GEMMs: cuBLAS, or the CPU's BLAS) and ATen fallbacks (ops Inductor does not
generate, such as top-k). Set them against the eager regions' aten ops per layer of
``benchmarks/routed_ops.py`` and the GPU profile's kernels.

    .venv/bin/python benchmarks/compiled_regions.py            # the CPU: C++ kernels
    .venv/bin/python benchmarks/compiled_regions.py --device cuda --dtype bf16

Shapes: the routed_ops/structmoe_step tokens (``--tokens``), StructMoE L = 16 experts of rank
16, top-1 (``structmoe_step``), Sigma 96 experts top-1 (``sigma_step``), STEM d_ff 5632 (the
product only; ``stem_mlp``). Counts, not times: the benchmarks time the regions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launches(code: str) -> dict:
    """Kernel launches in the ``call`` function of one generated module (comments left out)."""
    body = code[code.index("def call("):] if "def call(" in code else code
    body = "\n".join(line.split("#", 1)[0] for line in body.splitlines())
    return {"fused": len(re.findall(r"\b(?:triton_\w+\.run|cpp_fused_\w+)\(", body)),
            "extern": len(re.findall(r"\bextern_kernels\.\w+\(", body)),
            "fallback": sorted(re.findall(r"\b(?:torch\.ops\.)?aten\.(\w+)\.\w+\(", body))}


def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]


def eager_ops(fn, args, kwargs) -> list:
    """``[forward, backward]`` aten ops that compute, of ``fn`` run eagerly (the op recorder of
    ``benchmarks/routed_ops.py``: on a GPU each is a kernel); the backward from gradients made
    beforehand, as the compiled count's."""
    from megatron_ext.tools.host_syncs import Recorder

    with Recorder() as fwd:
        outs = _outputs(fn(*args, **kwargs))
    grads = [torch.randn_like(o) for o in outs]
    with Recorder() as bwd:
        torch.autograd.backward(outs, grads)
    return [sum(fwd.kernels.values()), sum(bwd.kernels.values())]


def count(fn, args, kwargs) -> list:
    """``[forward, backward]`` launches of ``fn`` compiled as the families compile it."""
    from torch._inductor.utils import run_and_get_code

    from megatron_ext.compiled import compile_region

    torch._dynamo.reset()
    compiled = compile_region(fn)

    def run():
        outs = _outputs(compiled(*args, **kwargs))
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])

    _, codes = run_and_get_code(run)
    return [launches(c) for c in codes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="of the activations (default: bf16 on a GPU, fp32 on the CPU); "
                             "routers are fp32 as in training")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()

    from megatron_ext.sigma.router import compiled_routing
    from megatron_ext.stem.mlp import gate_product
    from megatron_ext.structmoe.balance import lbl_statistics
    from megatron_ext.structmoe.routed import dense_masked_route_tail, route_head

    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    n, h, e, r, sigma_e, ffn = args.tokens, 2048, 16, 16, 96, 5632
    torch.manual_seed(0)

    def leaf(*shape, dt=torch.float32):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=True)

    logits = leaf(n, e)
    probs = torch.softmax(logits.detach(), -1).requires_grad_(True)
    sigma_state = [torch.zeros(3 * sigma_e + 2, device=dev)] + \
        [torch.rand(sigma_e, device=dev), torch.rand(sigma_e, device=dev),
         torch.rand(1, device=dev)]
    sigma_kw = dict(topk=1, pre_softmax=True, num_groups=None, group_topk=None,
                    scaling_factor=None, score_function="softmax", coeff=1e-3,
                    temperature=1.0, scale=1e-3 / n)
    regions = {
        "structmoe dense-masked tail": (dense_masked_route_tail,
                                        (logits, leaf(n, h, dt=dtype), leaf(e, h, r, dt=dtype), 1),
                                        {}),
        "structmoe router head (grouped, reference)": (route_head, (logits, 1), {}),
        "structmoe load-balancing statistics": (lbl_statistics,
                                                (probs, torch.topk(probs, 1).indices), {}),
        "sigma routing + statistics (global)": (compiled_routing, (leaf(n, sigma_e),
                                                                   *sigma_state),
                                                dict(sigma_kw, lbl="global")),
        "sigma routing + statistics (top1)": (compiled_routing, (leaf(n, sigma_e),
                                                                 *sigma_state),
                                              dict(sigma_kw, lbl="top1")),
        "stem gate product (up)": (gate_product, (leaf(n, 1, ffn, dt=dtype),
                                                  leaf(n, 1, ffn, dt=dtype), "up", F.silu), {}),
    }
    result = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "tokens": n, "regions": {}}
    print(f"Kernels per compiled region | {result['device']} {result['dtype']} | {n} tokens")
    print(f"  {'region':44s} {'eager ops fwd/bwd':>17s} {'compiled forward':>30s} "
          f"{'compiled backward':>30s}")
    for name, (fn, a, kw) in regions.items():
        eager = eager_ops(fn, a, kw)
        graphs = count(fn, a, kw)
        result["regions"][name] = {"eager_ops": eager, "compiled": graphs}
        cells = [f"{g['fused']} fused, {g['extern']} extern, {len(g['fallback'])} fallback"
                 for g in graphs]
        print(f"  {name:44s} {f'{eager[0]} / {eager[1]}':>17s} "
              + " ".join(f"{c:>30s}" for c in cells)
              + ("  (" + ", ".join(sorted({f for g in graphs for f in g["fallback"]})) + ")"
                 if any(g["fallback"] for g in graphs) else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
