// Placeholder: the ops below are written in this file.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

struct CudaAttentionState {};
void CudaAttentionStateDeleter::operator()(CudaAttentionState* s) const { delete s; }
CudaAttentionState& CudaBackend::attention_state() {
  if (!attention_) attention_.reset(new CudaAttentionState);
  return *attention_;
}
std::string CudaBackend::attention_path() const { return "none"; }

void CudaBackend::rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                    float theta, DType act) {
  throw Error("CudaBackend::rope_forward: not implemented");
}

void CudaBackend::rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                     float theta, DType act) {
  throw Error("CudaBackend::rope_backward: not implemented");
}

void CudaBackend::attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t NH,
                         int64_t NKV, int64_t HS, DType act) {
  throw Error("CudaBackend::attention_forward: not implemented");
}

void CudaBackend::attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                          const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HS, DType act) {
  throw Error("CudaBackend::attention_backward: not implemented");
}

}  // namespace tetra
