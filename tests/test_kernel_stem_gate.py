"""The fused STEM lookup-and-gate kernel (kernels/stem_gate.py) against plain-PyTorch references.

On the CPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py`` before anything imports Triton: ``@triton.jit`` reads it at decoration
time), at small shapes. On a GPU the same tests run the compiled kernels, and the ``gpu`` tests add the paper's
shape and a check that forward + backward never synchronise with the host.

References: ``fp64`` recomputes the variant's formula and its hand-derived gradients in float64
from the same (already rounded) inputs, with ``index_add`` for the row sums; in fp32 the kernel
must equal it to fp32 rounding, in bf16 to one rounding of the result (2**-8 relative). The
PyTorch path of ``StemMLP`` (``stem_gate_reference``) is compared too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext_kernels import stem_gate as sg
from tests_helpers import offline_builds

pytestmark = pytest.mark.skipif(not sg.available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_REL = 2.0 ** -8


def fp64_reference(fc1, rows_src, index, grad, variant):
    """Forward and gradients in float64, written out by hand (d silu(z) = s (1 + z (1 - s)))."""
    fc1, grad = fc1.double(), grad.double()
    t = rows_src[index].double()
    n_cols = rows_src.shape[-1]

    def silu(z):
        return z * torch.sigmoid(z)

    def dsilu(z):
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))

    if variant == "up":
        a = fc1
        out, dfc1, drow = silu(a) * t, grad * t * dsilu(a), grad * silu(a)
    elif variant == "gate":
        a = fc1
        out, dfc1, drow = silu(t) * a, grad * silu(t), grad * a * dsilu(t)
    else:
        a, u = fc1[..., :n_cols], fc1[..., n_cols:]
        out = silu(a) * (u + t)
        dfc1 = torch.cat([grad * (u + t) * dsilu(a), grad * silu(a)], dim=-1)
        drow = grad * silu(a)
    drows = torch.zeros(rows_src.shape, dtype=torch.float64, device=fc1.device)
    drows.index_add_(0, index.reshape(-1), drow.reshape(-1, n_cols))
    # |terms| of the row sums: the scale a rounding error of the sum is measured against.
    scale = torch.zeros_like(drows).index_add_(0, index.reshape(-1), drow.abs().reshape(-1, n_cols))
    return out, dfc1, drows, scale


def make(variant, dtype, n_tokens, n_cols, vocab, ids=None, seed=0, table_dtype=None):
    g = torch.Generator().manual_seed(seed)
    width = n_cols * (2 if variant == "dagger" else 1)
    fc1 = (torch.randn(n_tokens, width, generator=g) * 2).to(dtype)
    table = torch.randn(vocab, n_cols, generator=g).to(table_dtype or dtype)
    if ids is None:
        ids = torch.randint(0, vocab, (n_tokens,), generator=g)
    grad = torch.randn(n_tokens, n_cols, generator=g).to(dtype)
    return fc1.to(DEVICE), table.to(DEVICE), ids.to(DEVICE), grad.to(DEVICE)


def run_fused(fc1, table, ids, grad, variant, shape=None, tile=None):
    fc1 = fc1.clone().requires_grad_(True)
    table = table.clone().requires_grad_(True)
    x, i = (fc1, ids) if shape is None else (fc1.view(*shape, -1), ids.view(*shape))
    out = sg.stem_gate(x, table, i, variant, bwd_tile=tile)
    out.backward(grad.view(out.shape))
    return out.reshape(-1, out.shape[-1]), fc1.grad, table.grad


def assert_matches_fp64(variant, fc1, table, ids, grad, out, dfc1, dtable):
    rows_src = table.to(fc1.dtype)  # the kernel rounds rows to the model's dtype, as StemMLP does
    ref_out, ref_dfc1, ref_drows, scale = fp64_reference(fc1, rows_src, ids, grad, variant)
    if fc1.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dfc1.double(), ref_dfc1, rtol=1e-5, atol=1e-6)
        assert ((dtable.double() - ref_drows).abs() <= 1e-6 * scale + 1e-7).all()
    else:
        # One rounding of an fp32 result to bf16: |error| <= 2**-8 |exact| (+ fp32 noise).
        for got, exact in ((out, ref_out), (dfc1, ref_dfc1)):
            err = (got.double() - exact).abs()
            assert (err <= BF16_REL * exact.abs() + 1e-6).all(), err.max()
        err = (dtable.double() - ref_drows).abs()
        assert (err <= BF16_REL * ref_drows.abs() + 1e-6 * scale + 1e-7).all(), err.max()


SHAPES = [
    # n_tokens, n_cols, vocab, ids, backward tile (None: the default, sg.BWD_TILE)
    (37, 24, 11, None, None),                       # random ids with repeats, F < one block
    (1, 24, 11, None, None),                        # one token
    (40, 20, 50, torch.full((40,), 7), None),       # every token the same row, three chunks
    # F spans two forward column blocks with a ragged tail (three backward ones of 512); chunks
    # of one position: every run of two or more tokens is summed by the carry pass alone (and
    # the interpreter's scan, (chunk - 1) x width steps per program, costs nothing).
    (6, 1030, 9, torch.tensor([3, 0, 3, 8, 3, 0]), sg.BwdTile(1, 512, 4)),
]


@pytest.mark.parametrize("variant", ["up", "gate", "dagger"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", range(len(SHAPES)), ids=["random", "one", "same", "wide"])
def test_fused_matches_fp64_reference(variant, dtype, shape):
    n, cols, vocab, ids, tile = SHAPES[shape]
    fc1, table, ids, grad = make(variant, dtype, n, cols, vocab, ids)
    out, dfc1, dtable = run_fused(fc1, table, ids, grad, variant, tile=tile)
    assert out.dtype == dtype and dfc1.dtype == dtype and dtable.dtype == dtype
    assert_matches_fp64(variant, fc1, table, ids, grad, out, dfc1, dtable)
    untouched = torch.ones(vocab, dtype=torch.bool, device=ids.device)
    untouched[ids] = False
    assert (dtable[untouched] == 0).all()


# The skew tests' backward tile: chunks of 4 positions, column blocks of 8. Small, because the
# interpreter runs a segmented scan element by element (``tl.associative_scan`` with a combine
# function of our own), and because small chunks put many chunk edges in few tokens; the
# default tile runs in the tests above.
SKEW_TILE = sg.BwdTile(chunk=4, block_f=8, num_warps=1)
SKEW_COLS = 12  # two column blocks, the second ragged
SKEW_TOKENS = SKEW_TILE.chunk * (sg.SPAN + 4) + 3  # a run can cover more than SPAN + 1 chunks


def skewed_ids(kind: str, n: int, vocab: int) -> torch.Tensor:
    """Ids that load the backward's chunks unevenly, shuffled (the kernel sorts them):

    * ``most``: 90% of the tokens on one row, the others random: a run across many chunk
      edges, short runs before and after it;
    * ``one``: every token on one row: one run longer than the carry pass adds in one step;
    * ``distinct``: no row twice: no run crosses an edge;
    * ``edges``: runs of 3, 9, 20, 1 and the rest of the tokens in sorted order: runs that end
      inside a chunk and on a chunk's edge, start on an edge, and cover whole chunks."""
    g = torch.Generator().manual_seed(7)
    if kind == "most":
        ids = torch.randint(0, vocab, (n,), generator=g)
        ids[torch.randperm(n, generator=g)[: n * 9 // 10]] = vocab // 2
        return ids
    if kind == "one":
        return torch.full((n,), 3)
    if kind == "distinct":
        return torch.randperm(vocab, generator=g)[:n]
    runs = [(0, 3), (2, 9), (4, 20), (9, 1), (7, n - 33)]
    ids = torch.cat([torch.full((k,), row) for row, k in runs])
    return ids[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("variant", ["up", "gate", "dagger"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["most", "one", "distinct", "edges"])
def test_skewed_ids_match_fp64_reference_and_repeat_bitwise(variant, dtype, kind):
    """However the tokens fall on rows, the backward's chunks and its carry pass give the fp64
    reference's gradients (the tolerance above), and the same bits in a second call."""
    n, vocab = SKEW_TOKENS, 2 * SKEW_TOKENS
    fc1, table, ids, grad = make(variant, dtype, n, SKEW_COLS, vocab,
                                 ids=skewed_ids(kind, n, vocab), seed=2)
    first = run_fused(fc1, table, ids, grad, variant, tile=SKEW_TILE)
    assert_matches_fp64(variant, fc1, table, ids, grad, *first)
    untouched = torch.ones(vocab, dtype=torch.bool, device=ids.device)
    untouched[ids] = False
    assert (first[2][untouched] == 0).all()
    second = run_fused(fc1, table, ids, grad, variant, tile=SKEW_TILE)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["up", "gate", "dagger"])
def test_fused_matches_pytorch_path(variant):
    """The kernel and the PyTorch path StemMLP uses without it, [s, b] layout, fp32."""
    fc1, table, ids, grad = make(variant, torch.float32, 12, 40, 7, seed=3)
    out, dfc1, dtable = run_fused(fc1, table, ids, grad, variant, shape=(4, 3))
    f, t = fc1.clone().requires_grad_(True), table.clone().requires_grad_(True)
    ref = sg.stem_gate_reference(f.view(4, 3, -1), t, ids.view(4, 3), variant)
    ref.backward(grad.view(ref.shape))
    torch.testing.assert_close(out, ref.reshape(12, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dfc1, f.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dtable, t.grad, rtol=1e-6, atol=1e-6)


def test_a_wrong_row_sum_is_caught():
    """The comparison can fail: the row gradients with one token's contribution dropped (what a
    segment boundary off by one would produce) are outside the tolerance."""
    fc1, table, ids, grad = make("up", torch.float32, 37, 24, 11)
    out, dfc1, dtable = run_fused(fc1, table, ids, grad, "up")
    wrong = dtable.clone()
    wrong[ids[0]] -= (grad[0] * F.silu(fc1[0]))
    with pytest.raises(AssertionError):
        assert_matches_fp64("up", fc1, table, ids, grad, out, dfc1, wrong)


def test_accumulates_into_main_grad_over_micro_batches():
    """Megatron DDP's main_grad (fp32) of a bf16 table gets the row sums of two micro-batches;
    the returned gradient is DDP's dummy and grad_added_to_main_grad is set."""
    vocab, cols = 13, 32
    table = torch.nn.Parameter(torch.randn(vocab, cols).to(torch.bfloat16).to(DEVICE))
    table.main_grad = torch.zeros(vocab, cols, device=DEVICE)
    table.grad_added_to_main_grad = False
    expected = torch.zeros(vocab, cols, dtype=torch.float64, device=DEVICE)
    for seed in (0, 1):
        fc1, _, ids, grad = make("up", torch.bfloat16, 21, cols, vocab, seed=seed)
        sg.stem_gate(fc1.view(7, 3, -1), table, ids.view(7, 3), "up").backward(grad.view(7, 3, -1))
        expected += fp64_reference(fc1, table.detach(), ids, grad, "up")[2]
    assert table.grad_added_to_main_grad
    err = (table.main_grad.double() - expected).abs()
    assert (err <= 1e-5 * expected.abs().max()).all()


def test_managed_rows_and_inverse():
    """A managed table's unique fp32 rows with each token's index into them: the rows are
    rounded to the model's dtype in forward and their gradient is [U, F] in fp32."""
    fc1, _, _, grad = make("dagger", torch.bfloat16, 18, 16, 5, seed=4)
    rows = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    inverse = torch.randint(0, 5, (6, 3), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = sg.stem_gate(fc1.view(6, 3, -1), rows, inverse, "dagger")
    out.backward(grad.view(6, 3, -1))
    assert rows.grad.dtype == torch.float32 and rows.grad.shape == (5, 16)
    ref_out, _, ref_drows, scale = fp64_reference(fc1, rows.detach().to(torch.bfloat16),
                                                  inverse.reshape(-1), grad, "dagger")
    assert ((out.reshape(18, -1).double() - ref_out).abs()
            <= BF16_REL * ref_out.abs() + 1e-6).all()
    # Summed in fp32 from bf16 inputs, not rounded to bf16 at the end (the rows are fp32).
    assert ((rows.grad.double() - ref_drows).abs() <= 1e-6 * scale + 1e-7).all()


def test_backward_is_bitwise_reproducible():
    fc1, table, ids, grad = make("up", torch.bfloat16, 64, 16, 6, seed=5)
    first = run_fused(fc1, table, ids, grad, "up")
    second = run_fused(fc1, table, ids, grad, "up")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_shapes_refused():
    fc1, table, ids, _ = make("up", torch.float32, 4, 8, 5)
    with pytest.raises(ValueError, match="width"):
        sg.stem_gate(fc1, table, ids, "dagger")
    with pytest.raises(ValueError, match="ids of shape"):
        sg.stem_gate(fc1, table, ids[:3], "up")
    with pytest.raises(ValueError, match="unknown STEM variant"):
        sg.stem_gate(fc1, table, ids, "down")


def test_resolve_kernel_choice(monkeypatch):
    assert sg.resolve("torch") == "torch"
    assert sg.resolve("triton", F.silu) == "triton"
    with pytest.raises(ValueError, match="SiLU"):
        sg.resolve("triton", F.gelu)
    with pytest.raises(ValueError, match="--stem-kernel"):
        sg.resolve("fast")
    assert sg.resolve("auto", F.gelu) == "torch"
    # auto is the PyTorch path everywhere: faster than the kernel on an H100 (docs/stem.md).
    assert sg.resolve("auto", F.silu) == "torch"
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            sg.resolve("triton", F.silu)


@pytest.mark.parametrize("variant", ["up", "dagger"])
def test_stem_mlp_with_the_kernel_equals_the_pytorch_path(mcore_single_rank, variant):
    """A whole StemMLP (Megatron's local linear layers) with --stem-kernel triton vs torch:
    output and every parameter gradient, fp32."""
    from tests_helpers import build_tiny_stem_mlp

    results = []
    for kernel in ("torch", "triton"):
        torch.manual_seed(0)
        mlp = build_tiny_stem_mlp(variant=variant, ffn=40, vocab=9)
        mlp.stem.kernel = kernel
        mlp.kernel = sg.resolve(kernel, mlp.activation_func)
        mlp = mlp.to(DEVICE)
        x = torch.randn(5, 2, 16, device=DEVICE)
        ids = torch.tensor([[1, 2], [2, 2], [8, 1], [0, 2], [1, 1]], device=DEVICE)
        out, _ = mlp(x, context=ids)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in mlp.named_parameters()}))
    (out_t, grads_t), (out_k, grads_k) = results
    torch.testing.assert_close(out_k, out_t, rtol=1e-5, atol=1e-6)
    assert grads_t.keys() == grads_k.keys() and "table" in grads_k
    for name in grads_t:
        torch.testing.assert_close(grads_k[name], grads_t[name], rtol=1e-5, atol=1e-6)


def test_compiles_for_the_gpu_without_spills():
    """The GPU build, checked offline (no device needed): every variant in bf16, and dagger in
    fp32 at a TP-split width, compile for A100 and H100 (sm_80, sm_90) with the launch options
    ``stem_gate`` uses (the forward, the backward and its carry pass), without register
    spills."""
    reports = offline_builds(
        "stem_gate", "[offline_build(a, d, v, n) for a in (80, 90) for d, v, n in "
        "[('bf16', 'up', 5632), ('bf16', 'gate', 5632), ('bf16', 'dagger', 5632), "
        "('fp32', 'dagger', 704)]]")
    assert len(reports) == 8
    for report in reports:
        for name, use in report.items():
            assert use["local"] == 0, f"{name} spills registers: {use}"
            # At least three programs fit an SM's 64K registers, so that one program's loads
            # overlap another's arithmetic and stores.
            assert use["registers"] * 32 * use["num_warps"] * 3 <= 65536, f"{name}: {use}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paper_shape_on_gpu_without_host_sync():
    """d_ff = 5632, 8192 tokens, bf16, a Zipf-like id distribution (a few very frequent rows):
    compiled kernels vs the fp64 reference, with CUDA's sync debug mode turned to errors."""
    n, cols, vocab = 8192, 5632, 32000
    g = torch.Generator().manual_seed(0)
    ids = torch.multinomial(1.0 / torch.arange(1, vocab + 1).double(), n, True, generator=g)
    fc1, table, ids, grad = make("up", torch.bfloat16, n, cols, vocab, ids=ids)
    f, t = fc1.clone().requires_grad_(True), table.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sg.stem_gate(f, t, ids, "up")
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches_fp64("up", fc1, table, ids, grad, out, f.grad, t.grad)
