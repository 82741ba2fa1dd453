"""The hybrid path (``models/hybrid.py``, ``models/hybrid_specs.py``) in one process: STEM layer i
is the i-th ``-`` of the pattern, every STEM MLP gets its micro-batch's ids (also when full
recompute runs it again in backward), its output is the plain-PyTorch STEM MLP's, and
``*-`` repeated is the GPT path's computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.stem.config import StemConfig

PATTERN = "*-*-*-*-"  # 4 MLP blocks; --stem-ratio 1/2 -> MLP blocks 1 and 3 (layers 3 and 7)
VOCAB, SEQ, BATCH = 128, 16, 2


def _config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=8, hidden_size=32, ffn_hidden_size=64,
                             num_attention_heads=4, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False,
                             normalization="RMSNorm", use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, **kwargs)


def _stem_spec(config, stem):
    from megatron_ext.models import hybrid_specs
    from megatron_ext.models.hybrid_pattern import mlp_layer_indices
    from megatron_ext.models.layer import TokenContextMLPLayer
    from megatron_ext.models.specs import with_mlp
    from megatron_ext.stem.mlp import StemMLP

    ids = set(stem.stem_layers(len(mlp_layer_indices(PATTERN))))
    return hybrid_specs.hybrid_stack_spec(
        config, PATTERN, False,
        lambda k, dense: with_mlp(dense, StemMLP.as_mlp_submodule, TokenContextMLPLayer,
                                  stem=stem, vocab_size=VOCAB) if k in ids else dense)


def _hybrid(config, stem=None, seed=0):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_ext.models import hybrid_specs
    from megatron_ext.models.hybrid import TokenIdsHybridModel

    torch.manual_seed(seed)
    spec = _stem_spec(config, stem) if stem else hybrid_specs.hybrid_stack_spec(config, PATTERN,
                                                                                False)
    cls = TokenIdsHybridModel if stem else HybridModel
    return cls(config=config, hybrid_stack_spec=spec, vocab_size=VOCAB,
               max_sequence_length=SEQ, hybrid_layer_pattern=PATTERN,
               position_embedding_type="rope")


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


MASK = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()  # causal (True: masked)


def _record_ids(model):
    """Each STEM MLP call's ids (its ``context`` argument), in call order, by the layer's global
    index."""
    from megatron_ext.models.token_ids import split_context
    from megatron_ext.stem.mlp import StemMLP

    seen = []
    for layer in model.decoder.layers:
        if isinstance(layer.mlp, StemMLP):
            layer.mlp.register_forward_pre_hook(
                lambda m, args, kwargs, n=layer.layer_number - 1: seen.append(
                    (n, split_context(kwargs["context"])[0].clone())), with_kwargs=True)
    return seen


def test_stem_layers_are_the_mlp_symbols(mcore_single_rank):
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.mlp import MLP

    from megatron_ext.models.layer import TokenContextMLPLayer
    from megatron_ext.stem.mlp import StemMLP

    model = _hybrid(_config(), StemConfig(ratio="1/2"))
    layers = model.decoder.layers
    assert [type(layer.mlp).__name__ for layer in layers] == [
        "IdentityOp", "MLP", "IdentityOp", "StemMLP"] * 2
    assert [i for i, layer in enumerate(layers) if isinstance(layer, TokenContextMLPLayer)] \
        == [3, 7]
    assert all(isinstance(layers[i], MLPLayer) and type(layers[i].mlp) is MLP for i in (1, 5))
    assert [m.layer_number for m in model.modules() if isinstance(m, StemMLP)] == [4, 8]
    assert model.token_layers_here


def test_every_stem_mlp_gets_the_ids_and_matches_the_reference(mcore_single_rank):
    model = _hybrid(_config(), StemConfig(ratio="1/2"))
    tokens, pos = _inputs()
    seen = _record_ids(model)
    stem = model.decoder.layers[3].mlp
    captured = {}
    stem.register_forward_hook(lambda m, args, out: captured.update(h=args[0], y=out[0]))
    model(tokens, pos, MASK)
    assert [n for n, _ in seen] == [3, 7]
    for _, ids in seen:
        assert torch.equal(ids, tokens.t())
    # Eq. 4 of the STEM paper in plain PyTorch: y = W_d(silu(W_g h) * U[t]).
    h = captured["h"]
    ref = (F.silu(h @ stem.linear_fc1.weight.t()) * stem.table[tokens.t()]) \
        @ stem.linear_fc2.weight.t()
    torch.testing.assert_close(captured["y"], ref, rtol=1e-5, atol=1e-6)


def test_full_recompute_gives_the_recomputed_layers_their_ids(mcore_single_rank):
    config = _config(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    model = _hybrid(config, StemConfig(ratio="1/2"))
    model.train()
    tokens, pos = _inputs()
    seen = _record_ids(model)
    model(tokens, pos, MASK, labels=tokens).sum().backward()
    assert [n for n, _ in seen] == [3, 7, 7, 3]  # forward, then recompute in backward
    for _, ids in seen:
        assert torch.equal(ids, tokens.t())
    plain = _hybrid(_config(), StemConfig(ratio="1/2"))
    plain.train()
    plain(tokens, pos, MASK, labels=tokens).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("stem", [None, StemConfig(ratio="1/2")], ids=["dense", "stem"])
def test_star_dash_repeated_is_the_gpt_path(mcore_single_rank, stem):
    """Same seed, same draws in the same order: the same parameters and the same logits."""
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.models.gpt import TokenIdsGPTModel
    from megatron_ext.stem.specs import decoder_block_spec

    hybrid = _hybrid(_config(), stem)
    gpt_config = _config()
    gpt_config.num_layers = 4
    torch.manual_seed(0)
    gpt = (TokenIdsGPTModel if stem else GPTModel)(
        config=gpt_config, transformer_layer_spec=decoder_block_spec(gpt_config, stem, VOCAB,
                                                                     False),
        vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    tokens, pos = _inputs()
    torch.testing.assert_close(hybrid(tokens, pos, MASK), gpt(tokens, pos, MASK),
                               rtol=0, atol=0)


def test_ids_outside_the_tables_are_refused(mcore_single_rank):
    model = _hybrid(_config(), StemConfig(ratio="1/2"))
    tokens, pos = _inputs()
    tokens[1, 3] = VOCAB
    with pytest.raises(ValueError, match="outside the STEM tables"):
        model(tokens, pos, MASK)


def test_mlp_blocks_are_counted_in_the_pattern():
    from types import SimpleNamespace

    from megatron_ext.models.hybrid_pattern import mlp_block_count, mlp_layer_indices

    assert mlp_layer_indices("*-*-|*-*-") == [1, 3, 5, 7]  # "|" is no layer
    assert mlp_layer_indices("*--*E-") == [1, 2, 5]
    assert mlp_block_count(SimpleNamespace(hybrid_layer_pattern="*-*-*-*-", num_layers=8)) == 4
    assert mlp_block_count(SimpleNamespace(hybrid_layer_pattern=None, num_layers=8)) == 8
    with pytest.raises(ValueError, match="out of range"):  # MLP block 5 of 4
        StemConfig(layers=[1, 5]).stem_layers(mlp_block_count(
            SimpleNamespace(hybrid_layer_pattern="*-*-*-*-", num_layers=8)))


def test_a_family_without_the_hybrid_path_is_refused_naming_it(monkeypatch):
    from types import SimpleNamespace

    from megatron_ext.models import registry
    from megatron_ext.models.family import Family
    from megatron_ext.training.arguments import check_family_args

    # A family of the GPT path only (no hybrid_stack_spec), registered for this test alone.
    gpt = registry.get_family("gpt")
    monkeypatch.setitem(registry._FAMILIES, "gpt_path_only",
                        Family("gpt_path_only", "test: no hybrid path", gpt.block_spec))
    with pytest.raises(ValueError, match="--model-family gpt_path_only does not build on the "
                                         "hybrid"):
        check_family_args(SimpleNamespace(model_family="gpt_path_only",
                                          hybrid_layer_pattern="*-*-"))


def _sigma_config(**kwargs):
    return _config(num_moe_experts=8, moe_ffn_hidden_size=16, moe_router_topk=1,
                   moe_router_pre_softmax=True, moe_router_dtype="fp32",
                   moe_router_load_balancing_type="none", qk_layernorm=True, num_query_groups=2,
                   moe_token_dispatcher_type="alltoall", **kwargs)


def test_the_kth_e_is_sigma_layer_k_and_star_e_repeated_is_the_gpt_path(mcore_single_rank):
    """``*E*E*E*E`` with a top-k per Sigma layer (3, 2, 1, 1): the k-th E is Sigma layer k (its
    top-k, its index), QK-norm and GQA in the ``*`` layers, and the same logits as the GPT
    path's Sigma model from the same seed (failed with every E given Sigma layer 0)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    from megatron_ext.models import hybrid_specs
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.layer import SigmaMoELayer
    from megatron_ext.sigma.specs import sigma_block_spec, sigma_layer_spec

    pattern = "*E*E*E*E"
    sigma = SigmaConfig(num_layers=4, num_experts=8, topk=1, topk_schedule=(3, 2),
                        sparsify_at=5)
    config = _sigma_config()
    torch.manual_seed(0)
    spec = hybrid_specs.hybrid_stack_spec(config, pattern, False,
                                          moe_fn=lambda k, moe: sigma_layer_spec(moe, sigma, k))
    hybrid = HybridModel(config=config, hybrid_stack_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=SEQ, hybrid_layer_pattern=pattern,
                         position_embedding_type="rope")
    layers = hybrid.decoder.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer, MoETransformerLayer)] \
        == [1, 3, 5, 7]
    moe = [layer.mlp for layer in layers if isinstance(layer.mlp, SigmaMoELayer)]
    assert [(m.layer_number, m.layer_index, m.router.layer_index, m.topk) for m in moe] == [
        (2, 0, 0, 3), (4, 1, 1, 2), (6, 2, 2, 1), (8, 3, 3, 1)]
    attention = layers[0].self_attention
    assert type(attention.q_layernorm).__name__ != "IdentityOp"
    assert attention.linear_qkv.weight.shape[0] == 32 + 2 * 2 * 8  # 4 heads of 8, 2 groups
    gpt_config = _sigma_config()
    gpt_config.num_layers = 4
    torch.manual_seed(0)
    gpt = GPTModel(config=gpt_config, transformer_layer_spec=sigma_block_spec(
        gpt_config, sigma, False), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope")
    tokens, pos = _inputs()
    torch.testing.assert_close(hybrid(tokens, pos, MASK), gpt(tokens, pos, MASK),
                               rtol=0, atol=0)


def test_moe_blocks_are_counted_in_the_pattern():
    from types import SimpleNamespace

    from megatron_ext.models.hybrid_pattern import mlp_block_count, moe_layer_indices

    assert moe_layer_indices("*E*E|*E*E") == [1, 3, 5, 7]
    assert moe_layer_indices("*--*E-E") == [4, 6]
    assert mlp_block_count(SimpleNamespace(hybrid_layer_pattern="*E*E*E*E", num_layers=8)) == 4
    assert mlp_block_count(SimpleNamespace(hybrid_layer_pattern="*--*E-E", num_layers=7)) == 5


@pytest.mark.parametrize("family,pattern,ok", [
    ("gpt", "*-*-|*-*-", True), ("stem", "*-*-", True), ("structmoe", "-*-*", True),
    ("gpt", "*-*E", False), ("stem", "*E*E", False), ("structmoe", "*-*M", False),
    ("sigma", "*E*-", False)])
def test_a_pattern_holds_only_the_layers_its_family_builds(family, pattern, ok):
    """Each family builds one kind of MLP block (``Family.hybrid_symbols``), so its k-th block is
    the k-th ``-`` (or ``E``) that its layer flags, logs and exports count."""
    from megatron_ext.models.hybrid_pattern import check_family_symbols
    from megatron_ext.models.registry import get_family

    allowed = get_family(family).hybrid_symbols
    if ok:
        check_family_symbols(pattern, family, allowed)
    else:
        with pytest.raises(ValueError, match=f"--model-family {family} builds .* layers only"):
            check_family_symbols(pattern, family, allowed)


def test_e_without_experts_dense_symbols_and_long_schedules_are_refused(mcore_single_rank):
    from types import SimpleNamespace

    from megatron_ext.models import hybrid_specs
    from megatron_ext.sigma.family import check_args

    with pytest.raises(ValueError, match="need --num-experts"):
        hybrid_specs.hybrid_stack_spec(_config(), "*E*-", False)
    args = SimpleNamespace(
        num_layers=None, num_experts=8, moe_router_topk=1, expert_model_parallel_size=1,
        sigma_lbl="global", sigma_lbl_coeff=1e-3, sigma_top1_lbl_temperature=1.0,
        sigma_topk_schedule=None, sigma_sparsify_at=None, train_iters=10,
        moe_ffn_hidden_size=16, swiglu=True, normalization="RMSNorm", qk_layernorm=True,
        moe_router_pre_softmax=True, moe_router_dtype="fp32",
        moe_router_score_function="softmax", add_bias_linear=False,
        moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=None,
        moe_expert_capacity_factor=None, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=False, hybrid_layer_pattern="*E*E")
    check_args(args)
    for pattern in ("*E*-", "*-*-", "*E*", "*EE", "*E*M", "*E*E/*E"):
        args.hybrid_layer_pattern = pattern
        with pytest.raises(ValueError, match=r"give only \* and E, as many of each"):
            check_args(args)
    args.hybrid_layer_pattern = "E*|E*"  # the order within a block is the pattern's choice
    check_args(args)
    # The schedule counts Sigma layers: the E symbols, not --num-layers (every symbol).
    args.hybrid_layer_pattern, args.num_layers = "*E*E", 4
    args.sigma_topk_schedule, args.sigma_sparsify_at = "[2,2,2]", "3"
    with pytest.raises(ValueError, match="has 3 entries but the model has 2 layers"):
        check_args(args)


def test_sigma_top1_lbl_on_e_layers_is_the_gpt_paths(mcore_single_rank):
    """Top-1 LBL (Eqs. 2-4) on ``*E*E*E*E``: two training steps (the second with the gradient
    weights of the first), each global batch closed in the routers: the same statistics, logged
    values per Sigma layer and router gradients as the GPT path's Sigma model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_ext.models import hybrid_specs
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.monitor import layer_scalars
    from megatron_ext.sigma.router import SigmaRouter, end_global_batch
    from megatron_ext.sigma.specs import sigma_block_spec, sigma_layer_spec

    pattern = "*E*E*E*E"
    sigma = SigmaConfig(num_layers=4, num_experts=8, topk=1, lbl="top1", lbl_coeff=0.1,
                        top1_temperature=0.5)
    config = _sigma_config()
    torch.manual_seed(0)
    hybrid = HybridModel(config=config, hybrid_stack_spec=hybrid_specs.hybrid_stack_spec(
        config, pattern, False, moe_fn=lambda k, moe: sigma_layer_spec(moe, sigma, k)),
        vocab_size=VOCAB, max_sequence_length=SEQ, hybrid_layer_pattern=pattern,
        position_embedding_type="rope")
    gpt_config = _sigma_config()
    gpt_config.num_layers = 4
    torch.manual_seed(0)
    gpt = GPTModel(config=gpt_config, transformer_layer_spec=sigma_block_spec(
        gpt_config, sigma, False), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope")
    results = []
    for model in (hybrid, gpt):
        model.train()
        routers = [m for m in model.modules() if isinstance(m, SigmaRouter)]
        assert [r.layer_index for r in routers] == [0, 1, 2, 3]
        logs, grads = [], []
        for seed in (1, 2):
            model.zero_grad()
            tokens, pos = _inputs(seed)
            model(tokens, pos, MASK, labels=tokens).sum().backward()
            grads.append([r.weight.grad.clone() for r in routers])
            stats = end_global_batch([model])
            logs.append({k: v for layer, s in sorted(stats.items())
                         for k, v in layer_scalars(s, layer, "top1").items()})
        results.append((logs, grads))
    (hybrid_logs, hybrid_grads), (gpt_logs, gpt_grads) = results
    assert sorted(hybrid_logs[1]) == sorted(gpt_logs[1])
    assert "sigma/top1_lbl_layer_3" in hybrid_logs[1]
    assert hybrid_logs == gpt_logs
    for got, want in zip(hybrid_grads, gpt_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
