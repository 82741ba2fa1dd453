"""Where the fused StructMoE router + codes kernel departs from PyTorch on a GPU.

    python scripts/gpu/structmoe_codes_check.py

For several shapes (the paper's N = 8192, H = 2048, L = r = 16 and ones that shrink one axis),
the fused kernel's routing and codes against the same function in PyTorch on the same bf16
inputs (fp32 GEMM of the upcast operands, the fused kernel's routing reused so only the codes
differ), and the expanded output. Prints the relative error (max |diff| / max |ref|), where the
largest errors sit (token block, expert) and what fraction of tokens is off by more than 1%.
A diagnostic, not a test: tests/test_kernel_structmoe.py holds the checks.
"""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.structmoe.routed import (dense_masked_codes, dense_masked_expand,  # noqa: E402
                                           route, route_codes_stages)


def rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def check(shape, dtype=torch.bfloat16, seed=0):
    n, h, n_exp, r, d = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).cuda().to(dtype)
    w = (0.5 * torch.randn(n_exp, h, generator=g)).cuda().to(dtype)
    a = (torch.randn(n_exp, h, r, generator=g) / h ** 0.5).cuda().to(dtype)
    b = (torch.randn(n_exp, r, d, generator=g) / r ** 0.5).cuda().to(dtype)
    route_codes, expand = route_codes_stages("triton")
    with torch.no_grad():
        routing, codes = route_codes(x, w, a, 1)
        ref_routing = route(x.float(), w.float(), 1)
        same = (routing.indices == ref_routing.indices).all(dim=1)
        ref_codes = dense_masked_codes(x.float(), a.float(), routing)
        bf_codes = dense_masked_codes(x, a, routing)
        out = expand(codes, b, routing)
        ref_out = dense_masked_expand(ref_codes, b.float(), routing)
        probs_err = rel(routing.probs, ref_routing.probs)
        c_err = rel(codes, ref_codes)
        bf_err = rel(bf_codes, ref_codes)
        o_err = rel(out[same], ref_out[same])
        diff = (codes.float() - ref_codes).abs().view(n, n_exp, r)
        scale = ref_codes.abs().max()
        per_tok = diff.amax(dim=(1, 2)) / scale
        bad = per_tok > 0.01
        line = (f"{str(shape):32s} probs {probs_err:.2e}  codes {c_err:.2e} (torch bf16 "
                f"{bf_err:.2e})  out {o_err:.2e}  same routing {same.float().mean().item():.5f}  "
                f"tokens >1%: {bad.float().mean().item():.4f}")
        print(line, flush=True)
        if bad.any():
            tok = bad.nonzero().squeeze(-1)
            blocks = torch.unique(tok // 64)
            per_exp = diff[bad].amax(dim=(0, 2)) / scale
            per_col = diff[bad].amax(dim=(0, 1)) / scale
            print(f"    bad tokens (first 16): {tok[:16].tolist()}  in {blocks.numel()} of "
                  f"{-(-n // 64)} 64-token blocks; per expert max {[round(v, 3) for v in per_exp.tolist()]}; "
                  f"per rank column {[round(v, 3) for v in per_col.tolist()]}", flush=True)
            t = tok[0].item()
            e = routing.indices[t, 0].item()
            print(f"    token {t} expert {e} weight {routing.weights[t, 0].item():.4f}: fused "
                  f"{codes.view(n, n_exp, r)[t, e, :6].float().tolist()} ref "
                  f"{ref_codes.view(n, n_exp, r)[t, e, :6].tolist()}", flush=True)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "needs a GPU"
    print(f"{torch.cuda.get_device_name(0)}; tf32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    from megatron_ext_kernels import structmoe_routed

    shapes = [(8192, 2048, 16, 16, 6618), (8192, 64, 16, 16, 64), (8192, 2048, 8, 8, 64)]
    if "--quick" not in sys.argv:
        shapes += [(256, 2048, 16, 16, 256), (8192, 512, 16, 16, 64), (1024, 2048, 16, 16, 64)]
    for bf16_dot in (False, True):
        structmoe_routed.BF16_DOT = bf16_dot
        print(f"-- codes GEMM on {'bf16 tensor cores' if bf16_dot else 'fp32 (upcast tiles)'}")
        for shape in shapes:
            check(shape)
    check((8192, 2048, 16, 16, 64), dtype=torch.float32)
