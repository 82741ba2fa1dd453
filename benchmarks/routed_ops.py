"""Kernels and host syncs per layer of the routed paths: StructMoE's MLP per backend against the
dense MLP, Sigma's router against upstream's aux-loss router, forward and backward.

    .venv/bin/python benchmarks/routed_ops.py             # CPU, tiny shape
    .venv/bin/python benchmarks/routed_ops.py --json OUT  # also as JSON

Counted with ``megatron_ext/tools/host_syncs.py``'s recorder (aten ops that compute, no views;
an in-place op counts), in training: aux losses attached, router metrics recorded, the second
step of each (the first creates the metric entries). On a GPU each op is about one kernel launch,
so these are the numbers to set against a profile's kernel list; the flagged syncs are ops that
would make the host wait for a GPU. Counts do not depend on the shape (no data-dependent loop on
these paths), so the default shape is small; the triton backend runs under Triton's interpreter
on the CPU (slow, small shape only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.tools.host_syncs import Recorder, forward_backward  # noqa: E402


def mlp_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                             num_attention_heads=4, gated_linear_unit=args.swiglu,
                             activation_func=F.silu if args.swiglu else F.gelu,
                             add_bias_linear=False, use_cpu_initialization=True)


def mlps(args):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    out = {"dense MLP": MLP(mlp_config(args), subs)}
    for backend in args.backends:
        mlp = StructMoEMLP.as_mlp_submodule(
            submodules=subs, structmoe=StructMoEConfig(
                num_experts=args.experts, rank=args.rank, topk=args.topk, backend=backend),
            config=mlp_config(args), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        mlp.set_layer_number(1)
        out[f"StructMoE {backend}"] = mlp
    return out


def routers(args):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.router import SigmaRouter

    def config(**kw):
        return TransformerConfig(
            num_layers=2, hidden_size=args.hidden, num_attention_heads=4,
            num_moe_experts=args.sigma_experts, moe_router_topk=1, moe_router_pre_softmax=True,
            moe_router_dtype="fp32", moe_ffn_hidden_size=64, ffn_hidden_size=args.ffn,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            use_cpu_initialization=True, moe_token_dispatcher_type="alltoall", **kw)

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    up = TopKRouter(config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3),
                    pgs)
    out = {"upstream TopKRouter aux_loss": up}
    for lbl in ("global", "top1"):
        sig = SigmaRouter(config(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0),
                          pgs, sigma=SigmaConfig(num_layers=2, num_experts=args.sigma_experts,
                                                 topk=1, lbl=lbl, lbl_coeff=1e-3))
        sig.layer_index = 0
        out[f"Sigma router {lbl}"] = sig
    for r in out.values():
        r.set_layer_number(1)
    return out


def count(module, x, end=None) -> dict:
    module.train()
    for _ in range(2):
        fwd, bwd = forward_backward(lambda: module(x))
        with Recorder() as tail:
            if end is not None:
                end()
    return {"forward": sum(fwd.kernels.values()), "backward": sum(bwd.kernels.values()),
            "end_of_step": sum(tail.kernels.values()),
            "syncs": [str(s) for s in fwd.syncs + bwd.syncs + tail.syncs],
            "forward_ops": dict(fwd.kernels), "backward_ops": dict(bwd.kernels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=176, help="dense D_ff")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--sigma-experts", type=int, default=96)
    parser.add_argument("--swiglu", action="store_true", help="SwiGLU MLPs (default GELU)")
    parser.add_argument("--backends", nargs="+", default=["dense-masked", "grouped", "reference"],
                        choices=["dense-masked", "grouped", "reference", "triton"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_ext.compat.standalone import init_single_rank

    init_single_rank()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([1.0]))
    torch.manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, requires_grad=True)
    result = {name: count(m, x) for name, m in mlps(args).items()}
    for name, r in routers(args).items():
        result[name] = count(r, x, getattr(r, "end_global_batch", None))
    print(f"Kernels per layer (aten ops that compute), second training step | H={args.hidden}, "
          f"{'SwiGLU' if args.swiglu else 'GELU'}, StructMoE L={args.experts} r={args.rank} "
          f"k={args.topk}, Sigma {args.sigma_experts} experts top-1")
    print(f"  {'':30s} {'forward':>8s} {'backward':>9s} {'end of step':>12s}  host syncs")
    for name, r in result.items():
        print(f"  {name:30s} {r['forward']:8d} {r['backward']:9d} {r['end_of_step']:12d}  "
              f"{len(r['syncs'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "layers": result}, f, indent=1)


if __name__ == "__main__":
    main()
