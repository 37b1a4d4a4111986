// LayerNorm and RMSNorm, forward and backward, on the CPU.
//
// Both norms share one code path: RMSNorm is LayerNorm with the mean fixed at 0 (and no mean
// saved). Activations are stored as float, bf16 or fp16 (template T), weights as float or 16-bit
// (template W); every reduction and every intermediate is fp32.
//
// Forward and the dx part of backward are row-parallel: each row (C elements) is independent.
// dweight/dbias are column sums over all N rows, so backward splits the rows into blocks whose
// number depends only on N (never on the thread count), accumulates one partial sum per block while
// it walks the rows for dx, and finally adds the blocks' partials into dweight/dbias in block
// order. The result is bitwise the same for any number of threads and any scheduling.
//
// As a generalisation of the contract's RMSNorm formula, a non-null bias is added (and its
// gradient accumulated) for RMSNORM as well; with bias == nullptr it is exactly x * rstd * weight.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

// x, out (N, C); weight, bias (C); mean (N) written if non-null; rstd (N).
template <typename T, typename W>
void norm_forward_impl(bool subtract_mean, T* out, float* mean, float* rstd, const T* x,
                       const W* weight, const W* bias, int64_t N, int64_t C, float eps, int nt) {
  const float inv_c = 1.0f / static_cast<float>(C);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* xr = x + i * C;
    T* yr = out + i * C;
    float m = 0.0f;
    if (subtract_mean) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < C; ++j) s += to_f32(xr[j]);
      m = s * inv_c;
    }
    // Second pass over the (cached) row: a centred variance, not E[x^2] - E[x]^2.
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < C; ++j) {
      float d = to_f32(xr[j]) - m;
      ss += d * d;
    }
    const float r = 1.0f / std::sqrt(ss * inv_c + eps);
    if (mean) mean[i] = m;
    rstd[i] = r;
    if (bias) {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j)
        yr[j] = from_f32<T>((to_f32(xr[j]) - m) * r * to_f32(weight[j]) + to_f32(bias[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j)
        yr[j] = from_f32<T>((to_f32(xr[j]) - m) * r * to_f32(weight[j]));
    }
  }
}

// Row blocks for the dweight/dbias partial sums: at least 16 rows each (so a block's partial
// amortises its reduction), at most 64 blocks (so the partials stay small). Depends on N only.
struct RowBlocks {
  int64_t rows_per_block;
  int64_t count;
};

RowBlocks row_blocks(int64_t N) {
  constexpr int64_t kMinRows = 16, kMaxBlocks = 64;
  int64_t rows = std::max(kMinRows, math::ceil_div(N, kMaxBlocks));
  return {rows, math::ceil_div(N, rows)};
}

// The blocks' partial sums of dweight and dbias, kept by the backend (CpuScratch::shared).
struct Partials {
  std::vector<float> sums;
};

// dx (N, C) accumulates; dweight, dbias (C) F32 accumulate (either may be null).
//   xhat = (x - mean) * rstd,  dn = dout * weight
//   dx  += rstd * (dn - mean_j(dn) - xhat * mean_j(dn * xhat))     (LayerNorm)
//   dx  += rstd * (dn - xhat * mean_j(dn * xhat))                  (RMSNorm)
//   dweight += sum_i dout * xhat,  dbias += sum_i dout
template <typename T, typename W>
void norm_backward_impl(bool subtract_mean, T* dx, float* dweight, float* dbias, const T* dout,
                        const T* x, const W* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C, int nt, Partials& scratch) {
  const float inv_c = 1.0f / static_cast<float>(C);
  const RowBlocks blocks = row_blocks(N);
  const bool param_grads = dweight != nullptr || dbias != nullptr;
  // Partials: for block b, pw = part[(2b) C ...], pb = part[(2b+1) C ...]. Reused across calls
  // (grows to the largest N, C seen), so the step loop does not allocate.
  std::vector<float>& partials = scratch.sums;
  if (param_grads) partials.resize(static_cast<size_t>(blocks.count * 2 * C));
  float* part = partials.data();

#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t blk = 0; blk < blocks.count; ++blk) {
    float* pw = part + (2 * blk) * C;
    float* pb = part + (2 * blk + 1) * C;
    if (param_grads) std::fill(pw, pw + 2 * C, 0.0f);
    const int64_t row_end = std::min(N, (blk + 1) * blocks.rows_per_block);
    for (int64_t i = blk * blocks.rows_per_block; i < row_end; ++i) {
      const T* xr = x + i * C;
      const T* gr = dout + i * C;
      T* dxr = dx + i * C;
      const float m = subtract_mean ? mean[i] : 0.0f;
      const float r = rstd[i];
      float sum_dn = 0.0f, sum_dn_xhat = 0.0f;
#pragma omp simd reduction(+ : sum_dn, sum_dn_xhat)
      for (int64_t j = 0; j < C; ++j) {
        float xhat = (to_f32(xr[j]) - m) * r;
        float dn = to_f32(gr[j]) * to_f32(weight[j]);
        sum_dn += dn;
        sum_dn_xhat += dn * xhat;
      }
      const float mean_dn = subtract_mean ? sum_dn * inv_c : 0.0f;
      const float mean_dn_xhat = sum_dn_xhat * inv_c;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) {
        float xhat = (to_f32(xr[j]) - m) * r;
        float g = to_f32(gr[j]);
        float dn = g * to_f32(weight[j]);
        dxr[j] = from_f32<T>(to_f32(dxr[j]) + r * (dn - mean_dn - xhat * mean_dn_xhat));
      }
      if (param_grads) {
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) {
          float g = to_f32(gr[j]);
          pw[j] += g * (to_f32(xr[j]) - m) * r;
          pb[j] += g;
        }
      }
    }
  }
  if (!param_grads) return;

  // Fixed-order reduction of the blocks' partials, parallel over columns.
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t j = 0; j < C; ++j) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t blk = 0; blk < blocks.count; ++blk) {
      sw += part[(2 * blk) * C + j];
      sb += part[(2 * blk + 1) * C + j];
    }
    if (dweight) dweight[j] += sw;
    if (dbias) dbias[j] += sb;
  }
}

}  // namespace

void CpuBackend::norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x,
                              const void* weight, const void* bias, int64_t N, int64_t C,
                              float eps, DType act, DType w) {
  TETRA_CHECK(N >= 0 && C > 0, "norm_forward: N ({}) must be >= 0 and C ({}) > 0", N, C);
  TETRA_CHECK(rstd != nullptr && weight != nullptr, "norm_forward: rstd and weight are required");
  const bool layernorm = kind == NormKind::LAYERNORM;
  TETRA_CHECK(!layernorm || mean != nullptr, "norm_forward: LAYERNORM needs a mean buffer");
  const int nt = team_size(threads_);
  with_float_type(act, "norm", "activation type", [&](auto a) {
    using T = decltype(a);
    with_float_type(w, "norm", "weight type", [&](auto b) {
      using W = decltype(b);
      norm_forward_impl<T, W>(layernorm, static_cast<T*>(out), layernorm ? mean : nullptr, rstd,
                              static_cast<const T*>(x), static_cast<const W*>(weight),
                              static_cast<const W*>(bias), N, C, eps, nt);
    });
  });
}

void CpuBackend::norm_backward(NormKind kind, void* dx, float* dweight, float* dbias,
                               const void* dout, const void* x, const void* weight,
                               const float* mean, const float* rstd, int64_t N, int64_t C,
                               DType act, DType w) {
  TETRA_CHECK(N >= 0 && C > 0, "norm_backward: N ({}) must be >= 0 and C ({}) > 0", N, C);
  TETRA_CHECK(rstd != nullptr && weight != nullptr, "norm_backward: rstd and weight are required");
  const bool layernorm = kind == NormKind::LAYERNORM;
  TETRA_CHECK(!layernorm || mean != nullptr, "norm_backward: LAYERNORM needs the saved mean");
  const int nt = team_size(threads_);
  with_float_type(act, "norm", "activation type", [&](auto a) {
    using T = decltype(a);
    with_float_type(w, "norm", "weight type", [&](auto b) {
      using W = decltype(b);
      norm_backward_impl<T, W>(layernorm, static_cast<T*>(dx), dweight, dbias,
                               static_cast<const T*>(dout), static_cast<const T*>(x),
                               static_cast<const W*>(weight), mean, rstd, N, C, nt,
                               scratch_.shared<Partials>());
    });
  });
}

}  // namespace tetra
