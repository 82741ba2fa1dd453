"""The fused vocab-parallel cross entropy (``megatron_ext_kernels/vocab_ce.py``, its Triton
kernels under the interpreter on the CPU) against Megatron-Core's ``vocab_parallel_cross_entropy``
and a plain ``logsumexp`` written here: the loss and the logits' gradient, fp32 and bf16, a
vocabulary over several of the kernel's blocks, an odd one, extreme logits, targets at the
shard's edges; the flag's refusals; and in training on 2 gloo ranks under TP=2 (the vocabulary
in two shards, the all-reduces), the fused loss gives upstream's losses (one launch, the kernels
interpreted)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from megatron_ext_kernels import vocab_ce
from megatron_ext.training import cross_entropy
from megatron_ext.training import kernel_choice
from multirank import TINY_GPT, Launches, assert_close_curves, require_ok

pytestmark = pytest.mark.skipif(not vocab_ce.available(),
                                reason="needs Triton (its interpreter on the CPU)")


def _upstream(logits, target):
    from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

    from megatron_ext.compat.standalone import init_single_rank

    ps = init_single_rank()
    # Upstream subtracts the max in place from fp32 logits: hand it a copy.
    return _VocabParallelCrossEntropy.apply(logits.clone(), target, 0.0,
                                            ps.get_tensor_model_parallel_group())


def _case(vocab, dtype, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, 3, vocab, generator=g) * scale).to(dtype)
    target = torch.randint(0, vocab, (6, 3), generator=g)
    target[0, 0], target[1, 1] = 0, vocab - 1  # the shard's first and last column
    grad_loss = torch.rand(6, 3, generator=g)
    return logits, target, grad_loss


def _loss_and_grad(fn, logits, target, grad_loss):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, target)
    loss.backward(grad_loss)
    return loss.detach(), x.grad


@pytest.mark.parametrize("vocab", [37, 1000, vocab_ce.MAX_BLOCK + 904])
def test_fp32_loss_and_gradient_are_upstreams(vocab):
    logits, target, grad_loss = _case(vocab, torch.float32)
    loss, grad = _loss_and_grad(vocab_ce.fused_vocab_parallel_cross_entropy, logits, target,
                                grad_loss)
    up_loss, up_grad = _loss_and_grad(_upstream, logits, target, grad_loss)
    ref_loss, _ = _loss_and_grad(vocab_ce.reference, logits, target, grad_loss)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    torch.testing.assert_close(loss, up_loss, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=2e-6)
    assert grad.dtype == logits.dtype
    torch.testing.assert_close(grad, up_grad, rtol=1e-5, atol=1e-7)


def test_extreme_logits_neither_overflow_nor_lose_the_target():
    logits, target, grad_loss = _case(300, torch.float32, scale=80.0, seed=3)
    logits[2, 0, target[2, 0]] = 1e4  # a certain token: loss 0, gradient 0 at it
    loss, grad = _loss_and_grad(vocab_ce.fused_vocab_parallel_cross_entropy, logits, target,
                                grad_loss)
    up_loss, up_grad = _loss_and_grad(_upstream, logits, target, grad_loss)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert loss[2, 0] == 0.0 and grad[2, 0].abs().max() == 0.0
    torch.testing.assert_close(loss, up_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grad, up_grad, rtol=1e-5, atol=1e-6)


def test_bf16_gradient_is_upstreams_rounded_once():
    """bf16 logits: the loss in fp32 from the bf16 values (as upstream's ``.float()``); the
    gradient computed in fp32 and rounded once to bf16 (upstream rounds its fp32 gradient when
    autograd casts it to the input's dtype): equal up to one bf16 rounding step."""
    logits, target, grad_loss = _case(1000, torch.bfloat16)
    loss, grad = _loss_and_grad(vocab_ce.fused_vocab_parallel_cross_entropy, logits, target,
                                grad_loss)
    up_loss, up_grad = _loss_and_grad(_upstream, logits, target, grad_loss)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, up_loss, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(grad.float(), up_grad.float(), rtol=2 ** -7, atol=1e-9)
    assert (grad == up_grad).float().mean() > 0.95


def test_non_contiguous_logits_and_empty_input():
    logits, target, grad_loss = _case(64, torch.float32)
    wide = torch.cat([logits, torch.zeros_like(logits)], dim=-1)[..., :64]  # rows strided
    loss, grad = _loss_and_grad(vocab_ce.fused_vocab_parallel_cross_entropy, wide, target,
                                grad_loss)
    up_loss, up_grad = _loss_and_grad(_upstream, logits, target, grad_loss)
    torch.testing.assert_close(loss, up_loss, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(grad, up_grad, rtol=1e-5, atol=1e-7)
    empty = torch.zeros(0, 2, 64, requires_grad=True)
    out = vocab_ce.fused_vocab_parallel_cross_entropy(empty, torch.zeros(0, 2, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0, 2) and empty.grad.shape == empty.shape


def test_refusals_name_the_flag(monkeypatch):
    with pytest.raises(ValueError, match=r"^--ext-cross-entropy fused with "
                                         r"--cross-entropy-loss-fusion"):
        cross_entropy.check_args(types.SimpleNamespace(ext_cross_entropy="fused",
                                                       cross_entropy_loss_fusion=True))
    assert cross_entropy.check_args(types.SimpleNamespace(ext_cross_entropy="auto")) == "upstream"
    with pytest.raises(ValueError, match="targets of torch.float32"):
        vocab_ce.fused_vocab_parallel_cross_entropy(torch.zeros(2, 1, 8), torch.zeros(2, 1))
    monkeypatch.setattr(kernel_choice, "available", lambda: False)
    with pytest.raises(ValueError, match=r"^--ext-cross-entropy fused needs Triton"):
        cross_entropy.resolve("fused")


def test_the_seam_chooses_per_training(monkeypatch):
    """The per-run replacement reads the training's flag once and keeps upstream's path for
    label smoothing."""
    calls = []

    def upstream(logits, target, label_smoothing=0.0, tp_group=None):
        calls.append(label_smoothing)
        return torch.zeros(target.shape)

    args = types.SimpleNamespace(ext_cross_entropy="fused")
    monkeypatch.setattr(cross_entropy, "get_args", lambda: args)
    monkeypatch.setattr(cross_entropy.parallel_state, "get_tensor_model_parallel_group",
                        lambda: None)
    fn = cross_entropy.wrap(upstream)
    logits, target, _ = _case(50, torch.float32)
    torch.testing.assert_close(fn(logits, target), vocab_ce.reference(logits, target),
                               rtol=1e-6, atol=2e-6)
    fn(logits, target, label_smoothing=0.1)
    assert calls == [0.1]
    args.ext_cross_entropy = "upstream"  # read once: the training's choice stays
    fn(logits, target)
    assert calls == [0.1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_compile_and_give_upstreams_numbers(dtype):
    """The kernels compiled by Triton on a GPU at a model's vocabulary (128256, the 1B presets'):
    the loss and gradient against upstream's, 2048 rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(512, 4, 128256, generator=g, device="cuda") * 3).to(dtype)
    target = torch.randint(0, 128256, (512, 4), generator=g, device="cuda")
    grad_loss = torch.rand(512, 4, generator=g, device="cuda")
    loss, grad = _loss_and_grad(vocab_ce.fused_vocab_parallel_cross_entropy, logits, target,
                                grad_loss)
    up_loss, up_grad = _loss_and_grad(_upstream, logits, target, grad_loss)
    torch.testing.assert_close(loss, up_loss, rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(grad.float(), up_grad.float(), rtol=2 ** -7, atol=1e-9)
    else:
        torch.testing.assert_close(grad, up_grad, rtol=1e-4, atol=1e-9)


TP2 = ["--tensor-model-parallel-size", "2"]
# One micro-batch per iteration: the kernels run under Triton's interpreter (about a second per
# call at this shape on 2 cores).
ITERS = ["--train-iters", "3", "--global-batch-size", "2"]
INTERPRET = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")} \
    if not torch.cuda.is_available() else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = Launches(str(tmp_path_factory.mktemp("vocab_ce")))
    # SP changes nothing the loss sees (the output layer gathers the sequence first).
    for name, flags in (("tp2_upstream", TP2 + ["--ext-cross-entropy", "upstream"]),
                        ("tp2_fused", TP2 + ["--ext-cross-entropy", "fused"])):
        launches.add(name, TINY_GPT + ITERS + flags, env=INTERPRET)
    return launches.run()


@pytest.mark.multirank
def test_tp2_training_with_the_fused_loss_gives_upstreams_losses(runs):
    fused, upstream = require_ok(runs["tp2_fused"]), require_ok(runs["tp2_upstream"])
    assert "megatron-ext: cross entropy: fused" in fused.log
    assert "cross entropy: fused" not in upstream.log
    assert sorted(fused.losses) == [1, 2, 3]
    assert_close_curves(fused, upstream, [1, 2, 3], tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_estimate_counts_what_each_loss_keeps(dtype):
    """``planning/estimate.py`` ``loss_bytes`` against the bytes autograd keeps for each loss's
    backward, measured with ``saved_tensors_hooks`` (the targets, kept by both, aside)."""
    from megatron_ext.planning.estimate import loss_bytes
    from megatron_ext.planning.layout import Layout

    s, b, vocab = 16, 2, 1000
    logits, target, _ = _case(vocab, dtype)
    logits, target = logits[:, :2].reshape(6, 2, vocab).repeat(3, 1, 1)[:s], \
        target[:, :2].repeat(3, 1)[:s]

    def kept(fn):
        saved = {}

        def pack(t):
            if t.dtype.is_floating_point:  # the targets and masks are not the loss's
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = logits.detach().clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, target)
        return sum(saved.values())

    for fused, fn in ((False, _upstream), (True, vocab_ce.fused_vocab_parallel_cross_entropy)):
        layout = Layout(param_bytes=logits.element_size(), fused_cross_entropy=fused)
        assert kept(fn) == loss_bytes(layout, s, b, vocab), (fused, dtype)
