// Mixture-of-Experts ops on the CPU: the fp32 router (softmax, top-k, and their backward with the
// load-balancing and z-loss gradients), and the row movement around the expert GEMMs (gather of
// tokens into per-expert contiguous blocks, and the gate-weighted combine back, with its
// backward). The expert GEMMs themselves are ordinary gemm calls, one per expert over its block.
//
// Every loop is over rows, OpenMP-parallel with a static schedule; each output row is written by
// one thread with its sums in a fixed order, so results do not depend on the thread count.
// Rows are C-element vectors of the activation type; sums over k and dot products are fp32.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/common/math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

template <typename T>
void gather_rows_impl(T* dst, const T* src, const int32_t* rows, int64_t M, int64_t C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t p = 0; p < M; ++p)
    std::memcpy(dst + p * C, src + static_cast<int64_t>(rows[p]) * C, static_cast<size_t>(C) * sizeof(T));
}

template <typename T>
void combine_impl(T* out, const T* y, const int32_t* pos, const float* w, int64_t N, int64_t K,
                  int64_t C, bool accumulate, int nt) {
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> acc(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      T* o = out + i * C;
      for (int64_t c = 0; c < C; ++c) acc[c] = accumulate ? to_f32(o[c]) : 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t p = pos[i * K + k];
        if (p < 0) continue;
        const float g = w ? w[i * K + k] : 1.0f;
        const T* yr = y + static_cast<int64_t>(p) * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += g * to_f32(yr[c]);
      }
      for (int64_t c = 0; c < C; ++c) o[c] = from_f32<T>(acc[c]);
    }
  }
}

template <typename T>
void combine_backward_impl(T* dy, float* dw, const T* dout, const T* y, const int32_t* pos,
                           const float* w, int64_t N, int64_t K, int64_t C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* d = dout + i * C;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t p = pos[i * K + k];
      if (p < 0) {
        dw[i * K + k] = 0.0f;
        continue;
      }
      const float g = w[i * K + k];
      const T* yr = y + static_cast<int64_t>(p) * C;
      T* dyr = dy + static_cast<int64_t>(p) * C;
      float dot = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        const float dc = to_f32(d[c]);
        dot += dc * to_f32(yr[c]);
        dyr[c] = from_f32<T>(g * dc);
      }
      dw[i * K + k] = dot;
    }
  }
}

template <typename T>
void shared_gate_impl(T* out, float* gate, const float* logits, const T* y, int64_t N, int64_t C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float g = math::moe_shared_gate(logits[i]);
    gate[i] = g;
    T* o = out + i * C;
    const T* yr = y + i * C;
    for (int64_t c = 0; c < C; ++c) o[c] = from_f32<T>(to_f32(o[c]) + g * to_f32(yr[c]));
  }
}

template <typename T>
void shared_gate_backward_impl(T* dy, float* dlogits, const T* dout, const T* y, const float* gate, int64_t N,
                               int64_t C, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float g = gate[i];
    const T* d = dout + i * C;
    const T* yr = y + i * C;
    T* dyr = dy + i * C;
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float dc = to_f32(d[c]);
      dot += dc * to_f32(yr[c]);
      dyr[c] = from_f32<T>(g * dc);
    }
    dlogits[i] = math::moe_shared_gate_grad(g, dot);
  }
}

}  // namespace

void CpuBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                                    const float* logits, int64_t N, int64_t E, int64_t K, MoeScore score,
                                    const float* select_bias) {
  TETRA_CHECK(K >= 1 && K <= E, "moe_router_forward: top-k {} of {} experts", K, E);
  const bool sigmoid = score == MoeScore::SIGMOID;
  const int nt = team_size(threads_);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> s(static_cast<size_t>(E)), key(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* l = logits + i * E;
      float* p = probs + i * E;
      if (!sigmoid) {
        float mx = l[0];
        for (int64_t j = 1; j < E; ++j) mx = std::max(mx, l[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < E; ++j) sum += std::exp(l[j] - mx);
        lse[i] = mx + std::log(sum);
        for (int64_t j = 0; j < E; ++j) s[j] = p[j] = std::exp(l[j] - mx) / sum;
      } else {
        float sum = 0.0f;
        for (int64_t j = 0; j < E; ++j) s[j] = math::sigmoid(l[j]), sum += s[j];
        lse[i] = sum;
        for (int64_t j = 0; j < E; ++j) p[j] = s[j] / sum;
      }
      for (int64_t j = 0; j < E; ++j) key[j] = select_bias ? s[j] + select_bias[j] : s[j];
      // Selection by repeated arg-max (K is small): strictly greater wins, so ties go to the lower
      // index; an expert already taken is skipped.
      for (int64_t k = 0; k < K; ++k) {
        int64_t best = -1;
        for (int64_t j = 0; j < E; ++j) {
          bool taken = false;
          for (int64_t q = 0; q < k; ++q) taken = taken || topk_idx[i * K + q] == j;
          if (!taken && (best < 0 || key[j] > key[best])) best = j;
        }
        topk_idx[i * K + k] = static_cast<int32_t>(best);
        topk_prob[i * K + k] = s[best];
      }
    }
  }
}

void CpuBackend::moe_router_backward(float* dlogits, const float* probs, const float* lse,
                                     const int32_t* topk_idx, const float* dtopk_prob,
                                     const float* expert_grad, float z_scale, int64_t N, int64_t E,
                                     int64_t K, MoeScore score) {
  const bool sigmoid = score == MoeScore::SIGMOID;
  TETRA_CHECK(!sigmoid || z_scale == 0.0f, "moe_router_backward: a z-loss ({}) with sigmoid scores", z_scale);
  const int nt = team_size(threads_);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> dp(static_cast<size_t>(E)), ds(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* p = probs + i * E;
      for (int64_t j = 0; j < E; ++j) dp[j] = expert_grad ? expert_grad[j] : 0.0f, ds[j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) ds[topk_idx[i * K + k]] += dtopk_prob[i * K + k];
      if (!sigmoid) {
        float dot = 0.0f;
        for (int64_t j = 0; j < E; ++j) dot += p[j] * (dp[j] + ds[j]);
        const float z = 2.0f * z_scale * lse[i];
        for (int64_t j = 0; j < E; ++j) dlogits[i * E + j] = p[j] * (dp[j] + ds[j] - dot) + z * p[j];
      } else {
        const float S = lse[i];
        float dot = 0.0f;
        for (int64_t j = 0; j < E; ++j) dot += p[j] * dp[j];
        for (int64_t j = 0; j < E; ++j) {
          const float sj = p[j] * S;
          dlogits[i * E + j] = (ds[j] + (dp[j] - dot) / S) * sj * (1.0f - sj);
        }
      }
    }
  }
}

void CpuBackend::moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                                   float scale) {
  const int nt = team_size(threads_);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) math::moe_gates_row(gates + i * K, topk_prob + i * K, K, normalize, scale);
}

void CpuBackend::moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N,
                                    int64_t K, bool normalize, float scale) {
  const int nt = team_size(threads_);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i)
    math::moe_gates_row_backward(dtopk_prob + i * K, dgates + i * K, topk_prob + i * K, K, normalize, scale);
}

void CpuBackend::moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N,
                                         int64_t C, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "moe_shared_gate_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    shared_gate_impl<T>(static_cast<T*>(out), gate, logits, static_cast<const T*>(y), N, C, nt);
  });
}

void CpuBackend::moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y,
                                          const float* gate, int64_t N, int64_t C, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "moe_shared_gate_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    shared_gate_backward_impl<T>(static_cast<T*>(dy), dlogits, static_cast<const T*>(dout),
                                 static_cast<const T*>(y), gate, N, C, nt);
  });
}

void CpuBackend::moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t C,
                                 DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "moe_gather_rows", "activation type", [&](auto tag) {
    using T = decltype(tag);
    gather_rows_impl<T>(static_cast<T*>(dst), static_cast<const T*>(src), rows, M, C, nt);
  });
}

void CpuBackend::moe_combine(void* out, const void* y, const int32_t* pos, const float* weights, int64_t N,
                             int64_t K, int64_t C, bool accumulate, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "moe_combine", "activation type", [&](auto tag) {
    using T = decltype(tag);
    combine_impl<T>(static_cast<T*>(out), static_cast<const T*>(y), pos, weights, N, K, C, accumulate, nt);
  });
}

void CpuBackend::moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y,
                                      const int32_t* pos, const float* weights, int64_t N, int64_t K,
                                      int64_t C, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "moe_combine_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    combine_backward_impl<T>(static_cast<T*>(dy), dweights, static_cast<const T*>(dout),
                             static_cast<const T*>(y), pos, weights, N, K, C, nt);
  });
}

}  // namespace tetra
