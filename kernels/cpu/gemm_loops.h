// The GEMM of kernels/backend.h in plain C++ loops: the CPU backend's GEMM in a build without
// oneDNN (a GPU machine that lacks the package), so the CPU reference the CUDA tests compare
// against still exists there. Correct for every case of the contract, OpenMP-parallel and
// cache-blocked, but far slower than oneDNN (no register tiling, no AMX): a fallback, announced on
// stderr at the first GEMM of such a build.
#pragma once

#include <cstdint>

#include "kernels/common/dtype.h"

namespace tetra::cpu {

// Row-major C(M,N) = alpha * op(A)(M,K) · op(B)(K,N) + beta * C + bias(N), exactly as
// Backend::gemm (kernels/backend.h): A and B of ab_type (F32, BF16 or F16), C of c_type (likewise),
// bias of ab_type or null, fp32 accumulation, C not read when beta == 0. `threads` <= 0: every
// core. Throws tetra::Error on arguments outside the contract.
// Throws tetra::Error, naming the values, unless the arguments are inside the contract of
// Backend::gemm: A/B and C types F32, BF16 or F16, M, N >= 0, K > 0, and leading dimensions at
// least the rows' lengths (when M and N are not 0). Every CPU GEMM path checks this first.
void check_gemm_args(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda,
                     int64_t ldb, int64_t ldc, DType ab_type, DType c_type);

void gemm_loops(int threads, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta, void* C,
                int64_t ldc, DType c_type, const void* bias);

}  // namespace tetra::cpu
