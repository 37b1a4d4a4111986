// Fused softmax cross-entropy on the CPU: per-row loss and, optionally, the logits' gradient,
// written in place over the logits if the caller wishes (the (N, V) logits are the largest
// activation of a GPT step, V = 50257, so a second buffer of that size is worth avoiding).
//
// Rows are independent and run in parallel. One row (V floats, ~200 KB at V = 50257) stays in L2
// across the three passes: (1) max, (2) e = exp(l - max) and its sum s, lse = max + log(s), (3)
// gradient dloss_scale * (e / s - onehot). The exponential is math::exp_fast: a Cephes-style
// polynomial that GCC vectorises (glibc's expf is vectorised only under -ffast-math), within 1 ulp
// of exp, and the same on every machine.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "trainer/core/check.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

// logits (N, V) of type L; losses (N); dlogits (N, V) of type G, may be null, may alias logits
// if L == G (each element is read before it is written, and rows are disjoint).
template <typename L, typename G>
void cross_entropy_impl(float* losses, G* dlogits, const L* logits, const int32_t* targets,
                        int64_t N, int64_t V, float scale, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const L* l = logits + i * V;
    const int32_t t = targets[i];
    const float lt = t >= 0 ? to_f32(l[t]) : 0.0f;  // read before an in-place gradient overwrites it
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < V; ++j) mx = to_f32(l[j]) > mx ? to_f32(l[j]) : mx;

    // e = exp(l - max) is kept for the gradient pass (one exp per element, not two): in the F32
    // gradient row itself (in place over l too: l[j] is read before e[j] is written), else in a
    // per-thread row buffer.
    float* e = nullptr;
    if (dlogits != nullptr && t >= 0) {
      if constexpr (std::is_same_v<G, float>) {
        e = dlogits + i * V;  // in place over float logits: l[j] is read before e[j] is written
      } else {
        thread_local std::vector<float> row;
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
  with_float_type(logits_type, "cross_entropy", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    const L* l = static_cast<const L*>(logits);
    if (dlogits == nullptr) {
      cross_entropy_impl(losses, static_cast<float*>(nullptr), l, targets, N, V, dloss_scale, nt);
      return;
    }
    with_float_type(dlogits_type, "cross_entropy", "dlogits type", [&](auto gtag) {
      using G = decltype(gtag);
      cross_entropy_impl(losses, static_cast<G*>(dlogits), l, targets, N, V, dloss_scale, nt);
    });
  });
}

}  // namespace tetra
