// Placeholder: the ops below are written in this file.
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

void CudaBackend::cross_entropy(float* losses, void* dlogits, DType dlogits_type, const void* logits,
                     DType logits_type, const int32_t* targets, int64_t N, int64_t V,
                     float dloss_scale) {
  throw Error("CudaBackend::cross_entropy: not implemented");
}

void CudaBackend::vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N,
                    int64_t Vl) {
  throw Error("CudaBackend::vocab_ce_max: not implemented");
}

void CudaBackend::vocab_ce_sums(float* sumexp, float* target_logit, const void* logits, DType logits_type,
                     const float* row_max, const int32_t* targets, int64_t v0, int64_t N,
                     int64_t Vl) {
  throw Error("CudaBackend::vocab_ce_sums: not implemented");
}

void CudaBackend::vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type, const void* logits,
                       DType logits_type, const float* row_max, const float* sumexp,
                       const float* target_logit, const int32_t* targets, int64_t v0, int64_t N,
                       int64_t Vl, float dloss_scale) {
  throw Error("CudaBackend::vocab_ce_finish: not implemented");
}

}  // namespace tetra
