// bf16 GEMM on AMX tiles: see gemm_amx.cpp. CpuBackend::gemm takes this path for bf16 operands
// where amx_available(), and oneDNN elsewhere.
#pragma once

#include <cstdint>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/scratch.h"
#include "kernels/common/dtype.h"

namespace tetra::cpu {

// C (M, N) = alpha * op(A) (M, K) · op(B) (K, N) + beta * C + bias (N): the contract of
// Backend::gemm (kernels/backend.h) with A, B and bias bf16 and C fp32 or bf16. beta == 0 never
// reads C. Requires amx_available(). Runs on at most `threads` threads, with the backend's scratch
// (which has a slot for each of them).
void amx_gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, void* C,
                   int64_t ldc, DType c_type, const bf16* bias, int threads, CpuScratch& scratch);

}  // namespace tetra::cpu
