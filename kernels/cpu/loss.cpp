// Fused softmax cross-entropy on the CPU: per-row loss and, optionally, the logits' gradient,
// written in place over the logits if the caller wishes (the (N, V) logits are the largest
// activation of a GPT step, V = 50257, so a second buffer of that size is worth avoiding).
//
// Rows are independent and run in parallel. One row (V floats, ~200 KB at V = 50257) stays in L2
// across the three passes: (1) max, (2) e = exp(l - max) and its sum s, lse = max + log(s), (3)
// gradient dloss_scale * (e / s - onehot). The exponential is math::exp_fast: a Cephes-style
// polynomial that GCC vectorises (glibc's expf is vectorised only under -ffast-math), within 1 ulp
// of exp, and the same on every machine.
//
// The vocab-parallel variant (tensor parallel: each rank holds the logits of a vocabulary slice)
// splits the same three passes at the two points where a row needs the whole vocabulary: after
// the max and after the sums the caller all-reduces (MAX, then SUM) over the TP group. It uses the
// same max, the same exponential and the same final formulas as the fused op, so the two differ
// only by the order of the fp32 additions in the exp sum. Pass 3 computes exp(l - max) again
// instead of keeping it from pass 2 (that would take an (N, Vl) fp32 buffer between the passes,
// while the slice's logits are read again anyway).
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

// max_j l[j] over n elements (NaNs are skipped here; they reach the loss through the exp sum).
template <typename L>
inline float row_max_of(const L* l, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = to_f32(l[j]) > mx ? to_f32(l[j]) : mx;
  return mx;
}

// The column of global vocabulary id t in the slice [v0, v0 + Vl), or -1 (also for t < 0).
inline int64_t slice_col(int32_t t, int64_t v0, int64_t Vl) {
  const int64_t c = static_cast<int64_t>(t) - v0;
  return t >= 0 && c >= 0 && c < Vl ? c : -1;
}

// A thread's row of exp(l - max) for a 16-bit gradient (CpuScratch::per_thread), grown only.
struct ExpRow {
  std::vector<float> e;
};

// logits (N, V) of type L; losses (N); dlogits (N, V) of type G, may be null, may alias logits
// if L == G (each element is read before it is written, and rows are disjoint).
template <typename L, typename G>
void cross_entropy_impl(float* losses, G* dlogits, const L* logits, const int32_t* targets,
                        int64_t N, int64_t V, float scale, int nt, std::span<ExpRow> rows) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const L* l = logits + i * V;
    const int32_t t = targets[i];
    const float lt = t >= 0 ? to_f32(l[t]) : 0.0f;  // read before an in-place gradient overwrites it
    const float mx = row_max_of(l, V);

    // e = exp(l - max) is kept for the gradient pass (one exp per element, not two): in the F32
    // gradient row itself (in place over l too: l[j] is read before e[j] is written), else in a
    // per-thread row buffer.
    float* e = nullptr;
    if (dlogits != nullptr && t >= 0) {
      if constexpr (std::is_same_v<G, float>) {
        e = dlogits + i * V;  // in place over float logits: l[j] is read before e[j] is written
      } else {
        std::vector<float>& row = rows[omp_get_thread_num()].e;
        row.resize(static_cast<size_t>(V));
        e = row.data();
      }
    }
    float s = 0.0f;
    if (e) {
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < V; ++j) {
        const float ej = math::exp_fast(to_f32(l[j]) - mx);
        e[j] = ej;
        s += ej;
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < V; ++j) s += math::exp_fast(to_f32(l[j]) - mx);
    }
    // loss = lse - l[t] = (max - l[t]) + log(s): no rounding of lse at the logits' magnitude.
    losses[i] = t >= 0 ? (mx - lt) + std::log(s) : 0.0f;
    if (!dlogits) continue;

    G* g = dlogits + i * V;
    if (t < 0) {
      for (int64_t j = 0; j < V; ++j) g[j] = from_f32<G>(0.0f);
      continue;
    }
    // dlogits = scale * (e / s - onehot(t))
    const float k = scale / s;
    const float et = e[t];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) g[j] = from_f32<G>(e[j] * k);
    g[t] = from_f32<G>(et * k - scale);
  }
}

// Pass 1: row_max (N) = max over the slice's logits (N, Vl).
template <typename L>
void vocab_ce_max_impl(float* row_max, const L* logits, int64_t N, int64_t Vl, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) row_max[i] = row_max_of(logits + i * Vl, Vl);
}

// Pass 2: sumexp (N) = sum over the slice of exp(l - row_max), row_max the global one;
// target_logit (N) = the target's logit if this slice holds it, else 0.
template <typename L>
void vocab_ce_sums_impl(float* sumexp, float* target_logit, const L* logits,
                        const float* row_max, const int32_t* targets, int64_t v0, int64_t N,
                        int64_t Vl, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const L* l = logits + i * Vl;
    const float mx = row_max[i];
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < Vl; ++j) s += math::exp_fast(to_f32(l[j]) - mx);
    sumexp[i] = s;
    const int64_t c = slice_col(targets[i], v0, Vl);
    target_logit[i] = c >= 0 ? to_f32(l[c]) : 0.0f;
  }
}

// Pass 3, from the global row_max, sumexp and target_logit: losses (N) and, if dlogits is
// non-null, the slice's gradient (N, Vl) of type G (may alias logits if L == G: each element is
// read before it is written, and rows are disjoint).
template <typename L, typename G>
void vocab_ce_finish_impl(float* losses, G* dlogits, const L* logits, const float* row_max,
                          const float* sumexp, const float* target_logit, const int32_t* targets,
                          int64_t v0, int64_t N, int64_t Vl, float scale, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = targets[i];
    const float mx = row_max[i], s = sumexp[i];
    // As in cross_entropy_impl: (max - l[t]) + log(s), no rounding of lse at the logits' size.
    losses[i] = t >= 0 ? (mx - target_logit[i]) + std::log(s) : 0.0f;
    if (!dlogits) continue;

    const L* l = logits + i * Vl;
    G* g = dlogits + i * Vl;
    if (t < 0) {
      for (int64_t j = 0; j < Vl; ++j) g[j] = from_f32<G>(0.0f);
      continue;
    }
    // dlogits = scale * (e / s - onehot(t - v0)), e = exp(l - max)
    const float k = scale / s;
    const int64_t c = slice_col(t, v0, Vl);
    const float ec = c >= 0 ? math::exp_fast(to_f32(l[c]) - mx) : 0.0f;  // before g overwrites l
#pragma omp simd
    for (int64_t j = 0; j < Vl; ++j) g[j] = from_f32<G>(math::exp_fast(to_f32(l[j]) - mx) * k);
    if (c >= 0) g[c] = from_f32<G>(ec * k - scale);
  }
}

}  // namespace

void CpuBackend::cross_entropy(float* losses, void* dlogits, DType dlogits_type,
                               const void* logits, DType logits_type, const int32_t* targets,
                               int64_t N, int64_t V, float dloss_scale) {
  TETRA_CHECK(N >= 0 && V > 0, "cross_entropy: N ({}) must be >= 0 and V ({}) > 0", N, V);
  for (int64_t i = 0; i < N; ++i)
    TETRA_CHECK(targets[i] < V, "cross_entropy: target {} of row {} is >= V ({})", targets[i], i,
                V);
  TETRA_CHECK(dlogits != logits || dlogits_type == logits_type,
              "cross_entropy: dlogits ({}) may alias logits ({}) only when both types are equal",
              dtype_name(dlogits_type), dtype_name(logits_type));
  const int nt = team_size(threads_);
  const std::span<ExpRow> rows = scratch_.per_thread<ExpRow>();
  with_float_type(logits_type, "cross_entropy", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    const L* l = static_cast<const L*>(logits);
    if (dlogits == nullptr) {
      cross_entropy_impl(losses, static_cast<float*>(nullptr), l, targets, N, V, dloss_scale, nt,
                         rows);
      return;
    }
    with_float_type(dlogits_type, "cross_entropy", "dlogits type", [&](auto gtag) {
      using G = decltype(gtag);
      cross_entropy_impl(losses, static_cast<G*>(dlogits), l, targets, N, V, dloss_scale, nt,
                         rows);
    });
  });
}


void CpuBackend::vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N,
                              int64_t Vl) {
  TETRA_CHECK(N >= 0 && Vl > 0, "vocab_ce_max: N ({}) must be >= 0 and Vl ({}) > 0", N, Vl);
  const int nt = team_size(threads_);
  with_float_type(logits_type, "vocab_ce_max", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    vocab_ce_max_impl(row_max, static_cast<const L*>(logits), N, Vl, nt);
  });
}

void CpuBackend::vocab_ce_sums(float* sumexp, float* target_logit, const void* logits,
                               DType logits_type, const float* row_max, const int32_t* targets,
                               int64_t v0, int64_t N, int64_t Vl) {
  TETRA_CHECK(N >= 0 && Vl > 0 && v0 >= 0,
              "vocab_ce_sums: N ({}) must be >= 0, Vl ({}) > 0 and v0 ({}) >= 0", N, Vl, v0);
  const int nt = team_size(threads_);
  with_float_type(logits_type, "vocab_ce_sums", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    vocab_ce_sums_impl(sumexp, target_logit, static_cast<const L*>(logits), row_max, targets, v0,
                       N, Vl, nt);
  });
}

void CpuBackend::vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type,
                                 const void* logits, DType logits_type, const float* row_max,
                                 const float* sumexp, const float* target_logit,
                                 const int32_t* targets, int64_t v0, int64_t N, int64_t Vl,
                                 float dloss_scale) {
  TETRA_CHECK(N >= 0 && Vl > 0 && v0 >= 0,
              "vocab_ce_finish: N ({}) must be >= 0, Vl ({}) > 0 and v0 ({}) >= 0", N, Vl, v0);
  TETRA_CHECK(dlogits != logits || dlogits_type == logits_type,
              "vocab_ce_finish: dlogits ({}) may alias logits ({}) only when both types are equal",
              dtype_name(dlogits_type), dtype_name(logits_type));
  const int nt = team_size(threads_);
  with_float_type(logits_type, "vocab_ce_finish", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    const L* l = static_cast<const L*>(logits);
    if (dlogits == nullptr) {
      vocab_ce_finish_impl(losses, static_cast<float*>(nullptr), l, row_max, sumexp, target_logit,
                           targets, v0, N, Vl, dloss_scale, nt);
      return;
    }
    with_float_type(dlogits_type, "vocab_ce_finish", "dlogits type", [&](auto gtag) {
      using G = decltype(gtag);
      vocab_ce_finish_impl(losses, static_cast<G*>(dlogits), l, row_max, sumexp, target_logit,
                           targets, v0, N, Vl, dloss_scale, nt);
    });
  });
}

}  // namespace tetra
