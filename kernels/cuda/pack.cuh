// 128-bit vector access for the kernels: a Pack is N consecutive elements loaded or stored with one
// wide instruction (16 bytes: 4 floats or 8 bf16 values). Kernels take the vector path only where
// the host has checked the pointers' alignment and the row lengths (aligned_to, divides); the
// scalar path covers everything else. Included by .cu files only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace tetra::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& x) {
  *reinterpret_cast<Pack<T, N>*>(p) = x;
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace tetra::cuda
