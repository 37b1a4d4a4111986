// Placeholder: the ops below are written in this file.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

void CudaBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                          const float* logits, int64_t N, int64_t E, int64_t K) {
  throw Error("CudaBackend::moe_router_forward: not implemented");
}

void CudaBackend::moe_router_backward(float* dlogits, const float* probs, const float* lse,
                           const int32_t* topk_idx, const float* dtopk_prob,
                           const float* expert_grad, float z_scale, int64_t N, int64_t E,
                           int64_t K) {
  throw Error("CudaBackend::moe_router_backward: not implemented");
}

void CudaBackend::moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t C,
                       DType act) {
  throw Error("CudaBackend::moe_gather_rows: not implemented");
}

void CudaBackend::moe_combine(void* out, const void* y, const int32_t* pos, const float* weights, int64_t N,
                   int64_t K, int64_t C, bool accumulate, DType act) {
  throw Error("CudaBackend::moe_combine: not implemented");
}

void CudaBackend::moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y,
                            const int32_t* pos, const float* weights, int64_t N, int64_t K,
                            int64_t C, DType act) {
  throw Error("CudaBackend::moe_combine_backward: not implemented");
}

}  // namespace tetra
