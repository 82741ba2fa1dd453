"""Row-wise AdamW on the CPU, in place, for the rows a batch touched (the ``sparse`` STEM optimizer).

DeepSpeed's ``cpu_adam`` kernel updates one contiguous tensor; touched table rows are scattered
over the shard, so using it means gathering rows into buffers and scattering them back (six copies
of the touched rows). This kernel instead walks the touched rows in place (an OpenMP loop over
rows, a vectorisable loop over columns) and, in the same pass over each row's columns, first
brings the row from the iteration it was last current at to the previous one (the sparse
optimizer's catch-up, ``megatron_ext/stem/runtime/row_adam.py``). The per-row catch-up factors are
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
it. The calls release the GIL (``ctypes.CDLL``), so a row step or gather running in a background
thread does not stop the training thread from launching work.

Rows go to the team's threads 16 at a time as threads come free (``schedule(dynamic, 16)``), not
in fixed shares: on a busy host (the training thread, NCCL's and the data loader's threads) a
thread that loses its core for a while no longer holds up the whole call. Each row is stepped by
one thread alone, so the results are the same bits either way. Measured on the development machine
(2 threads, the sparse step of 3,379 Zipf rows of 5,632, median of 12): 10.61 vs 10.60 ms with
static shares on idle cores; with one core kept busy by another process, 13.20 vs 17.85 ms.

Refusals. The kernels are a plain C library (``extern "C"`` functions, built with
``-fno-exceptions``, loaded with ``ctypes``): no C++ exception, pybind11 or torch header is part of
a call. Every argument is checked before anything is written: the tensors' dtype, device,
contiguity and shapes in the Python wrapper, the row indices, the rows' iterations and the clock's
series in the kernel (it reads them anyway), before its parallel loop; a refusal comes back as a
return code and a message in the caller's buffer, and the wrapper raises ``RowKernelError`` naming
the function, the row and why. Why: on a GPU machine's host (torch 2.11, its own compiler,
``-march=native``) the refusal of ``catch_up_rows_``, then a ``TORCH_CHECK`` thrown (a
``c10::Error``) out of a pybind11 function that had released the GIL, died with SIGSEGV; whatever
in that path failed there (torch's exception translator reached through pybind11's shared
internals, the c10::Error's stack capture, a C++ runtime other than torch's), none of it is left.

Built on first use with the system's C++ compiler (``CXX``, else ``c++``; a few seconds: no torch
headers) into a folder per virtualenv and CPU (``_build_dir.py``), for a named instruction-set
level (``arch_flags``); ``load()`` returns None when no compiler is available, and the caller
falls back.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from typing import List, Optional

import torch

from megatron_ext_kernels._build_dir import build_environment, cpu_signature

logger = logging.getLogger(__name__)

_SOURCE = r"""
// Plain C entry points (extern "C"), built with -fno-exceptions: nothing here can throw, and each
// call reports a refusal as a return code and a message in the caller's buffer.
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

// A refusal: the message (function name first) written into err, 1 returned.
static int refuse(char* err, int64_t errlen, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(char* err, int64_t errlen, const char* fmt, ...) {
  if (err != nullptr && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, (size_t)errlen, fmt, ap);
    va_end(ap);
  }
  return 1;
}

// The sparse optimizer's iteration clock brought to iteration u (row_adam.RowClock): D_j for
// j = base.. (running decay product), the momentum's move F_u(s) for s in [u - nwin + 1, u],
// G_s = F_(s+H)(s) for s = base.. (rows untouched for longer than the horizon H), the betas, eps.
struct Clock {
  const double *d, *win, *gs;
  int64_t nd, nwin, ngs, base, horizon, u;
  double b1, b2, eps;
};

// The series' lengths against what the rows' iterations index (owed_at): D_j for j up to u, the
// window of F_u over [max(base, u - H), u], G_s for every s < u - H. A clock that does not hold
// them is refused, so no read goes past a series.
static int check_clock(const char* name, const Clock& k, char* err, int64_t errlen) {
  if (k.horizon < 1 || k.u < k.base || k.u - k.base >= k.nd)
    return refuse(err, errlen, "%s: iteration %lld is outside the clock's %lld..%lld "
                  "(horizon %lld)", name, (long long)k.u, (long long)k.base,
                  (long long)(k.base + k.nd - 1), (long long)k.horizon);
  const int64_t span = k.u - k.base;
  const int64_t want_win = (span < k.horizon ? span : k.horizon) + 1;
  const int64_t want_gs = span - k.horizon > 0 ? span - k.horizon : 0;
  if (k.nwin != want_win || k.ngs < want_gs)
    return refuse(err, errlen, "%s: the clock's series do not cover iteration %lld (window "
                  "%lld, needs %lld; %lld completed moves, needs %lld)", name, (long long)k.u,
                  (long long)k.nwin, (long long)want_win, (long long)k.ngs, (long long)want_gs);
  return 0;
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
// (gather_current_rows), so that both give the same bits.
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

// Every row index inside the shard and, with a clock, every row's iterations within it
// (0 <= touched <= last, base <= last <= max_last): checked before any row is touched, so a
// refused call changes nothing. The message names the first offending row and why.
static int check_row_iterations(const char* name, const int64_t* R, int64_t n, int64_t nrows,
                                const int64_t* LAST, const int64_t* TOUCHED, const Clock* k,
                                int64_t max_last, char* err, int64_t errlen) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    if (r < 0 || r >= nrows)
      return refuse(err, errlen, "%s: row %lld (position %lld of %lld) is outside the shard's "
                    "%lld rows", name, (long long)r, (long long)j, (long long)n,
                    (long long)nrows);
    if (k == nullptr) continue;
    if (LAST[r] < k->base || LAST[r] > max_last)
      return refuse(err, errlen, "%s: row %lld was last brought up to date at iteration %lld, "
                    "outside the clock's %lld..%lld", name, (long long)r, (long long)LAST[r],
                    (long long)k->base, (long long)max_last);
    if (TOUCHED[r] < 0 || TOUCHED[r] > LAST[r])
      return refuse(err, errlen, "%s: row %lld was last given a gradient at iteration %lld, "
                    "outside 0..%lld (its last iteration)", name, (long long)r,
                    (long long)TOUCHED[r], (long long)LAST[r]);
  }
  return 0;
}

static int check_threads(const char* name, int64_t threads, char* err, int64_t errlen) {
  if (threads < 1 || threads > 65536)
    return refuse(err, errlen, "%s: %lld threads (needs 1..65536)", name, (long long)threads);
  return 0;
}

static inline void prefetch_row(const float* P, const float* M, const float* V, int64_t start,
                                int64_t width) {
  for (int64_t c = 0; c < width && c < 256; c += 16) {
    __builtin_prefetch(P + start + c, 1);
    __builtin_prefetch(M + start + c, 1);
    __builtin_prefetch(V + start + c, 1);
  }
}

extern "C" {

// The sparse step of iteration u + 1 for rows[j] (unique) with gradients g[j]: each row brought
// from its last iteration to u (catch-up) and stepped, in one pass; last[r] = touched[r] = u + 1.
// *seconds: the row loop alone (the team's work, without the call's checks or the GIL taken
// back after it: the stats tell a slow team from a slow way into it).
int mx_sparse_adamw(float* P, float* M, float* V, int64_t nrows, int64_t width, const int64_t* R,
                    int64_t n, const float* G, int64_t* LAST, int64_t* TOUCHED, const double* d,
                    int64_t nd, const double* win, int64_t nwin, const double* gs, int64_t ngs,
                    int64_t base, int64_t horizon, int64_t u, double b1, double b2, double eps,
                    double step, double inv_bc2_sqrt, double decay, int64_t threads,
                    double* seconds, char* err, int64_t errlen) {
  const char* name = "sparse_adamw_";
  const Clock k{d, win, gs, nd, nwin, ngs, base, horizon, u, b1, b2, eps};
  if (check_threads(name, threads, err, errlen) || check_clock(name, k, err, errlen) ||
      check_row_iterations(name, R, n, nrows, LAST, TOUCHED, &k, u, err, errlen))
    return 1;
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
  *seconds = omp_get_wtime() - start;
  return 0;
}

// Rows[j] (unique) brought from their last iteration to u, in place (a read of rows untouched
// for a while); last[r] = u. Rows current at u or later are left as they are.
int mx_catch_up_rows(float* P, float* M, float* V, int64_t nrows, int64_t width, const int64_t* R,
                     int64_t n, int64_t* LAST, const int64_t* TOUCHED, const double* d,
                     int64_t nd, const double* win, int64_t nwin, const double* gs, int64_t ngs,
                     int64_t base, int64_t horizon, int64_t u, double b1, double b2, double eps,
                     int64_t threads, char* err, int64_t errlen) {
  const char* name = "catch_up_rows_";
  const Clock k{d, win, gs, nd, nwin, ngs, base, horizon, u, b1, b2, eps};
  if (check_threads(name, threads, err, errlen) || check_clock(name, k, err, errlen) ||
      check_row_iterations(name, R, n, nrows, LAST, TOUCHED, &k, base + nd - 1, err, errlen))
    return 1;
  #pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = R[j];
    if (LAST[r] >= u) continue;
    row_pass<true, false>(P + r * width, M + r * width, V + r * width, nullptr, width,
                          owed_at(k, LAST[r], TOUCHED[r]), 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
    LAST[r] = u;
  }
  return 0;
}

}  // extern "C"

// fp32 bits to bf16 bits, rounded to nearest even, every NaN to 0xFFFF: what torch's vectorised
// CPU cast (ATen's cvtfp32_bf16, behind Tensor.to) gives, bit for bit. Written on the bits, with
// a select for NaN, so that the column loop vectorises: c10's scalar BFloat16(float) branches on
// NaN and kept the loop scalar (the bf16 gather took 3.1x the fp32 one's time on the development
// machine).
static inline uint16_t bf16_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0xFFFFu : (uint16_t)rounded;
}

// fp32 to fp16 bits, rounded to nearest even: the F16C instruction where there is one (what
// torch's CPU cast uses), else c10's portable fp16_ieee_from_fp32_value (torch/headeronly/util/
// Half.h), the same bits for every non-NaN value.
static inline uint16_t fp16_bits(float f) {
#if defined(__F16C__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t w, bits;
  std::memcpy(&w, &f, 4);
  const uint32_t inf_bits = (uint32_t)239 << 23, zero_bits = (uint32_t)17 << 23;
  float scale_to_inf, scale_to_zero, b;
  std::memcpy(&scale_to_inf, &inf_bits, 4);
  std::memcpy(&scale_to_zero, &zero_bits, 4);
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const uint32_t b_bits = (bias >> 1) + 0x07800000u;
  std::memcpy(&b, &b_bits, 4);
  base = b + base;
  std::memcpy(&bits, &base, 4);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

typedef uint32_t __attribute__((may_alias)) float_bits;  // fp32 rows read as their bits

// The output dtypes of the gathers (row_adam_cpu._OUT_DTYPES): fp32, bf16, fp16.
enum { OUT_FP32 = 0, OUT_BF16 = 1, OUT_FP16 = 2 };

// One row cast to the output's dtype: fp32 (a copy); bf16 on the bits (bf16_bits); fp16 by the
// F16C instruction, eight columns at a time (the compiler does not vectorise a scalar cast: fp16
// gathers took 1.4x the fp32 one's time on the development machine), fp16_bits for the rest.
static inline void cast_row(const float* __restrict__ sr, float* __restrict__ orow,
                            int64_t width) {
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) orow[c] = sr[c];
}

static inline void cast_row_bf16(const float* src, uint16_t* __restrict__ orow, int64_t width) {
  const float_bits* __restrict__ sr = reinterpret_cast<const float_bits*>(src);
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) orow[c] = bf16_bits(sr[c]);
}

static inline void cast_row_fp16(const float* __restrict__ sr, uint16_t* __restrict__ orow,
                                 int64_t width) {
  int64_t c = 0;
#if defined(__F16C__)
  for (; c + 8 <= width; c += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(sr + c),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; c < width; ++c) orow[c] = fp16_bits(sr[c]);
}

static inline void cast_any(const float* src, void* out, int kind, int64_t j, int64_t width) {
  if (kind == OUT_FP32)
    cast_row(src, static_cast<float*>(out) + j * width, width);
  else if (kind == OUT_BF16)
    cast_row_bf16(src, static_cast<uint16_t*>(out) + j * width, width);
  else
    cast_row_fp16(src, static_cast<uint16_t*>(out) + j * width, width);
}

static int check_kind(const char* name, int kind, char* err, int64_t errlen) {
  if (kind != OUT_FP32 && kind != OUT_BF16 && kind != OUT_FP16)
    return refuse(err, errlen, "%s: output kind %d (fp32 0, bf16 1, fp16 2)", name, kind);
  return 0;
}

// A row's parameters brought forward by its catch-up, into out (the row is left as it is).
static inline void caught_up_row(const float* __restrict__ pr, const float* __restrict__ mr,
                                 const float* __restrict__ vr, float* __restrict__ out,
                                 int64_t width, const Owed& o) {
  #pragma omp simd
  for (int64_t c = 0; c < width; ++c) out[c] = caught_up(pr[c], mr[c], vr[c], o);
}

extern "C" {

// out[j] = src[index[j]] cast to out's dtype (fp32, bf16 or fp16; round to nearest even, as
// Tensor.to, bit for bit): the rows to fetch, written straight into a (pinned) staging buffer.
int mx_gather_rows(const float* S, int64_t nrows, int64_t width, const int64_t* I, int64_t n,
                   void* out, int kind, int64_t threads, char* err, int64_t errlen) {
  const char* name = "gather_rows_";
  if (check_threads(name, threads, err, errlen) || check_kind(name, kind, err, errlen) ||
      check_row_iterations(name, I, n, nrows, nullptr, nullptr, nullptr, 0, err, errlen))
    return 1;
  #pragma omp parallel for num_threads((int)threads) schedule(dynamic, 16)
  for (int64_t j = 0; j < n; ++j) cast_any(S + I[j] * width, out, kind, j, width);
  return 0;
}

// out[j] = row index[j] of p as the catch-up to iteration u would leave it (rows current at u
// or later as they are), cast like gather_rows; the rows, their moments and last iterations
// are left as they are. What catch_up_rows then gather_rows give, bit for bit, with one read
// of each row's parameters and moments and no write to them: a read of host rows costs half the
// memory traffic (the row steps later bring it up to date in their own pass, sparse_adamw).
int mx_gather_current_rows(const float* P, const float* M, const float* V, int64_t nrows,
                           int64_t width, const int64_t* I, int64_t n, const int64_t* LAST,
                           const int64_t* TOUCHED, const double* d, int64_t nd,
                           const double* win, int64_t nwin, const double* gs, int64_t ngs,
                           int64_t base, int64_t horizon, int64_t u, double b1, double b2,
                           double eps, void* out, int kind, int64_t threads, char* err,
                           int64_t errlen) {
  const char* name = "gather_current_rows_";
  const Clock k{d, win, gs, nd, nwin, ngs, base, horizon, u, b1, b2, eps};
  if (check_threads(name, threads, err, errlen) || check_kind(name, kind, err, errlen) ||
      check_clock(name, k, err, errlen) ||
      check_row_iterations(name, I, n, nrows, LAST, TOUCHED, &k, base + nd - 1, err, errlen))
    return 1;
  // One caught-up row per thread at a time, in the caches; allocated here, outside the team: an
  // allocation cannot fail inside it.
  float* scratch = static_cast<float*>(std::malloc(sizeof(float) * (size_t)(width > 0 ? width : 1)
                                                   * (size_t)threads));
  if (scratch == nullptr)
    return refuse(err, errlen, "%s: no memory for %lld scratch rows of %lld columns", name,
                  (long long)threads, (long long)width);
  #pragma omp parallel num_threads((int)threads)
  {
    float* row = scratch + (size_t)omp_get_thread_num() * (size_t)width;
    #pragma omp for schedule(dynamic, 16)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = I[j];
      const float* src = P + r * width;
      if (LAST[r] < u) {
        caught_up_row(src, M + r * width, V + r * width, row, width,
                      owed_at(k, LAST[r], TOUCHED[r]));
        src = row;
      }
      cast_any(src, out, kind, j, width);
    }
  }
  std::free(scratch);
  return 0;
}

// The number of threads an OpenMP team of `threads` (>= 1) gets here (tests, the start-up
// report).
int64_t mx_team_size(int64_t threads) {
  int64_t size = 0;
  #pragma omp parallel num_threads((int)(threads < 1 ? 1 : threads))
  {
    #pragma omp single
    size = omp_get_num_threads();
  }
  return size;
}

// Where a team of `threads` runs when this thread starts one: per team thread, the CPU it was on
// after `spin_us` microseconds of work (all of the team alive at once) and the number of CPUs its
// affinity mask allows, written to cpus[i], allowed[i] (arrays of `threads`); returns the team's
// size. A team on fewer CPUs than threads (a narrowed mask inherited from the thread that made
// the pool, a binding policy) runs its rows one core's worth at a time.
int64_t mx_team_cpus(int64_t threads, int64_t spin_us, int64_t* cpus, int64_t* allowed) {
  int64_t size = 0;
  #pragma omp parallel num_threads((int)(threads < 1 ? 1 : threads))
  {
    const double until = omp_get_wtime() + 1e-6 * (double)spin_us;
    volatile double x = 0.0;
    while (omp_get_wtime() < until) x = x + 1.0;
    int64_t mask = -1, cpu = -1;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) mask = CPU_COUNT(&set);
    cpu = sched_getcpu();
#endif
    const int i = omp_get_thread_num();
    cpus[i] = cpu;
    allowed[i] = mask;
    #pragma omp single
    size = omp_get_num_threads();
  }
  return size;
}

}  // extern "C"
"""

_MODULE = None
_THREADS = 0  # 0: default_threads()
_NAME = "megatron_ext_row_kernels"
_ERR_BYTES = 1024  # a refusal's message buffer


class RowKernelError(ValueError):
    """A call of the compiled row kernels refused its input (a row outside the shard, iterations
    the clock does not know, a tensor of the wrong dtype, device or shape): nothing was written.
    The message names the function, the row (or tensor) and why."""


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


# The gathers' output dtypes, as the kernels number them (OUT_FP32, OUT_BF16, OUT_FP16).
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "contiguous" if t.is_contiguous() else "strided"
    return f"{layout} {t.dtype} {t.device.type} {tuple(t.shape)}"


def _tensor(fn: str, label: str, t, dtype, dim: int) -> None:
    """``t`` is what a kernel may read through its data pointer: a contiguous host tensor of
    ``dtype`` (or one of ``dtype``) and ``dim`` dimensions; else ``RowKernelError``."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in dtypes
            and t.dim() == dim and t.is_contiguous()):
        want = " or ".join(str(d) for d in dtypes)
        raise RowKernelError(f"{fn}: {label} must be a contiguous {dim}-D {want} CPU tensor, got "
                             f"{_describe(t)}")


def _rows_and_moments(fn: str, p, m, v, rows, last, touched) -> None:
    for label, t in (("p", p), ("m", m), ("v", v)):
        _tensor(fn, label, t, torch.float32, 2)
    if m.shape != p.shape or v.shape != p.shape:
        raise RowKernelError(f"{fn}: rows and moments of one shape, got p {tuple(p.shape)}, "
                             f"m {tuple(m.shape)}, v {tuple(v.shape)}")
    _tensor(fn, "rows", rows, torch.int64, 1)
    for label, t in (("last", last), ("touched", touched)):
        _tensor(fn, label, t, torch.int64, 1)
        if t.numel() != p.shape[0]:
            raise RowKernelError(f"{fn}: {label} needs one iteration per row ({p.shape[0]}), "
                                 f"got {t.numel()}")


def _clock_args(fn: str, clock) -> list:
    """``RowClock.kernel_state(u)`` as the kernels take it: each series' pointer and length, then
    base, horizon, u, b1, b2, eps (their lengths against ``u`` are checked in the kernel)."""
    if not (isinstance(clock, tuple) and len(clock) == 9):
        raise RowKernelError(f"{fn}: the clock must be RowClock.kernel_state(u), got "
                             f"{type(clock).__name__}")
    d, win, gs, base, horizon, u, b1, b2, eps = clock
    out = []
    for label, t in (("the clock's decay series", d), ("the clock's window", win),
                     ("the clock's completed moves", gs)):
        _tensor(fn, label, t, torch.float64, 1)
        out += [t.data_ptr(), t.numel()]
    return out + [int(base), int(horizon), int(u), float(b1), float(b2), float(eps)]


def _output(fn: str, out, rows: int, width: int) -> int:
    _tensor(fn, "out", out, tuple(_OUT_KINDS), 2)
    if tuple(out.shape) != (rows, width):
        raise RowKernelError(f"{fn}: out must be [{rows}, {width}] (index x width), got "
                             f"{tuple(out.shape)}")
    return _OUT_KINDS[out.dtype]


class _Kernels:
    """The compiled functions (a plain C library, ``ctypes``), each given ``threads()`` at call
    time. Every argument is checked here (tensors: dtype, device, contiguity, shapes) or in the
    kernel (row indices, iterations, the clock's series: data it reads anyway) before anything
    is written; a refusal raises ``RowKernelError``. ``path``: the library's file."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib = lib
        self.path = path

    def _call(self, fn: str, symbol: str, *args) -> None:
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if getattr(self.lib, symbol)(*args, err, _ERR_BYTES) != 0:
            raise RowKernelError(err.value.decode(errors="replace"))

    def sparse_adamw_(self, p, m, v, rows, g, last, touched, clock, step, inv_bc2_sqrt,
                      decay) -> float:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows step iteration ``u + 1``).
        Returns the seconds of the row loop alone."""
        fn = "sparse_adamw_"
        _rows_and_moments(fn, p, m, v, rows, last, touched)
        _tensor(fn, "g", g, torch.float32, 2)
        if tuple(g.shape) != (rows.numel(), p.shape[1]):
            raise RowKernelError(f"{fn}: g must be [{rows.numel()}, {p.shape[1]}] (rows x "
                                 f"width), got {tuple(g.shape)}")
        seconds = ctypes.c_double(0.0)
        self._call(fn, "mx_sparse_adamw", p.data_ptr(), m.data_ptr(), v.data_ptr(), p.shape[0],
                   p.shape[1], rows.data_ptr(), rows.numel(), g.data_ptr(), last.data_ptr(),
                   touched.data_ptr(), *_clock_args(fn, clock), float(step),
                   float(inv_bc2_sqrt), float(decay), threads(), ctypes.byref(seconds))
        return seconds.value

    def catch_up_rows_(self, p, m, v, rows, last, touched, clock) -> None:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows are brought to ``u``)."""
        fn = "catch_up_rows_"
        _rows_and_moments(fn, p, m, v, rows, last, touched)
        self._call(fn, "mx_catch_up_rows", p.data_ptr(), m.data_ptr(), v.data_ptr(), p.shape[0],
                   p.shape[1], rows.data_ptr(), rows.numel(), last.data_ptr(),
                   touched.data_ptr(), *_clock_args(fn, clock), threads())

    def gather_rows_(self, src, index, out) -> None:
        fn = "gather_rows_"
        _tensor(fn, "src", src, torch.float32, 2)
        _tensor(fn, "index", index, torch.int64, 1)
        kind = _output(fn, out, index.numel(), src.shape[1])
        self._call(fn, "mx_gather_rows", src.data_ptr(), src.shape[0], src.shape[1],
                   index.data_ptr(), index.numel(), out.data_ptr(), kind, threads())

    def gather_current_rows_(self, p, m, v, index, last, touched, clock, out) -> None:
        """``clock``: ``RowClock.kernel_state(u)`` (the rows are read as of ``u``)."""
        fn = "gather_current_rows_"
        _rows_and_moments(fn, p, m, v, index, last, touched)
        kind = _output(fn, out, index.numel(), p.shape[1])
        self._call(fn, "mx_gather_current_rows", p.data_ptr(), m.data_ptr(), v.data_ptr(),
                   p.shape[0], p.shape[1], index.data_ptr(), index.numel(), last.data_ptr(),
                   touched.data_ptr(), *_clock_args(fn, clock), out.data_ptr(), kind, threads())

    def team_size(self, n: int) -> int:
        if n < 1:
            raise RowKernelError(f"team_size: a team of {n} threads (needs >= 1)")
        return int(self.lib.mx_team_size(n))

    def team_cpus(self, n: int, spin_us: int = 20000) -> list:
        """``[(cpu, cpus allowed), ...]``, one per thread of a team of ``n`` started from the
        calling thread, after ``spin_us`` microseconds of work each."""
        if n < 1:
            raise RowKernelError(f"team_cpus: a team of {n} threads (needs >= 1)")
        cpus, allowed = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
        size = self.lib.mx_team_cpus(n, spin_us, cpus, allowed)
        return [(int(cpus[i]), int(allowed[i])) for i in range(size)]


_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
_CLOCK = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _F64, _F64, _F64]
_ERR = [ctypes.c_char_p, _I64]
# Each entry point's arguments (ctypes converts and checks the Python values against them).
_SIGNATURES = {
    "mx_sparse_adamw": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, *_CLOCK,
                        _F64, _F64, _F64, _I64, ctypes.POINTER(_F64), *_ERR],
    "mx_catch_up_rows": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, *_CLOCK, _I64,
                         *_ERR],
    "mx_gather_rows": [_PTR, _I64, _I64, _PTR, _I64, _PTR, ctypes.c_int, _I64, *_ERR],
    "mx_gather_current_rows": [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, *_CLOCK,
                               _PTR, ctypes.c_int, _I64, *_ERR],
    "mx_team_size": [_I64],
    "mx_team_cpus": [_I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64)],
}


def arch_flags(cpu_flags: Optional[set] = None, machine: Optional[str] = None) -> List[str]:
    """The instruction set the kernels are built for: on x86-64 the highest of the named levels
    x86-64-v4 (AVX-512), -v3 (AVX2, FMA, F16C: the fp16 casts' instruction) and -v2 whose every
    feature the kernel reports in ``/proc/cpuinfo`` (it lists only what the OS has enabled),
    else the compiler's default; elsewhere the compiler's default. Not ``-march=native``: that
    is whatever the compiler's own detection makes of the CPU, which differs from compiler to
    compiler and misreads CPUs newer than the compiler; a named level is the same code on every
    host that has it. CPU time of the calling thread, one thread, the sparse step / bf16 read of
    2,359 Zipf rows of 8,192 x 5,632 on the development machine (AVX-512), min of 30: native
    13.15 / 12.11 ms, v4 12.95 / 12.15, v3 14.84 / 12.59, the pybind11 build with native
    12.94 / 12.07."""
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return []
    if cpu_flags is None:
        sig = cpu_signature()
        cpu_flags = set(sig.split("flags=", 1)[1].split("|", 1)[0].split()) \
            if "flags=" in sig else set()
    v2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
    v3 = v2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
    v4 = v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    for level, needs in (("x86-64-v4", v4), ("x86-64-v3", v3), ("x86-64-v2", v2)):
        if needs <= cpu_flags:
            return [f"-march={level}"]
    return []


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


def _build(root: str) -> str:
    """The kernels' library under ``root`` (``_build_dir.build_root()``), compiled on first use:
    one file per source, compiler and flags, written under a lock (the ranks of a node build it
    once) and renamed into place (a reader never sees half a file)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')})")
    # -fno-trapping-math: the catch-up's division under a condition (0 where v = 0) may then be
    # computed in every column and selected (nothing here reads floating-point exception flags);
    # without it only AVX-512's masked division vectorised that loop (-fopt-info-vec: scalar
    # with x86-64-v3 or the default target).
    flags = ["-O3", *arch_flags(), "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC",
             "-shared", "-std=c++17", "-fno-exceptions", "-fno-rtti"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.split("\n", 1)[0]
    key = hashlib.sha256("\0".join([_SOURCE, cxx, version, *flags]).encode()).hexdigest()[:16]
    folder = os.path.join(root, _NAME)
    path = os.path.join(folder, f"{_NAME}_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):  # built by another process meanwhile
            return path
        source = os.path.join(folder, f"{_NAME}_{key}.cpp")
        with open(source, "w") as f:
            f.write(_SOURCE)
        partial = f"{path}.{os.getpid()}.tmp"
        done = subprocess.run([cxx, *flags, source, "-o", partial], capture_output=True,
                              text=True, timeout=600)
        level = [f for f in flags if f.startswith("-march=")]
        if done.returncode != 0 and level:  # a compiler older than the named levels (GCC 11)
            logger.warning("%s refused %s; the row kernels are built for its default target",
                           cxx, level[0])
            done = subprocess.run([cxx, *[f for f in flags if f not in level], source, "-o",
                                   partial], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    return path


def load():
    """The compiled kernels (``_Kernels``), or None (no compiler / build failure: logged once)."""
    global _MODULE
    if _MODULE is None:
        try:
            with build_environment() as root:  # a folder per virtualenv and CPU (_build_dir.py)
                path = _build(root)
            lib = ctypes.CDLL(path)  # CDLL: the GIL is released for every call
            for symbol, argtypes in _SIGNATURES.items():
                fn = getattr(lib, symbol)
                fn.argtypes = argtypes
                fn.restype = _I64 if symbol.startswith("mx_team") else ctypes.c_int
            _MODULE = _Kernels(lib, path)
        except Exception as exc:  # pragma: no cover - depends on the machine's toolchain
            logger.warning("row-wise AdamW kernel unavailable (%s); falling back", exc)
            _MODULE = False
    return _MODULE or None
