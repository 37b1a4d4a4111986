// Token (and learned position) embeddings on the CPU: the gather in forward, the scatter-add of
// gradients in backward.
//
// Forward is a row gather, parallel over the B*T tokens. Backward must add every token's gradient
// row into the row of its token id, and several tokens may share an id. Instead of atomics (whose
// order, and so whose rounding, depends on scheduling) backward splits the C columns between the
// threads: each thread walks all tokens in order and touches only its own columns, so every
// element's sum runs in token order and the result is bitwise the same for any thread count.
#include <omp.h>

#include <algorithm>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "trainer/core/check.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

// out (B, T, C) = wte[tokens] (+ wpe[t]); wte (V, C), wpe (T, C).
template <typename T, typename W>
void embedding_forward_impl(T* out, const int32_t* tokens, const W* wte, const W* wpe, int64_t B,
                            int64_t T_len, int64_t C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t bt = 0; bt < B * T_len; ++bt) {
    const W* e = wte + static_cast<int64_t>(tokens[bt]) * C;
    T* o = out + bt * C;
    if (wpe) {
      const W* p = wpe + (bt % T_len) * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(to_f32(e[j]) + to_f32(p[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(to_f32(e[j]));
    }
  }
}

// dwte[tokens[b,t], :] += dout[b,t,:]; dwpe[t, :] += sum_b dout[b,t,:] (b in order).
template <typename T>
void embedding_backward_impl(float* dwte, float* dwpe, const T* dout, const int32_t* tokens,
                             int64_t B, int64_t T_len, int64_t C, int nt) {
  // Column ranges of 16 floats (a 64-byte line) or more, so no two threads share a cache line.
  const int64_t per_thread = (C + nt - 1) / nt;
  const int64_t width = std::max<int64_t>(16, (per_thread + 15) / 16 * 16);
#pragma omp parallel num_threads(nt)
  {
    const int64_t j0 = std::min(C, omp_get_thread_num() * width);
    const int64_t j1 = std::min(C, j0 + width);
    for (int64_t bt = 0; bt < B * T_len && j0 < j1; ++bt) {
      float* d = dwte + static_cast<int64_t>(tokens[bt]) * C;
      const T* g = dout + bt * C;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) d[j] += to_f32(g[j]);
    }
  }
  if (!dwpe) return;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < T_len; ++t) {
    float* d = dwpe + t * C;
    for (int64_t b = 0; b < B; ++b) {
      const T* g = dout + (b * T_len + t) * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) d[j] += to_f32(g[j]);
    }
  }
}

}  // namespace

void CpuBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                   const void* wpe, int64_t B, int64_t T, int64_t C, DType act,
                                   DType w) {
  TETRA_CHECK(B >= 0 && T >= 0 && C > 0, "embedding_forward: bad shape B={} T={} C={}", B, T, C);
  const int nt = team_size(threads_);
  with_float_type(act, "embedding", "activation type", [&](auto a) {
    using TA = decltype(a);
    with_float_type(w, "embedding", "weight type", [&](auto b) {
      using TW = decltype(b);
      embedding_forward_impl<TA, TW>(static_cast<TA*>(out), tokens, static_cast<const TW*>(wte),
                                     static_cast<const TW*>(wpe), B, T, C, nt);
    });
  });
}

void CpuBackend::embedding_backward(float* dwte, float* dwpe, const void* dout,
                                    const int32_t* tokens, int64_t B, int64_t T, int64_t C,
                                    DType act) {
  TETRA_CHECK(B >= 0 && T >= 0 && C > 0, "embedding_backward: bad shape B={} T={} C={}", B, T, C);
  const int nt = team_size(threads_);
  with_float_type(act, "embedding", "activation type", [&](auto a) {
    using TA = decltype(a);
    embedding_backward_impl<TA>(dwte, dwpe, static_cast<const TA*>(dout), tokens, B, T, C, nt);
  });
}

}  // namespace tetra
