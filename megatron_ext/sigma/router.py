"""Sigma's router: upstream's top-k router plus the global-batch and Top-1 load-balancing losses.

Extends ``megatron.core.transformer.moe.router.TopKRouter``. Routing itself is upstream's (FP32
gating with ``--moe-router-dtype fp32``, pre-softmax top-k so that with top-1 the gate is the
softmax probability and the router learns from the LM loss); upstream's own aux losses are off
(``--moe-router-load-balancing-type none``). What upstream lacks, added here:

* global-batch statistics accumulated over the micro-batches of one global batch and all-reduced
  once per step over the TP x DP x CP group (:meth:`end_global_batch`, called after the gradients
  of the step are finalized);
* a gradient of Eq. 1 / Eqs. 2-4 whose scale does not depend on DP size or micro-batch count
  (see ``sigma/lbl.py`` for exactly what it is). Upstream's ``global_aux_loss`` (0.19.2,
  ``router.py`` ``_apply_global_aux_loss``) normalizes each rank's probabilities by the token count
  of the whole DP group (``get_tokens_per_expert_and_token_count(..., tp_dp_cp_group)``) and then
  the data-parallel gradient reduction averages over DP, so its gradient is the global one divided
  by the DP size; here each rank's term is normalized by its own share of the batch, so the
  DP average gives exactly the global gradient.

The loss is attached with upstream's ``MoEAuxLossAutoScaler`` like every Megatron aux loss, so its
gradient gets the LM loss's factor (loss scale, micro-batches, CP) that Megatron sets per step.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.compiled import compile_region
from megatron_ext.sigma.config import SigmaConfig
from megatron_ext.sigma.lbl import BatchStats, acc_size, coefficients

def sigma_statistics(logits, routing_map, acc, prev_f, prev_fhat, prev_pbar, *, lbl: str,
                     coeff: float, temperature: float, scale: float) -> Optional[torch.Tensor]:
    """Add this micro-batch's statistics into ``acc`` (lbl.ACC_FIELDS, in place) and return its
    load-balancing loss term (None without one): the tensor maths of the router's training
    forward, ``logits`` ``[tokens, N_E]`` in fp32, ``scale`` the coefficient over this rank's
    share of the tokens (``SigmaRouter._statistics_options``)."""
    e = logits.shape[-1]
    scores = torch.softmax(logits, dim=-1)  # P of Eq. 1 (per token)
    # Each per-token sum once: the accumulator takes it detached, the loss term uses it.
    # In-place adds into views of the accumulator: ``acc[a:b] += v`` would add and then copy
    # the sum back onto itself (Python's setitem), a second kernel per statistic.
    p_sum = scores.sum(dim=0)
    with torch.no_grad():
        acc[:e].add_(routing_map.sum(dim=0))
        acc[e:2 * e].add_(p_sum.detach())
    if lbl == "top1":
        q = torch.softmax(logits / temperature, dim=-1)  # Eq. 3
        q_sum = q.sum(dim=0)
        qmax_sum = q.max(dim=-1).values.sum()  # Eq. 4
        with torch.no_grad():
            acc[2 * e:3 * e].add_(q_sum.detach())
            acc[3 * e].add_(qmax_sum.detach())
    if lbl == "none" or coeff == 0:
        return None
    # The coefficient and the normalization are folded into the [N_E] weights (one small
    # multiply, no scalar ops on the loss).
    if lbl == "global":
        return torch.dot(prev_f * (e * scale), p_sum)  # N_E f'_i P_i
    coef = coefficients(prev_f, prev_fhat, prev_pbar)
    return (torch.dot(coef.w_fhat, q_sum) + coef.w_pbar * qmax_sum) * scale


def compiled_routing(logits, acc, prev_f, prev_fhat, prev_pbar, *, topk: int, pre_softmax: bool,
                     num_groups, group_topk, scaling_factor, score_function: str, lbl: str,
                     coeff: float, temperature: float, scale: float):
    """``(probs, routing_map, loss)`` of a training forward: upstream's
    ``topk_routing_with_score_function`` and :func:`sigma_statistics`, the region
    ``--sigma-compile router`` compiles (``logits`` ``[tokens, N_E]``)."""
    probs, routing_map = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
        scaling_factor=scaling_factor, score_function=score_function)
    loss = sigma_statistics(logits.float(), routing_map, acc, prev_f, prev_fhat, prev_pbar,
                            lbl=lbl, coeff=coeff, temperature=temperature, scale=scale)
    return probs, routing_map, loss


def sigma_compile_problem(compile: str, config) -> Optional[str]:
    """Why ``--sigma-compile`` cannot work with these MoE options (one line), or None. The
    compiled region is upstream's plain top-k routing; the router's other upstream features run
    in ``TopKRouter.routing`` only."""
    if compile == "none":
        return None
    # ``config``: the TransformerConfig or Megatron's args (the same names).
    blockers = [(getattr(config, "moe_z_loss_coeff", None), "--moe-z-loss-coeff"),
                (getattr(config, "moe_router_enable_expert_bias", False),
                 "--moe-router-enable-expert-bias"),
                (getattr(config, "moe_router_fusion", False), "--moe-router-fusion"),
                (getattr(config, "moe_expert_capacity_factor", None) is not None,
                 "--moe-expert-capacity-factor"),
                (getattr(config, "moe_enable_routing_replay", False),
                 "--moe-enable-routing-replay")]
    for on, flag in blockers:
        if on:
            return (f"--sigma-compile {compile}: the compiled router region is upstream's plain "
                    f"top-k routing, without {flag}; drop {flag} or pass --sigma-compile none")
    return None


def _buffer_device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class SigmaRouter(TopKRouter):
    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *,
                 sigma: SigmaConfig):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.sigma = sigma
        self.layer_index: Optional[int] = None  # 0-based global layer (set by SigmaMoELayer)
        e = config.num_moe_experts
        dev = _buffer_device()
        # Statistics of the previous global batch: the gradient weights of this step. Persistent
        # (identical on every rank), so a resumed run continues with the same weights.
        self.register_buffer("sigma_prev_f", torch.zeros(e, dtype=torch.float32, device=dev))
        self.register_buffer("sigma_prev_fhat", torch.zeros(e, dtype=torch.float32, device=dev))
        self.register_buffer("sigma_prev_pbar", torch.zeros(1, dtype=torch.float32, device=dev))
        # This rank's sums over the micro-batches of the current global batch (lbl.ACC_FIELDS).
        self.register_buffer("sigma_acc", torch.zeros(acc_size(e), dtype=torch.float32,
                                                      device=dev), persistent=False)
        self.last_stats: Optional[BatchStats] = None  # the finished global batch (for logs)
        self._forwards = 0  # training forwards since the last end of a global batch
        # This rank's tokens of those forwards, counted on the host (every forward's count is a
        # shape) and written into sigma_acc once per step (take_tokens) instead of an add per
        # forward.
        self._tokens = 0
        # --sigma-compile router: upstream's routing and the statistics as one compiled region
        # for the training forward (evaluation runs upstream's routing eagerly).
        problem = sigma_compile_problem(sigma.compile, config)
        if problem is not None:
            raise ValueError(problem)
        self._compiled = (compile_region(compiled_routing) if sigma.compile == "router"
                          else None)

    def set_topk(self, topk: int) -> None:
        self.topk = topk

    # -- forward ---------------------------------------------------------------------------------
    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        if self._compiled is not None and padding_mask is None and self.training \
                and torch.is_grad_enabled():
            return self._routing_compiled(logits)
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.training and torch.is_grad_enabled():
            if padding_mask is not None:
                raise NotImplementedError("Sigma load balancing does not support padding masks")
            probs = self._accumulate_and_attach(logits.reshape(-1, self.num_experts).float(),
                                                routing_map, probs)
        return probs, routing_map

    def _accumulate_and_attach(self, logits: torch.Tensor, routing_map: torch.Tensor,
                               probs: torch.Tensor) -> torch.Tensor:
        self._count_forward(logits.shape[0])
        loss = sigma_statistics(logits, routing_map, self.sigma_acc, self.sigma_prev_f,
                                self.sigma_prev_fhat, self.sigma_prev_pbar,
                                **self._statistics_options(logits.shape[0]))
        return probs if loss is None else MoEAuxLossAutoScaler.apply(probs, loss)

    def _count_forward(self, n_local: int) -> None:
        # Host counters, outside any compiled region (a compiled region would specialise on them).
        self._forwards += 1
        self._tokens += n_local

    def _statistics_options(self, n_local: int) -> dict:
        """The constants of :func:`sigma_statistics` for this router and micro-batch. This rank's
        share of the global-batch loss is normalized by its own share of the tokens (n_local
        tokens of one of tp_cp_size sequence shards): summed over TP/CP shards and averaged over
        micro-batches and DP ranks (as Megatron does with every gradient) it gives the gradient
        of the loss over the whole global batch."""
        return dict(lbl=self.sigma.lbl, coeff=self.sigma.lbl_coeff,
                    temperature=self.sigma.top1_temperature,
                    scale=self.sigma.lbl_coeff / (n_local * self.tp_cp_group.size()))

    def _routing_compiled(self, logits: torch.Tensor):
        """``--sigma-compile router``: upstream's top-k routing (what ``TopKRouter.routing``
        runs with Sigma's fixed choices: no z-loss, no token dropping, no expert bias, no aux
        loss of upstream's; ``sigma_compile_problem`` refuses the others) and Sigma's statistics
        and loss, as one compiled region; the loss is attached outside it."""
        e = self.num_experts
        logits2d = logits.view(-1, e)
        self._count_forward(logits2d.shape[0])
        c = self.config
        probs, routing_map, loss = self._compiled(
            logits2d, self.sigma_acc, self.sigma_prev_f, self.sigma_prev_fhat,
            self.sigma_prev_pbar, topk=self.topk, pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            **self._statistics_options(logits2d.shape[0]))
        return probs if loss is None else MoEAuxLossAutoScaler.apply(probs, loss), routing_map

    # -- end of a global batch -------------------------------------------------------------------
    def take_tokens(self) -> None:
        """Add the tokens counted on the host since the last call into ``sigma_acc`` (before
        its all-reduce)."""
        if self._tokens:
            self.sigma_acc[3 * self.num_experts + 1].add_(float(self._tokens))
            self._tokens = 0

    def end_global_batch(self, reduced: Optional[torch.Tensor] = None) -> Optional[BatchStats]:
        """All-reduce this step's sums over TP x DP x CP (unless ``reduced`` holds them already),
        keep the global statistics as next step's gradient weights and for the logs, and clear
        the sums. Collective over the router's TP x DP x CP group; call once per optimizer step
        on every rank."""
        acc = self.sigma_acc
        if reduced is None:
            self.take_tokens()
            reduced = acc.clone()
            if self.tp_dp_cp_group is not None and self.tp_dp_cp_group.size() > 1:
                torch.distributed.all_reduce(reduced, group=self.tp_dp_cp_group)
        stats = BatchStats.from_acc(reduced, self.num_experts, self.topk)
        acc.zero_()
        forwards, self._forwards = self._forwards, 0
        if forwards == 0:  # no training forward in this step (the same on every rank)
            return None
        with torch.no_grad():
            self.sigma_prev_f.copy_(stats.f)
            if self.sigma.lbl == "top1":
                self.sigma_prev_fhat.copy_(stats.fhat)
                self.sigma_prev_pbar.copy_(stats.pbar.reshape(1))
        self.last_stats = stats
        return stats


def end_global_batch(model_chunks) -> Dict[int, BatchStats]:
    """Close the global batch in every Sigma router of ``model_chunks`` (all ranks)."""
    routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, SigmaRouter)]
    if not routers:
        return {}
    # One all-reduce for all layers (they share the TP x DP x CP group).
    group = routers[0].tp_dp_cp_group
    if any(r.tp_dp_cp_group is not group for r in routers):
        reduced = [None] * len(routers)
    else:
        for router in routers:
            router.take_tokens()
        flat = torch.cat([r.sigma_acc for r in routers])
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(flat, group=group)
        reduced = list(flat.split([r.sigma_acc.numel() for r in routers]))
    out = {}
    for router, red in zip(routers, reduced):
        stats = router.end_global_batch(red)
        if stats is not None:
            out[router.layer_index] = stats
    return out
