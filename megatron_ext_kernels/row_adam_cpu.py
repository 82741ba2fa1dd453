"""Row-wise AdamW on the CPU, in place, for the rows a batch touched (the ``sparse`` STEM optimizer).

DeepSpeed's ``cpu_adam`` kernel updates one contiguous tensor; touched table rows are scattered
over the shard, so using it means gathering rows into buffers and scattering them back (six copies
of the touched rows). This kernel instead walks the touched rows in place (an OpenMP loop over
rows, a vectorisable loop over columns) and, in the same pass over each row's columns, first
brings the row from the iteration it was last current at to the previous one (the sparse
optimizer's catch-up, ``megatron_ext/stem/row_adam.py``). The per-row catch-up factors are
computed here, from the iteration clock's float64 series (``RowClock.kernel_state``) and each
row's last iterations (``last``, ``touched``, updated in place), with the formulas of
``RowClock.coefficients``, which the torch path uses.

Per row ``r = rows[j]``, with the iteration's ``step = lr / (1 - b1^t)``,
``inv_bc2_sqrt = 1 / sqrt(1 - b2^t)``, ``decay = 1 - lr wd``::

    p[r]  = p[r] * owed - move * m[r] / (sqrt(v[r]) + e)   # catch-up (0 where v = 0), if owed
    m[r] *= b1^lag;  v[r] *= b2^lag
    p[r] *= decay                                          # this iteration's AdamW step
    m[r]  = b1 m[r] + (1 - b1) g[j]
    v[r]  = b2 v[r] + (1 - b2) g[j]^2
    p[r] -= step * m[r] / (sqrt(v[r]) * inv_bc2_sqrt + eps)
    last[r] = touched[r] = t

Three helpers for host-resident rows share the module: ``gather_rows_`` (rows gathered and cast
to the wire dtype straight into a staging buffer, with no temporaries: each large temporary costs
page faults, which dominated the fetch time on a GPU machine; the bf16 and fp16 casts vectorised,
with torch's bits, ``benchmarks/stem_host_gather.py``), ``gather_current_rows_`` (the same, of
rows as the catch-up would leave them, computed on the way and written nowhere else: a fetch's
read, one pass that reads each row and its moments once and writes only the output) and
``catch_up_rows_`` (the catch-up alone, in place: rows read whole, for checkpoints).

Threads and the GIL: each call runs an OpenMP team of ``threads()`` threads (``set_threads``;
``--stem-cpu-threads``; by default the cores of this process's affinity mask shared among the
node's local ranks), given explicitly with ``num_threads``: neither torch's intra-op thread count
nor ``OMP_NUM_THREADS`` (which torchrun sets to 1 when it starts several ranks per node) limits
it. The calls release the GIL, so a row step or gather running in a background thread does not
stop the training thread from launching work.

Rows go to the team's threads 16 at a time as threads come free (``schedule(dynamic, 16)``), not
in fixed shares: on a busy host (the training thread, NCCL's and the data loader's threads) a
thread that loses its core for a while no longer holds up the whole call. Each row is stepped by
one thread alone, so the results are the same bits either way. Measured on the development machine
(2 threads, the sparse step of 3,379 Zipf rows of 5,632, median of 12): 10.61 vs 10.60 ms with
static shares on idle cores; with one core kept busy by another process, 13.20 vs 17.85 ms.

Built with ``torch.utils.cpp_extension.load_inline`` on first use (cached afterwards, in a folder
per virtualenv and CPU: ``_build_dir.py``); ``load()`` returns None when no compiler is
available, and the caller falls back.
"""

from __future__ import annotations

import logging
import os

import torch

from megatron_ext_kernels._build_dir import build_environment

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <vector>
#include <omp.h>
#include <utility>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

static void check_rows(const char* name, torch::Tensor p, torch::Tensor m, torch::Tensor v,
                       torch::Tensor rows, torch::Tensor last, torch::Tensor touched) {
  TORCH_CHECK(p.is_contiguous() && m.is_contiguous() && v.is_contiguous() &&
              p.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat && p.dim() == 2 &&
              m.sizes() == p.sizes() && v.sizes() == p.sizes(),
              name, ": contiguous fp32 rows and moments of one shape");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.is_contiguous(),
              name, ": contiguous int64 rows");
  for (const auto& t : {last, touched})
    TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.dim() == 1 &&
                t.numel() == p.size(0), name, ": contiguous int64 per-row iterations");
}

// The sparse optimizer's iteration clock brought to iteration u (row_adam.RowClock): D_j for
// j = base.. (running decay product), the momentum's move F_u(s) for s in [u - nwin + 1, u],
// G_s = F_(s+H)(s) for s = base.. (rows untouched for longer than the horizon H), the betas, eps.
struct Clock {
  const double *d, *win, *gs;
  int64_t base, nwin, horizon, u;
  double b1, b2, eps;
};

static Clock clock_of(torch::Tensor d, torch::Tensor win, torch::Tensor gs, int64_t base,
                      int64_t horizon, int64_t u, double b1, double b2, double eps) {
  for (const auto& t : {d, win, gs})
    TORCH_CHECK(t.scalar_type() == torch::kDouble && t.is_contiguous() && t.dim() == 1,
                "row clock: contiguous float64 series");
  TORCH_CHECK(u >= base && d.numel() > u - base && win.numel() >= 1 && horizon >= 1,
              "row clock: iteration ", u, " outside the clock's series");
  return Clock{d.data_ptr<double>(), win.data_ptr<double>(), gs.data_ptr<double>(), base,
               win.numel(), horizon, u, b1, b2, eps};
}

// What a row current at iteration s, last given a gradient at s0, owes at u (row_adam.RowClock.
// coefficients, the same float64 formulas, rounded to fp32 as the row math uses them).
struct Owed { float owed, move, ms, vs, e; };

static inline Owed owed_at(const Clock& k, int64_t s, int64_t s0) {
  const int64_t lag = k.u - s;
  const double du = k.d[k.u - k.base];
  const double move = lag <= k.horizon ? k.win[s - (k.u - k.nwin + 1)]
                                       : k.gs[s - k.base] * du / k.d[s + k.horizon - k.base];
  return Owed{(float)(du / k.d[s - k.base]), (float)move, (float)std::pow(k.b1, (double)lag),
              (float)std::pow(k.b2, (double)lag),
              (float)(k.eps * std::pow(k.b2, (double)(s - s0) / 2.0))};
}

// A parameter brought forward by its catch-up: p owed - move m/(sqrt(v) + e), 0 where v = 0. One
// function for the in-place catch-up and the read of a row that leaves it as it is
// (gather_current_rows_), so that both give the same bits.
static inline float caught_up(float pc, float mc, float vc, const Owed& o) {
  const float ratio = vc > 0.0f ? mc / (std::sqrt(vc) + o.e) : 0.0f;
  return pc * o.owed - o.move * ratio;
}

// One row's catch-up (CATCH_UP: p = p owed - move m/(sqrt(v) + e), 0 where v = 0; m, v
// scaled) and, STEP, its AdamW step with gradient gr, in one pass over its columns. No aliasing
// between a row's parameter, moments and gradient (__restrict__): without this promise the
// compiler keeps the loop scalar (2.5x slower on the development machine).
template <bool CATCH_UP, bool STEP>
static inline void row_pass(float* __restrict__ pr, float* __restrict__ mr, float* __restrict__ vr,
                            const float* __restrict__ gr, int64_t width, const Owed& o, float b1,
                            float b2, float eps, float step, float inv_bc2_sqrt, float decay) {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) {
    float pc = pr[c], mc = mr[c], vc = vr[c];
    if (CATCH_UP) {
      pc = caught_up(pc, mc, vc, o);
      mc = mc * o.ms;
      vc = vc * o.vs;
    }
    if (STEP) {
      const float gc = gr[c];
      mc = b1 * mc + c1 * gc;
      vc = b2 * vc + c2 * gc * gc;
      pc = pc * decay - step * mc / (std::sqrt(vc) * inv_bc2_sqrt + eps);
    }
    pr[c] = pc;
    mr[c] = mc;
    vr[c] = vc;
  }
}

// A row index outside the shard, or iterations of a row other than 0 <= touched <= last and
// base <= last <= max_last, stops the call before any row is touched.
static void check_row_iterations(const char* name, const int64_t* R, int64_t n, int64_t nrows,
                                 const int64_t* LAST, const int64_t* TOUCHED, const Clock& k,
                                 int64_t max_last) {
  int64_t bad = -1;
  for (int64_t j = 0; j < n && bad < 0; ++j) {
    const int64_t r = R[j];
    if (r < 0 || r >= nrows || LAST[r] < k.base || LAST[r] > max_last || TOUCHED[r] < 0 ||
        TOUCHED[r] > LAST[r])
      bad = j;
  }
  TORCH_CHECK(bad < 0, name, ": row ", bad < 0 ? 0 : R[bad], " is outside the shard, or its "
              "iterations outside the clock's");
}

static inline void prefetch_row(const float* P, const float* M, const float* V, int64_t start,
                                int64_t width) {
  for (int64_t c = 0; c < width && c < 256; c += 16) {
    __builtin_prefetch(P + start + c, 1);
    __builtin_prefetch(M + start + c, 1);
    __builtin_prefetch(V + start + c, 1);
  }
}

// The sparse step of iteration u + 1 for rows[j] (unique) with gradients g[j]: each row brought
// from its last iteration to u (catch-up) and stepped, in one pass; last[r] = touched[r] = u + 1.
// Returns the seconds of the row loop alone (the team's work, without the call's checks or the
// GIL taken back after it: the stats tell a slow team from a slow way into it).
double sparse_adamw_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor rows,
                   torch::Tensor g, torch::Tensor last, torch::Tensor touched, torch::Tensor d,
                   torch::Tensor win, torch::Tensor gs, int64_t base, int64_t horizon, int64_t u,
                   double b1, double b2, double eps, double step, double inv_bc2_sqrt,
                   double decay, int64_t threads) {
  check_rows("sparse_adamw_", p, m, v, rows, last, touched);
  TORCH_CHECK(g.is_contiguous() && g.scalar_type() == torch::kFloat && g.dim() == 2 &&
              g.size(0) == rows.numel() && g.size(1) == p.size(1),
              "sparse_adamw_: contiguous fp32 gradients [rows, width]");
  const Clock k = clock_of(d, win, gs, base, horizon, u, b1, b2, eps);
  const int64_t n = rows.numel(), width = p.size(1);
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  int64_t* LAST = last.data_ptr<int64_t>();
  int64_t* TOUCHED = touched.data_ptr<int64_t>();
  check_row_iterations("sparse_adamw_", R, n, p.size(0), LAST, TOUCHED, k, u);  // once a step
  const float fb1 = (float)b1, fb2 = (float)b2, feps = (float)eps, fstep = (float)step;
  const float fbc2 = (float)inv_bc2_sqrt, fdecay = (float)decay;
  const Owed none{1.0f, 0.0f, 1.0f, 1.0f, 0.0f};
  const double start = omp_get_wtime();
  #pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    // The next row's start: the hardware prefetcher picks up from there.
    if (j + 1 < n) prefetch_row(P, M, V, R[j + 1] * width, width);
    float* pr = P + r * width;
    float* mr = M + r * width;
    float* vr = V + r * width;
    const float* gr = G + j * width;
    if (LAST[r] < u)
      row_pass<true, true>(pr, mr, vr, gr, width, owed_at(k, LAST[r], TOUCHED[r]), fb1, fb2,
                           feps, fstep, fbc2, fdecay);
    else
      row_pass<false, true>(pr, mr, vr, gr, width, none, fb1, fb2, feps, fstep, fbc2, fdecay);
    LAST[r] = TOUCHED[r] = u + 1;
  }
  return omp_get_wtime() - start;
}

// Rows[j] (unique) brought from their last iteration to u, in place (a read of rows untouched
// for a while); last[r] = u. Rows current at u or later are left as they are.
void catch_up_rows_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor rows,
                    torch::Tensor last, torch::Tensor touched, torch::Tensor d, torch::Tensor win,
                    torch::Tensor gs, int64_t base, int64_t horizon, int64_t u, double b1,
                    double b2, double eps, int64_t threads) {
  check_rows("catch_up_rows_", p, m, v, rows, last, touched);
  const Clock k = clock_of(d, win, gs, base, horizon, u, b1, b2, eps);
  const int64_t n = rows.numel(), width = p.size(1);
  float* P = p.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const int64_t* R = rows.data_ptr<int64_t>();
  int64_t* LAST = last.data_ptr<int64_t>();
  const int64_t* TOUCHED = touched.data_ptr<int64_t>();
  check_row_iterations("catch_up_rows_", R, n, p.size(0), LAST, TOUCHED, k,
                       k.base + d.numel() - 1);
  #pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    if (LAST[r] >= u) continue;
    row_pass<true, false>(P + r * width, M + r * width, V + r * width, nullptr, width,
                          owed_at(k, LAST[r], TOUCHED[r]), 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
    LAST[r] = u;
  }
}

// fp32 bits to bf16 bits, rounded to nearest even, every NaN to 0xFFFF: what torch's vectorised
// CPU cast (ATen's cvtfp32_bf16, behind Tensor.to) gives, bit for bit. Written on the bits, with
// a select for NaN, so that the column loop vectorises: c10's scalar BFloat16(float) branches on
// NaN and kept the loop scalar (the bf16 gather took 3.1x the fp32 one's time on the development
// machine).
static inline uint16_t bf16_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFFu : (uint16_t)rounded;
}

typedef uint32_t __attribute__((may_alias)) float_bits;  // fp32 rows read as their bits

// One row cast to the output's dtype: fp32 (a copy); bf16 on the bits (bf16_bits); fp16 by the
// F16C instruction, rounding to nearest even (what torch's vectorised CPU cast uses), eight
// columns at a time (the compiler does not vectorise c10's scalar Half(float): fp16 gathers took
// 1.4x the fp32 one's time on the development machine), c10's scalar cast without F16C.
static inline void cast_row(const float* __restrict__ sr, float* __restrict__ orow,
                            int64_t width) {
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) orow[c] = sr[c];
}

static inline void cast_row(const float* src, uint16_t* __restrict__ orow, int64_t width) {
  const float_bits* __restrict__ sr = reinterpret_cast<const float_bits*>(src);
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) orow[c] = bf16_bits(sr[c]);
}

static inline void cast_row(const float* __restrict__ sr, at::Half* __restrict__ orow,
                            int64_t width) {
  int64_t c = 0;
#if defined(__F16C__)
  for (; c + 8 <= width; c += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(sr + c),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; c < width; ++c) orow[c] = static_cast<at::Half>(sr[c]);
}

// The output's data as the type cast_row writes (fp32, bf16 bits, fp16), handed to f.
template <typename F>
static void with_output(torch::Tensor out, const char* name, F f) {
  switch (out.scalar_type()) {
    case torch::kFloat: f(out.data_ptr<float>()); break;
    case torch::kBFloat16: f(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())); break;
    case torch::kHalf: f(out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, name, ": output must be fp32, bf16 or fp16");
  }
}

// out[j] = src[index[j]] cast to out's dtype (fp32, bf16 or fp16; round to nearest even, as
// Tensor.to, bit for bit): the rows to fetch, written straight into a (pinned) staging buffer.
void gather_rows_(torch::Tensor src, torch::Tensor index, torch::Tensor out, int64_t threads) {
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous() && src.scalar_type() == torch::kFloat,
              "gather_rows_: contiguous fp32 source and contiguous output");
  TORCH_CHECK(index.scalar_type() == torch::kLong && out.size(0) == index.numel() &&
              out.size(1) == src.size(1), "gather_rows_: shapes");
  const int64_t n = index.numel(), width = src.size(1);
  const float* S = src.data_ptr<float>();
  const int64_t* I = index.data_ptr<int64_t>();
  with_output(out, "gather_rows_", [&](auto* O) {
    #pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
    for (int64_t j = 0; j < n; ++j) cast_row(S + I[j] * width, O + j * width, width);
  });
}

// A row's parameters brought forward by its catch-up, into out (the row is left as it is).
static inline void caught_up_row(const float* __restrict__ pr, const float* __restrict__ mr,
                                 const float* __restrict__ vr, float* __restrict__ out,
                                 int64_t width, const Owed& o) {
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) out[c] = caught_up(pr[c], mr[c], vr[c], o);
}

// out[j] = row index[j] of p as the catch-up to iteration u would leave it (rows current at u
// or later as they are), cast like gather_rows_; the rows, their moments and last iterations
// are left as they are. What catch_up_rows_ then gather_rows_ give, bit for bit, with one read
// of each row's parameters and moments and no write to them: a read of host rows costs half the
// memory traffic (the row steps later bring it up to date in their own pass, sparse_adamw_).
void gather_current_rows_(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor index,
                          torch::Tensor last, torch::Tensor touched, torch::Tensor d,
                          torch::Tensor win, torch::Tensor gs, int64_t base, int64_t horizon,
                          int64_t u, double b1, double b2, double eps, torch::Tensor out,
                          int64_t threads) {
  check_rows("gather_current_rows_", p, m, v, index, last, touched);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == index.numel() &&
              out.size(1) == p.size(1), "gather_current_rows_: contiguous output [rows, width]");
  const Clock k = clock_of(d, win, gs, base, horizon, u, b1, b2, eps);
  const int64_t n = index.numel(), width = p.size(1);
  const float* P = p.data_ptr<float>();
  const float* M = m.data_ptr<float>();
  const float* V = v.data_ptr<float>();
  const int64_t* I = index.data_ptr<int64_t>();
  const int64_t* LAST = last.data_ptr<int64_t>();
  const int64_t* TOUCHED = touched.data_ptr<int64_t>();
  check_row_iterations("gather_current_rows_", I, n, p.size(0), LAST, TOUCHED, k,
                       k.base + d.numel() - 1);
  with_output(out, "gather_current_rows_", [&](auto* O) {
    #pragma omp parallel num_threads((int)threads)
    {
      std::vector<float> row((size_t)width);  // one caught-up row at a time, in the caches
      #pragma omp for schedule(dynamic, 16)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = I[j];
        const float* src = P + r * width;
        if (LAST[r] < u) {
          caught_up_row(src, M + r * width, V + r * width, row.data(), width,
                        owed_at(k, LAST[r], TOUCHED[r]));
          src = row.data();
        }
        cast_row(src, O + j * width, width);
      }
    }
  });
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

// Where a team of `threads` runs when this thread starts one: per team thread, the CPU it was
// on after `spin_us` microseconds of work (all of the team alive at once) and the number of CPUs
// its affinity mask allows. A team on fewer CPUs than threads (a narrowed mask inherited from
// the thread that made the pool, a binding policy) runs its rows one core's worth at a time.
std::vector<std::pair<int64_t, int64_t>> team_cpus(int64_t threads, int64_t spin_us) {
  std::vector<std::pair<int64_t, int64_t>> out;
  #pragma omp parallel num_threads((int)threads)
  {
    const double until = omp_get_wtime() + 1e-6 * (double)spin_us;
    volatile double x = 0.0;
    while (omp_get_wtime() < until) x = x + 1.0;
    int64_t allowed = -1;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) allowed = CPU_COUNT(&set);
    const int64_t cpu = sched_getcpu();
#else
    const int64_t cpu = -1;
#endif
    #pragma omp critical
    out.emplace_back(cpu, allowed);
  }
  return out;
}

// The GIL is released for the whole call: the tensors' data is all they touch.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("sparse_adamw_", &sparse_adamw_, nogil);
  m.def("catch_up_rows_", &catch_up_rows_, nogil);
  m.def("gather_rows_", &gather_rows_, nogil);
  m.def("gather_current_rows_", &gather_current_rows_, nogil);
  m.def("team_size", &team_size, nogil);
  m.def("team_cpus", &team_cpus, nogil);
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

    def sparse_adamw_(self, p, m, v, rows, g, last, touched, clock, step, inv_bc2_sqrt,
                      decay) -> float:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows step iteration ``u + 1``).
        Returns the seconds of the row loop alone."""
        return self.module.sparse_adamw_(p, m, v, rows, g, last, touched, *clock, step,
                                         inv_bc2_sqrt, decay, threads())

    def catch_up_rows_(self, p, m, v, rows, last, touched, clock) -> None:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows are brought to ``u``)."""
        self.module.catch_up_rows_(p, m, v, rows, last, touched, *clock, threads())

    def gather_rows_(self, src, index, out) -> None:
        self.module.gather_rows_(src, index, out, threads())

    def gather_current_rows_(self, p, m, v, index, last, touched, clock, out) -> None:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows are read as of ``u``)."""
        self.module.gather_current_rows_(p, m, v, index, last, touched, *clock, out, threads())

    def team_size(self, n: int) -> int:
        return int(self.module.team_size(n))

    def team_cpus(self, n: int, spin_us: int = 20000) -> list:
        """``[(cpu, cpus allowed), ...]``, one per thread of a team of ``n`` started from the
        calling thread, after ``spin_us`` microseconds of work each."""
        return [tuple(x) for x in self.module.team_cpus(n, spin_us)]


def load():
    """The compiled kernels (``_Kernels``), or None (no compiler / build failure: logged once)."""
    global _MODULE
    if _MODULE is None:
        try:
            from torch.utils.cpp_extension import load_inline

            with build_environment():  # a build folder per virtualenv and CPU (_build_dir.py)
                _MODULE = _Kernels(load_inline(
                    name="megatron_ext_row_adam_v12", cpp_sources=[_SOURCE],
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False))
        except Exception as exc:  # pragma: no cover - depends on the machine's toolchain
            logger.warning("row-wise AdamW kernel unavailable (%s); falling back", exc)
            _MODULE = False
    return _MODULE or None
