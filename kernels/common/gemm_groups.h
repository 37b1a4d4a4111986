// The problems of a grouped GEMM (Backend::gemm_grouped / gemm_grouped_k, kernels/backend.h) as
// the gemm calls they stand for: each non-empty group's operand pointers moved to its row block.
// Both backends expand a grouped call through these, so the offsets are written once.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tetra {

// One product of gemm's contract: C (M, N) = alpha op(A) (M, K) · op(B) (K, N) + beta C + bias.
struct GemmProblem {
  const void* A = nullptr;
  const void* B = nullptr;
  void* C = nullptr;
  const void* bias = nullptr;
  int64_t M = 0, N = 0, K = 0;
};

// gemm_grouped: group g is rows [o_g, o_g + rows[g]) of op(A) and C. op(A)'s row r is row r of A
// (lda apart), or with trans_a (A stored (K, R)) its column r. ea, ec: element sizes of A and C.
template <class F>
void for_gemm_groups(bool trans_a, int64_t G, const int64_t* rows, int64_t N, int64_t K, const void* A,
                     int64_t lda, const void* const* B, size_t ea, void* C, int64_t ldc, size_t ec,
                     const void* const* bias, F&& f) {
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g] > 0) {
      GemmProblem p;
      p.A = static_cast<const char*>(A) + static_cast<size_t>(trans_a ? o : o * lda) * ea;
      p.B = B[g];
      p.C = static_cast<char*>(C) + static_cast<size_t>(o * ldc) * ec;
      p.bias = bias ? bias[g] : nullptr;
      p.M = rows[g], p.N = N, p.K = K;
      f(p);
    }
    o += rows[g];
  }
}

// gemm_grouped_k: group g is columns [o_g, o_g + rows[g]) of op(A) (its rows where A is stored
// transposed, (R, M)) and rows [o_g, o_g + rows[g]) of op(B) (its columns where trans_b, (N, R)).
// ea: element size of A and B.
template <class F>
void for_gemm_groups_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N,
                       const void* A, int64_t lda, const void* B, int64_t ldb, size_t ea, void* const* C, F&& f) {
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (rows[g] > 0) {
      GemmProblem p;
      p.A = static_cast<const char*>(A) + static_cast<size_t>(trans_a ? o * lda : o) * ea;
      p.B = static_cast<const char*>(B) + static_cast<size_t>(trans_b ? o : o * ldb) * ea;
      p.C = C[g];
      p.M = M, p.N = N, p.K = rows[g];
      f(p);
    }
    o += rows[g];
  }
}

}  // namespace tetra
