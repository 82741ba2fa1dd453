"""No host synchronisation on the routed paths of StructMoE and Sigma, checked on the CPU.

``megatron_ext/tools/host_syncs.py`` records, forward and backward, every op that would make the
host wait for a GPU (``.item()``, ``nonzero``, ``bincount``, boolean masks, ...) and counts the
ops that compute. Here: the recorder itself on each kind of op; the StructMoE MLP of each backend
that runs on the CPU (the triton one under Triton's interpreter) and the Sigma router with its
global-batch and top-1 losses, in training (aux loss attached, router metrics recorded), with
none; the reference backend (Algorithm 1, a host sync per expert by design) as the case that
shows the check finds them in a real layer; and what the op counts promise: StructMoE's
additive update adds no ``[tokens, D']`` tensor to the dense MLP's, recording the routing
fractions costs the same for 4 experts as for 16 (in ops, and in the host's torch calls), and
goes to the tracker's current entries however they were changed, and Sigma's router launches
no more kernels than upstream's aux-loss router.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.tools.host_syncs import Recorder, forward_backward

H, FF, S, B = 16, 40, 5, 2


# -- the recorder -------------------------------------------------------------------------------
SYNCING = {
    "item": lambda t: t.sum().item(),
    "bool": lambda t: bool(t[0] > 0),
    "python if": lambda t: 1 if t.max() else 0,
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "nonzero": lambda t: t.nonzero(),
    "boolean mask": lambda t: t[t > 0],
    "boolean mask assignment": lambda t: t.clone().__setitem__(t > 0, 0.0),
    "masked_select": lambda t: t.masked_select(t > 0),
    "unique": lambda t: torch.unique(t),
    "repeat_interleave": lambda t: torch.arange(3).repeat_interleave(torch.tensor([1, 0, 2])),
    "bincount": lambda t: torch.bincount(torch.tensor([0, 2]), minlength=4),
    "equal": lambda t: torch.equal(t, t),
}

CLEAN = {
    "arithmetic, softmax, topk, scatter": lambda t: torch.zeros(3, 4).scatter(
        1, torch.topk(torch.softmax(t.view(3, 4), -1), 2).indices, 1.0),
    "repeat_interleave with output_size": lambda t: torch.arange(3).repeat_interleave(
        torch.tensor([1, 0, 2]), output_size=3),
    "repeat_interleave of an int": lambda t: torch.arange(3).repeat_interleave(2),
    "integer indexing, index_add, argsort, cumsum": lambda t: torch.zeros(4).index_add(
        0, torch.argsort(t[:4]), t[:4].cumsum(0)),
    "shapes": lambda t: t.shape[0] * t.numel(),
}


@pytest.mark.parametrize("name", list(SYNCING))
def test_recorder_finds_each_kind_of_sync(name):
    t = torch.randn(12)
    with Recorder() as rec:
        SYNCING[name](t)
    assert len(rec.syncs) >= 1, name
    assert all("test_routed_host_syncs.py" in s.where for s in rec.syncs), rec.syncs


@pytest.mark.parametrize("name", list(CLEAN))
def test_recorder_passes_ops_that_do_not_sync(name):
    with Recorder() as rec:
        CLEAN[name](torch.randn(12))
    assert rec.syncs == [], rec.syncs


# -- StructMoE ----------------------------------------------------------------------------------
def structmoe_mlp(backend, gated=False, fusion="additive", topk=1, experts=6, rank=3):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    torch.manual_seed(0)
    smoe = StructMoEConfig(num_experts=experts, rank=rank, topk=topk, fusion=fusion,
                           backend=backend, aux_loss_coeff=0.01)
    mlp = StructMoEMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        structmoe=smoe, config=config(gated),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    mlp.set_layer_number(1)  # the router metrics are recorded, as in training
    mlp.train()
    return mlp


def config(gated):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=FF,
                             num_attention_heads=4, gated_linear_unit=gated,
                             activation_func=F.silu if gated else F.gelu,
                             add_bias_linear=False, use_cpu_initialization=True)


def dense_mlp(gated=False):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    torch.manual_seed(0)
    return MLP(config(gated), MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                            linear_fc2=RowParallelLinear))


def second_step(module, x):
    """Forward + backward twice, recorded the second time (the first creates the tracker's
    entries, as the first step of a run does)."""
    forward_backward(lambda: module(x))
    return forward_backward(lambda: module(x))


@pytest.fixture
def aux_scale():
    """The aux-loss scale set; afterwards the router metrics these layers recorded are dropped
    (the tracker is global and an entry keeps the layer count of its first record)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_ext.structmoe.balance import tracked_names

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([1.0]))
    yield
    for name in tracked_names(16):
        get_moe_metrics_tracker().metrics.pop(name, None)


BACKENDS = ["dense-masked", "grouped", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gated,fusion,topk", [(False, "additive", 1), (True, "additive", 2),
                                               (True, "glu", 1)])
def test_structmoe_training_step_has_no_host_sync(mcore_single_rank, aux_scale, backend, gated,
                                                  fusion, topk):
    if backend == "triton":
        pytest.importorskip("triton")
    mlp = structmoe_mlp(backend, gated, fusion, topk)
    fwd, bwd = second_step(mlp, torch.randn(S, B, H, requires_grad=True))
    assert fwd.syncs == [] and bwd.syncs == [], [str(s) for s in fwd.syncs + bwd.syncs]
    # The layer ran under the recorder: fc1, the expand and fc2 at least.
    assert fwd.kernels["aten::mm"] + fwd.kernels["aten::addmm_"] >= 3, fwd.kernels


def test_the_reference_backend_shows_the_check_finds_syncs(mcore_single_rank, aux_scale):
    """Algorithm 1 selects each expert's tokens with ``nonzero`` (forward) on purpose."""
    fwd, _ = second_step(structmoe_mlp("reference"), torch.randn(S, B, H, requires_grad=True))
    assert {s.op for s in fwd.syncs} == {"aten::nonzero"}
    assert all("structmoe/routed.py" in s.where for s in fwd.syncs)


@pytest.mark.parametrize("backend", ["dense-masked", "triton"])
def test_additive_update_allocates_no_tensor_of_the_mlp_width(mcore_single_rank, aux_scale,
                                                               backend):
    """x W1' + R(x) (Eq. 6, plain activation): the expand GEMM adds into fc1's output, so the
    StructMoE MLP allocates as many [tokens, D'] tensors as the dense MLP does [tokens, D_ff]
    ones, forward and backward."""
    if backend == "triton":
        pytest.importorskip("triton")
    mlp, dense = structmoe_mlp(backend), dense_mlp()
    x = torch.randn(S, B, H, requires_grad=True)

    def wide(rec, width):
        return sorted(op for op, shape in rec.new_tensors if shape[-1:] == (width,)
                      and shape[:-1] in ((S, B), (S * B,)))

    (fwd, bwd), (dfwd, dbwd) = second_step(mlp, x), second_step(dense, x)
    assert len(wide(fwd, mlp.ffn_per_partition)) == len(wide(dfwd, FF)), (
        wide(fwd, mlp.ffn_per_partition), wide(dfwd, FF))
    assert len(wide(bwd, mlp.ffn_per_partition)) == len(wide(dbwd, FF)), (
        wide(bwd, mlp.ffn_per_partition), wide(dbwd, FF))


def test_dense_masked_gate_is_scattered_into_its_zeros(mcore_single_rank, aux_scale):
    """Dense-masked's [tokens, L] gate: the selected scores scattered in place into fresh zeros,
    no second [tokens, L] tensor (an out-of-place scatter copies the zeros: one more kernel per
    layer on a GPU, until 2026-11-28). The forward's [tokens, L] tensors: the router's logits,
    its probabilities and the gate."""
    fwd, _ = second_step(structmoe_mlp("dense-masked"), torch.randn(S, B, H, requires_grad=True))
    made = sorted(op for op, shape in fwd.new_tensors if shape == (S * B, 6))
    assert made == ["aten::_softmax", "aten::mm", "aten::zeros"], made


def test_routing_fractions_cost_the_same_for_any_number_of_experts(mcore_single_rank, aux_scale):
    """Recording L fractions per layer is one add, not L of upstream's ``tracker.record``."""
    x = torch.randn(S, B, H, requires_grad=True)
    few, _ = second_step(structmoe_mlp("dense-masked", experts=4, rank=2), x)
    many, _ = second_step(structmoe_mlp("dense-masked", experts=16, rank=2), x)
    assert sum(many.kernels.values()) == sum(few.kernels.values()), (few.kernels, many.kernels)


def test_recorded_fractions_survive_a_new_tracker_entry(mcore_single_rank, aux_scale):
    """The fractions' grid is made anew when the tracker's entries are dropped (as
    test_hybrid_structmoe does between models) and it records into the new entries."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.structmoe.balance import fraction_name

    tracker = get_moe_metrics_tracker()
    mlp = structmoe_mlp("dense-masked")
    x = torch.randn(S, B, H, requires_grad=True)
    for _ in range(2):
        for l in range(6):
            tracker.metrics.pop(fraction_name(l), None)
        mlp(x)
        got = sum(tracker.metrics[fraction_name(l)].values[0].item() for l in range(6))
        assert got == pytest.approx(1.0)  # the fractions of one forward sum to 1
    tracker.clear()


# -- the router metrics' records (structmoe/balance.py), per layer and micro-batch ----------
TOKENS, TOPK = 12, 1


def _routing(num_experts, seed=0):
    from megatron_ext.structmoe.routed import Routing

    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(TOKENS, num_experts, generator=g), dim=-1)
    weights, indices = torch.topk(probs, TOPK, dim=-1)
    return Routing(probs=probs, indices=indices, weights=weights)


def _record(routing, block=2, blocks=3):
    from megatron_ext.structmoe.balance import attach_and_record

    update = torch.zeros(TOKENS, 4, requires_grad=True)
    return attach_and_record(update, routing, 0.0, block, blocks)


def _fractions(tracker, num_experts, block=2):
    from megatron_ext.structmoe.balance import fraction_name

    return torch.stack([tracker.metrics[fraction_name(l)].values[block - 1]
                        for l in range(num_experts)])


def _expected(routing):
    # f_l = count_l / (TOKENS TOPK), as the tracker's record() would add it
    counts = routing.tokens_per_expert()
    return torch.zeros(counts.shape).add_(counts, alpha=1.0 / (TOKENS * TOPK))


def test_records_land_in_whatever_entries_the_tracker_holds(mcore_single_rank):
    """The places taken once (balance._records) are taken again whenever the tracker's entries
    changed: an entry replaced by another, an entry given other values, the loss entry dropped,
    a new tracker; ``clear`` keeps them (it zeroes in place). Each time the records go into the
    tracker's current entries, and the fractions of one record sum to 1."""
    import megatron.core.transformer.moe.moe_logging as moe_logging
    from megatron.core.transformer.moe.moe_logging import MetricEntry, get_moe_metrics_tracker

    from megatron_ext.structmoe.balance import LOSS_NAME, fraction_name

    L = 6
    routing = _routing(L)
    tracker = get_moe_metrics_tracker()
    _record(routing)
    first = _fractions(tracker, L).clone()
    assert torch.equal(first, _expected(routing)) and first.sum().item() == pytest.approx(1.0)
    loss = tracker.metrics[LOSS_NAME].values[1].item()
    assert loss > 0

    tracker.clear()
    _record(routing)
    assert torch.equal(_fractions(tracker, L), first)

    tracker.metrics[fraction_name(3)] = MetricEntry(values=torch.zeros(3))  # replaced
    _record(routing)
    assert torch.equal(_fractions(tracker, L), first * torch.tensor(
        [2, 2, 2, 1, 2, 2], dtype=torch.float32))

    tracker.clear()
    tracker.metrics[fraction_name(0)].values = torch.zeros(3)  # the same entry, new values
    _record(routing)
    assert torch.equal(_fractions(tracker, L), first)

    del tracker.metrics[LOSS_NAME]
    _record(routing)
    assert tracker.metrics[LOSS_NAME].values[1].item() == loss

    saved = moe_logging._MOE_METRICS_TRACKER
    moe_logging._MOE_METRICS_TRACKER = None  # a new tracker
    try:
        _record(routing)
        fresh = get_moe_metrics_tracker()
        assert fresh is not tracker
        assert torch.equal(_fractions(fresh, L), first)
        assert fresh.metrics[LOSS_NAME].values[1].item() == loss
    finally:
        moe_logging._MOE_METRICS_TRACKER = saved


def test_recording_a_block_costs_the_same_torch_calls_for_any_number_of_experts(
        mcore_single_rank):
    """After the first record, recording one block's loss and fractions makes as many torch
    calls (ops, views, tensor attributes: what the host pays per layer and micro-batch) at
    L = 16 as at L = 4, and few: finding the fractions' grid again from the tracker's entries
    on every call read two data pointers and a base per expert (until 2026-11-28: 39 calls at
    L = 4, 75 at L = 16; 20 since)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    calls = {}
    for L in (4, 16):
        routing = _routing(L)
        _record(routing)
        routing = _routing(L, seed=1)
        with Count() as count:
            _record(routing)
        calls[L] = count.calls
    assert calls[4] == calls[16] <= 20, calls


# -- Sigma --------------------------------------------------------------------------------------
E = 8


def router_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = dict(num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
               moe_router_topk=1, moe_router_pre_softmax=True, moe_router_dtype="fp32",
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_ffn_hidden_size=12, ffn_hidden_size=32, gated_linear_unit=True,
               activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
               moe_token_dispatcher_type="alltoall")
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def sigma_router(lbl):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.router import SigmaRouter

    torch.manual_seed(0)
    router = SigmaRouter(router_config(), ProcessGroupCollection.use_mpu_process_groups(),
                         sigma=SigmaConfig(num_layers=2, num_experts=E, topk=1, lbl=lbl,
                                           lbl_coeff=1e-3))
    router.layer_index = 0
    router.set_layer_number(1)
    router.train()
    return router


def upstream_router():
    """What benchmarks/sigma_step.py compares against: TopKRouter with the Switch aux loss."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(0)
    router = TopKRouter(router_config(moe_router_load_balancing_type="aux_loss",
                                      moe_aux_loss_coeff=1e-3),
                        ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    router.train()
    return router


def router_step(router, x):
    fwd, bwd = forward_backward(lambda: router(x))
    with Recorder() as end:
        if hasattr(router, "end_global_batch"):
            router.end_global_batch()
    return fwd, bwd, end


@pytest.mark.parametrize("lbl", ["global", "top1"])
def test_sigma_router_and_lbl_have_no_host_sync(mcore_single_rank, aux_scale, lbl):
    router = sigma_router(lbl)
    x = torch.randn(S, B, H, requires_grad=True)
    router_step(router, x)  # step 1: no previous statistics, zero gradient weights
    fwd, bwd, end = router_step(router, x)
    assert fwd.kernels["aten::mm"] == 1
    syncs = fwd.syncs + bwd.syncs + end.syncs
    assert syncs == [], [str(s) for s in syncs]


def test_sigma_router_launches_no_more_kernels_than_upstream(mcore_single_rank, aux_scale):
    """Forward + backward of one router on the same tokens (the end of the global batch, once per
    step for all layers, is counted apart)."""
    x = torch.randn(S, B, H, requires_grad=True)
    sigma, upstream = sigma_router("global"), upstream_router()
    router_step(sigma, x)
    s_fwd, s_bwd, _ = router_step(sigma, x)
    u_fwd, u_bwd, _ = router_step(upstream, x)
    ours = sum(s_fwd.kernels.values()) + sum(s_bwd.kernels.values())
    theirs = sum(u_fwd.kernels.values()) + sum(u_bwd.kernels.values())
    assert ours <= theirs, (s_fwd.kernels, s_bwd.kernels, u_fwd.kernels, u_bwd.kernels)
