// Vectorised loads and stores for the memory-bound kernels (element-wise, norms, embeddings,
// loss): a Chunk is K consecutive elements moved with 128-bit (or 64-bit) memory instructions
// instead of K scalar ones, which is what lets these kernels reach the GPU's memory bandwidth.
//
// K is chosen by the kernel from the storage type it streams (kVec<T>: 4 floats or 8 bf16 values
// = 16 bytes). A chunk of K elements of another type (weights in F32 beside bf16 activations)
// is 32 or 8 bytes and moves as two 128-bit or one 64-bit access. K = 1 is the scalar fallback
// for rows whose length or address does not allow vector access, so every kernel has one code
// path, templated on K. The caller guarantees alignment: a chunk of K elements of X must start at
// a multiple of min(16, K * sizeof(X)) bytes (aligned16() on the base pointer plus offsets that
// are multiples of K elements do that).
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace tetra::cuda {

// Elements of T in 16 bytes.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T, int K>
struct alignas(K * sizeof(T) >= 16 ? 16 : K * sizeof(T)) Chunk {
  T v[K];
};

template <int K, typename T>
__device__ __forceinline__ Chunk<T, K> load_chunk(const T* p) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  Chunk<T, K> c;
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 16; ++q)
      reinterpret_cast<int4*>(&c)[q] = reinterpret_cast<const int4*>(p)[q];
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<int2*>(&c) = *reinterpret_cast<const int2*>(p);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) c.v[k] = p[k];
  }
  return c;
}

template <int K, typename T>
__device__ __forceinline__ void store_chunk(T* p, const Chunk<T, K>& c) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int q = 0; q < kBytes / 16; ++q)
      reinterpret_cast<int4*>(p)[q] = reinterpret_cast<const int4*>(&c)[q];
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<int2*>(p) = *reinterpret_cast<const int2*>(&c);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = c.v[k];
  }
}

// K elements of T at p as fp32, and K fp32 values stored as T (bf16: round to nearest even).
template <int K, typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[K]) {
  const Chunk<T, K> c = load_chunk<K>(p);
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = to_float(c.v[k]);
}
template <int K, typename T>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[K]) {
  Chunk<T, K> c;
#pragma unroll
  for (int k = 0; k < K; ++k) c.v[k] = from_float<T>(in[k]);
  store_chunk<K>(p, c);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A row of n elements of T at p, split for vector access: `head` scalar elements up to the first
// 16-byte boundary, then `chunks` chunks of kVec<T> elements, then the scalar tail up to n.
// (Device memory holds T at addresses that are multiples of sizeof(T), so the head is exact.)
struct RowSplit {
  int64_t head;
  int64_t chunks;
};
template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* p, int64_t n) {
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
  int64_t head = misaligned == 0 ? 0 : (16 - misaligned) / static_cast<int64_t>(sizeof(T));
  if (head > n) head = n;
  return {head, (n - head) / kVec<T>};
}

}  // namespace tetra::cuda
