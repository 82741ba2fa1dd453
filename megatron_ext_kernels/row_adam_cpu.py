"""Row-wise AdamW on the CPU, in place, for the rows a batch touched (the ``sparse`` STEM optimizer).

DeepSpeed's ``cpu_adam`` kernel updates one contiguous tensor; touched table rows are scattered
over the shard, so using it means gathering rows into buffers and scattering them back (six copies
of the touched rows). This kernel instead walks the touched rows in place (an OpenMP loop over
rows, a vectorisable loop over columns) and, in the same pass, first brings each row from the
iteration it was last current at to the previous one (``megatron_ext/stem/row_adam.py``: the
sparse optimizer's catch-up, per-row float64 factors computed there).

Per row ``r = rows[j]``, with the iteration's ``step = lr / (1 - b1^t)``,
``inv_bc2_sqrt = 1 / sqrt(1 - b2^t)``, ``decay = 1 - lr wd``::

    p[r]  = p[r] * owed[j] - move[j] * m[r] / (sqrt(v[r]) + e[j])   # catch-up (0 where v = 0)
    m[r] *= m_scale[j];  v[r] *= v_scale[j]
    p[r] *= decay                                          # this iteration's AdamW step
    m[r]  = b1 m[r] + (1 - b1) g[j]
    v[r]  = b2 v[r] + (1 - b2) g[j]^2
    p[r] -= step * m[r] / (sqrt(v[r]) * inv_bc2_sqrt + eps)

Two helpers for host-resident rows share the module: ``catch_up_rows_`` (the catch-up alone, in
place, when a row is read) and ``gather_rows_`` (rows gathered and cast to the wire dtype straight
into a staging buffer, with no temporaries: each large temporary costs page faults, which
dominated the fetch time on a GPU machine).

Threads and the GIL: each call runs an OpenMP team of ``threads()`` threads (``set_threads``;
``--stem-cpu-threads``; by default the cores of this process's affinity mask shared among the
node's local ranks), given explicitly with ``num_threads``: neither torch's intra-op thread count
nor ``OMP_NUM_THREADS`` (which torchrun sets to 1 when it starts several ranks per node) limits
it. The calls release the GIL, so a row step or gather running in a background thread does not
stop the training thread from launching work.

Built with ``torch.utils.cpp_extension.load_inline`` on first use (cached afterwards);
``load()`` returns None when no compiler is available, and the caller falls back.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <omp.h>

static void check_rows(const char* name, torch::Tensor p, torch::Tensor m, torch::Tensor v,
                       torch::Tensor rows, std::initializer_list<torch::Tensor> factors) {
  TORCH_CHECK(p.is_contiguous() && m.is_contiguous() && v.is_contiguous() &&
              p.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat && p.dim() == 2 &&
              m.sizes() == p.sizes() && v.sizes() == p.sizes(),
              name, ": contiguous fp32 rows and moments of one shape");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.is_contiguous(),
              name, ": contiguous int64 rows");
  for (const auto& f : factors)
    TORCH_CHECK(f.scalar_type() == torch::kDouble && f.is_contiguous() &&
                f.numel() == rows.numel(), name, ": one contiguous float64 factor per row");
}

// The catch-up of one row, in place: p = p owed - move m/(sqrt(v) + e) (0 where v = 0); m, v
// scaled.
static inline void catch_up_row(float* __restrict__ pr, float* __restrict__ mr,
                                float* __restrict__ vr, int64_t width, float owed, float move,
                                float ms, float vs, float e) {
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    const float mc = mr[c], vc = vr[c];
    const float ratio = vc > 0.0f ? mc / (std::sqrt(vc) + e) : 0.0f;
    pr[c] = pr[c] * owed - move * ratio;
    mr[c] = mc * ms;
    vr[c] = vc * vs;
  }
}

static inline bool owes(double owed, double move, double ms, double vs) {
  return owed != 1.0 || move != 0.0 || ms != 1.0 || vs != 1.0;
}

void sparse_adamw_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor rows,
                   torch::Tensor g, torch::Tensor owed, torch::Tensor move,
                   torch::Tensor m_scale, torch::Tensor v_scale, torch::Tensor e, double step,
                   double inv_bc2_sqrt, double decay, double b1, double b2, double eps,
                   int64_t threads) {
  check_rows("sparse_adamw_", p, m, v, rows, {owed, move, m_scale, v_scale, e});
  TORCH_CHECK(g.is_contiguous() && g.scalar_type() == torch::kFloat && g.dim() == 2 &&
              g.size(0) == rows.numel() && g.size(1) == p.size(1),
              "sparse_adamw_: contiguous fp32 gradients [rows, width]");
  const int64_t n = rows.numel();
  const int64_t width = p.size(1);
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  const double *O = owed.data_ptr<double>(), *MV = move.data_ptr<double>();
  const double *MS = m_scale.data_ptr<double>(), *VS = v_scale.data_ptr<double>();
  const double* E = e.data_ptr<double>();
  const float fb1 = (float)b1, fb2 = (float)b2, c1 = (float)(1.0 - b1), c2 = (float)(1.0 - b2);
  const float feps = (float)eps, fstep = (float)step, fbc2 = (float)inv_bc2_sqrt;
  const float fdecay = (float)decay;
  #pragma omp parallel for num_threads((int)threads) schedule(static, 16)
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    // No aliasing between a row's parameter, moments and gradient: without this promise the
    // compiler keeps the loop scalar (2.5x slower on the development machine).
    float* __restrict__ pr = P + r * width;
    float* __restrict__ mr = M + r * width;
    float* __restrict__ vr = V + r * width;
    const float* __restrict__ gr = G + j * width;
    if (j + 1 < n) {  // the next row's start: the hardware prefetcher picks up from there
      const int64_t nr = R[j + 1] * width;
      for (int64_t c = 0; c < width && c < 256; c += 16) {
        __builtin_prefetch(P + nr + c, 1);
        __builtin_prefetch(M + nr + c, 1);
        __builtin_prefetch(V + nr + c, 1);
      }
    }
    if (owes(O[j], MV[j], MS[j], VS[j]))
      catch_up_row(pr, mr, vr, width, (float)O[j], (float)MV[j], (float)MS[j], (float)VS[j],
                   (float)E[j]);
    #pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float gc = gr[c];
      const float mc = fb1 * mr[c] + c1 * gc;
      const float vc = fb2 * vr[c] + c2 * gc * gc;
      mr[c] = mc;
      vr[c] = vc;
      pr[c] = pr[c] * fdecay - fstep * mc / (std::sqrt(vc) * fbc2 + feps);
    }
  }
}

// The sparse optimizer's catch-up of rows[j], in place (a read of rows untouched for a while).
void catch_up_rows_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor rows,
                    torch::Tensor owed, torch::Tensor move, torch::Tensor m_scale,
                    torch::Tensor v_scale, torch::Tensor e, int64_t threads) {
  check_rows("catch_up_rows_", p, m, v, rows, {owed, move, m_scale, v_scale, e});
  const int64_t n = rows.numel(), width = p.size(1);
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  const double *O = owed.data_ptr<double>(), *MV = move.data_ptr<double>();
  const double *MS = m_scale.data_ptr<double>(), *VS = v_scale.data_ptr<double>();
  const double* E = e.data_ptr<double>();
  #pragma omp parallel for num_threads((int)threads) schedule(static, 16)
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    if (owes(O[j], MV[j], MS[j], VS[j]))
      catch_up_row(P + r * width, M + r * width, V + r * width, width, (float)O[j],
                   (float)MV[j], (float)MS[j], (float)VS[j], (float)E[j]);
  }
}

// out[j] = src[index[j]] cast to out's dtype (fp32, bf16 or fp16; round to nearest even, as
// Tensor.to): the rows to fetch, written straight into a (pinned) staging buffer.
template <typename T>
static void gather_into(const float* S, const int64_t* I, T* O, int64_t n, int64_t width,
                        int64_t threads) {
  #pragma omp parallel for num_threads((int)threads) schedule(static, 16)
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict__ sr = S + I[j] * width;
    T* __restrict__ orow = O + j * width;
    #pragma omp simd
    for (int64_t c = 0; c < width; ++c) orow[c] = static_cast<T>(sr[c]);
  }
}

void gather_rows_(torch::Tensor src, torch::Tensor index, torch::Tensor out, int64_t threads) {
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous() && src.scalar_type() == torch::kFloat,
              "gather_rows_: contiguous fp32 source and contiguous output");
  TORCH_CHECK(index.scalar_type() == torch::kLong && out.size(0) == index.numel() &&
              out.size(1) == src.size(1), "gather_rows_: shapes");
  const int64_t n = index.numel(), width = src.size(1);
  const float* S = src.data_ptr<float>();
  const int64_t* I = index.data_ptr<int64_t>();
  switch (out.scalar_type()) {
    case torch::kFloat: gather_into(S, I, out.data_ptr<float>(), n, width, threads); break;
    case torch::kBFloat16: gather_into(S, I, out.data_ptr<at::BFloat16>(), n, width, threads); break;
    case torch::kHalf: gather_into(S, I, out.data_ptr<at::Half>(), n, width, threads); break;
    default: TORCH_CHECK(false, "gather_rows_: output must be fp32, bf16 or fp16");
  }
}

// The number of threads an OpenMP team of `threads` gets here (tests, the start-up report).
int64_t team_size(int64_t threads) {
  int64_t size = 0;
  #pragma omp parallel num_threads((int)threads)
  {
    #pragma omp single
    size = omp_get_num_threads();
  }
  return size;
}

// The GIL is released for the whole call: the tensors' data is all they touch.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("sparse_adamw_", &sparse_adamw_, nogil);
  m.def("catch_up_rows_", &catch_up_rows_, nogil);
  m.def("gather_rows_", &gather_rows_, nogil);
  m.def("team_size", &team_size, nogil);
}
"""

_MODULE = None
_THREADS = 0  # 0: default_threads()


def affinity_cores() -> int:
    """The cores this process may run on (launchers and NCCL may pin a rank to a few)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def default_threads() -> int:
    """The cores in this process's affinity mask, shared equally among the ranks torchrun started
    on this node (``LOCAL_WORLD_SIZE``), at least 1; with a GPU, one of a rank's cores is left to
    its training thread, which launches the GPU's work while the table step runs in the
    background (a team on every core would stall the launches and starve the GPU)."""
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    share = affinity_cores() // local
    if share > 2 and torch.cuda.is_available():
        share -= 1
    return max(share, 1)


def set_threads(threads: int) -> None:
    """Threads of every later kernel call (0: ``default_threads()``)."""
    global _THREADS
    if threads < 0:
        raise ValueError(f"CPU kernel threads must be >= 0 (0: automatic), got {threads}")
    _THREADS = int(threads)


def threads() -> int:
    return _THREADS or default_threads()


class _Kernels:
    """The compiled functions, each given ``threads()`` at call time."""

    def __init__(self, module):
        self.module = module

    def sparse_adamw_(self, p, m, v, rows, g, owed, move, m_scale, v_scale, e, step,
                      inv_bc2_sqrt, decay, b1, b2, eps) -> None:
        self.module.sparse_adamw_(p, m, v, rows, g, owed, move, m_scale, v_scale, e, step,
                                  inv_bc2_sqrt, decay, b1, b2, eps, threads())

    def catch_up_rows_(self, p, m, v, rows, owed, move, m_scale, v_scale, e) -> None:
        self.module.catch_up_rows_(p, m, v, rows, owed, move, m_scale, v_scale, e, threads())

    def gather_rows_(self, src, index, out) -> None:
        self.module.gather_rows_(src, index, out, threads())

    def team_size(self, n: int) -> int:
        return int(self.module.team_size(n))


def load():
    """The compiled kernels (``_Kernels``), or None (no compiler / build failure: logged once)."""
    global _MODULE
    if _MODULE is None:
        try:
            from torch.utils.cpp_extension import load_inline

            _MODULE = _Kernels(load_inline(
                name="megatron_ext_row_adam_v6", cpp_sources=[_SOURCE],
                extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False))
        except Exception as exc:  # pragma: no cover - depends on the machine's toolchain
            logger.warning("row-wise AdamW kernel unavailable (%s); falling back", exc)
            _MODULE = False
    return _MODULE or None
