"""Row-wise AdamW on the CPU, in place, for the rows a batch touched (the ``sparse`` STEM optimizer).

DeepSpeed's ``cpu_adam`` kernel updates one contiguous tensor with one step count; touched table
rows are scattered over the shard and each has its own step count, so using it means gathering
rows into buffers and scattering them back (six copies of the touched rows) and one call per
distinct step count: about 0.04x of its own dense throughput on the development machine. This
kernel instead walks the touched rows in place (``at::parallel_for`` over rows, a vectorisable
loop over columns), with per-row bias correction and the per-row owed weight-decay factor.

Per row ``r = rows[j]`` with new step count ``k = steps[j]``::

    p[r] *= owed[j] * (1 - lr wd)                   # missed decay, then this step's decay
    m[r]  = b1 m[r] + (1 - b1) g[j]
    v[r]  = b2 v[r] + (1 - b2) g[j]^2
    p[r] -= lr / (1 - b1^k) * m[r] / (sqrt(v[r]) / sqrt(1 - b2^k) + eps)

Two helpers for host-resident rows share the module: ``scale_rows_`` (the owed weight decay
applied in place when a row is read) and ``gather_rows_`` (rows gathered and cast to the wire
dtype straight into a staging buffer, with no temporaries: each large temporary costs page
faults, which dominated the fetch time on a GPU machine).

Built with ``torch.utils.cpp_extension.load_inline`` on first use (cached afterwards);
``load()`` returns None when no compiler is available, and the caller falls back.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

void sparse_adamw_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor rows,
                   torch::Tensor g, torch::Tensor steps, torch::Tensor owed,
                   double lr, double b1, double b2, double eps, double wd) {
  TORCH_CHECK(p.is_contiguous() && m.is_contiguous() && v.is_contiguous() && g.is_contiguous(),
              "sparse_adamw_: tensors must be contiguous");
  TORCH_CHECK(p.scalar_type() == torch::kFloat && g.scalar_type() == torch::kFloat,
              "sparse_adamw_: fp32 only");
  const int64_t n = rows.numel();
  const int64_t width = p.size(1);
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  const int64_t* K = steps.data_ptr<int64_t>();
  const double* O = owed.data_ptr<double>();
  const float fb1 = (float)b1, fb2 = (float)b2, c1 = (float)(1.0 - b1), c2 = (float)(1.0 - b2);
  const float feps = (float)eps;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t r = R[j];
      const double k = (double)K[j];
      const float step = (float)(lr / (1.0 - std::pow(b1, k)));
      const float inv_bc2_sqrt = (float)(1.0 / std::sqrt(1.0 - std::pow(b2, k)));
      const float decay = (float)(O[j] * (1.0 - lr * wd));
      // No aliasing between a row's parameter, moments and gradient: without this promise the
      // compiler keeps the loop scalar (2.5x slower on the development machine).
      float* __restrict__ pr = P + r * width;
      float* __restrict__ mr = M + r * width;
      float* __restrict__ vr = V + r * width;
      const float* __restrict__ gr = G + j * width;
      if (j + 1 < end) {  // the next row's start: the hardware prefetcher picks up from there
        const int64_t nr = R[j + 1] * width;
        for (int64_t c = 0; c < width && c < 256; c += 16) {
          __builtin_prefetch(P + nr + c, 1);
          __builtin_prefetch(M + nr + c, 1);
          __builtin_prefetch(V + nr + c, 1);
        }
      }
      #pragma omp simd
      for (int64_t c = 0; c < width; ++c) {
        const float gc = gr[c];
        const float mc = fb1 * mr[c] + c1 * gc;
        const float vc = fb2 * vr[c] + c2 * gc * gc;
        mr[c] = mc;
        vr[c] = vc;
        pr[c] = pr[c] * decay - step * mc / (std::sqrt(vc) * inv_bc2_sqrt + feps);
      }
    }
  });
}

// shard[rows[j]] *= factors[j], in place (the sparse optimizer's weight-decay catch-up).
void scale_rows_(torch::Tensor p, torch::Tensor rows, torch::Tensor factors) {
  TORCH_CHECK(p.is_contiguous() && p.scalar_type() == torch::kFloat, "scale_rows_: fp32 rows");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && factors.scalar_type() == torch::kDouble &&
              rows.numel() == factors.numel(), "scale_rows_: int64 rows, float64 factors");
  const int64_t n = rows.numel(), width = p.size(1);
  float* P = p.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  const double* F = factors.data_ptr<double>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float f = (float)F[j];
      float* pr = P + R[j] * width;
      for (int64_t c = 0; c < width; ++c) pr[c] *= f;
    }
  });
}

// out[j] = src[index[j]] cast to out's dtype (fp32, bf16 or fp16; round to nearest even, as
// Tensor.to): the rows to fetch, written straight into a (pinned) staging buffer.
template <typename T>
static void gather_into(const float* S, const int64_t* I, T* O, int64_t n, int64_t width) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* __restrict__ sr = S + I[j] * width;
      T* __restrict__ orow = O + j * width;
      #pragma omp simd
      for (int64_t c = 0; c < width; ++c) orow[c] = static_cast<T>(sr[c]);
    }
  });
}

void gather_rows_(torch::Tensor src, torch::Tensor index, torch::Tensor out) {
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous() && src.scalar_type() == torch::kFloat,
              "gather_rows_: contiguous fp32 source and contiguous output");
  TORCH_CHECK(index.scalar_type() == torch::kLong && out.size(0) == index.numel() &&
              out.size(1) == src.size(1), "gather_rows_: shapes");
  const int64_t n = index.numel(), width = src.size(1);
  const float* S = src.data_ptr<float>();
  const int64_t* I = index.data_ptr<int64_t>();
  switch (out.scalar_type()) {
    case torch::kFloat: gather_into(S, I, out.data_ptr<float>(), n, width); break;
    case torch::kBFloat16: gather_into(S, I, out.data_ptr<at::BFloat16>(), n, width); break;
    case torch::kHalf: gather_into(S, I, out.data_ptr<at::Half>(), n, width); break;
    default: TORCH_CHECK(false, "gather_rows_: output must be fp32, bf16 or fp16");
  }
}
"""

_MODULE = None


def load():
    """The compiled kernel module, or None (no compiler / build failure: logged once)."""
    global _MODULE
    if _MODULE is None:
        try:
            from torch.utils.cpp_extension import load_inline

            _MODULE = load_inline(name="megatron_ext_row_adam_v3", cpp_sources=[_SOURCE],
                                  functions=["sparse_adamw_", "scale_rows_", "gather_rows_"],
                                  extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                  verbose=False)
        except Exception as exc:  # pragma: no cover - depends on the machine's toolchain
            logger.warning("row-wise AdamW kernel unavailable (%s); falling back", exc)
            _MODULE = False
    return _MODULE or None
