"""The local backend's fused core attention (``megatron_ext/models/sdpa_attention.py``) against
Megatron's unfused ``DotProductAttention``: fp32, forward and the gradients of q, k and v, causal,
with and without GQA, Megatron's default and a custom softmax scale, query-key layer scaling;
dropout in training only; what it refuses; its selection by ``--ext-core-attention`` in every
family's spec. Under TP=2 + SP (a whole self-attention, 2 gloo ranks) and for a family's losses
(STEM, TP=2 + SP, sdpa vs unfused), one launch (``tests/dist/sdpa_check.py`` and two trainings)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models import specs
from megatron_ext.models.sdpa_attention import SDPAttention

SQ, B, HEADS, HN = 12, 2, 4, 8


class _Group:  # a tensor-parallel group of one rank, all the core attentions ask of it
    def size(self):
        return 1


class _Tracker:
    """Megatron's model-parallel RNG tracker, recording its forks (the CPU has no CUDA RNG)."""

    def __init__(self):
        self.forks = 0

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        self.forks += 1
        yield


@pytest.fixture
def tracker(monkeypatch, mcore_single_rank):
    """Megatron's state of one rank (upstream's unfused attention takes its score buffer from
    Megatron's global buffer) and a tracker that counts forks."""
    fake = _Tracker()
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: fake)
    return fake


def _config(groups=HEADS, **kwargs):
    kwargs = {"attention_dropout": 0.0, "hidden_dropout": 0.0, **kwargs}
    return TransformerConfig(num_layers=4, hidden_size=HEADS * HN, num_attention_heads=HEADS,
                             num_query_groups=groups, masked_softmax_fusion=False, **kwargs)


def _pair(config, layer_number=1, softmax_scale=None, mask_type=AttnMaskType.causal):
    pg = SimpleNamespace(tp=_Group())
    return [cls(config, layer_number, mask_type, "self", softmax_scale=softmax_scale,
                pg_collection=pg) for cls in (DotProductAttention, SDPAttention)]


def _qkv(groups, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(SQ, B, HEADS, HN, generator=gen),
            torch.randn(SQ, B, groups, HN, generator=gen),
            torch.randn(SQ, B, groups, HN, generator=gen))


def _run(module, qkv, mask=None):
    q, k, v = (t.clone().requires_grad_(True) for t in qkv)
    out = module(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out, q.grad, k.grad, v.grad


def _assert_same(ref, new):
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, new):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("scale", [None, 0.05], ids=["default_scale", "scale0.05"])
def test_matches_unfused_causal(tracker, groups, scale):
    ref, new = _pair(_config(groups), softmax_scale=scale)
    qkv = _qkv(groups)
    out = _run(ref, qkv)
    assert out[0].shape == (SQ, B, HEADS * HN)
    _assert_same(out, _run(new, qkv))


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_matches_unfused_with_the_dataloader_mask(tracker, groups):
    """Megatron's mask (True: masked), here causal with a reset at position 5 (EOD resets),
    as ``--reset-attention-mask`` makes it: taken exactly."""
    ref, new = _pair(_config(groups))
    mask = torch.ones(SQ, SQ).triu(1).bool()
    mask[5:, :5] = True
    mask = mask.expand(B, 1, SQ, SQ)
    qkv = _qkv(groups, seed=1)
    _assert_same(_run(ref, qkv, mask), _run(new, qkv, mask))


def test_query_key_layer_scaling_keeps_the_effective_scale(tracker):
    """Upstream divides the scores by the layer number and its softmax multiplies them back."""
    config = _config(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
    ref, new = _pair(config, layer_number=3)
    qkv = _qkv(HEADS, seed=2)
    _assert_same(_run(ref, qkv), _run(new, qkv))


def test_dropout_in_training_only(tracker):
    _, new = _pair(_config(attention_dropout=0.5))
    qkv = _qkv(HEADS, seed=3)
    new.eval()
    ref, _ = _pair(_config())
    _assert_same(_run(ref, qkv), _run(new, qkv))  # eval: no dropout, exactly the unfused
    new.train()
    torch.manual_seed(0)
    tracker.forks = 0
    dropped = new(*qkv, None)
    # dropout draws from the model-parallel generator without SP, as upstream's
    assert tracker.forks == 1
    assert not torch.allclose(dropped, ref(*qkv, None))


@pytest.mark.parametrize("kwargs, words", [
    (dict(window_size=(4, 0)), "--window-size"),
    (dict(softmax_type="learnable"), "--softmax-type"),
])
def test_refusals_at_construction(tracker, kwargs, words):
    with pytest.raises(ValueError, match=words) as err:
        _pair(_config(**kwargs))
    assert "\n" not in str(err.value) and "--ext-core-attention" in str(err.value)


def test_context_parallel_refused(tracker):
    config = _config()
    config.context_parallel_size = 2  # the config refuses CP without its groups; the flag's value
    with pytest.raises(ValueError, match="--context-parallel-size 2"):
        SDPAttention(config, 1, AttnMaskType.causal, "self",
                     pg_collection=SimpleNamespace(tp=_Group()))


def test_packed_sequences_refused(tracker):
    _, new = _pair(_config())
    with pytest.raises(ValueError, match="packed sequences"):
        new(*_qkv(HEADS), None, packed_seq_params=object())


def _core_attentions(spec, seen=None):
    """Every ``core_attention`` in a spec tree (ModuleSpecs, submodule dataclasses, partials)."""
    seen = [] if seen is None else seen
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if field.name == "core_attention":
                seen.append(value)
            else:
                _core_attentions(value, seen)
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            _core_attentions(item, seen)
    elif isinstance(spec, dict):
        for item in spec.values():
            _core_attentions(item, seen)
    elif hasattr(spec, "submodules"):
        _core_attentions(spec.submodules, seen)
    elif hasattr(spec, "keywords"):  # functools.partial
        _core_attentions(spec.keywords, seen)
    return seen


def _family_specs():
    from megatron_ext.models import hybrid_specs
    from megatron_ext.models.registry import get_family
    from megatron_ext.sigma.config import SigmaConfig
    from megatron_ext.sigma.specs import sigma_block_spec, sigma_layer_spec
    from megatron_ext.stem.config import StemConfig
    from megatron_ext.stem.specs import decoder_block_spec

    dense = _config(ffn_hidden_size=64, gated_linear_unit=True, add_bias_linear=False,
                    normalization="RMSNorm")
    moe = _config(ffn_hidden_size=64, num_moe_experts=4, moe_ffn_hidden_size=16,
                  moe_router_topk=1, moe_router_pre_softmax=True, add_bias_linear=False,
                  normalization="RMSNorm")
    structmoe_args = SimpleNamespace(
        hybrid_layer_pattern=None, num_layers=4, structmoe_num_experts=4, structmoe_rank=4,
        structmoe_topk=2, structmoe_fusion="additive", structmoe_param_matched=None,
        structmoe_ffn_hidden_size=None, structmoe_init="small", structmoe_backend="reference",
        structmoe_aux_loss_coeff=0.01)
    sigma = SigmaConfig(num_layers=4, num_experts=4, topk=1)
    return {
        "gpt": get_family("gpt").block_spec(SimpleNamespace(), dense, False),
        "stem": decoder_block_spec(dense, StemConfig(ratio="1/2"), 100, use_te=False),
        "structmoe": get_family("structmoe").block_spec(structmoe_args, dense, False),
        "sigma": sigma_block_spec(moe, sigma, False),
        "hybrid": hybrid_specs.hybrid_stack_spec(dense, "*-*-", False),
        "hybrid_sigma": hybrid_specs.hybrid_stack_spec(
            moe, "*E*E", False, moe_fn=lambda k, m: sigma_layer_spec(m, sigma, k)),
    }


@pytest.mark.parametrize("flag, expected", [("sdpa", SDPAttention),
                                            ("unfused", DotProductAttention),
                                            ("auto", DotProductAttention),  # the CPU
                                            (None, DotProductAttention)])  # no training's flags
def test_every_family_gets_the_flags_core_attention(flag, expected):
    with contextlib.ExitStack() as stack:
        if flag is not None:  # None: a spec built outside a training
            stack.enter_context(specs.core_attention_choice(flag))
        family_specs = _family_specs()
    for name, spec in family_specs.items():
        found = _core_attentions(spec)
        assert found and all(c is expected for c in found), (name, found)


@pytest.mark.parametrize("cuda, te, expected", [(True, False, SDPAttention),
                                                (True, True, DotProductAttention),
                                                (False, False, DotProductAttention)])
def test_auto(monkeypatch, cuda, te, expected):
    """auto: the fused attention on a GPU without Transformer Engine; upstream's beside TE and
    on the CPU backend (whose saved tensors planning/estimate.py itemises)."""
    monkeypatch.setattr(specs.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(specs, "te_available", lambda: te)
    assert specs.local_core_attention("auto") is expected
    assert specs.local_core_attention("sdpa") is SDPAttention
    assert specs.local_core_attention("unfused") is DotProductAttention


def test_flag_parses():
    import argparse

    from megatron_ext.training.arguments import add_extension_args

    parser = add_extension_args(argparse.ArgumentParser())
    assert parser.parse_args([]).ext_core_attention == "auto"
    assert parser.parse_args(["--ext-core-attention", "unfused"]).ext_core_attention == "unfused"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ext-core-attention", "flash"])


# ---- 2 ranks: TP=2 + SP, one launch --------------------------------------------------------

# No [b, 1, s, s] mask in the batch, as launch/scaling.py runs on a GPU: the causal kernel
# (the unit tests above take Megatron's mask).
STEM_TP2_SP = ["--model-family", "stem", "--stem-ratio", "1/2", "--train-iters", "4",
               "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--num-query-groups", "2", "--group-query-attention",
               "--no-create-attention-mask-in-dataloader"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from multirank import MULTI_CONFIG, TINY_GPT, launch_ranks, plan_item_logs

    from megatron_ext.tools.metrics import read_tensorboard_scalars

    tmp = tmp_path_factory.mktemp("sdpa")
    plan = [{"name": "module", "module": "sdpa_check", "argv": ["--out", str(tmp / "module")],
             "log_dir": str(tmp / "module" / "ranks")}]
    for core in ("sdpa", "unfused"):
        plan.append({"name": core, "log_dir": str(tmp / core / "ranks"),
                     "argv": TINY_GPT + STEM_TP2_SP + [
                         "--ext-core-attention", core, "--tensorboard-dir", str(tmp / core / "tb"),
                         "--tensorboard-log-interval", "1"]})
    (tmp / "plan.json").write_text(json.dumps(plan, indent=1))
    status, launch_log = launch_ranks([MULTI_CONFIG, str(tmp / "plan.json")], 2, timeout=900)
    result = {}
    for item in plan:
        logs, done = plan_item_logs(item, 2)
        assert done, "".join(logs)[-4000:] + launch_log[-2000:]
        result[item["name"]] = "".join(logs)
    result["ranks"] = [json.loads((tmp / "module" / f"rank{r}.json").read_text())
                       for r in range(2)]
    result["losses"] = {core: dict(read_tensorboard_scalars(str(tmp / core / "tb"))["lm loss"])
                        for core in ("sdpa", "unfused")}
    return result


@pytest.mark.multirank
def test_tp2_sp_self_attention_matches_unfused(launched):
    for rank in launched["ranks"]:
        for case, groups in (("mha", 4), ("gqa", 1)):
            r = rank[case]
            assert r["core"] == "SDPAttention" and r["causal"], r
            assert (r["heads_per_rank"], r["groups_per_rank"]) == (4, groups), r
            for key in ("out", "grad_input", "grad_weights"):
                assert r[key] < 1e-5, (case, key, r)


@pytest.mark.multirank
def test_stem_losses_unchanged_under_tp2_sp(launched):
    sdpa, unfused = launched["losses"]["sdpa"], launched["losses"]["unfused"]
    assert sorted(sdpa) == sorted(unfused) == [1, 2, 3, 4]
    for it in sdpa:
        assert sdpa[it] == pytest.approx(unfused[it], rel=1e-5), (it, sdpa, unfused)
    assert len(set(sdpa.values())) == 4  # it trains: each iteration's loss differs
    # the flag reached the model (the losses may agree to the last bit)
    line = "core attention: torch scaled_dot_product_attention"
    assert line in launched["sdpa"] and line not in launched["unfused"]
