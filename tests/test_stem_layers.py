"""Layer selection (the paper's rule), STEM config validation, and the per-layer spec list."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.stem.config import StemConfig, parse_layers, select_stem_layers

# Written out by hand from the rule: 1/3 -> (i+1) % 3 == 0, 1/2 -> (i+1) % 2 == 0, full -> i >= 1.
EXPECTED = {
    (8, "1/3"): [2, 5],
    (8, "1/2"): [1, 3, 5, 7],
    (8, "full"): [1, 2, 3, 4, 5, 6, 7],
    (12, "1/3"): [2, 5, 8, 11],
    (12, "1/2"): [1, 3, 5, 7, 9, 11],
    (12, "full"): list(range(1, 12)),
    (16, "1/3"): [2, 5, 8, 11, 14],
    (16, "1/2"): [1, 3, 5, 7, 9, 11, 13, 15],
    (16, "full"): list(range(1, 16)),
    (24, "1/3"): [2, 5, 8, 11, 14, 17, 20, 23],
    (24, "1/2"): [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23],
    (24, "full"): list(range(1, 24)),
}


@pytest.mark.parametrize("num_layers,ratio", sorted(EXPECTED))
def test_ratio_selection(num_layers, ratio):
    layers = select_stem_layers(num_layers, ratio)
    assert layers == EXPECTED[(num_layers, ratio)]
    assert 0 not in layers


def test_explicit_list_wins_over_ratio():
    cfg = StemConfig(ratio="full", layers=[5, 2, 8])
    assert cfg.stem_layers(12) == [2, 5, 8]


def test_parse_layers():
    assert parse_layers("2,5,8") == [2, 5, 8]
    with pytest.raises(ValueError, match="--stem-layers"):
        parse_layers("2,x")


@pytest.mark.parametrize("kwargs,match", [
    (dict(layers=[0, 3]), "layer 0 is never"),
    (dict(layers=[3, 3]), "repeated"),
    (dict(layers=[]), "empty"),
    (dict(ratio="1/4"), "--stem-ratio"),
    (dict(variant="down"), "--stem-variant"),
    (dict(init="xavier"), "--stem-init"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StemConfig(**kwargs)


def test_layer_out_of_range_is_refused():
    with pytest.raises(ValueError, match="out of range.*1..7"):
        StemConfig(layers=[2, 8]).stem_layers(8)


def _tiny_stem_gpt(num_layers=3, ratio="1/3"):
    """A STEM GPT of ``num_layers`` layers (STEM at ``--stem-ratio`` ``ratio``), vocabulary 128,
    built on the CPU."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.specs import decoder_block_spec

    config = TransformerConfig(num_layers=num_layers, hidden_size=32, ffn_hidden_size=64,
                               num_attention_heads=4, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               normalization="RMSNorm", use_cpu_initialization=True)
    model = TokenIdsGPTModel(config=config,
                             transformer_layer_spec=decoder_block_spec(
                                 config, StemConfig(ratio=ratio), 128, False),
                             vocab_size=128, max_sequence_length=16,
                             position_embedding_type="rope")
    return model


@pytest.mark.parametrize("ratio", ["1/3", "1/2", "full"])
def test_spec_list_places_stem_layers(mcore_single_rank, ratio):
    from megatron.core.transformer.mlp import MLP

    from megatron_ext.stem.mlp import StemMLP

    model = _tiny_stem_gpt(8, ratio)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    stem_ids = [i for i, k in enumerate(kinds) if k is StemMLP]
    assert stem_ids == EXPECTED[(8, ratio)]
    assert all(k is MLP for i, k in enumerate(kinds) if i not in stem_ids)

    tokens = torch.randint(0, 128, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    out = model(tokens, pos, None)
    assert out.shape[:2] == (2, 16)
    bad = tokens.clone()
    bad[1, 3] = 128
    with pytest.raises(ValueError, match="outside the STEM tables"):
        model(bad, pos, None)


def _count_range_reads(tokens, reads):
    """Record every ``min``/``max`` of ``tokens`` itself: the range read that, on a GPU, waits
    for every kernel queued before."""
    for name in ("min", "max"):
        method = getattr(tokens, name)
        setattr(tokens, name, lambda *a, _m=method, _n=name, **k: reads.append(_n) or _m(*a, **k))
    return tokens


def test_ids_checked_on_the_host_are_not_read_back(mcore_single_rank):
    """``check_host_token_ids`` checks the host copy and the forward told so
    (``token_ids_checked``) then does not read the device ids; unchecked ids are read (and
    refused) by the forward as before."""
    model = _tiny_stem_gpt()
    pos = torch.arange(16).unsqueeze(0).expand(2, 16)
    reads = []
    tokens = _count_range_reads(torch.randint(0, 128, (2, 16)), reads)
    model(tokens, pos, None)
    assert sorted(reads) == ["max", "min"]
    reads.clear()
    model.check_host_token_ids(tokens.clone())
    model(tokens, pos, None, token_ids_checked=True)
    assert reads == []
    for bad_id in (128, -1):
        bad = tokens.clone()
        bad[1, 3] = bad_id
        with pytest.raises(ValueError, match=f"token id {bad_id} is outside the STEM tables"):
            model.check_host_token_ids(bad)


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("take_batch", [False, True])
def test_forward_step_checks_the_host_copy(mcore_single_rank, monkeypatch, host, take_batch):
    """The trainer's forward step checks the ids on the batch's host copy where it has one, so
    the model's forward reads nothing back (once per micro-batch on a GPU, a wait for the
    previous micro-batch's backward); without a host copy (context parallelism, TP ranks without
    a host group) the forward reads and checks the device ids. With and without a family's
    ``take_batch`` (STEM's managed tables)."""
    from types import SimpleNamespace

    from megatron_ext.training import forward_step as fs

    class Timer:
        def start(self):
            pass

        def stop(self):
            pass

    reads = []
    tokens = _count_range_reads(torch.randint(0, 128, (2, 16)), reads)
    labels = torch.randint(0, 128, (2, 16))
    batch = (tokens, labels, torch.ones(2, 16), None, torch.arange(16).unsqueeze(0).expand(2, 16),
             tokens.clone() if host else None)
    from megatron_ext.models.family import FamilyRun

    class ReadingRun(FamilyRun):  # a run with its own take_batch (as STEM's managed tables)
        def take_batch(self, model, read_batch):
            return read_batch(), {}

    run = ReadingRun() if take_batch else FamilyRun()
    monkeypatch.setattr(fs, "get_args", lambda: SimpleNamespace())
    monkeypatch.setattr(fs, "get_timers", lambda: lambda *a, **k: Timer())
    monkeypatch.setattr(fs, "get_batch", lambda *a, host_tokens=False, host_group=None:
                        batch if host_tokens else batch[:5])
    output, loss = fs.forward_step(iter(()), _tiny_stem_gpt(), run=run)
    assert output.shape == (2, 16) and loss(output)[1] == 32
    assert reads == ([] if host else ["min", "max"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_context_of_host_checked_ids_does_not_wait_for_the_gpu():
    """On a GPU, the block context of ids checked on their host copy is made without waiting for
    the kernels queued before (CUDA's sync debug mode "error" raises at any synchronisation);
    ids not checked on the host are read back, which it catches."""
    from megatron_ext.models.token_ids import TokenIdsMixin

    class Ids(TokenIdsMixin, torch.nn.Module):
        pass

    model = Ids(table_vocab_size=128)
    host = torch.randint(0, 128, (2, 16))
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # kernels queued ahead, as the previous micro-batch's backward
        busy = busy @ busy.t() / 4096
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        checked = host.pin_memory().to("cuda", non_blocking=True)
        model.check_host_token_ids(host)
        context = model.block_context(checked, token_ids_checked=True)
        unchecked = host.pin_memory().to("cuda", non_blocking=True)
        with pytest.raises(RuntimeError, match="synchroniz"):
            model.block_context(unchecked)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(context.cpu(), host.t())
