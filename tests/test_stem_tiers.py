"""Tiered STEM tables in-process: the hot-first ownership, reading rows across the two tiers,
the tiered optimizer against RowAdamW on one plain shard (dense and sparse, several steps) and,
sparse, against the independent float64 reference of ``test_stem_row_adam``, and the GPU tier
chosen from token counts or, with mock data, the lowest ids."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from megatron_ext.stem.runtime.hot_rows import choose_hot_mask
from megatron_ext.stem.runtime.ownership import RowOwnership, TieredOwnership
from megatron_ext.stem.runtime.row_adam import AdamHyper, RowAdamW, TieredRowAdamW
from megatron_ext.stem.runtime.store import PinnedStaging, TableStore, gather_rows
from megatron_ext.stem.runtime.tiers import TieredShard, split_grads, take_rows
from megatron_ext.stem.runtime.transfer import stage_to_host


@pytest.mark.parametrize("scheme", ["interleaved", "contiguous"])
def test_ownership_numbers_hot_rows_first(scheme):
    vocab, world = 23, 3
    hot = torch.zeros(vocab, dtype=torch.bool)
    hot[[0, 4, 5, 9, 22]] = True
    base = RowOwnership(vocab, world, scheme)
    for rank in range(world):
        tiered = TieredOwnership(base, hot, rank)
        owned = base.owned_ids(rank)
        ordered = tiered.owned_ids(rank)
        assert sorted(ordered.tolist()) == sorted(owned.tolist())
        n = tiered.num_hot
        assert n == int(hot[owned].sum())
        assert hot[ordered[:n]].all() and not hot[ordered[n:]].any()
        # An owner finds each of its ids at its position in the ordered list.
        assert torch.equal(tiered.local_index(ordered), torch.arange(ordered.numel()))
        assert torch.equal(tiered.owner(torch.arange(vocab)), base.owner(torch.arange(vocab)))
        others = torch.tensor([i for i in range(vocab) if i not in owned.tolist()])
        with pytest.raises(RuntimeError, match="does not own"):
            tiered.local_index(others[:1])


def _tiered(full: torch.Tensor, num_hot: int) -> TieredShard:
    return TieredShard(full[:num_hot].clone(), full[num_hot:].clone())


def test_gather_reads_both_tiers():
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(10, w, generator=g) for w in (3, 5)]
    shards = [_tiered(f, 4) for f in fulls]
    index = torch.tensor([9, 0, 3, 4, 4, 7, 1])
    got = gather_rows(shards, index, torch.device("cpu"), torch.float32)
    assert torch.equal(got, torch.cat([f[index] for f in fulls], dim=1))
    # Only hot rows, only cold rows, none; and a 16-bit wire dtype.
    for idx in (torch.tensor([0, 3]), torch.tensor([8, 5]), torch.tensor([], dtype=torch.long)):
        got = gather_rows(shards, idx, torch.device("cpu"), torch.bfloat16)
        assert torch.equal(got, torch.cat([f[idx] for f in fulls], dim=1).bfloat16())
    shard = shards[0]
    assert shard.shape == (10, 3) and torch.equal(shard.full(), fulls[0])
    shard.assign(fulls[0] * 2)
    assert torch.equal(shard.hot, fulls[0][:4] * 2) and torch.equal(shard.cold, fulls[0][4:] * 2)
    assert shard.host_bytes() == 6 * 3 * 4


@pytest.mark.parametrize("placement", ["cpu", "gpu", "tiered"])
def test_store_counts_the_rows_it_keeps_in_host_memory(placement):
    """What the traffic report calls host rows: local rows past the GPU tier (tiered), all
    (cpu), none (gpu), duplicates counted as the reads count them."""
    vocab, num_hot = 12, 5
    tables = [torch.randn(vocab, 3), torch.randn(vocab, 2)]
    owned = torch.tensor([11, 0, 7, 3, 5, 9, 2, 8])  # local order: the first five are hot
    store = TableStore(iter(tables), owned, placement, torch.device("cpu"),
                       num_hot if placement == "tiered" else None)
    rows = torch.tensor([0, 4, 5, 7, 7, 2, 6])
    expected = {"cpu": 7, "gpu": 0, "tiered": sum(1 for r in rows.tolist() if r >= num_hot)}
    assert store.host_rows(rows) == expected[placement]
    assert store.host_rows(torch.tensor([], dtype=torch.long)) == 0
    # The rows are the drawn table's owned ones, in local order, whatever the placement.
    assert torch.equal(store.read(1), tables[1][owned])


def test_host_tier_keeps_only_its_rows_when_the_hot_rows_move():
    """With the GPU tier on another device (here "meta"), the host tier holds its own rows only:
    not a view that keeps the whole shard, hot rows included, alive in host memory."""
    vocab, num_hot = 12, 5
    owned = torch.tensor([11, 0, 7, 3, 5, 9, 2, 8])
    store = TableStore(iter([torch.randn(vocab, 3)]), owned, "tiered", torch.device("meta"),
                       num_hot)
    cold = store.shards[0].cold
    assert cold.shape == (3, 3) and cold.untyped_storage().nbytes() == 3 * 3 * 4
    assert store.shards[0].hot.device.type == "meta"


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_tiered_optimizer_equals_one_plain_shard(mode):
    """Four iterations with row subsets that touch both tiers, one tier, and nothing: the
    tiered optimizer leaves each row, moment and (sparse) last step where RowAdamW on one plain
    shard leaves it, bit for bit with the same kernel on both sides."""
    g = torch.Generator().manual_seed(1)
    rows, width, num_hot = 12, 6, 5
    init = [torch.randn(rows, width, generator=g) for _ in range(2)]
    plain_shards = [x.clone() for x in init]
    tiered_shards = [_tiered(x, num_hot) for x in init]
    plain = RowAdamW(plain_shards, mode=mode, kernel="torch")
    tiered = TieredRowAdamW(tiered_shards, mode=mode)
    for opt in (tiered.hot, tiered.cold):  # the same kernel as the plain side
        opt.rowwise, opt.op = None, None
    touched = [torch.tensor([0, 4, 5, 11]), torch.tensor([1, 2]), torch.tensor([7, 9, 10]),
               torch.tensor([3, 6, 8, 2])]
    for step, ids in enumerate(touched):
        hyper = AdamHyper(lr=1e-2 * (step + 1), beta1=0.9, beta2=0.99, eps=1e-8,
                          weight_decay=0.1)
        grads = [torch.randn(ids.numel(), width, generator=g) for _ in range(2)]
        plan_a, plan_b = plain.begin_step(hyper), tiered.begin_step(hyper)
        assert plan_a == plan_b
        for i in range(2):
            plain.step_rows(i, ids, grads[i], plan_a)
            tiered.step_rows(i, ids, grads[i], plan_b)
        if mode == "sparse":  # a read of some rows brings them up to date
            plain.catch_up(0, torch.tensor([1, 8]))
            tiered.catch_up(0, torch.tensor([1, 8]))
    plain.materialize()
    tiered.materialize()
    for i in range(2):
        assert torch.equal(tiered_shards[i].full(), plain_shards[i])
        assert torch.equal(tiered.exp_avg[i].full(), plain.exp_avg[i])
        assert torch.equal(tiered.exp_avg_sq[i].full(), plain.exp_avg_sq[i])
        if mode == "sparse":
            assert torch.equal(tiered.lazy.last[i], plain.lazy.last[i])
    assert tiered.step_count == plain.step_count == 4
    assert not torch.equal(tiered_shards[0].full(), init[0])  # it trained


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_tiered_step_in_parts_of_split_gradients(mode):
    """The optimizer's path: gradients split by tier once (``split_grads``, what moves the host
    tier's part to the host before the model's step), then stepped in parts of any positions
    (``take_rows``: a read's rows first, the rest in chunks), gives the bits of one step with
    the gradients as they came."""
    g = torch.Generator().manual_seed(3)
    rows_n, width, num_hot = 12, 4, 5
    init = torch.randn(rows_n, width, generator=g)
    whole_shard, parts_shard = _tiered(init, num_hot), _tiered(init, num_hot)
    whole = TieredRowAdamW([whole_shard], mode=mode)
    parts = TieredRowAdamW([parts_shard], mode=mode)
    rows = torch.tensor([9, 2, 0, 11, 4, 6])  # hot and cold interleaved
    for step in range(3):
        hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        grad = torch.randn(rows.numel(), width, generator=g)
        whole.step_rows(0, rows, grad, whole.begin_step(hyper))
        plan = parts.begin_step(hyper)
        ordered, split = split_grads(parts_shard, rows, grad)
        assert ordered.tolist() == [2, 0, 4, 9, 11, 6] and split.num_hot == 3
        assert torch.equal(split.cold, grad[[0, 3, 5]])
        if mode == "dense":  # one pass over each tier
            parts.step_rows(0, ordered, split, plan)
        else:
            for keep in (torch.tensor([4, 1]), torch.tensor([5, 0, 3]), torch.tensor([2])):
                part_rows, part_grads = take_rows(ordered, split, keep)
                assert torch.equal(part_grads.hot, split.hot[keep[keep < 3].sort().values])
                parts.step_rows(0, part_rows, part_grads, plan)
    whole.materialize()
    parts.materialize()
    assert torch.equal(parts_shard.full(), whole_shard.full())
    assert torch.equal(parts.exp_avg_sq[0].full(), whole.exp_avg_sq[0].full())
    assert not torch.equal(parts_shard.full(), init)


def test_split_puts_the_host_rows_read_first_ahead():
    """``split_grads``'s ``first`` (the rows the next step's first micro-batch reads): its host
    rows come first among the host rows, their gradients with them, and ``within_first`` tells
    whether positions need no host gradient past them."""
    g = torch.Generator().manual_seed(6)
    shard = _tiered(torch.randn(12, 4, generator=g), 5)
    rows = torch.tensor([9, 2, 0, 11, 4, 6])
    grad = torch.randn(rows.numel(), 4, generator=g)
    ordered, split = split_grads(shard, rows, grad, torch.tensor([6, 0, 11, 3]))
    assert ordered.tolist() == [2, 0, 4, 11, 6, 9] and split.cold_first == 2
    assert torch.equal(split.hot, grad[[1, 2, 4]]) and torch.equal(split.cold, grad[[3, 5, 0]])
    assert split.within_first(torch.tensor([3, 4, 1])) and split.within_first(torch.tensor([0]))
    assert not split.within_first(torch.tensor([3, 5]))
    _, plain = split_grads(shard, rows, grad)
    assert plain.cold_first == 0 and not plain.within_first(torch.tensor([3]))


@pytest.mark.parametrize("eps", [1e-8, 0.3])
def test_tiered_sparse_matches_the_documented_semantics(eps):
    """The tiered sparse optimizer (the GPU tier's torch path, the host tier's production kernel)
    against the float64 reference of ``test_stem_row_adam`` that steps every row every iteration:
    rows touched in either tier or both, reads between iterations with repeats, a row never
    touched. Independent of the plain optimizer the test above compares with."""
    from test_stem_row_adam import BETAS, LRS, TOUCHED, WD, grads_for, initial, sparse_reference

    shards = [_tiered(initial(), 5)]  # rows 0..4 in the GPU tier
    opt = TieredRowAdamW(shards, mode="sparse")
    # The GPU tier steps and catches up with the torch path, as it does on a GPU (on the CPU it
    # would take the host kernel).
    opt.hot.rowwise, opt.hot.op, opt.lazy.hot._kernel = None, None, False
    for step, lr in enumerate(LRS):
        rows, g = grads_for(step)
        opt.step_rows(0, rows, g, opt.begin_step(AdamHyper(lr, *BETAS, eps, WD)))
        if step in (2, 3):
            opt.catch_up(0, torch.tensor([0, 5, 6, 5, 0, 11]))
    p_ref, m_ref, v_ref, _ = sparse_reference(len(LRS), eps=eps)
    last = TOUCHED[-1]
    torch.testing.assert_close(shards[0].full()[last], p_ref[last], rtol=1e-6, atol=1e-6)
    opt.materialize()
    torch.testing.assert_close(shards[0].full(), p_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.exp_avg[0].full(), m_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.exp_avg_sq[0].full(), v_ref, rtol=1e-6, atol=1e-9)


def _data_args(**flags):
    """Megatron's data flags, unset but for ``flags``."""
    names = ("data_path", "data_args_path", "train_data_path", "valid_data_path",
             "test_data_path", "per_split_data_args_path")
    return argparse.Namespace(mock_data=False, **{n: flags.get(n) for n in names})


def test_hot_rows_from_token_counts(tmp_path):
    """The tier is the most frequent ids of the training blend, however Megatron's flags name it
    (``--data-path`` with weights, ``--data-args-path``, ``--train-data-path``); with mock data,
    the lowest ids."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in ([7, 7, 7, 3, 3, 9], [3, 7, 1]):
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    (tmp_path / "blend.txt").write_text(f"1.0 {prefix}\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": prefix, "valid": [prefix],
                                                      "test": None}))
    for args in (_data_args(data_path=["1.0", prefix]),
                 _data_args(data_args_path=str(tmp_path / "blend.txt")),
                 _data_args(train_data_path=[prefix], valid_data_path=[prefix]),
                 _data_args(per_split_data_args_path=str(tmp_path / "splits.json"))):
        mask, how = choose_hot_mask(args, 16, "2", count_tokens=0)
        assert mask.nonzero().squeeze(1).tolist() == [3, 7], args  # 4 x 7, 3 x 3
        assert "the 2 most frequent ids of 1 indexed dataset(s)" in how
        assert "77.8% of the training tokens; 9 of 9 tokens counted (every token)" in how
    mock = argparse.Namespace(data_path=None, train_data_path=None, mock_data=True)
    mask, how = choose_hot_mask(mock, 16, "25%", count_tokens=0)
    assert mask.nonzero().squeeze(1).tolist() == [0, 1, 2, 3] and "mock data" in how
    remote = _data_args(data_path=[prefix, "s3://bucket/corpus"])
    mask, how = choose_hot_mask(remote, 16, "25%", count_tokens=0)
    assert mask.nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    assert "s3://bucket/corpus is in object storage" in how


def test_training_blend_is_megatrons(tmp_path):
    """The blend the tier is counted on is the one Megatron's trainer builds its training data
    from (``get_blend_and_blend_per_split``: the blend, else the train split)."""
    from megatron.training.utils import get_blend_and_blend_per_split

    from megatron_ext.data_paths import training_blend

    (tmp_path / "blend.txt").write_text("30 /d/a\n70 /d/b\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": "0.5 /d/t 0.5 /d/u",
                                                      "valid": ["/d/v"], "test": ["/d/w"]}))
    cases = [_data_args(data_path=["/d/a"]), _data_args(data_path=["/d/a", "/d/b"]),
             _data_args(data_path=["1", "/d/a", "3", "/d/b"]),
             _data_args(data_args_path=str(tmp_path / "blend.txt")),
             _data_args(train_data_path=["2", "/d/t", "1", "/d/u"], valid_data_path=["/d/v"]),
             _data_args(per_split_data_args_path=str(tmp_path / "splits.json"))]
    for args in cases:
        blend, per_split = get_blend_and_blend_per_split(args)
        assert training_blend(args) == (blend if blend is not None else per_split[0]), args
    assert training_blend(_data_args()) is None
    assert training_blend(argparse.Namespace(mock_data=True, data_path=["/d/a"])) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gpu_tier_step_queues_without_waiting_for_the_gpu(mode):
    """On a GPU, a tiered step given its gradients as the optimizer gives them (split by tier,
    the host tier's part copied to pinned memory before the kernels queued ahead), and, sparse,
    a read's catch-up of its rows, run without one synchronisation (CUDA's sync debug mode
    "error" raises on any, implicit copies included): the GPU tier's work queues behind those
    kernels, the host tier steps on the CPU meanwhile. The rows, moments and last steps are
    those of the same optimizer on the host."""
    g = torch.Generator().manual_seed(4)
    rows, width, num_hot = 12, 6, 5
    init = torch.randn(rows, width, generator=g)
    host = TieredRowAdamW([_tiered(init, num_hot)], mode=mode)
    gpu_shard = TieredShard(init[:num_hot].clone().cuda(), init[num_hot:].clone())
    gpu = TieredRowAdamW([gpu_shard], mode=mode)
    for opt in (host.hot, host.cold, gpu.cold):  # the torch kernel on both sides
        opt.rowwise, opt.op = None, None
    touched = [torch.tensor([0, 2, 4, 7]), torch.tensor([1, 9, 4]), torch.tensor([11, 0, 3])]
    busy = torch.randn(2048, 2048, device="cuda")
    for step, ids in enumerate(touched):
        hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        grad = torch.randn(ids.numel(), width, generator=g)
        host.step_rows(0, ids, grad, host.begin_step(hyper))
        plan = gpu.begin_step(hyper)
        ordered, split = split_grads(gpu_shard, ids, grad.cuda())
        staged = torch.empty(split.cold.shape, pin_memory=True)
        staged.copy_(split.cold, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        arrived.synchronize()  # what the worker waits for before the host tier's step
        split.cold = staged
        if step == 0:  # warm-up: pinned blocks, kernels loaded
            gpu.step_rows(0, ordered, split, plan)
            gpu.catch_up(0, torch.tensor([1, 3, 8]))
            host.catch_up(0, torch.tensor([1, 3, 8]))
            torch.cuda.synchronize()
            continue
        for _ in range(10):  # kernels queued ahead, as the next micro-batch's would be
            busy = busy @ busy.t() / 2048
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu.step_rows(0, ordered, split, plan)
            gpu.catch_up(0, torch.tensor([1, 3, 8]))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        host.catch_up(0, torch.tensor([1, 3, 8]))
    host.materialize()
    gpu.materialize()
    torch.testing.assert_close(gpu_shard.full(), host.shards[0].full())
    torch.testing.assert_close(gpu.exp_avg[0].full(), host.exp_avg[0].full())
    torch.testing.assert_close(gpu.exp_avg_sq[0].full(), host.exp_avg_sq[0].full())
    if mode == "sparse":
        assert torch.equal(gpu.lazy.last[0], host.lazy.last[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_gradients_leave_the_gpu_beside_the_current_stream():
    """The host tier's gradients go to pinned memory on a stream of their own
    (``stage_to_host``), queued without a synchronisation: the copies wait for the kernels that
    made the gradients (written late on the current stream), and the current stream's later work
    (the model's optimizer step, the next micro-batch) does not wait for the copies (made to end
    late by a busy copy stream; queued on the current stream they would end before its later
    work)."""
    grads = [torch.zeros(300, 64, device="cuda"), torch.zeros(7, 64, device="cuda")]
    staging, copy = PinnedStaging(), torch.cuda.Stream()
    staging.view(sum(g.numel() for g in grads), torch.float32)  # the pinned block, made once

    def stage():
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return stage_to_host(grads, staging, copy)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def check(views, first):
        for value, (g, view) in enumerate(zip(grads, views), start=first):
            assert view.device.type == "cpu" and view.is_pinned() and view.shape == g.shape
            assert torch.equal(view, torch.full_like(view, float(value)))

    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the gradients are final late on the current stream
    for value, g in enumerate(grads, start=3):
        g.fill_(float(value))
    views, arrived = stage()
    arrived.synchronize()
    check(views, 3)  # zeros if the copies ran before the fills

    for value, g in enumerate(grads, start=5):
        g.fill_(float(value))
    with torch.cuda.stream(copy):
        torch.cuda._sleep(400_000_000)  # the copies end late
    views, arrived = stage()
    later = torch.cuda.Event()
    later.record()  # the current stream's next work
    later.synchronize()
    assert not arrived.query(), "the current stream's later work waited for the copies"
    arrived.synchronize()
    check(views, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_rows_of_the_host_tier_gradients_land_first():
    """``stage_to_host`` with ``first``: the leading rows of every gradient (those the next step's
    first micro-batch reads) are copied before the rest, and ``synchronize_first`` waits for
    them alone (the other 512 MiB are still on their way when it returns); then every row
    lands."""
    grads = [torch.randn(2048, 32768, device="cuda"), torch.randn(5, 32768, device="cuda"),
             torch.randn(1, 32768, device="cuda")]  # 256 MiB and a few rows
    grads.append(torch.full((2048, 32768), 7.0, device="cuda"))  # none of it first
    first = [3, 5, 0, 0]
    staging, copy = PinnedStaging(), torch.cuda.Stream()
    staging.view(sum(g.numel() for g in grads), torch.float32)  # the pinned block, made once
    torch.cuda.synchronize()
    views, arrived = stage_to_host(grads, staging, copy, first)
    arrived.synchronize_first()
    assert not arrived.query(), "the first rows waited for the whole copy"
    for g, view, n in zip(grads, views, first):
        assert torch.equal(view[:n], g[:n].cpu())
    arrived.synchronize()
    for g, view in zip(grads, views):
        assert torch.equal(view, g.cpu())


def test_gradient_rows_of_a_run_are_taken_as_a_view():
    """``select_rows`` (the table step's gradients per chunk, ``take_rows`` and
    ``TierGrads.take``): the values of ``index_select`` always; a view of the gradients for a
    run of consecutive positions, a copy otherwise."""
    from megatron_ext.stem.runtime.tiers import TierGrads, select_rows, take_rows

    g = torch.arange(40.0).view(10, 4)
    cases = {"run": [3, 4, 5, 6], "one": [7], "gap": [3, 4, 6], "unsorted": [5, 4, 3],
             "repeated": [2, 2, 3], "empty": []}
    for name, pos in cases.items():
        positions = torch.tensor(pos, dtype=torch.long)
        out = select_rows(g, positions)
        assert torch.equal(out, g.index_select(0, positions)), name
        shares = out.numel() > 0 and out.untyped_storage().data_ptr() == \
            g.untyped_storage().data_ptr()
        assert shares == (name in ("run", "one")), name
        assert out.is_contiguous()
    rows = torch.arange(100, 110)
    taken_rows, taken = take_rows(rows, g, torch.tensor([2, 3, 4]))
    assert torch.equal(taken_rows, rows[2:5]) and torch.equal(taken, g[2:5])
    hot, cold = torch.arange(12.0).view(3, 4), torch.arange(100.0, 124.0).view(6, 4)
    grads = TierGrads(hot, cold)
    taken_rows, parts = grads.take(torch.arange(9), torch.tensor([4, 1, 2, 3, 5]))
    assert torch.equal(taken_rows, torch.tensor([1, 2, 3, 4, 5]))
    assert torch.equal(parts.hot, hot[1:3]) and torch.equal(parts.cold, cold[0:3])
    assert parts.cold.untyped_storage().data_ptr() == cold.untyped_storage().data_ptr()
