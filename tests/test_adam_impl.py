"""Without Transformer Engine and Apex: torch's fused AdamW (``--ext-adam-impl``,
``megatron_ext/training/adam_impl.py``) and the gradient norm and scaling on the device
(``compat/upstream_fixes.py``, ``multi_tensor_fallbacks_on_the_device``).

In process: the switch gives torch's own fused AdamW bit for bit; megatron-core's fallbacks and
ours give the same norms and scaled tensors bit for bit on the CPU, and ours read nothing back to
the host (they run on the meta device, where any host read fails); a resume keeps each step
counter on the device its kernel reads it from. One launch of 2 gloo ranks: a tiny GPT with the
distributed optimizer, gradients clipped at every step, foreach against fused (fp32 rounding) and a
fused resume (exact); fp16 without the distributed optimizer (main parameters copied into the
model's by the scaling fallback), foreach against fused.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
from megatron.core import optimizer as megatron_optimizer
from megatron.core.optimizer import clip_grads
from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

from megatron_ext.compat import upstream_fixes
from megatron_ext.training import adam_impl
from multirank import TINY_GPT, Launches, assert_close_curves, require_ok


def _tensors(device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = [(100, 37), (5,), (4096,), (33, 7, 3), (1,)]
    return [(torch.randn(s, generator=g) * 10.0 ** (-i)).to(device) for i, s in enumerate(shapes)]


def _adam(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, **kw)


def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()


def test_the_switch_gives_torchs_fused_adamw_bit_for_bit():
    ts = _tensors()
    grads = [[torch.randn_like(t) for t in ts] for _ in range(4)]
    switched = [torch.nn.Parameter(t.clone()) for t in ts]
    built = [torch.nn.Parameter(t.clone()) for t in ts]
    default = [torch.nn.Parameter(t.clone()) for t in ts]
    wrapper = types.SimpleNamespace(optimizer=_adam(switched))  # as Megatron's wrappers hold it
    chained = types.SimpleNamespace(chained_optimizers=[wrapper])
    assert adam_impl.select(chained, "fused") == \
        "megatron-ext: torch AdamW, fused (--ext-adam-impl fused)"
    assert all(g["fused"] for g in wrapper.optimizer.param_groups)
    _steps(wrapper.optimizer, switched, grads)
    _steps(_adam(built, fused=True), built, grads)
    opt = _adam(default)
    _steps(opt, default, grads)
    assert all(torch.equal(a, b) for a, b in zip(switched, built))
    # The foreach/for-loop update differs in rounding only.
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(switched, default))


def test_every_optimizer_of_a_chain_is_switched():
    """Megatron's ChainedOptimizer over several (the experts' own under EP): its ``optimizer``
    property asserts there; each chained one is reached instead."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    opts = [_adam([torch.nn.Parameter(t)]) for t in _tensors()[:2]]
    chain = ChainedOptimizer([types.SimpleNamespace(optimizer=o) for o in opts])
    with pytest.raises(AssertionError):
        chain.optimizer
    assert "fused" in adam_impl.select(chain, "fused")
    assert all(g["fused"] for o in opts for g in o.param_groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_fused_on_the_gpu_and_gives_torchs_fused_adamw():
    ts = _tensors("cuda")
    grads = [[torch.randn_like(t) for t in ts] for _ in range(3)]
    switched = [torch.nn.Parameter(t.clone()) for t in ts]
    built = [torch.nn.Parameter(t.clone()) for t in ts]
    opt = _adam(switched)
    assert adam_impl.select(types.SimpleNamespace(optimizer=opt), "auto") == \
        "megatron-ext: torch AdamW, fused (--ext-adam-impl auto)"
    _steps(opt, switched, grads)
    _steps(_adam(built, fused=True), built, grads)
    assert all(torch.equal(a, b) for a, b in zip(switched, built))
    assert all(st["step"].is_cuda for st in opt.state.values())  # where the kernel reads it


def test_auto_keeps_torchs_default_off_the_gpu_and_foreach_always():
    params = [torch.nn.Parameter(t) for t in _tensors()]
    for choice, said in (("auto", ""), ("foreach", "megatron-ext: torch AdamW, torch's default "
                                                  "implementation (--ext-adam-impl foreach)")):
        opt = _adam(params)
        assert adam_impl.select(types.SimpleNamespace(optimizer=opt), choice) == said
        assert not any(g["fused"] for g in opt.param_groups)


def test_refusals_name_the_flag(monkeypatch):
    args = types.SimpleNamespace(ext_adam_impl="fused", optimizer="sgd",
                                 optimizer_cpu_offload=False)
    with pytest.raises(ValueError, match=r"^--ext-adam-impl fused: for Megatron's GPU Adam"):
        adam_impl.check_args(args)
    with pytest.raises(ValueError, match="no torch Adam in it"):
        adam_impl.select(types.SimpleNamespace(optimizer=None), "fused")
    adam_impl.check_args(types.SimpleNamespace(ext_adam_impl="auto", optimizer="sgd"))
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)  # TE or Apex
    with pytest.raises(ValueError, match="Transformer Engine's or Apex's FusedAdam"):
        adam_impl.check_args(types.SimpleNamespace(ext_adam_impl="foreach", optimizer="adam"))
    opt = _adam([torch.nn.Parameter(torch.ones(3))])
    assert adam_impl.select(types.SimpleNamespace(optimizer=opt), "auto") == ""
    assert not opt.param_groups[0]["fused"]


def test_the_device_fallbacks_are_in_place_without_apex_or_te():
    upstream_fixes.install(["multi_tensor_fallbacks_on_the_device"])
    for module in (clip_grads, megatron_optimizer.optimizer):
        if module is clip_grads:
            assert clip_grads.l2_norm_impl.__qualname__.startswith("_l2_norm_without_host_reads")
        assert module.multi_tensor_scale_impl.__qualname__.startswith("_scale_in_few_launches")
    # --log-params-norm's norm (megatron.training.utils.calc_params_l2_norm) too.
    from megatron.training.utils import common_utils

    assert common_utils.multi_tensor_l2norm.__qualname__.startswith("_l2_norm_without_host_reads")


def test_gradient_norm_is_upstreams_bit_for_bit_and_reads_nothing_on_the_host():
    l2 = upstream_fixes._l2_norm_without_host_reads(local_multi_tensor_l2_norm)
    ts = _tensors()
    ours, _ = l2(2048 * 32, None, [ts], False)
    assert ours.shape == (1,) and ours.dtype == torch.float32
    expected = torch.norm(torch.tensor([float(torch.norm(t)) for t in ts]))
    assert ours.item() == expected.item()
    meta = [t.to("meta") for t in ts]
    assert l2(2048 * 32, None, [meta], False)[0].device.type == "meta"  # no host read
    with pytest.raises((RuntimeError, NotImplementedError)):  # upstream's reads every norm
        local_multi_tensor_l2_norm(2048 * 32, None, [meta], False)


def test_scaling_is_upstreams_bit_for_bit_and_reads_nothing_on_the_host():
    scale = upstream_fixes._scale_in_few_launches(local_multi_tensor_scale)
    for factor in (0.37, 1.0):
        ours, theirs = _tensors(), _tensors()
        scale(0, None, [ours, ours], factor)  # in place: clipped gradients
        local_multi_tensor_scale(0, None, [theirs, theirs], factor)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        src = _tensors()  # fp32 main parameters into bf16 model ones
        ours = [t.to(torch.bfloat16).zero_() for t in src]
        theirs = [t.clone() for t in ours]
        scale(0, None, [src, ours], factor)
        local_multi_tensor_scale(0, None, [src, theirs], factor)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    meta = [t.to("meta") for t in _tensors()]
    scale(0, None, [meta, meta], 0.5)
    with pytest.raises(ValueError, match="5 sources for 4 targets"):
        scale(0, None, [meta, meta[:4]], 0.5)


def test_a_resume_keeps_each_step_counter_on_its_device():
    """The fused kernel reads its step counters on the parameters' device; torch's load puts
    them there, and the fix that gives each state its own counter must leave them there (it made
    them host tensors until 2026-11-28)."""
    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    inner = types.SimpleNamespace(state={p: {"step": torch.zeros((), device="meta")}})
    load = upstream_fixes._load_state_dict_own_steps(lambda self, sd: None)
    load(types.SimpleNamespace(optimizer=inner),
         {"optimizer": {"param_groups": [{"step": 7}]}})
    assert inner.state[p]["step"].device.type == "meta"


DOPT = ["--use-distributed-optimizer"]
CLIP = ["--clip-grad", "0.05"]  # clipped at every step: the scaling fallback runs
ITERS = ["--train-iters", "6"]
# fp16 (static loss scale) without the distributed optimizer: Float16OptimizerWithFloat16Params
# copies main parameters into the model's through multi_tensor_scale (bf16 copies tensor by tensor).
FP16 = ["--fp16", "--loss-scale", "128", "--train-iters", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adam_impl")
    ck = str(tmp / "ck")
    launches = Launches(str(tmp))
    launches.add("foreach", TINY_GPT + ITERS + DOPT + CLIP + ["--ext-adam-impl", "foreach"])
    launches.add("fused", TINY_GPT + ITERS + DOPT + CLIP +
                 ["--ext-adam-impl", "fused", "--save", ck, "--save-interval", "3"])
    launches.add("fused_resume", TINY_GPT + ITERS + DOPT + CLIP +
                 ["--ext-adam-impl", "fused", "--load", ck, "--ckpt-step", "3"])
    launches.add("fp16_foreach", TINY_GPT + FP16 + CLIP + ["--ext-adam-impl", "foreach"])
    launches.add("fp16_fused", TINY_GPT + FP16 + CLIP + ["--ext-adam-impl", "fused"])
    return launches.run()


def _grad_norms(run):
    return {int(i): float(v) for i, v in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.E+-]+)", run.log)}


def test_fused_trains_as_foreach_and_resumes_exactly(runs):
    foreach, fused = require_ok(runs["foreach"]), require_ok(runs["fused"])
    assert "megatron-ext: torch AdamW, fused (--ext-adam-impl fused)" in fused.log
    assert "torch's default implementation (--ext-adam-impl foreach)" in foreach.log
    assert_close_curves(fused, foreach, [1, 2, 3, 4, 5, 6], tol=2e-5)
    norms = _grad_norms(fused)
    assert sorted(norms) == [1, 2, 3, 4, 5, 6] and min(norms.values()) > 0.05  # clipped
    assert norms[1] == _grad_norms(foreach)[1]  # same weights, same gradients, same norm
    resumed = require_ok(runs["fused_resume"])
    assert "megatron-ext: torch AdamW, fused" in resumed.log
    assert sorted(resumed.losses) == [4, 5, 6]
    assert resumed.curve([4, 5, 6]) == fused.curve([4, 5, 6])


def test_fp16_fused_trains_as_foreach(runs):
    foreach, fused = require_ok(runs["fp16_foreach"]), require_ok(runs["fp16_fused"])
    assert "megatron-ext: torch AdamW, fused" in fused.log
    assert_close_curves(fused, foreach, [1, 2, 3], tol=2e-3)
