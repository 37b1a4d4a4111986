// Optimizer kernels on the CPU: the AdamW step over a flat fp32 parameter range, and the two
// reductions the optimizer needs (sum of squares for the global gradient norm, plain sum).
//
// The reductions must give the same bits on every run whatever the thread count: the range is cut
// into chunks whose size depends on n only, each chunk is summed in double, and the chunks'
// partial sums are added in chunk order by one thread. AdamW is element-wise through
// math::adamw_update (the same function the CUDA kernel calls); the optional compute copy is the
// updated parameter rounded to the compute type (bf16 or fp16 weights for the next forward).
#include <omp.h>

#include <algorithm>

#include "kernels/common/math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra {
namespace {

using cpu::team_size;

// sum_i f(x[i]) in double, deterministic: at most kMaxChunks chunks of >= kMinChunk elements.
template <bool kSquare>
double chunked_sum(const float* x, int64_t n, int nt) {
  constexpr int64_t kMinChunk = 8192, kMaxChunks = 256;
  const int64_t chunk = std::max(kMinChunk, math::ceil_div(n, kMaxChunks));
  const int64_t chunks = math::ceil_div(n, chunk);
  double partial[kMaxChunks];
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * chunk, end = std::min(n, (c + 1) * chunk);
    // kLanes independent accumulators (several vector registers), so the adds are not one
    // latency-bound chain; they are combined in a fixed order.
    constexpr int64_t kLanes = 32;
    double acc[kLanes] = {};
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
#pragma omp simd
      for (int64_t k = 0; k < kLanes; ++k) {
        double v = x[i + k];
        acc[k] += kSquare ? v * v : v;
      }
    }
    for (int64_t k = 0; i < end; ++i, ++k) {
      double v = x[i];
      acc[k] += kSquare ? v * v : v;
    }
    double s = 0.0;
    for (int64_t k = 0; k < kLanes; ++k) s += acc[k];
    partial[c] = s;
  }
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

template <typename T>
void adamw_impl(float* params, float* grads, float* m, float* v, int64_t n,
                const math::AdamParams& hp, T* compute_copy, int nt) {
  const math::AdamParams a = hp;
  if (compute_copy) {
#pragma omp parallel for simd num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      compute_copy[i] = from_f32<T>(math::adamw_update(params[i], m[i], v[i], grads[i], a));
      grads[i] = 0.0f;
    }
  } else {
#pragma omp parallel for simd num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      math::adamw_update(params[i], m[i], v[i], grads[i], a);
      grads[i] = 0.0f;
    }
  }
}

}  // namespace

void CpuBackend::sum_squares(float* out, const float* x, int64_t n) {
  TETRA_CHECK(n >= 0, "sum_squares: n ({}) must be >= 0", n);
  out[0] = static_cast<float>(chunked_sum<true>(x, n, team_size(threads_)));
}

void CpuBackend::sum(float* out, const float* x, int64_t n) {
  TETRA_CHECK(n >= 0, "sum: n ({}) must be >= 0", n);
  out[0] = static_cast<float>(chunked_sum<false>(x, n, team_size(threads_)));
}

void CpuBackend::adamw(float* params, float* grads, float* m, float* v, int64_t n,
                       const math::AdamParams& hp, void* compute_copy, DType compute_type) {
  TETRA_CHECK(n >= 0, "adamw: n ({}) must be >= 0", n);
  const int nt = team_size(threads_);
  if (compute_copy == nullptr) {
    adamw_impl<float>(params, grads, m, v, n, hp, nullptr, nt);
  } else {
    cpu::with_float_type(compute_type, "adamw", "compute_type", [&](auto tag) {
      using TC = decltype(tag);
      adamw_impl(params, grads, m, v, n, hp, static_cast<TC*>(compute_copy), nt);
    });
  }
}

}  // namespace tetra
