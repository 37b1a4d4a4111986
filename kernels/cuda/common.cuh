// Helpers shared by the CUDA kernels: error checks, the storage types and their fp32 loads and
// stores, the dispatch from a run-time DType to a kernel templated on its storage type, launch
// geometry, and warp/block reductions. Included by .cu files only.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/common/math.h"
#include "kernels/common/check.h"
#include "kernels/common/dtype.h"

namespace tetra::cuda {

// Throws tetra::Error naming the call, the file and line, and CUDA's message.
inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess)
    throw Error(fmt::format("{}:{}: CUDA error in {}: {} ({})", file, line, what,
                            cudaGetErrorString(err), static_cast<int>(err)));
}
#define TETRA_CUDA_CHECK(call) ::tetra::cuda::check_cuda((call), #call, __FILE__, __LINE__)
// After a kernel launch: a bad launch configuration is reported here, not at the next sync.
#define TETRA_CUDA_LAUNCHED() ::tetra::cuda::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

using bf16_t = __nv_bfloat16;
using f16_t = __half;

// fp32 loads and stores of every storage type. bf16 and fp16 stores round to nearest even, like
// math::f32_to_bf16_bits / math::f32_to_f16_bits on the host (NaN stays NaN; fp16 overflows to
// infinity from 65520 up and underflows gradually), so both backends produce the same bits.
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16_t* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const f16_t* p) { return __half2float(*p); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(f16_t x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float x) { return __float2half_rn(x); }
__device__ __forceinline__ void st(float* p, float x) { *p = x; }
__device__ __forceinline__ void st(bf16_t* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void st(f16_t* p, float x) { *p = __float2half_rn(x); }

// Calls f(float{}), f(bf16_t{}) or f(f16_t{}) for a floating storage type; anything else is an
// Error naming the op and the argument.
template <typename F>
void with_float_type(DType t, const char* op, const char* what, F&& f) {
  if (t == DType::F32) {
    f(float{});
  } else if (t == DType::BF16) {
    f(bf16_t{});
  } else if (t == DType::F16) {
    f(f16_t{});
  } else {
    throw Error(fmt::format("{}: {} must be F32, BF16 or F16, got {}", op, what, dtype_name(t)));
  }
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Blocks for an element-wise kernel of n elements with `threads` per block (grid-stride loops
// cover the rest beyond the cap).
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 8) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 floats. Deterministic: a fixed tree for a given block size.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace tetra::cuda
