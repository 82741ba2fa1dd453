"""Load balancing of StructMoE's router: the Switch loss, routing fractions, and their logging.

The loss is upstream's ``switch_load_balancing_loss_func`` (``L * sum_l f_l P_l`` times the
coefficient, with ``f_l = count_l / (T k)`` the share of the micro-batch's ``T k`` routing slots
given to expert ``l``, summing to 1 over the experts, and ``P_l`` its mean router probability over
the ``T`` tokens; a balanced router gives 1), attached to the routed update through upstream's
``MoEAuxLossAutoScaler``, exactly as Megatron's ``TopKRouter`` does. Two things upstream does only
for models with ``config.num_moe_experts`` (StructMoE is a dense model to Megatron) are done here:

* the autoscaler's gradient scale (loss scale x CP size / micro-batches, as in
  ``megatron.core.pipeline_parallel.schedules.forward_step_calc_loss``) is set by
  :func:`set_aux_loss_scale`, which the forward step calls on every pipeline stage;
* the per-layer values recorded in upstream's ``MoEMetricsTracker`` are reported by a
  ``training/log_hooks.py`` hook on ``training_log`` (upstream reports them there only when
  ``--num-experts`` is set).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.moe.moe_logging import MetricEntry, get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    switch_load_balancing_loss_func,
)

from megatron_ext.structmoe.routed import Routing

LOSS_NAME = "load_balancing_loss"


def fraction_name(expert: int) -> str:
    return f"structmoe_routing_fraction_expert_{expert}"


def tracked_names(num_experts: int) -> List[str]:
    return [LOSS_NAME, *_fraction_names(num_experts)]


def switch_loss(routing: Routing) -> torch.Tensor:
    """The Switch load-balancing loss of one micro-batch (Megatron's definition, micro-batch level).

    Every TP rank holds all tokens of the sequence here (the routed path gathers a sequence-parallel
    input), so the micro-batch statistics need no reduction.
    """
    n, k = routing.indices.shape
    return switch_load_balancing_loss_func(
        probs=routing.probs, tokens_per_expert=routing.tokens_per_expert(), total_num_tokens=n,
        topk=k, num_experts=routing.probs.shape[-1], moe_aux_loss_coeff=1.0)


def lbl_statistics(probs: torch.Tensor, indices: torch.Tensor):
    """``(tokens_per_expert, switch loss)`` of one routing from its probabilities and selected
    experts: what :func:`switch_loss` and ``Routing.tokens_per_expert`` compute, as one pure
    function, the region ``--structmoe-compile routed`` compiles (the counts' scatter-add, the
    probabilities' column sums and the loss's product in a few kernels)."""
    n, k = indices.shape
    flat = indices.reshape(-1)
    counts = torch.zeros(probs.shape[-1], dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    loss = switch_load_balancing_loss_func(
        probs=probs, tokens_per_expert=counts, total_num_tokens=n, topk=k,
        num_experts=probs.shape[-1], moe_aux_loss_coeff=1.0)
    return counts, loss


# The routing fractions of every expert and block as one [L, blocks] tensor, the grid, whose rows
# are the values of the tracker's entries. Upstream's ``tracker.record`` takes one scalar per
# call (two kernels: ``values[i] += v`` is an add and a copy back); recording L fractions that way
# cost 2 L kernel launches per layer and micro-batch (32 at L = 16, more than the routed path's
# own forward), one add into a column of the grid costs one. The grid is found again through the
# entries themselves (each one's values a row view of it).


@functools.lru_cache(maxsize=None)
def _fraction_names(num_experts: int) -> Tuple[str, ...]:
    return tuple(fraction_name(l) for l in range(num_experts))


def _fraction_grid(tracker, num_experts: int, num_blocks: int, device) -> torch.Tensor:
    """``[L, num_blocks]``, row ``l`` being the values of the tracker's entry
    ``fraction_name(l)``; made anew (keeping recorded values) when an entry was replaced or
    dropped (the tracker's ``clear`` zeroes the rows in place, its reduction all-reduces them)."""
    names = _fraction_names(num_experts)
    metrics = tracker.metrics
    first = metrics.get(names[0])
    grid = first.values._base if first is not None else None
    if grid is not None and grid.shape == (num_experts, num_blocks) and all(
            entry is not None and entry.values._base is grid
            and entry.values.data_ptr() == row.data_ptr()
            for entry, row in zip((metrics.get(n) for n in names), grid)):
        return grid
    grid = torch.zeros(num_experts, num_blocks, device=device)
    for l, name in enumerate(names):
        old = metrics.get(name)
        if old is not None and old.values.shape == (num_blocks,):
            grid[l].copy_(old.values)
        metrics[name] = MetricEntry(values=grid[l])
    return grid


@dataclass(frozen=True)
class _Records:
    """Where one MLP block's values go in the tracker, for every block of a model with
    ``num_experts`` experts and ``num_blocks`` blocks: the loss entry's element and the grid's
    column of each block (views made once, not per call), and the entries and tensors they were
    taken from, to check that the tracker still holds them."""

    names: Tuple[str, ...]  # the loss's, then the fractions' in expert order
    entries: Tuple[MetricEntry, ...]  # the tracker's entries of those names
    values: Tuple[torch.Tensor, ...]  # each entry's values when the views were taken
    loss_at: Tuple[torch.Tensor, ...]  # [block - 1]: the loss entry's element
    fractions_at: Tuple[torch.Tensor, ...]  # [block - 1]: the grid's column, [L]

    def held_by(self, metrics) -> bool:
        # The check that runs per layer and micro-batch: identities only, in C loops (an entry
        # dropped, replaced or given other values, by the tracker or by anyone, fails it);
        # checking that the entries are rows of one grid (_fraction_grid) costs ten times more.
        return (all(map(operator.is_, map(metrics.get, self.names), self.entries))
                and all(map(operator.is_, map(_VALUES, self.entries), self.values)))


_VALUES = operator.attrgetter("values")
# Where the records are kept: on upstream's MoEMetricsTracker itself, one per (experts, blocks)
# (models of the same shape record into the same entries), not in a module-level table: they are
# views of the tracker's own tensors, so they live and die with it (a new tracker starts with none).
_RECORDS_ATTR = "_megatron_ext_structmoe_records"


def _records(tracker, num_experts: int, num_blocks: int, device) -> _Records:
    """The tracker's places for the loss and fractions (:class:`_Records`), taken again when
    the tracker no longer holds the ones taken last (cleared entries keep them: ``clear``
    zeroes in place)."""
    key = (num_experts, num_blocks)
    held: Dict[Tuple[int, int], _Records] = tracker.__dict__.setdefault(_RECORDS_ATTR, {})
    rec = held.get(key)
    metrics = tracker.metrics
    if rec is not None and rec.held_by(metrics):
        return rec
    tracker.ensure_initialized(LOSS_NAME, num_blocks, device)
    grid = _fraction_grid(tracker, num_experts, num_blocks, device)
    names = (LOSS_NAME,) + _fraction_names(num_experts)
    entries = tuple(metrics[n] for n in names)
    rec = _Records(names=names, entries=entries, values=tuple(e.values for e in entries),
                   loss_at=entries[0].values.unbind(0), fractions_at=grid.unbind(1))
    held[key] = rec
    return rec


def attach_and_record(update: torch.Tensor, routing: Routing, coeff: float, block: int,
                      num_blocks: int, statistics=None) -> torch.Tensor:
    """Attach ``coeff x loss`` to ``update``'s backward and record the loss (unscaled, as upstream
    does) and the routing fractions of this MLP block (1-based, of ``num_blocks``: the GPT path's
    layers, the hybrid path's ``-`` symbols) for logging. Only while training with autograd on:
    evaluation and the no-grad first pass of activation recomputation record nothing.
    ``statistics``: :func:`lbl_statistics` or its compiled version (the loss and the counts in
    one region); None: :func:`switch_loss` eagerly."""
    if not (torch.is_grad_enabled() and update.requires_grad):
        return update
    if statistics is None:
        loss = switch_loss(routing)
    else:
        counts, loss = statistics(routing.probs, routing.indices)
        if routing._counts is None:
            routing._counts = counts
    if block is not None:
        rec = _records(get_moe_metrics_tracker(), routing.probs.shape[-1], num_blocks,
                       loss.device)
        # What tracker.record(LOSS_NAME, loss, block, num_blocks) adds, in one kernel (record's
        # ``values[i] += v`` adds, then copies the sum back).
        rec.loss_at[block - 1].add_(loss.detach())
        n, k = routing.indices.shape
        # f_l = count_l / (n k), added as the tracker's record() would add each one.
        rec.fractions_at[block - 1].add_(routing.tokens_per_expert(), alpha=1.0 / (n * k))
    if coeff > 0:
        update = MoEAuxLossAutoScaler.apply(update, coeff * loss)
    return update


def set_aux_loss_scale(config, num_microbatches: int, cp_size: int = 1) -> None:
    """The gradient of every attached aux loss is ``loss_scale x cp / num_microbatches``, the factor
    the LM loss gets, so gradient accumulation and fp16 loss scaling treat both alike."""
    one = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    scale = scale.reshape(1).detach().float()
    if not config.calculate_per_token_loss:
        scale = scale * cp_size / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def report(args, iteration: int, total_loss_dict: dict, writer, wandb_writer,
           num_blocks: int) -> None:
    """Reduce the recorded values over PP and DP, add the mean loss over the ``num_blocks`` MLP
    blocks to the console line, write the loss and, per block (``moe/..._layer_<block - 1>``), the
    loss and each expert's routing fraction (the StructMoE paper's Fig. 4). Collective: every rank
    calls it once per iteration (the family's ``log_report``)."""
    # One report for all names: report() clears every entry of the tracker when it is done.
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / get_num_microbatches(), iteration=iteration, writer=writer,
        wandb_writer=wandb_writer, per_layer_logging=True, force_initialize=True,
        track_names=tracked_names(args.structmoe_num_experts), num_layers=num_blocks,
        total_loss_dict=total_loss_dict)
