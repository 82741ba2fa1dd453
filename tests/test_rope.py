"""The fused rotary position embedding (``megatron_ext_kernels/rope.py``, its Triton kernel under
the interpreter on the CPU) against Megatron-Core's unfused ``_apply_rotary_pos_emb_bshd`` and a
float64 rotation written here from the definition: forward and backward, halves and interleaved
pairs, a partial rotary dimension, ``mscale``, per-sequence frequencies, the key view of a fused
QKV projection read in place, bf16 rounded once; the flag's refusals and the seam's per-call
choice; and in training on 2 gloo ranks under TP=2 + SP, the fused RoPE gives upstream's losses
(one launch, the kernel interpreted)."""

from __future__ import annotations

import os
import types

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_ext.compat import seam
from megatron_ext.training import rope as rope_choice
from megatron_ext.training import kernel_choice
from megatron_ext_kernels import rope
from multirank import TINY_GPT, Launches, assert_close_curves, require_ok
from tests_helpers import offline_builds

pytestmark = pytest.mark.skipif(not rope.available(),
                                reason="needs Triton (its interpreter on the CPU)")


def _upstream():
    """Megatron's own function, under any seam row in place in this process."""
    fn = rope_utils._apply_rotary_pos_emb_bshd
    while getattr(fn, seam.MARK, None) is not None:
        fn = seam._below(fn)
    return fn


def _freqs(s, rot, interleaved, batch=1, offset=3, device="cpu"):
    """Megatron's RotaryEmbedding layout: each angle twice (halves, or adjacent pairs)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    pos = torch.arange(s * batch, dtype=torch.float32, device=device).view(s, batch) + offset
    angles = pos[..., None] * inv  # [s, batch, rot/2]
    if interleaved:
        emb = torch.stack((angles, angles), dim=-1).flatten(-2)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    return emb[:, :, None, :]


def _fwd_bwd(fn, t, grad, *args):
    x = t.detach().clone().requires_grad_()
    y = fn(x, *args)
    y.backward(grad)
    return y.detach(), x.grad


CASES = [  # (s, b, heads, head_dim, rot_dim, interleaved, mscale, per-sequence freqs)
    (7, 3, 5, 16, 16, False, 1.0, False),
    (7, 3, 5, 16, 16, True, 1.0, False),
    (6, 2, 3, 16, 8, False, 1.0, False),  # rotary_percent 0.5: half the features copied
    (6, 2, 3, 10, 6, True, 1.3, False),  # odd half, interleaved, YaRN's mscale
    (5, 4, 6, 8, 8, False, 0.7, True),  # freqs [s, b, 1, rot]
]


@pytest.mark.parametrize("s,b,heads,d,rot,interleaved,mscale,per_seq", CASES)
def test_fp32_forward_and_backward_are_upstreams(s, b, heads, d, rot, interleaved, mscale,
                                                 per_seq):
    g = torch.Generator().manual_seed(s * 100 + d)
    t = torch.randn(s, b, heads, d, generator=g)
    grad = torch.randn(s, b, heads, d, generator=g)
    freqs = _freqs(s, rot, interleaved, batch=b if per_seq else 1)
    up = _upstream()
    y_up, g_up = _fwd_bwd(lambda x: up(x, freqs, rotary_interleaved=interleaved, mscale=mscale),
                          t, grad)
    y, gx = _fwd_bwd(rope.fused_rope, t, grad, freqs, interleaved, mscale)
    torch.testing.assert_close(y, y_up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, g_up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), rope.reference(t, freqs, interleaved, mscale),
                               rtol=1e-6, atol=1e-6)
    assert y.is_contiguous() and y.shape == t.shape and y.dtype == t.dtype
    if rot < d:  # the features past rot_dim are copied bit for bit
        assert torch.equal(y[..., rot:], t[..., rot:])
        assert torch.equal(gx[..., rot:], grad[..., rot:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_any_frequencies_forward_and_backward(interleaved):
    """Frequencies whose two copies of an angle differ (not Megatron's layout): the forward
    takes each feature's own angle as upstream does, and the backward still equals autograd
    through upstream's ops, so it applies the exact transpose rather than a rotation by minus
    the angle."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(4, 2, 3, 12, generator=g)
    grad = torch.randn(4, 2, 3, 12, generator=g)
    freqs = torch.rand(4, 1, 1, 12, generator=g) * 6
    up = _upstream()
    y_up, g_up = _fwd_bwd(lambda x: up(x, freqs, rotary_interleaved=interleaved), t, grad)
    y, gx = _fwd_bwd(rope.fused_rope, t, grad, freqs, interleaved, 1.0)
    torch.testing.assert_close(y, y_up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, g_up, rtol=1e-6, atol=1e-6)


def test_the_key_view_of_a_fused_qkv_is_read_in_place():
    """Megatron's SelfAttention splits the fused QKV projection ``[s, b, groups, (q/g + 2) d]``:
    the key is a strided view (heads ``(q/g + 2) d`` apart); a gradient may arrive strided too."""
    g = torch.Generator().manual_seed(2)
    s, b, groups, per_group, d = 6, 2, 2, 3, 16
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, generator=g)
    key = mixed[..., per_group * d:(per_group + 1) * d]
    assert not key.is_contiguous() and key.stride(-1) == 1
    freqs = _freqs(s, d, False)
    grad = torch.randn(b, s, groups, d, generator=g).transpose(0, 1)  # strided in s and b
    up = _upstream()
    y_up, g_up = _fwd_bwd(lambda x: up(x, freqs), key, grad)
    y, gx = _fwd_bwd(rope.fused_rope, key, grad, freqs, False, 1.0)
    torch.testing.assert_close(y, y_up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, g_up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_bf16_is_the_exact_value_rounded_once(interleaved):
    """In bf16 the kernel computes in fp32 and rounds once: within half a bf16 ulp (and the
    fp32 arithmetic's rounding) of the float64 rotation of the same bf16 inputs, forward and
    backward; upstream, rounding after each op, is further off."""
    g = torch.Generator().manual_seed(3)
    s, b, heads, d = 16, 2, 4, 32
    t = torch.randn(s, b, heads, d, generator=g).bfloat16()
    grad = torch.randn(s, b, heads, d, generator=g).bfloat16()
    freqs = _freqs(s, d, interleaved, offset=100)
    y, gx = _fwd_bwd(rope.fused_rope, t, grad, freqs, interleaved, 1.0)
    up = _upstream()
    y_up, _ = _fwd_bwd(lambda x: up(x, freqs, rotary_interleaved=interleaved), t, grad)
    exact = rope.reference(t, freqs, interleaved)
    # the backward is the rotation by minus the angle for Megatron's frequencies
    exact_grad = rope.reference(grad, -freqs, interleaved)
    for got, want in ((y, exact), (gx, exact_grad)):
        half_ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 8)
        assert ((got.double() - want).abs() <= half_ulp * 1.001 + 1e-12).all()
    assert (y_up.double() - exact).abs().max() > (y.double() - exact).abs().max()


def test_supports_and_refusals():
    t = torch.zeros(4, 2, 3, 8)
    assert rope.supports(t, torch.zeros(4, 1, 1, 8))
    assert rope.supports(t, torch.zeros(4, 2, 1, 4))
    assert not rope.supports(t, torch.zeros(4, 1, 1, 5))  # odd rotary dimension
    assert not rope.supports(t, torch.zeros(4, 1, 1, 16))  # wider than the heads
    assert not rope.supports(t, torch.zeros(4, 3, 1, 8))  # neither 1 nor b sequences
    assert not rope.supports(t, torch.zeros(1, 1, 1, 8))  # upstream broadcasts; not covered
    assert not rope.supports(t[0], torch.zeros(4, 1, 1, 8))
    assert not rope.supports(t.double(), torch.zeros(4, 1, 1, 8))
    with pytest.raises(ValueError, match=r"^fused RoPE: t \(4, 2, 3, 8\)"):
        rope.fused_rope(t, torch.zeros(4, 1, 1, 5))


def test_the_flag_refuses_in_one_line(monkeypatch):
    args = types.SimpleNamespace(ext_rope="fused", position_embedding_type="rope",
                                 apply_rope_fusion=False)
    assert rope_choice.check_args(args) == "fused"
    assert rope_choice.check_args(types.SimpleNamespace(ext_rope="auto")) == "upstream"
    with pytest.raises(ValueError, match=r"^--ext-rope fused with rope fusion on"):
        rope_choice.check_args(types.SimpleNamespace(**{**vars(args), "apply_rope_fusion": True}))
    with pytest.raises(ValueError, match=r"^--ext-rope fused with --position-embedding-type "
                                         r"learned_absolute"):
        rope_choice.check_args(types.SimpleNamespace(
            **{**vars(args), "position_embedding_type": "learned_absolute"}))
    with pytest.raises(ValueError, match=r"^--ext-rope best: choose one of auto, upstream, fused"):
        rope_choice.resolve("best")
    monkeypatch.setattr(kernel_choice, "available", lambda: False)
    with pytest.raises(ValueError, match=r"^--ext-rope fused needs Triton"):
        rope_choice.resolve("fused")


def test_the_seam_chooses_per_training_and_per_call(monkeypatch):
    """The per-run replacement reads the training's flag once; calls the kernel does not cover
    (MLA's interleaving, a packed sequence's 3-D ``t``... here an odd rotary dimension) and an
    ``upstream`` training keep upstream's function."""
    calls = []

    def upstream(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                 multi_latent_attention=None):
        calls.append((tuple(freqs.shape), mla_rotary_interleaved))
        return torch.zeros_like(t)

    args = types.SimpleNamespace(ext_rope="fused")
    monkeypatch.setattr(rope_choice, "get_args", lambda: args)
    fn = rope_choice.wrap(upstream)
    t = torch.randn(4, 2, 3, 8)
    freqs = _freqs(4, 8, False)
    torch.testing.assert_close(fn(t, freqs).double(), rope.reference(t, freqs),
                               rtol=1e-6, atol=1e-6)
    assert calls == []
    fn(t, freqs, mla_rotary_interleaved=True)
    fn(t, torch.zeros(4, 1, 1, 5))
    assert calls == [((4, 1, 1, 8), True), ((4, 1, 1, 5), False)]
    args.ext_rope = "upstream"  # read once: the training's choice stays
    fn(t, freqs)
    assert len(calls) == 2
    calls.clear()
    up = rope_choice.wrap(upstream)  # a training with --ext-rope upstream
    fn_args = types.SimpleNamespace(ext_rope="upstream")
    monkeypatch.setattr(rope_choice, "get_args", lambda: fn_args)
    up(t, freqs)
    assert calls == [((4, 1, 1, 8), False)]


def test_compiles_for_the_gpu_without_spills():
    """The GPU build, checked offline (no device needed): forward and backward, bf16 and fp32,
    halves, pairs and a half rotary dimension, at dense_1b's query and key shapes, compile for
    A100 and H100 (sm_80, sm_90) with the blocks and warps a launch uses, in few registers. The
    32 bytes of local memory are libdevice's ``sinf``/``cosf`` frame for arguments past 1e5
    radians (none without them; RoPE's angles stay below the sequence length): more would be
    spills."""
    reports = offline_builds(
        "rope", "[offline_build(a, t, heads=h, rot_dim=r, interleaved=i, backward=w) "
        "for a in (80, 90) for t in ('bf16', 'fp32') for w in (False, True) "
        "for h, r, i in [(32, 64, False), (8, 64, True), (8, 32, False)]]")
    assert len(reports) == 24
    for use in reports:
        assert use["local"] <= 32, use
        # Four programs of 4 warps per SM at least: loads of one overlap another's stores.
        assert use["registers"] * 32 * rope.NUM_WARPS * 4 <= 65536, use


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_kernel_compiles_and_gives_upstreams_numbers(dtype, interleaved):
    """The kernel compiled by Triton on a GPU at dense_1b's attention (sequence 4096, 32 query
    heads of 64, the key view of the fused QKV of 8 groups): forward and backward against
    upstream's (bf16: both within a bf16 ulp of the float64 rotation)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, groups, per_group, d = 4096, 2, 8, 4, 64
    mixed = torch.randn(s, b, groups, (per_group + 2) * d, generator=g, device="cuda").to(dtype)
    key = mixed[..., per_group * d:(per_group + 1) * d]
    query = mixed[..., :per_group * d].reshape(s, b, groups * per_group, d)
    freqs = _freqs(s, d, interleaved, device="cuda")
    up = _upstream()
    for t in (query, key):
        grad = torch.randn(t.shape, generator=g, device="cuda").to(dtype)
        y_up, g_up = _fwd_bwd(lambda x: up(x, freqs, rotary_interleaved=interleaved), t, grad)
        y, gx = _fwd_bwd(rope.fused_rope, t, grad, freqs, interleaved, 1.0)
        if dtype == torch.float32:
            torch.testing.assert_close(y, y_up, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gx, g_up, rtol=1e-5, atol=1e-5)
        else:
            exact = rope.reference(t, freqs, interleaved)
            ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
            assert ((y.double() - exact).abs() <= ulp * 0.5005 + 1e-12).all()
            assert ((y_up.double() - exact).abs() <= ulp * 2 + 1e-12).all()


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ITERS = ["--train-iters", "3", "--global-batch-size", "2"]
INTERPRET = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")} \
    if not torch.cuda.is_available() else {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = Launches(str(tmp_path_factory.mktemp("rope")))
    # rotary_percent 0.5 and interleaving: the kernel's copied features and its pairs in training
    extra = ["--rotary-percent", "0.5", "--rotary-interleaved"]
    for name, flags in (("upstream", TP2_SP + extra + ["--ext-rope", "upstream"]),
                        ("fused", TP2_SP + extra + ["--ext-rope", "fused"])):
        launches.add(name, TINY_GPT + ITERS + flags, env=INTERPRET)
    return launches.run()


@pytest.mark.multirank
def test_tp2_sp_training_with_the_fused_rope_gives_upstreams_losses(runs):
    fused, upstream = require_ok(runs["fused"]), require_ok(runs["upstream"])
    assert "megatron-ext: rope: fused" in fused.log
    assert "rope: fused" not in upstream.log
    assert sorted(fused.losses) == [1, 2, 3]
    assert_close_curves(fused, upstream, [1, 2, 3], tol=1e-5)
