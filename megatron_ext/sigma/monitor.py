"""End of a global batch and the load-balance logs of the Sigma routers.

* :func:`finalize_model_grads` wraps upstream's ``finalize_model_grads`` (installed as the model
  config's ``finalize_model_grads_func``, which ``megatron.training`` keeps when a model builder
  set it): after the step's gradients are final, every Sigma router all-reduces the statistics of
  the global batch and keeps them (``SigmaRouter.end_global_batch``).
* :func:`report` is a ``training/log_hooks.py`` hook that writes, per layer, the report's load-
  balance views of that global batch to tensorboard/wandb: the relative deviation from uniform
  allocation of the max- and min-loaded expert (Fig. 2a: ``N_E f_i - 1``), the same for the mean
  gate probability ``P`` (Figs. 2b/c compare the spread of ``f`` and ``p``), the coefficient of
  variation of ``f`` and ``P`` across experts, and the LBL value(s).
"""

from __future__ import annotations

import os
from typing import Dict, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads as upstream

from megatron_ext.sigma.router import SigmaRouter, end_global_batch


def finalize_model_grads(model, *args, ext_args=None, **kwargs):
    """Upstream's ``finalize_model_grads``, then the routers' global batch closed; with
    ``--sigma-dump-router-grads`` the routers' gradients written. ``ext_args``: the training's
    (Megatron's global) args, bound by the Sigma family's ``model_state``."""
    result = upstream(model, *args, **kwargs)
    stats = end_global_batch(model)
    margs = ext_args
    if margs is not None and margs.sigma_dump_router_grads:
        dump_router_grads(model, stats, margs.sigma_dump_router_grads, margs.curr_iteration + 1)
    return result


def dump_router_grads(model, stats, directory: str, step: int) -> None:
    """Rank 0 writes ``{layer: {"grad", "f", "p", "fhat", "pbar", "global_lbl", "top1_lbl"}}``
    of its routers (written to a temporary name, then renamed)."""
    if torch.distributed.get_rank() != 0:
        return
    out = {}
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, SigmaRouter):
                w = module.weight
                grad = getattr(w, "main_grad", None)
                grad = grad if grad is not None else w.grad
                st = module.last_stats
                out[module.layer_index] = dict(
                    grad=grad.detach().float().cpu().clone(), f=st.f.cpu(), p=st.p.cpu(),
                    fhat=st.fhat.cpu(), pbar=st.pbar.cpu(), global_lbl=st.global_lbl(),
                    top1_lbl=st.top1_lbl())
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)


def layer_scalars(stats, layer: int, lbl: str) -> Dict[str, float]:
    f_max, f_min = stats.load_deviation()
    p_dev = stats.num_experts * stats.p - 1.0
    out = {
        f"sigma/load_deviation_max_layer_{layer}": f_max,
        f"sigma/load_deviation_min_layer_{layer}": f_min,
        f"sigma/p_deviation_max_layer_{layer}": float(p_dev.max()),
        f"sigma/p_deviation_min_layer_{layer}": float(p_dev.min()),
        f"sigma/f_cv_layer_{layer}": stats.cv(stats.f),
        f"sigma/p_cv_layer_{layer}": stats.cv(stats.p),
        f"sigma/global_lbl_layer_{layer}": stats.global_lbl(),
        f"sigma/topk_layer_{layer}": float(stats.topk),
    }
    if lbl == "top1":
        out[f"sigma/top1_lbl_layer_{layer}"] = stats.top1_lbl()
    return out


def collect(lbl: str, routers: Sequence[SigmaRouter]) -> Dict[str, float]:
    scalars: Dict[str, float] = {}
    for router in routers:
        if router.last_stats is not None:
            scalars.update(layer_scalars(router.last_stats, router.layer_index, lbl))
    return scalars


def report(args, iteration: int, total_loss_dict: dict, writer, wandb_writer,
           routers: Sequence[SigmaRouter]) -> None:
    """The load balance of ``routers`` (this rank's, by layer). Collective over the pipeline
    group (every rank calls it each iteration)."""
    if args.tensorboard_log_interval and iteration % args.tensorboard_log_interval:
        return  # the same decision on every rank (no collective, no host synchronization)
    scalars = collect(args.sigma_lbl, routers)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        gathered = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(
            gathered, scalars, group=parallel_state.get_pipeline_model_parallel_group())
        scalars = {k: v for part in gathered for k, v in part.items()}
    if not scalars:
        return
    for name in ("global_lbl", "top1_lbl"):
        values = [v for k, v in scalars.items() if k.startswith(f"sigma/{name}_layer_")]
        if values:
            scalars[f"sigma/{name}"] = sum(values) / len(values)
    if writer is not None:
        for tag, value in sorted(scalars.items()):
            writer.add_scalar(tag, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)
