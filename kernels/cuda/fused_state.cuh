// Device buffers that the fused kernels keep between calls, owned by the backend (created at the
// first op that needs them, freed with the backend), so that no op allocates in the step loop:
// - norm_backward's per-block partial sums of dweight and dbias (a fixed 16 MiB, see norm.cu);
// - embedding_backward's radix-sort buffers (token keys and positions, twice, and cub's temporary
//   storage), sized for the largest token count seen. A larger count than before (the first step,
//   or a larger evaluation batch) reallocates them once, after waiting for the stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_backend.h"

namespace tetra {

struct CudaFusedState {
  float* norm_partials = nullptr;               // kNormPartialFloats floats
  uint32_t* sort_keys[2] = {nullptr, nullptr};  // (sort_capacity) each: input, sorted
  int32_t* sort_pos[2] = {nullptr, nullptr};    // (sort_capacity) each: input, sorted
  int64_t sort_capacity = 0;
  void* sort_temp = nullptr;
  size_t sort_temp_bytes = 0;
};

namespace cuda {

constexpr int64_t kNormPartialFloats = int64_t{1} << 22;  // 16 MiB

// The partial-sum area of norm_backward (kNormPartialFloats floats).
float* norm_partials(CudaBackend& be);
// Makes the sort buffers hold n tokens and the temporary storage temp_bytes bytes.
void reserve_sort(CudaBackend& be, int64_t n, size_t temp_bytes);

}  // namespace cuda
}  // namespace tetra
