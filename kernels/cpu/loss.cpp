// Fused softmax cross-entropy on the CPU: per-row loss and, optionally, the logits' gradient,
// written in place over the logits if the caller wishes (the (N, V) logits are the largest
// activation of a GPT step, V = 50257, so a second buffer of that size is worth avoiding).
//
// Rows are independent and run in parallel. One row (V floats, ~200 KB at V = 50257) stays in L2
// across the three passes: (1) max, (2) e = exp(l - max) and its sum s, lse = max + log(s), (3)
// gradient dloss_scale * (e / s - onehot). The exponential is `exp_vec` below: a Cephes-style
// polynomial that GCC vectorises (glibc's expf is vectorised only under -ffast-math), within 1 ulp
// of exp on [-87, 0], and the same on every machine.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "trainer/core/check.h"

namespace tetra {
namespace {

int team_size(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

// exp(x) for x <= 0 (callers pass l - max): x = n ln2 + r with |r| <= ln2/2, exp(r) by the
// Cephes expf polynomial, 2^n put in the exponent field. Below -87.3, where exp leaves fp32's
// normal range, it returns 0 (also for -inf); a NaN stays NaN, so a NaN logit makes its row's loss
// NaN instead of vanishing. No branches or float selects: GCC turns those into predicated
// arithmetic that it does not vectorise, so the clamp and the zeroing are integer masks.
inline float exp_vec(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kMin = -87.3f;
  const int32_t in_range = -static_cast<int32_t>(!(x < kMin));  // all ones (also NaN), or 0
  const float xc = std::bit_cast<float>((std::bit_cast<int32_t>(x) & in_range) |
                                        (std::bit_cast<int32_t>(kMin) & ~in_range));
  // n = round(x log2 e) by the 1.5 * 2^23 shifter (a vector floorf is not available under these
  // flags); the integer n is then the low bits of the shifted value.
  constexpr float kShifter = 12582912.0f;
  const float shifted = xc * kLog2e + kShifter;
  const float n = shifted - kShifter;
  const int32_t ni = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kShifter);
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t biased = (ni + 127) & in_range;  // exponent 0: scale = 0
  return p * std::bit_cast<float>(biased << 23);
}

// logits (N, V); losses (N); dlogits (N, V) of type G, may be null, may alias logits if G is
// float (each element is read before it is written, and rows are disjoint).
template <typename G>
void cross_entropy_impl(float* losses, G* dlogits, const float* logits, const int32_t* targets,
                        int64_t N, int64_t V, float scale, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* l = logits + i * V;
    const int32_t t = targets[i];
    const float lt = t >= 0 ? l[t] : 0.0f;  // read before an in-place gradient overwrites it
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < V; ++j) mx = l[j] > mx ? l[j] : mx;

    // e = exp(l - max) is kept for the gradient pass (one exp per element, not two): in the F32
    // gradient row itself (in place over l too: l[j] is read before e[j] is written), else in a
    // per-thread row buffer.
    float* e = nullptr;
    if (dlogits != nullptr && t >= 0) {
      if constexpr (std::is_same_v<G, float>) {
        e = dlogits + i * V;
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
        const float ej = exp_vec(l[j] - mx);
        e[j] = ej;
        s += ej;
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < V; ++j) s += exp_vec(l[j] - mx);
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
                               const float* logits, const int32_t* targets, int64_t N, int64_t V,
                               float dloss_scale) {
  TETRA_CHECK(N >= 0 && V > 0, "cross_entropy: N ({}) must be >= 0 and V ({}) > 0", N, V);
  for (int64_t i = 0; i < N; ++i)
    TETRA_CHECK(targets[i] < V, "cross_entropy: target {} of row {} is >= V ({})", targets[i], i,
                V);
  const int nt = team_size(threads_);
  if (dlogits == nullptr || dlogits_type == DType::F32) {
    cross_entropy_impl(losses, static_cast<float*>(dlogits), logits, targets, N, V, dloss_scale,
                       nt);
  } else if (dlogits_type == DType::BF16) {
    TETRA_CHECK(dlogits != static_cast<const void*>(logits),
                "cross_entropy: a BF16 dlogits cannot alias the F32 logits");
    cross_entropy_impl(losses, static_cast<bf16*>(dlogits), logits, targets, N, V, dloss_scale,
                       nt);
  } else {
    throw Error(fmt::format("cross_entropy: dlogits type must be F32 or BF16, got {}",
                            dtype_name(dlogits_type)));
  }
}

}  // namespace tetra
