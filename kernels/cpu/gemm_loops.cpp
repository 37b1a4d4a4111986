// The loop GEMM (see gemm_loops.h), and, in a build without oneDNN, the CpuBackend members that
// gemm.cpp defines otherwise (its constructor, destructor and gemm).
//
// How: op(A) and op(B) are first made fp32 row-major (copied when transposed or 16-bit; used in place
// when already so), then C is computed in tiles of kMb x kNb outputs, one OpenMP task per tile,
// each accumulating in an fp32 tile on the stack over K in slices of kKb: the inner loop is an
// axpy along a row of op(B), which the compiler vectorises. Each output sums its K products in
// order k = 0, 1, ..., whatever the thread count: results are reproducible bit for bit. The
// epilogue is alpha * acc + beta * C + bias, rounded once to C's type.
#include "kernels/cpu/gemm_loops.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <vector>

#include "kernels/common/math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra::cpu {

namespace {

constexpr int64_t kMb = 32;   // rows of a tile
constexpr int64_t kNb = 256;  // columns of a tile: kMb x kNb fp32 = 32 KiB of accumulators
constexpr int64_t kKb = 256;  // K slice: its rows of op(B) (kKb x kNb fp32, 256 KiB) stay in L2

float load(const void* p, DType t, int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  return t == DType::F16 ? math::f16_bits_to_f32(bits) : math::bf16_bits_to_f32(bits);
}

bool gemm_type(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

// op(X), `rows` x `cols`, as fp32 rows `ld` apart: X itself when it is fp32 and not transposed,
// else a copy in `buf`. X is stored (rows, cols) with leading dimension ldx, or (cols, rows) when
// transposed.
const float* f32_rows(const void* X, int64_t ldx, bool trans, int64_t rows, int64_t cols, DType t,
                      std::vector<float>& buf, int64_t& ld, int nt) {
  if (!trans && t == DType::F32) {
    ld = ldx;
    return static_cast<const float*>(X);
  }
  buf.resize(static_cast<size_t>(rows * cols));
  ld = cols;
  float* out = buf.data();
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = load(X, t, trans ? c * ldx + r : r * ldx + c);
  return out;
}

}  // namespace

void check_gemm_args(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda,
                     int64_t ldb, int64_t ldc, DType ab_type, DType c_type) {
  TETRA_CHECK(gemm_type(ab_type), "gemm: A/B type must be F32, BF16 or F16, got {}", dtype_name(ab_type));
  TETRA_CHECK(gemm_type(c_type), "gemm: C type must be F32, BF16 or F16, got {} (A/B are {})",
              dtype_name(c_type), dtype_name(ab_type));
  TETRA_CHECK(M >= 0 && N >= 0 && K > 0, "gemm: need M, N >= 0 and K > 0, got M={} N={} K={}", M, N, K);
  if (M == 0 || N == 0) return;
  TETRA_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
              "gemm: leading dimensions too small: trans_a={} trans_b={} M={} N={} K={} lda={} ldb={} ldc={}",
              trans_a, trans_b, M, N, K, lda, ldb, ldc);
}

void gemm_loops(int threads, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta, void* C,
                int64_t ldc, DType c_type, const void* bias) {
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc, ab_type, c_type);
  if (M == 0 || N == 0) return;

  const int nt = team_size(threads);
  std::vector<float> a_copy, b_copy;
  int64_t la = 0, lb = 0;
  const float* a = f32_rows(A, lda, trans_a, M, K, ab_type, a_copy, la, nt);
  const float* b = f32_rows(B, ldb, trans_b, K, N, ab_type, b_copy, lb, nt);
  const int64_t m_tiles = math::ceil_div(M, kMb), n_tiles = math::ceil_div(N, kNb);

#pragma omp parallel for collapse(2) num_threads(nt) schedule(static)
  for (int64_t ti = 0; ti < m_tiles; ++ti)
    for (int64_t tj = 0; tj < n_tiles; ++tj) {
      const int64_t m0 = ti * kMb, m1 = std::min(M, m0 + kMb);
      const int64_t n0 = tj * kNb, nw = std::min(N, n0 + kNb) - n0;
      float acc[kMb][kNb];
      for (int64_t m = m0; m < m1; ++m) std::fill(acc[m - m0], acc[m - m0] + nw, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += kKb) {
        const int64_t k1 = std::min(K, k0 + kKb);
        for (int64_t m = m0; m < m1; ++m) {
          float* am = acc[m - m0];
          const float* arow = a + m * la;
          for (int64_t k = k0; k < k1; ++k) {
            const float x = arow[k];
            const float* brow = b + k * lb + n0;
#pragma omp simd
            for (int64_t n = 0; n < nw; ++n) am[n] += x * brow[n];
          }
        }
      }
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t n = 0; n < nw; ++n) {
          const int64_t at = m * ldc + n0 + n;
          float v = alpha * acc[m - m0][n];
          if (beta != 0.0f) v += beta * load(C, c_type, at);
          if (bias != nullptr) v += load(bias, ab_type, n0 + n);
          if (c_type == DType::F32)
            static_cast<float*>(C)[at] = v;
          else if (c_type == DType::F16)
            static_cast<uint16_t*>(C)[at] = math::f32_to_f16_bits(v);
          else
            static_cast<uint16_t*>(C)[at] = math::f32_to_bf16_bits(v);
        }
    }
}

}  // namespace tetra::cpu

#if !defined(TETRA_HAVE_DNNL)
namespace tetra {

struct CpuBackend::GemmCache {};  // the loops cache nothing

CpuBackend::CpuBackend(int threads)
    : threads_(threads > 0 ? threads : omp_get_max_threads()),
      gemm_cache_(std::make_unique<GemmCache>()),
      scratch_(threads_) {
  omp_set_num_threads(threads_);
}

CpuBackend::~CpuBackend() = default;

void CpuBackend::gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                      int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta, void* C, int64_t ldc,
                      DType c_type, const void* bias) {
  cpu::check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc, ab_type, c_type);
  if (M == 0 || N == 0) return;
  if (gemm_amx(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type, bias))
    return;
  static std::once_flag announced;
  std::call_once(announced, [] {
    std::fprintf(stderr, "warning: this tetra was built without oneDNN: CPU GEMMs run on the slow loop fallback "
                         "(kernels/cpu/gemm_loops.cpp), many times slower than oneDNN's; install libdnnl-dev "
                         "and rebuild for a fast CPU backend\n");
  });
  cpu::gemm_loops(threads_, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type, bias);
}

// Without oneDNN the groups run one after another, each on every thread.
void CpuBackend::gemm_problems(bool trans_a, bool trans_b, float alpha, int64_t lda, int64_t ldb, DType ab_type,
                               float beta, int64_t ldc, DType c_type) {
  for (const GemmProblem& p : grouped_)
    gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc, c_type, p.bias);
}

}  // namespace tetra
#endif  // !TETRA_HAVE_DNNL
