// Token (and learned position) embeddings on the CPU: the gather in forward, the scatter-add of
// gradients in backward, for the whole vocabulary or for one tensor-parallel slice of it.
//
// A slice holds the wte rows [v0, v0 + Vl). A token outside it gives a zero row in forward (the TP
// ranks' outputs are summed, so exactly one rank supplies each token's row) and no gradient in
// backward. The whole vocabulary is the slice v0 = 0, Vl = V.
//
// Forward is a row gather, parallel over the B*T tokens. Backward must add every token's gradient
// row into the row of its token id, and several tokens may share an id. Instead of atomics (whose
// order, and so whose rounding, depends on scheduling) backward splits the C columns between the
// threads: each thread walks all tokens in order and touches only its own columns, so every
// element's sum runs in token order and the result is bitwise the same for any thread count (and
// a slice's rows are bitwise those of the whole-vocabulary result: the same terms in the same
// order).
#include <omp.h>

#include <algorithm>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

// The row of token id `token` in a slice [v0, v0 + Vl), or -1 if the slice does not hold it.
inline int64_t slice_row(int32_t token, int64_t v0, int64_t Vl) {
  const int64_t r = static_cast<int64_t>(token) - v0;
  return r >= 0 && r < Vl ? r : -1;
}

// out (B, T, C) = wte[tokens - v0] (zero row outside the slice) (+ wpe[p(t)]); wte (Vl, C),
// wpe (max p(t) + 1, C), p(t) = positions ? positions[t] : t.
template <typename T, typename W>
void embedding_forward_impl(T* out, const int32_t* tokens, const W* wte, const W* wpe, int64_t B,
                            int64_t T_len, int64_t C, int64_t v0, int64_t Vl, int nt, const int32_t* positions) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t bt = 0; bt < B * T_len; ++bt) {
    const int64_t r = slice_row(tokens[bt], v0, Vl);
    T* o = out + bt * C;
    const int64_t t = bt % T_len;
    const W* p = wpe ? wpe + (positions ? positions[t] : t) * C : nullptr;
    if (r >= 0) {
      const W* e = wte + r * C;
      if (p) {
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(to_f32(e[j]) + to_f32(p[j]));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(to_f32(e[j]));
      }
    } else if (p) {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(to_f32(p[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) o[j] = from_f32<T>(0.0f);
    }
  }
}

// dwte[tokens - v0, :] += dout[b,t,:] for tokens in the slice (if dwte);
// dwpe[p(t), :] += sum_b dout[b,t,:] (b in order, if dwpe).
template <typename T>
void embedding_backward_impl(float* dwte, float* dwpe, const T* dout, const int32_t* tokens,
                             int64_t B, int64_t T_len, int64_t C, int64_t v0, int64_t Vl, int nt,
                             const int32_t* positions) {
  if (dwte) {
    // Column ranges of 16 floats (a 64-byte line) or more, so no two threads share a cache line.
    const int64_t per_thread = math::ceil_div(C, nt);
    const int64_t width = std::max<int64_t>(16, math::round_up(per_thread, 16));
#pragma omp parallel num_threads(nt)
    {
      const int64_t j0 = std::min(C, omp_get_thread_num() * width);
      const int64_t j1 = std::min(C, j0 + width);
      for (int64_t bt = 0; bt < B * T_len && j0 < j1; ++bt) {
        const int64_t r = slice_row(tokens[bt], v0, Vl);
        if (r < 0) continue;
        float* d = dwte + r * C;
        const T* g = dout + bt * C;
#pragma omp simd
        for (int64_t j = j0; j < j1; ++j) d[j] += to_f32(g[j]);
      }
    }
  }
  if (!dwpe) return;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < T_len; ++t) {
    float* d = dwpe + (positions ? positions[t] : t) * C;
    for (int64_t b = 0; b < B; ++b) {
      const T* g = dout + (b * T_len + t) * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) d[j] += to_f32(g[j]);
    }
  }
}

}  // namespace

void CpuBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                   const void* wpe, int64_t B, int64_t T, int64_t C, int64_t v0,
                                   int64_t Vl, DType act, DType w, const int32_t* positions) {
  TETRA_CHECK(B >= 0 && T >= 0 && C > 0, "embedding_forward: bad shape B={} T={} C={}", B, T, C);
  TETRA_CHECK(v0 >= 0 && Vl > 0, "embedding_forward: bad vocabulary slice v0={} Vl={}", v0, Vl);
  const int nt = team_size(threads_);
  with_float_type(act, "embedding", "activation type", [&](auto a) {
    using TA = decltype(a);
    with_float_type(w, "embedding", "weight type", [&](auto b) {
      using TW = decltype(b);
      embedding_forward_impl<TA, TW>(static_cast<TA*>(out), tokens, static_cast<const TW*>(wte),
                                     static_cast<const TW*>(wpe), B, T, C, v0, Vl, nt, positions);
    });
  });
}

void CpuBackend::embedding_backward(float* dwte, float* dwpe, const void* dout,
                                    const int32_t* tokens, int64_t B, int64_t T, int64_t C,
                                    int64_t v0, int64_t Vl, DType act, const int32_t* positions) {
  TETRA_CHECK(B >= 0 && T >= 0 && C > 0, "embedding_backward: bad shape B={} T={} C={}", B, T, C);
  TETRA_CHECK(v0 >= 0 && Vl > 0, "embedding_backward: bad vocabulary slice v0={} Vl={}", v0, Vl);
  const int nt = team_size(threads_);
  with_float_type(act, "embedding", "activation type", [&](auto a) {
    using TA = decltype(a);
    embedding_backward_impl<TA>(dwte, dwpe, static_cast<const TA*>(dout), tokens, B, T, C, v0, Vl,
                                nt, positions);
  });
}

}  // namespace tetra
