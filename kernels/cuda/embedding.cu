// Token (and learned position) embeddings on the GPU, for the whole vocabulary or one tensor-
// parallel slice of it (rows [v0, v0 + Vl) of wte; a token outside the slice gives a zero row in
// forward and no gradient in backward). Contracts in kernels/backend.h; the reference is
// kernels/cpu/embedding.cpp.
//
// Forward is a gather: one thread per chunk of K columns of one token (16-byte accesses where C
// and the pointers allow), out = wte row (+ wpe row), rounded once.
//
// Backward must add each token's gradient row into the wte row of its id, and ids repeat
// (" the" many times a batch). Atomics would make the rounding depend on scheduling, so the
// positions are grouped by id instead, deterministically:
//   1. keys[p] = tokens[p] - v0 (or Vl, past every row, for a token outside the slice), pos[p] = p;
//   2. a stable radix sort of (key, pos) by key (cub::DeviceRadixSort over the key's bits only,
//      into buffers owned by the backend, fused_state.cuh): positions of one id stay in
//      increasing order;
//   3. the first sorted entry of each id's run sums the run's gradient rows into its wte row, one
//      thread per chunk of columns, starting from the row's current value and adding the positions
//      in increasing order: exactly the additions of the CPU backend in its order, so the result
//      is bitwise the CPU's, run after run.
// dwpe[t] += dout[b, t] for b in order: one thread per (t, chunk of columns), the CPU's order too.
// A run is summed by one thread per column chunk, so a very frequent id costs one long serial
// loop (its loads are independent and unrolled, so they overlap); the op is small next to the
// step's GEMMs.
#include <initializer_list>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/fused_state.cuh"
#include "kernels/cuda/vec.cuh"

namespace tetra {
namespace {

using cuda::kVec;

constexpr int kThreads = 256;
constexpr int kRunThreads = 128;  // threads per block over a run's column chunks

// The row of `token` in the slice [v0, v0 + Vl), or -1.
__device__ __forceinline__ int64_t slice_row(int32_t token, int64_t v0, int64_t Vl) {
  const int64_t r = static_cast<int64_t>(token) - v0;
  return r >= 0 && r < Vl ? r : -1;
}

// out (n_tok, C) of T = wte[tokens - v0] (zero row outside the slice) (+ wpe[p], p = bt % T_len or
// positions[bt % T_len]).
template <typename T, typename W, int K>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(T* out, const int32_t* tokens, const W* wte, const W* wpe,
                             int64_t n_tok, int64_t T_len, int64_t C, int64_t v0, int64_t Vl,
                             const int32_t* positions) {
  const int64_t per_row = C / K;
  const int64_t total = n_tok * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t bt = idx / per_row, j = (idx - bt * per_row) * K;
    const int64_t r = slice_row(tokens[bt], v0, Vl);
    const int64_t pos = positions ? positions[bt % T_len] : bt % T_len;
    float v[K];
    if (r >= 0) {
      cuda::load_floats<K>(wte + r * C + j, v);
      if (wpe) {
        float p[K];
        cuda::load_floats<K>(wpe + pos * C + j, p);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] += p[k];
      }
    } else if (wpe) {
      cuda::load_floats<K>(wpe + pos * C + j, v);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = 0.0f;
    }
    cuda::store_floats<K>(out + bt * C + j, v);
  }
}

// Step 1: sort keys (the slice row, or Vl outside the slice) and positions.
__global__ void __launch_bounds__(kThreads)
    embedding_keys_kernel(uint32_t* keys, int32_t* pos, const int32_t* tokens, int64_t n,
                          int64_t v0, int64_t Vl) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += stride) {
    const int64_t r = slice_row(tokens[p], v0, Vl);
    keys[p] = static_cast<uint32_t>(r >= 0 ? r : Vl);
    pos[p] = static_cast<int32_t>(p);
  }
}

// Step 3: block x = one sorted entry p; if it starts a run of an in-slice key, the block finds
// the run's length (kRunThreads keys per step, by a block-wide count: the run is contiguous, so
// within a window the matching entries are a prefix), then its threads (column chunks
// blockIdx.y kRunThreads + threadIdx.x) add the run's rows of dout (n, C) into dwte[key] in
// increasing position order.
template <typename T, int K>
__global__ void __launch_bounds__(kRunThreads)
    embedding_runs_kernel(float* dwte, const T* dout, const uint32_t* keys, const int32_t* pos,
                          int64_t n, int64_t C, int64_t Vl) {
  const int64_t p = blockIdx.x;
  const uint32_t key = keys[p];
  if (key >= Vl || (p > 0 && keys[p - 1] == key)) return;  // uniform over the block
  int64_t len = 0;
  for (int64_t base = p;; base += blockDim.x) {
    const int64_t q = base + threadIdx.x;
    const int same = __syncthreads_count(q < n && keys[q] == key);
    len += same;
    if (same < static_cast<int>(blockDim.x)) break;  // uniform: every thread got the same count
  }
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C / K) return;
  const int64_t j = c * K;
  float* d = dwte + static_cast<int64_t>(key) * C + j;
  float acc[K];
  cuda::load_floats<K>(d, acc);
#pragma unroll 4
  for (int64_t q = p; q < p + len; ++q) {
    float g[K];
    cuda::load_floats<K>(dout + static_cast<int64_t>(pos[q]) * C + j, g);
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] += g[k];
  }
  cuda::store_floats<K>(d, acc);
}

// dwpe[p(t)] += sum over b in order of dout[b, t] (B, T_len, C), p(t) = t or positions[t].
template <typename T, int K>
__global__ void __launch_bounds__(kThreads)
    embedding_dwpe_kernel(float* dwpe, const T* dout, int64_t B, int64_t T_len, int64_t C,
                          const int32_t* positions) {
  const int64_t per_row = C / K;
  const int64_t total = T_len * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t t = idx / per_row, j = (idx - t * per_row) * K;
    float acc[K];
    float* d = dwpe + (positions ? positions[t] : t) * C + j;
    cuda::load_floats<K>(d, acc);
    for (int64_t b = 0; b < B; ++b) {
      float g[K];
      cuda::load_floats<K>(dout + (b * T_len + t) * C + j, g);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += g[k];
    }
    cuda::store_floats<K>(d, acc);
  }
}

// Rows of C elements move as 16-byte chunks of kVec<T> when C is a multiple of the width and the
// base pointers are aligned (chunks of the other tensors' types are then 8- or 32-byte aligned).
template <typename T>
bool rows_vectorisable(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (p && !cuda::aligned16(p)) return false;
  return true;
}

// Bits of the sort key: enough for the values 0 .. Vl (Vl marks tokens outside the slice).
int key_bits(int64_t Vl) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= Vl) ++bits;
  return bits;
}

void check_args(const char* op, int64_t B, int64_t T, int64_t C, int64_t v0, int64_t Vl) {
  TETRA_CHECK(B >= 0 && T >= 0 && C > 0, "{}: bad shape B={} T={} C={}", op, B, T, C);
  TETRA_CHECK(v0 >= 0 && Vl > 0, "{}: bad vocabulary slice v0={} Vl={}", op, v0, Vl);
  TETRA_CHECK(Vl < (int64_t{1} << 31), "{}: the slice's Vl ({}) must be < 2^31", op, Vl);
  TETRA_CHECK(B * T < (int64_t{1} << 31), "{}: B*T ({}) must be < 2^31", op, B * T);
}

}  // namespace

void CudaBackend::embedding_forward(void* out, const int32_t* tokens, const void* wte,
                                    const void* wpe, int64_t B, int64_t T, int64_t C, int64_t v0,
                                    int64_t Vl, DType act, DType w, const int32_t* positions) {
  check_args("embedding_forward", B, T, C, v0, Vl);
  const int64_t n = B * T;
  if (n == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  cuda::with_float_type(act, "embedding_forward", "activation type", [&](auto a) {
    using TA = decltype(a);
    cuda::with_float_type(w, "embedding_forward", "weight type", [&](auto b) {
      using TW = decltype(b);
      const bool vector = rows_vectorisable<TA>(C, {out, wte, wpe});
      const int64_t chunks = n * (vector ? C / kVec<TA> : C);
      auto launch = [&](auto kernel) {
        kernel<<<cuda::grid_for(chunks, kThreads), kThreads, 0, stream>>>(
            static_cast<TA*>(out), tokens, static_cast<const TW*>(wte), static_cast<const TW*>(wpe),
            n, T, C, v0, Vl, positions);
      };
      if (vector)
        launch(embedding_forward_kernel<TA, TW, kVec<TA>>);
      else
        launch(embedding_forward_kernel<TA, TW, 1>);
      TETRA_CUDA_LAUNCHED();
    });
  });
}

void CudaBackend::embedding_backward(float* dwte, float* dwpe, const void* dout,
                                     const int32_t* tokens, int64_t B, int64_t T, int64_t C,
                                     int64_t v0, int64_t Vl, DType act, const int32_t* positions) {
  check_args("embedding_backward", B, T, C, v0, Vl);
  const int64_t n = B * T;
  if (n == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());

  if (dwte) {
    // Steps 1 and 2: keys and positions, sorted by key.
    const int bits = key_bits(Vl);
    size_t temp_bytes = 0;
    TETRA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(n),
        0, bits, stream));
    cuda::reserve_sort(*this, n, temp_bytes);
    CudaFusedState& st = fused_state();
    embedding_keys_kernel<<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(
        st.sort_keys[0], st.sort_pos[0], tokens, n, v0, Vl);
    TETRA_CUDA_LAUNCHED();
    TETRA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        st.sort_temp, temp_bytes, st.sort_keys[0], st.sort_keys[1], st.sort_pos[0], st.sort_pos[1],
        static_cast<int>(n), 0, bits, stream));
    // Step 3: one block column per sorted entry; only runs' first entries work.
    cuda::with_float_type(act, "embedding_backward", "activation type", [&](auto a) {
      using TA = decltype(a);
      const bool vector = rows_vectorisable<TA>(C, {dwte, dout});
      const int64_t chunks = vector ? C / kVec<TA> : C;
      const dim3 grid(static_cast<unsigned>(n),
                      static_cast<unsigned>((chunks + kRunThreads - 1) / kRunThreads));
      TETRA_CHECK(grid.y <= 65535, "embedding_backward: C ({}) too large", C);
      auto launch = [&](auto kernel) {
        kernel<<<grid, kRunThreads, 0, stream>>>(dwte, static_cast<const TA*>(dout),
                                                 st.sort_keys[1], st.sort_pos[1], n, C, Vl);
      };
      if (vector)
        launch(embedding_runs_kernel<TA, kVec<TA>>);
      else
        launch(embedding_runs_kernel<TA, 1>);
      TETRA_CUDA_LAUNCHED();
    });
  }

  if (dwpe) {
    cuda::with_float_type(act, "embedding_backward", "activation type", [&](auto a) {
      using TA = decltype(a);
      const bool vector = rows_vectorisable<TA>(C, {dwpe, dout});
      const int64_t chunks = T * (vector ? C / kVec<TA> : C);
      auto launch = [&](auto kernel) {
        kernel<<<cuda::grid_for(chunks, kThreads), kThreads, 0, stream>>>(
            dwpe, static_cast<const TA*>(dout), B, T, C, positions);
      };
      if (vector)
        launch(embedding_dwpe_kernel<TA, kVec<TA>>);
      else
        launch(embedding_dwpe_kernel<TA, 1>);
      TETRA_CUDA_LAUNCHED();
    });
  }
}

}  // namespace tetra
