// LayerNorm and RMSNorm on the GPU, forward and backward (contracts in kernels/backend.h, the
// numerical reference in kernels/cpu/norm.cpp, whose formulas and expression order these kernels
// follow). RMSNorm is LayerNorm with the mean fixed at 0 and none saved; as on the CPU, a non-null
// bias is added (and its gradient accumulated) for RMSNORM too. Activations T and weights W are
// F32, BF16 or F16; every statistic and intermediate is fp32.
//
// Forward: one warp per row (rows of a GPT are C = 768..8192 wide: 3..32 16-byte chunks per
// lane), mean then centred variance by warp shuffles, no shared memory and no block barrier. The
// row is read three times by the same warp (sum, centred squares, output); the second and third
// reads hit L1, so DRAM sees one read of x and one write of out.
//
// Backward, dx += rstd (dn - mean(dn) - xhat mean(dn xhat)) with dn = dout * weight, and the
// parameter gradients dweight += sum_i dout xhat, dbias += sum_i dout over all N rows. Those
// column sums must not depend on scheduling (no float atomics), so:
//   kernel 1: the rows are cut into blocks of consecutive rows, a partition that depends on N and
//     C only. A thread block takes its rows in tiles of kTileRows: first one warp per row computes
//     the row's two means (warp shuffles, into shared memory), then each thread owns K columns and
//     walks the tile's rows in order, adding to dx and accumulating its columns' dweight/dbias
//     terms in registers; at the end of each tile the running partial goes to the block's row of
//     the partial-sum area (fused_state.cuh). Each partial element is written by one thread only.
//   kernel 2: for each column, the blocks' partials are summed in a fixed tree (strided partial
//     sums, then a fixed-order sum over 32 of them) and added to dweight/dbias.
// The result is bitwise reproducible run after run. Registers and shared memory stay bounded for
// any C (the tile's row means are 2 kTileRows floats; each thread keeps 2 K column sums).
#include <algorithm>
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/fused_state.cuh"
#include "kernels/cuda/vec.cuh"

namespace tetra {
namespace {

using cuda::kVec;

constexpr int kForwardThreads = 256;  // 8 rows per block
constexpr int kBackwardMaxThreads = 512;
constexpr int kTileRows = 32;
constexpr int64_t kMinRowsPerBlock = 16;
constexpr int64_t kMaxBlocks = 1024;
constexpr int kReduceRows = 32;  // kernel 2: blockDim (32 columns, kReduceRows)

// x, out (N, C) of T; weight, bias (C) of W (bias may be null); mean (N) written if non-null;
// rstd (N). Chunks of K elements: K = 1, or kVec<T> when C % K == 0 and the pointers are 16-byte
// aligned.
template <typename T, typename W, int K>
__global__ void __launch_bounds__(kForwardThreads)
    norm_forward_kernel(T* out, float* mean, float* rstd, const T* x, const W* weight,
                        const W* bias, int64_t N, int64_t C, float eps, bool subtract_mean) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp: no barrier follows
  const T* xr = x + row * C;
  T* yr = out + row * C;
  const int64_t chunks = C / K;
  const float inv_c = 1.0f / static_cast<float>(C);

  float m = 0.0f;
  if (subtract_mean) {
    float s = 0.0f;
    for (int64_t c = lane; c < chunks; c += 32) {
      float v[K];
      cuda::load_floats<K>(xr + c * K, v);
#pragma unroll
      for (int k = 0; k < K; ++k) s += v[k];
    }
    m = cuda::warp_sum(s) * inv_c;
  }
  // A centred variance, not E[x^2] - E[x]^2 (as on the CPU).
  float ss = 0.0f;
  for (int64_t c = lane; c < chunks; c += 32) {
    float v[K];
    cuda::load_floats<K>(xr + c * K, v);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float d = v[k] - m;
      ss += d * d;
    }
  }
  const float r = 1.0f / sqrtf(cuda::warp_sum(ss) * inv_c + eps);
  if (lane == 0) {
    if (mean) mean[row] = m;
    rstd[row] = r;
  }
  for (int64_t c = lane; c < chunks; c += 32) {
    float v[K], w[K], y[K];
    cuda::load_floats<K>(xr + c * K, v);
    cuda::load_floats<K>(weight + c * K, w);
    if (bias) {
      float b[K];
      cuda::load_floats<K>(bias + c * K, b);
#pragma unroll
      for (int k = 0; k < K; ++k) y[k] = (v[k] - m) * r * w[k] + b[k];
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) y[k] = (v[k] - m) * r * w[k];
    }
    cuda::store_floats<K>(yr + c * K, y);
  }
}

// Kernel 1 of backward (see the file comment). dx, dout, x (N, C) of T; weight (C) of W; mean
// (N) (read only if subtract_mean), rstd (N). Block b owns rows [b rows_per_block, (b + 1)
// rows_per_block) and, if param_grads, writes partials[b 2C, +C) (dweight terms) and
// partials[b 2C + C, +C) (dbias terms).
template <typename T, typename W, int K>
__global__ void __launch_bounds__(kBackwardMaxThreads)
    norm_backward_kernel(T* dx, float* partials, const T* dout, const T* x, const W* weight,
                         const float* mean, const float* rstd, int64_t N, int64_t C,
                         int64_t rows_per_block, bool subtract_mean, bool param_grads) {
  __shared__ float s_mean_dn[kTileRows], s_mean_dn_xhat[kTileRows];
  __shared__ float s_mean[kTileRows], s_rstd[kTileRows];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t chunks = C / K;
  const float inv_c = 1.0f / static_cast<float>(C);
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t row_end = min(N, row_begin + rows_per_block);
  float* pw = param_grads ? partials + static_cast<int64_t>(blockIdx.x) * 2 * C : nullptr;
  float* pb = param_grads ? pw + C : nullptr;

  for (int64_t tile = row_begin; tile < row_end; tile += kTileRows) {  // uniform over the block
    const int tile_rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), row_end - tile));
    // Phase 1: the row means of dn and dn * xhat, one warp per row.
    for (int r = warp; r < tile_rows; r += warps) {
      const int64_t i = tile + r;
      const T* xr = x + i * C;
      const T* gr = dout + i * C;
      const float m = subtract_mean ? mean[i] : 0.0f;
      const float rs = rstd[i];
      float sum_dn = 0.0f, sum_dn_xhat = 0.0f;
      for (int64_t c = lane; c < chunks; c += 32) {
        float xv[K], gv[K], wv[K];
        cuda::load_floats<K>(xr + c * K, xv);
        cuda::load_floats<K>(gr + c * K, gv);
        cuda::load_floats<K>(weight + c * K, wv);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const float xhat = (xv[k] - m) * rs;
          const float dn = gv[k] * wv[k];
          sum_dn += dn;
          sum_dn_xhat += dn * xhat;
        }
      }
      sum_dn = cuda::warp_sum(sum_dn);
      sum_dn_xhat = cuda::warp_sum(sum_dn_xhat);
      if (lane == 0) {
        s_mean_dn[r] = subtract_mean ? sum_dn * inv_c : 0.0f;
        s_mean_dn_xhat[r] = sum_dn_xhat * inv_c;
        s_mean[r] = m;
        s_rstd[r] = rs;
      }
    }
    __syncthreads();
    // Phase 2: K columns per thread, the tile's rows in order.
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const int64_t j = c * K;
      float wv[K], aw[K], ab[K];
      cuda::load_floats<K>(weight + j, wv);
      if (param_grads && tile != row_begin) {
        cuda::load_floats<K>(pw + j, aw);
        cuda::load_floats<K>(pb + j, ab);
      } else {
#pragma unroll
        for (int k = 0; k < K; ++k) aw[k] = ab[k] = 0.0f;
      }
#pragma unroll 4
      for (int r = 0; r < tile_rows; ++r) {
        const int64_t o = (tile + r) * C + j;
        const float m = s_mean[r], rs = s_rstd[r];
        const float mean_dn = s_mean_dn[r], mean_dn_xhat = s_mean_dn_xhat[r];
        float xv[K], gv[K], dv[K];
        cuda::load_floats<K>(x + o, xv);
        cuda::load_floats<K>(dout + o, gv);
        cuda::load_floats<K>(dx + o, dv);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const float xhat = (xv[k] - m) * rs;
          const float dn = gv[k] * wv[k];
          dv[k] = dv[k] + rs * (dn - mean_dn - xhat * mean_dn_xhat);
          aw[k] += gv[k] * (xv[k] - m) * rs;
          ab[k] += gv[k];
        }
        cuda::store_floats<K>(dx + o, dv);
      }
      if (param_grads) {
        cuda::store_floats<K>(pw + j, aw);
        cuda::store_floats<K>(pb + j, ab);
      }
    }
    __syncthreads();  // the next tile's phase 1 overwrites the shared row values
  }
}

// Kernel 2: dweight[j] += sum_b partials[b 2C + j], dbias[j] += sum_b partials[b 2C + C + j] over
// `blocks` partials, in a fixed order: thread (tx, ty) sums b = ty, ty + kReduceRows, ... for
// column 32 blockIdx.x + tx, then row ty = 0 adds the kReduceRows sums in order.
__global__ void __launch_bounds__(32 * kReduceRows)
    norm_param_grads_kernel(float* dweight, float* dbias, const float* partials, int64_t blocks,
                            int64_t C) {
  __shared__ float s_w[kReduceRows][33], s_b[kReduceRows][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + tx;
  float aw = 0.0f, ab = 0.0f;
  if (j < C) {
    for (int64_t b = ty; b < blocks; b += kReduceRows) {
      aw += partials[b * 2 * C + j];
      ab += partials[b * 2 * C + C + j];
    }
  }
  s_w[ty][tx] = aw;
  s_b[ty][tx] = ab;
  __syncthreads();
  if (ty == 0 && j < C) {
    float sw = 0.0f, sb = 0.0f;
    for (int y = 0; y < kReduceRows; ++y) {
      sw += s_w[y][tx];
      sb += s_b[y][tx];
    }
    if (dweight) dweight[j] += sw;
    if (dbias) dbias[j] += sb;
  }
}

// True when every row's chunks of kVec<T> elements can be moved as 16-byte accesses (C a multiple
// of the width, base pointers aligned; weights of another width move as 8- or 32-byte accesses,
// aligned by the same argument).
template <typename T>
bool rows_vectorisable(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (p && !cuda::aligned16(p)) return false;
  return true;
}

// The row partition of backward: at least kMinRowsPerBlock rows per block, at most kMaxBlocks
// blocks, and the partials (2 C floats per block) within the partial-sum area. Depends on N and C
// only, so the summation order, and so the result, is the same on every run and every GPU.
struct RowBlocks {
  int64_t rows_per_block;
  int64_t count;
};
RowBlocks backward_blocks(int64_t N, int64_t C) {
  const int64_t fit = cuda::kNormPartialFloats / (2 * C);
  TETRA_CHECK(fit >= 1, "norm_backward: C ({}) is too large for the partial-sum area ({} floats)",
              C, cuda::kNormPartialFloats);
  const int64_t max_blocks = std::min(kMaxBlocks, fit);
  const int64_t rows = std::max(kMinRowsPerBlock, (N + max_blocks - 1) / max_blocks);
  return {rows, (N + rows - 1) / rows};
}

void check_shape(const char* op, int64_t N, int64_t C, const void* rstd, const void* weight,
                 bool layernorm, const void* mean) {
  TETRA_CHECK(N >= 0 && C > 0, "{}: N ({}) must be >= 0 and C ({}) > 0", op, N, C);
  TETRA_CHECK(rstd != nullptr && weight != nullptr, "{}: rstd and weight are required", op);
  TETRA_CHECK(!layernorm || mean != nullptr, "{}: LAYERNORM needs a mean buffer", op);
}

}  // namespace

void CudaBackend::norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x,
                               const void* weight, const void* bias, int64_t N, int64_t C,
                               float eps, DType act, DType w) {
  const bool layernorm = kind == NormKind::LAYERNORM;
  check_shape("norm_forward", N, C, rstd, weight, layernorm, mean);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  cuda::with_float_type(act, "norm_forward", "activation type", [&](auto a) {
    using T = decltype(a);
    cuda::with_float_type(w, "norm_forward", "weight type", [&](auto b) {
      using W = decltype(b);
      const unsigned blocks =
          static_cast<unsigned>((N + kForwardThreads / 32 - 1) / (kForwardThreads / 32));
      auto launch = [&](auto kernel) {
        kernel<<<blocks, kForwardThreads, 0, stream>>>(
            static_cast<T*>(out), layernorm ? mean : nullptr, rstd, static_cast<const T*>(x),
            static_cast<const W*>(weight), static_cast<const W*>(bias), N, C, eps, layernorm);
      };
      if (rows_vectorisable<T>(C, {out, x, weight, bias}))
        launch(norm_forward_kernel<T, W, kVec<T>>);
      else
        launch(norm_forward_kernel<T, W, 1>);
      TETRA_CUDA_LAUNCHED();
    });
  });
}

void CudaBackend::norm_backward(NormKind kind, void* dx, float* dweight, float* dbias,
                                const void* dout, const void* x, const void* weight,
                                const float* mean, const float* rstd, int64_t N, int64_t C,
                                DType act, DType w) {
  const bool layernorm = kind == NormKind::LAYERNORM;
  check_shape("norm_backward", N, C, rstd, weight, layernorm, mean);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  const bool param_grads = dweight != nullptr || dbias != nullptr;
  const RowBlocks rb = backward_blocks(N, C);
  float* partials = param_grads ? cuda::norm_partials(*this) : nullptr;
  cuda::with_float_type(act, "norm_backward", "activation type", [&](auto a) {
    using T = decltype(a);
    cuda::with_float_type(w, "norm_backward", "weight type", [&](auto b) {
      using W = decltype(b);
      const bool vector = rows_vectorisable<T>(C, {dx, dout, x, weight});
      const int64_t chunks = vector ? C / kVec<T> : C;
      // One thread per chunk of a row up to kBackwardMaxThreads (at least 2 warps for phase 1).
      const int threads =
          static_cast<int>(std::clamp<int64_t>((chunks + 31) / 32 * 32, 64, kBackwardMaxThreads));
      auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(rb.count), threads, 0, stream>>>(
            static_cast<T*>(dx), partials, static_cast<const T*>(dout), static_cast<const T*>(x),
            static_cast<const W*>(weight), layernorm ? mean : nullptr, rstd, N, C,
            rb.rows_per_block, layernorm, param_grads);
      };
      if (vector)
        launch(norm_backward_kernel<T, W, kVec<T>>);
      else
        launch(norm_backward_kernel<T, W, 1>);
      TETRA_CUDA_LAUNCHED();
    });
  });
  if (!param_grads) return;
  const dim3 block(32, kReduceRows);
  norm_param_grads_kernel<<<static_cast<unsigned>((C + 31) / 32), block, 0, stream>>>(
      dweight, dbias, partials, rb.count, C);
  TETRA_CUDA_LAUNCHED();
}

}  // namespace tetra
