// CpuBackend::gemm_gelu / gemm_dgelu: the GEMM, then the GELU pass. On the CPU the GELU pass over
// the (M, N) result is memory-bound next to the GEMM and fusing it into oneDNN's matmul as a
// post-op would lose `pre`, which backward needs; so the CPU composes the two ops, in the unfused
// order the contract names (the product rounded to act, then the GELU), and this is the
// reference the CUDA backend's fused epilogues are checked against.
#include "kernels/cpu/cpu_backend.h"
#include "kernels/common/check.h"

namespace tetra {

void CpuBackend::gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                           const void* A, int64_t lda, const void* B, int64_t ldb,
                           const void* bias, void* pre, void* out, DType act) {
  TETRA_CHECK(pre != out, "gemm_gelu: pre and out must be different buffers (backward reads pre)");
  gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, act, 0.0f, pre, N, act, bias);
  gelu_forward(out, pre, M * N, act);
}

void CpuBackend::gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            const void* A, int64_t lda, const void* B, int64_t ldb,
                            const void* pre, void* dpre, DType act) {
  TETRA_CHECK(pre != dpre, "gemm_dgelu: dpre must not alias pre");
  gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, act, 0.0f, dpre, N, act, nullptr);
  gelu_backward(dpre, pre, dpre, M * N, act);
}

}  // namespace tetra
