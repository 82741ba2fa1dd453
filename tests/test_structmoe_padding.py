"""``--structmoe-ffn-pad-to``: D'_ff stored wider, the extra columns zeros that stay zero, is the
same model as D'_ff stored as it is (one rank, fp32; the TP and checkpoint sides are in
``test_parallel_structmoe.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

H, FF, L, R, S, B = 16, 40, 6, 3, 5, 2


def build(gated, fusion, backend, pad_to=1, activation=None, topk=2):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.structmoe.config import StructMoEConfig
    from megatron_ext.structmoe.mlp import StructMoEMLP

    act = activation or (F.silu if gated else F.gelu)
    config = TransformerConfig(num_layers=4, hidden_size=H, ffn_hidden_size=FF,
                               num_attention_heads=4, gated_linear_unit=gated,
                               activation_func=act, add_bias_linear=False,
                               use_cpu_initialization=True)
    smoe = StructMoEConfig(num_experts=L, rank=R, topk=topk, fusion=fusion, backend=backend,
                           ffn_pad_to=pad_to)
    torch.manual_seed(0)
    return StructMoEMLP.as_mlp_submodule(
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        structmoe=smoe, config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def pieces(mlp):
    """Each padded tensor as (name, tensor, axis of D'_ff, blocks along it)."""
    return [("fc1", mlp.linear_fc1.weight, 0, 2 if mlp.gated else 1),
            ("lore_b", mlp.lore_b, 2, 1), ("fc2", mlp.linear_fc2.weight, 1, 1)]


def split(t, dim, blocks, real):
    """(the real columns, the padding) of each block of ``t`` along ``dim``."""
    width = t.shape[dim] // blocks
    parts = [t.narrow(dim, k * width, width) for k in range(blocks)]
    return ([p.narrow(dim, 0, real) for p in parts],
            [p.narrow(dim, real, width - real) for p in parts])


@pytest.mark.parametrize("backend", ["dense-masked", "grouped", "reference", "triton"])
@pytest.mark.parametrize("fusion", ["additive", "glu"])
@pytest.mark.parametrize("gated", [False, True])
def test_padded_mlp_is_the_unpadded_one(mcore_single_rank, gated, fusion, backend):
    """The same seed draws the same real columns; outputs and the real parameters' gradients are
    the unpadded MLP's; every gradient of the padding is exactly zero, and AdamW with weight decay
    leaves the padding exactly zero over steps."""
    plain, padded = build(gated, fusion, backend), build(gated, fusion, backend, pad_to=16)
    d = plain.budget.ffn
    assert padded.budget.ffn == d and padded.budget.storage_ffn == -(-d // 16) * 16 > d
    for (name, p, dim, blocks), (_, q, _, _) in zip(pieces(plain), pieces(padded)):
        assert q.shape[dim] == blocks * padded.budget.storage_ffn, name
        real, pad = split(q, dim, blocks, d)
        torch.testing.assert_close(torch.cat(real, dim), p, rtol=0, atol=0, msg=name)
        assert all(bool((x == 0).all()) for x in pad), name
    opt = torch.optim.AdamW(padded.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(step))
        grad = torch.randn(S, B, H, generator=torch.Generator().manual_seed(100 + step))
        out_plain, out_padded = plain(x)[0], padded(x)[0]
        if step == 0:
            torch.testing.assert_close(out_padded, out_plain, rtol=1e-6, atol=1e-6)
            out_plain.backward(grad)
        opt.zero_grad()
        out_padded.backward(grad)
        for (name, p, dim, blocks), (_, q, _, _) in zip(pieces(plain), pieces(padded)):
            real, pad = split(q.grad, dim, blocks, d)
            assert all(bool((x == 0).all()) for x in pad), (name, step)
            if step == 0:
                torch.testing.assert_close(torch.cat(real, dim), p.grad, rtol=1e-5, atol=1e-6)
        opt.step()
    for name, q, dim, blocks in pieces(padded):
        assert all(bool((x == 0).all()) for x in split(q, dim, blocks, d)[1]), name
        assert bool(split(q, dim, blocks, d)[0][0].abs().sum() > 0), name


def test_parameters_count_the_stored_width(mcore_single_rank):
    mlp = build(True, "additive", "dense-masked", pad_to=16)
    b = mlp.budget
    extra = (b.storage_ffn - b.ffn) * (3 * H + L * R)  # gate, up, down and B per column
    assert sum(p.numel() for p in mlp.parameters()) == b.params + extra
    assert f"D'_ff={b.ffn}, stored as {b.storage_ffn}" in b.describe()


def test_a_rank_s_partition_loses_its_padding():
    """``zero_padding`` on one TP rank's partition: the columns of D'_ff past the model's, counted
    from the rank's global offset, in each half of a gated fc1."""
    from megatron_ext.structmoe.mlp import zero_padding

    real, stored, tp = 10, 16, 2  # rank 0 holds columns 0-7 (real), rank 1 8-15 (8, 9 real)
    for rank, keep in ((0, 8), (1, 2)):
        w = torch.ones(2 * stored // tp, 3)
        zero_padding(w, real, rank * stored // tp, 0, 2)
        for half in (w[:8], w[8:]):
            assert bool((half[:keep] == 1).all()) and bool((half[keep:] == 0).all()), rank
        w2 = torch.ones(3, stored // tp)
        zero_padding(w2, real, rank * stored // tp, 1, 1)
        assert bool((w2[:, :keep] == 1).all()) and bool((w2[:, keep:] == 0).all()), rank


def test_refusals(mcore_single_rank):
    from megatron_ext.structmoe.config import StructMoEConfig

    with pytest.raises(ValueError, match=r"--structmoe-ffn-pad-to=0: must be >= 1"):
        StructMoEConfig(ffn_pad_to=0)
    # sigmoid(0) = 1/2: a zero column of W1' would feed W2' a non-zero input.
    with pytest.raises(ValueError, match=r"--structmoe-ffn-pad-to: the activation sigmoid is not "
                                         r"0 at 0"):
        build(False, "additive", "dense-masked", pad_to=16, activation=torch.sigmoid)
    build(False, "additive", "dense-masked", pad_to=1, activation=torch.sigmoid)  # no padding


def test_export_refuses_padding_that_is_not_zero():
    """to-hf keeps the first D'_ff columns only where the rest are zeros: otherwise the exported
    model would compute something else than the checkpoint's."""
    from megatron_ext.checkpoint_manifest import CheckpointError
    from megatron_ext.convert.to_hf import unpadded

    t = torch.zeros(3, 8)
    t[:, :6] = 1.0
    assert unpadded(t, 1, 6, "fc2").shape == (3, 6)
    assert unpadded(t, 1, 8, "fc2") is t
    t[2, 7] = 1e-30
    with pytest.raises(CheckpointError, match=r"fc2: its columns past 6 \(the stored padding of "
                                              r"8\) are not zero"):
        unpadded(t, 1, 6, "fc2")
