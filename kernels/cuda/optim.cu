// Optimizer kernels on the GPU: the AdamW step over a flat fp32 parameter range, the two
// reductions the optimizer needs (sum of squares for the global gradient norm, plain sum), and
// the casts between the floating types (F32, BF16, F16).
//
// Reductions are deterministic without atomics: pass 1 runs a block count that depends on n only;
// each thread accumulates its grid-stride share in double, each block reduces its threads in a
// fixed tree and writes one double partial to the scratch area; pass 2 (one block) adds the
// partials in a fixed tree and stores the float. Same bits on every run and every GPU for the same
// input at the same address alignment (which picks the 16-byte or the scalar load path).
//
// AdamW is element-wise through math::adamw_update, the function the CPU backend calls, with
// 16-byte loads and stores of params, grads and both moments where all four are aligned. The
// updated parameter is written to the compute copy (rounded to bf16 or fp16, or fp32) in the same pass,
// and the gradient is zeroed as it is consumed. Device code follows IEEE fp32 (nvcc's default
// precise division and square root, no fast math), and adamw_update writes its four
// multiply-adds as fmaf (math::fused_mul_add) with no other a * b + c left for a compiler to
// contract, so parameters, moments and the compute copy match the CPU bit for bit
// (tests/cuda/test_optim.cpp).
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/pack.cuh"
#include "kernels/cuda/scratch.cuh"

namespace tetra {
namespace cuda {
namespace {

constexpr int kReduceThreads = 256;
constexpr int64_t kMaxReduceBlocks = 1024;  // also pass 2's partial count: 8 KiB of scratch

__device__ __forceinline__ double warp_sum_double(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); the result is valid in thread 0.
__device__ __forceinline__ double block_sum_double(double v) {
  __shared__ double shared[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum_double(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0;
  return warp_sum_double(v);
}

template <bool kSquare>
__device__ __forceinline__ double term(float x) {
  const double d = x;
  return kSquare ? d * d : d;
}

// Pass 1: partials[blockIdx.x] = sum of f(x[i]) over this block's grid-stride share, in double.
template <bool kSquare, bool kVec>
__global__ void __launch_bounds__(kReduceThreads)
reduce_partials_kernel(double* partials, const float* x, int64_t n) {
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  double acc = 0.0;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const Pack<float, 4> p = load_pack<float, 4>(x + 4 * i);
      acc += term<kSquare>(p.v[0]) + term<kSquare>(p.v[1]) + term<kSquare>(p.v[2]) +
             term<kSquare>(p.v[3]);
    }
    tail = 4 * n4;
  }
  for (int64_t i = tail + tid; i < n; i += stride) acc += term<kSquare>(x[i]);
  acc = block_sum_double(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Pass 2 (one block): out[0] = float(sum of the `count` partials).
__global__ void __launch_bounds__(kReduceThreads)
reduce_finish_kernel(float* out, const double* partials, int64_t count) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum_double(acc);
  if (threadIdx.x == 0) out[0] = static_cast<float>(acc);
}

template <bool kSquare>
void launch_reduce(float* out, const float* x, int64_t n, CudaScratch& scratch,
                   cudaStream_t stream) {
  TETRA_CHECK(n >= 0, "{}: n ({}) must be >= 0", kSquare ? "sum_squares" : "sum", n);
  TETRA_CHECK(scratch.floats * sizeof(float) >= kMaxReduceBlocks * sizeof(double),
              "reduction: scratch area of {} floats is too small", scratch.floats);
  // ~16 elements per thread before the block count reaches its cap; a function of n alone.
  const int64_t per_block = int64_t{kReduceThreads} * 16;
  const int64_t blocks =
      std::min(kMaxReduceBlocks, std::max<int64_t>(1, (n + per_block - 1) / per_block));
  double* partials = reinterpret_cast<double*>(scratch.data);
  const unsigned grid = static_cast<unsigned>(blocks);
  if (aligned_to(x, 16)) {
    reduce_partials_kernel<kSquare, true><<<grid, kReduceThreads, 0, stream>>>(partials, x, n);
  } else {
    reduce_partials_kernel<kSquare, false><<<grid, kReduceThreads, 0, stream>>>(partials, x, n);
  }
  TETRA_CUDA_LAUNCHED();
  reduce_finish_kernel<<<1, kReduceThreads, 0, stream>>>(out, partials, blocks);
  TETRA_CUDA_LAUNCHED();
}

// ---- AdamW ----------------------------------------------------------------------------------

constexpr int kAdamThreads = 256;

// TC: the compute copy's type (float or bf16_t); copy may be null. kVec: params, grads, m, v are
// 16-byte aligned and the copy (if any) aligned to 4 of its elements.
template <typename TC, bool kVec>
__global__ void __launch_bounds__(kAdamThreads)
adamw_kernel(float* params, float* grads, float* m, float* v, TC* copy, int64_t n,
             math::AdamParams hp) {
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t tail = 0;
  if constexpr (kVec) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const int64_t e = 4 * i;
      Pack<float, 4> p = load_pack<float, 4>(params + e);
      const Pack<float, 4> g = load_pack<float, 4>(grads + e);
      Pack<float, 4> mm = load_pack<float, 4>(m + e);
      Pack<float, 4> vv = load_pack<float, 4>(v + e);
#pragma unroll
      for (int k = 0; k < 4; ++k) math::adamw_update(p.v[k], mm.v[k], vv.v[k], g.v[k], hp);
      store_pack<float, 4>(params + e, p);
      store_pack<float, 4>(m + e, mm);
      store_pack<float, 4>(v + e, vv);
      store_pack<float, 4>(grads + e, Pack<float, 4>{{0.0f, 0.0f, 0.0f, 0.0f}});
      if (copy) {
        Pack<TC, 4> c;
#pragma unroll
        for (int k = 0; k < 4; ++k) c.v[k] = from_float<TC>(p.v[k]);
        store_pack<TC, 4>(copy + e, c);
      }
    }
    tail = 4 * n4;
  }
  for (int64_t i = tail + tid; i < n; i += stride) {
    float p = params[i], mm = m[i], vv = v[i];
    math::adamw_update(p, mm, vv, grads[i], hp);
    params[i] = p;
    m[i] = mm;
    v[i] = vv;
    grads[i] = 0.0f;
    if (copy) copy[i] = from_float<TC>(p);
  }
}

template <typename TC>
void launch_adamw(float* params, float* grads, float* m, float* v, TC* copy, int64_t n,
                  const math::AdamParams& hp, cudaStream_t stream) {
  const bool vec = aligned_to(params, 16) && aligned_to(grads, 16) && aligned_to(m, 16) &&
                   aligned_to(v, 16) && (copy == nullptr || aligned_to(copy, 4 * sizeof(TC)));
  const unsigned blocks = grid_for(vec ? (n + 3) / 4 : n, kAdamThreads);
  if (vec) {
    adamw_kernel<TC, true><<<blocks, kAdamThreads, 0, stream>>>(params, grads, m, v, copy, n, hp);
  } else {
    adamw_kernel<TC, false><<<blocks, kAdamThreads, 0, stream>>>(params, grads, m, v, copy, n, hp);
  }
  TETRA_CUDA_LAUNCHED();
}

// ---- cast -----------------------------------------------------------------------------------

constexpr int kCastThreads = 256;

// dst[i] = convert(src[i]); VEC > 1: both pointers aligned to VEC of their elements.
template <typename TD, typename TS, int VEC>
__global__ void __launch_bounds__(kCastThreads)
cast_kernel(TD* dst, const TS* src, int64_t n) {
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t tail = 0;
  if constexpr (VEC > 1) {
    const int64_t nv = n / VEC;
    for (int64_t i = tid; i < nv; i += stride) {
      const Pack<TS, VEC> s = load_pack<TS, VEC>(src + VEC * i);
      Pack<TD, VEC> d;
#pragma unroll
      for (int k = 0; k < VEC; ++k) d.v[k] = from_float<TD>(to_float(s.v[k]));
      store_pack<TD, VEC>(dst + VEC * i, d);
    }
    tail = VEC * nv;
  }
  for (int64_t i = tail + tid; i < n; i += stride) dst[i] = from_float<TD>(to_float(src[i]));
}

template <typename TD, typename TS>
void launch_cast(TD* dst, const TS* src, int64_t n, cudaStream_t stream) {
  // 16-byte accesses on the wider side: 4 floats <-> 4 16-bit values, or 8 16-bit values <-> 8
  // floats (or 8 <-> 8 between the two 16-bit types).
  constexpr int kVec = sizeof(TS) == 2 ? 8 : 4;
  if (aligned_to(src, kVec * sizeof(TS)) && aligned_to(dst, kVec * sizeof(TD))) {
    cast_kernel<TD, TS, kVec>
        <<<grid_for((n + kVec - 1) / kVec, kCastThreads), kCastThreads, 0, stream>>>(dst, src, n);
  } else {
    cast_kernel<TD, TS, 1><<<grid_for(n, kCastThreads), kCastThreads, 0, stream>>>(dst, src, n);
  }
  TETRA_CUDA_LAUNCHED();
}

}  // namespace
}  // namespace cuda

void CudaBackend::sum_squares(float* out, const float* x, int64_t n) {
  cuda::launch_reduce<true>(out, x, n, scratch(), cuda::as_stream(stream_));
}

void CudaBackend::sum(float* out, const float* x, int64_t n) {
  cuda::launch_reduce<false>(out, x, n, scratch(), cuda::as_stream(stream_));
}

void CudaBackend::adamw(float* params, float* grads, float* m, float* v, int64_t n,
                        const math::AdamParams& hp, void* compute_copy, DType compute_type) {
  TETRA_CHECK(n >= 0, "adamw: n ({}) must be >= 0", n);
  if (n == 0) return;
  const cudaStream_t stream = cuda::as_stream(stream_);
  if (compute_copy == nullptr) {
    cuda::launch_adamw<float>(params, grads, m, v, nullptr, n, hp, stream);
    return;
  }
  cuda::with_float_type(compute_type, "adamw", "compute_type", [&](auto tag) {
    using TC = decltype(tag);
    cuda::launch_adamw<TC>(params, grads, m, v, static_cast<TC*>(compute_copy), n, hp, stream);
  });
}

void CudaBackend::cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) {
  TETRA_CHECK(n >= 0, "cast: n ({}) must be >= 0", n);
  if (n == 0) return;
  const cudaStream_t stream = cuda::as_stream(stream_);
  if (dst_type == src_type) {
    if (dst != src)
      TETRA_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(dst_type),
                                       cudaMemcpyDeviceToDevice, stream));
    return;
  }
  // Any pair of floating types; between the two 16-bit types the value passes through fp32
  // (exact), so bf16 <-> fp16 rounds once (as on the CPU).
  cuda::with_float_type(dst_type, "cast", "destination type", [&](auto dtag) {
    cuda::with_float_type(src_type, "cast", "source type", [&](auto stag) {
      using TD = decltype(dtag);
      using TS = decltype(stag);
      cuda::launch_cast(static_cast<TD*>(dst), static_cast<const TS*>(src), n, stream);
    });
  });
}

}  // namespace tetra
