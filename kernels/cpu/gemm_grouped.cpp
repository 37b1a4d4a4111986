// CpuBackend::gemm_grouped / gemm_grouped_k (kernels/backend.h): the groups expanded into gemm
// problems (kernels/common/gemm_groups.h), checked, then run by gemm_problems — in gemm.cpp, which
// spreads small groups over the threads, or gemm_loops.cpp in a build without oneDNN.
#include "kernels/common/check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_loops.h"

namespace tetra {

namespace {

void check_group_rows(const char* op, int64_t G, const int64_t* rows) {
  TETRA_CHECK(G >= 0, "{}: the number of groups ({}) is negative", op, G);
  TETRA_CHECK(G == 0 || rows != nullptr, "{}: no row counts for {} groups", op, G);
  for (int64_t g = 0; g < G; ++g) TETRA_CHECK(rows[g] >= 0, "{}: group {} has {} rows", op, g, rows[g]);
}

}  // namespace

void CpuBackend::gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K,
                              float alpha, const void* A, int64_t lda, const void* const* B, int64_t ldb,
                              DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
                              const void* const* bias) {
  check_group_rows("gemm_grouped", G, rows);
  grouped_.clear();
  for_gemm_groups(trans_a, G, rows, N, K, A, lda, B, dtype_size(ab_type), C, ldc, dtype_size(c_type), bias,
                  [&](const GemmProblem& p) {
                    cpu::check_gemm_args(trans_a, trans_b, p.M, p.N, p.K, lda, ldb, ldc, ab_type, c_type);
                    if (p.N > 0) grouped_.push_back(p);
                  });
  gemm_problems(trans_a, trans_b, alpha, lda, ldb, ab_type, beta, ldc, c_type);
}

void CpuBackend::gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N,
                                float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                                float beta, void* const* C, int64_t ldc, DType c_type) {
  check_group_rows("gemm_grouped_k", G, rows);
  grouped_.clear();
  for_gemm_groups_k(trans_a, trans_b, G, rows, M, N, A, lda, B, ldb, dtype_size(ab_type), C,
                    [&](const GemmProblem& p) {
                      cpu::check_gemm_args(trans_a, trans_b, p.M, p.N, p.K, lda, ldb, ldc, ab_type, c_type);
                      if (p.M > 0 && p.N > 0) grouped_.push_back(p);
                    });
  gemm_problems(trans_a, trans_b, alpha, lda, ldb, ab_type, beta, ldc, c_type);
}

}  // namespace tetra
