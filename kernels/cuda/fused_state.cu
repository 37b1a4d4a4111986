// The fused kernels' device buffers (fused_state.cuh): creation at first use, growth, release.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fused_state.cuh"

namespace tetra {

namespace {
// cudaFree of a buffer that kernels on the stream may still read: wait for them first.
template <typename T>
void release(CudaBackend& be, T*& p) {
  if (!p) return;
  TETRA_CUDA_CHECK(cudaStreamSynchronize(cuda::as_stream(be.stream())));
  TETRA_CUDA_CHECK(cudaFree(p));
  p = nullptr;
}
template <typename T>
void allocate(T*& p, size_t count) {
  void* raw = nullptr;
  TETRA_CUDA_CHECK(cudaMalloc(&raw, count * sizeof(T)));
  p = static_cast<T*>(raw);
}
}  // namespace

// Called when the backend is destroyed, after it waited for its stream: nothing reads the buffers.
// Errors are ignored (a destructor must not throw; at process exit the driver may be gone).
void CudaFusedStateDeleter::operator()(CudaFusedState* s) const {
  cudaFree(s->norm_partials);
  for (int b = 0; b < 2; ++b) {
    cudaFree(s->sort_keys[b]);
    cudaFree(s->sort_pos[b]);
  }
  cudaFree(s->sort_temp);
  delete s;
}

CudaFusedState& CudaBackend::fused_state() {
  if (!fused_) fused_.reset(new CudaFusedState);
  return *fused_;
}

namespace cuda {

float* norm_partials(CudaBackend& be) {
  CudaFusedState& s = be.fused_state();
  if (!s.norm_partials) allocate(s.norm_partials, static_cast<size_t>(kNormPartialFloats));
  return s.norm_partials;
}

void reserve_sort(CudaBackend& be, int64_t n, size_t temp_bytes) {
  CudaFusedState& s = be.fused_state();
  if (n > s.sort_capacity) {
    s.sort_capacity = 0;
    for (int b = 0; b < 2; ++b) {
      release(be, s.sort_keys[b]);
      release(be, s.sort_pos[b]);
    }
    for (int b = 0; b < 2; ++b) {
      allocate(s.sort_keys[b], static_cast<size_t>(n));
      allocate(s.sort_pos[b], static_cast<size_t>(n));
    }
    s.sort_capacity = n;
  }
  if (temp_bytes > s.sort_temp_bytes) {
    release(be, s.sort_temp);
    s.sort_temp_bytes = 0;
    void* raw = nullptr;
    TETRA_CUDA_CHECK(cudaMalloc(&raw, temp_bytes));
    s.sort_temp = raw;
    s.sort_temp_bytes = temp_bytes;
  }
}

}  // namespace cuda
}  // namespace tetra
