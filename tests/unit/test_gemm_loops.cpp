// The loop GEMM (kernels/cpu/gemm_loops.h, the CPU backend's GEMM in a build without oneDNN)
// against a double-precision triple loop, over every case of the contract: both transposes,
// fp32 and bf16 operands and results, alpha, beta (with C full of NaN when beta == 0, which must
// not be read), a bias, leading dimensions wider than the matrices, and sizes that are no multiple
// of the tiles (M 37 = one tile and a bit, N 300 = 256 + 44, K 261 = 256 + 5). Tested in every
// build, oneDNN or not.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "kernels/common/math.h"
#include "kernels/cpu/gemm_loops.h"
#include "tests/unit/kernel_testing.h"
#include "kernels/common/check.h"

using namespace tetra;

namespace {

// Inputs in [-1, 1], stored as `t` (bf16: rounded; the reference reads the stored values).
struct Stored {
  DType t;
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  Stored(DType type, size_t n, uint32_t seed) : t(type) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    f32.resize(n);
    for (float& x : f32) x = dist(gen);
    if (t == DType::BF16) {
      b16.resize(n);
      for (size_t i = 0; i < n; ++i) {
        b16[i] = math::f32_to_bf16_bits(f32[i]);
        f32[i] = math::bf16_bits_to_f32(b16[i]);
      }
    }
  }
  const void* data() const { return t == DType::F32 ? static_cast<const void*>(f32.data()) : b16.data(); }
  void* data() { return t == DType::F32 ? static_cast<void*>(f32.data()) : b16.data(); }
  double at(int64_t i) const { return f32[static_cast<size_t>(i)]; }
  double read(int64_t i) const {  // the current stored value (C after the call)
    return t == DType::F32 ? f32[static_cast<size_t>(i)] : math::bf16_bits_to_f32(b16[static_cast<size_t>(i)]);
  }
};

}  // namespace

TEST_CASE("gemm_loops matches a double-precision triple loop in every case of the contract", "[gemm]") {
  const int64_t M = 37, N = 300, K = 261;
  int cases = 0;
  for (DType ab : {DType::F32, DType::BF16})
    for (DType ct : {DType::F32, DType::BF16})
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (float beta : {0.0f, 1.5f})
            for (bool with_bias : {false, true}) {
              const float alpha = with_bias ? 0.5f : 1.0f;
              const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 7;
              const Stored A(ab, static_cast<size_t>((ta ? K : M) * lda), 11);
              const Stored B(ab, static_cast<size_t>((tb ? N : K) * ldb), 12);
              const Stored bias(ab, static_cast<size_t>(N), 13);
              Stored C(ct, static_cast<size_t>(M * ldc), 14);
              const Stored C0 = C;
              if (beta == 0.0f)  // must not be read: NaN would poison every result
                for (int64_t i = 0; i < M * ldc; ++i) {
                  C.f32[static_cast<size_t>(i)] = std::numeric_limits<float>::quiet_NaN();
                  if (ct == DType::BF16) C.b16[static_cast<size_t>(i)] = 0x7fc0;
                }
              cpu::gemm_loops(2, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, ab, beta, C.data(), ldc, ct,
                              with_bias ? bias.data() : nullptr);

              std::vector<double> got, want;
              double max_bound = 0.0;
              for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) {
                  double ref = 0.0, abs_sum = 0.0;
                  for (int64_t k = 0; k < K; ++k) {
                    const double p = A.at(ta ? k * lda + m : m * lda + k) * B.at(tb ? n * ldb + k : k * ldb + n);
                    ref += p;
                    abs_sum += std::fabs(p);
                  }
                  ref = alpha * ref + (beta != 0.0f ? beta * C0.at(m * ldc + n) : 0.0) +
                        (with_bias ? bias.at(n) : 0.0);
                  got.push_back(C.read(m * ldc + n));
                  want.push_back(ref);
                  max_bound = std::max(max_bound, abs_sum);
                }
              // fp32 accumulation of K products: each partial sum rounds by at most 2^-24 of the
              // sum of |products| so far, K * 2^-24 * sum|p| in all (<= 261 * 6e-8 * 261 ~ 4e-3
              // at worst, far less in practice); a bf16 result adds half an ulp, at most 2^-8 of
              // the value (8 significant bits).
              const double atol = static_cast<double>(K) * 6e-8 * max_bound + 1e-6;
              const double rtol = ct == DType::BF16 ? 1.0 / 256 : 1e-6;
              tetra_test::expect_close(got, want, {atol, rtol},
                                       fmt::format("ab {} c {} ta {} tb {} beta {} bias {}", dtype_name(ab),
                                                   dtype_name(ct), ta, tb, beta, with_bias));
              // Outside the M x N block the padding of C is untouched.
              bool padding_kept = true;
              for (int64_t m = 0; m < M; ++m)
                for (int64_t n = N; n < ldc; ++n) {
                  const double after = C.read(m * ldc + n), before = beta == 0.0f ? NAN : C0.read(m * ldc + n);
                  if (!(after == before || (std::isnan(after) && std::isnan(before)))) padding_kept = false;
                }
              CHECK(padding_kept);
              ++cases;
            }
  CHECK(cases == 64);
}

TEST_CASE("gemm_loops is bitwise reproducible across thread counts", "[gemm]") {
  const int64_t M = 70, N = 513, K = 300;
  const Stored A(DType::F32, static_cast<size_t>(M * K), 21), B(DType::F32, static_cast<size_t>(K * N), 22);
  std::vector<float> one(static_cast<size_t>(M * N)), two(one.size());
  cpu::gemm_loops(1, false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, DType::F32, 0.0f, one.data(), N, DType::F32,
                  nullptr);
  cpu::gemm_loops(2, false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, DType::F32, 0.0f, two.data(), N, DType::F32,
                  nullptr);
  tetra_test::expect_bitwise_equal(one, two, "1 thread vs 2 threads");
}

TEST_CASE("gemm_loops refuses arguments outside the contract", "[gemm]") {
  float a[4] = {}, b[4] = {}, c[4] = {};
  CHECK_THROWS_AS(cpu::gemm_loops(1, false, false, 2, 2, 2, 1.0f, a, 1, b, 2, DType::F32, 0.0f, c, 2, DType::F32,
                                  nullptr),
                  Error);  // lda < K
  CHECK_THROWS_AS(cpu::gemm_loops(1, false, false, 2, 2, 2, 1.0f, a, 2, b, 2, DType::I32, 0.0f, c, 2, DType::F32,
                                  nullptr),
                  Error);
  CHECK_THROWS_AS(cpu::gemm_loops(1, false, false, 2, 2, 0, 1.0f, a, 2, b, 2, DType::F32, 0.0f, c, 2, DType::F32,
                                  nullptr),
                  Error);
  // M == 0 is an empty product: nothing is touched.
  c[0] = 7.0f;
  cpu::gemm_loops(1, false, false, 0, 2, 2, 1.0f, a, 2, b, 2, DType::F32, 0.0f, c, 2, DType::F32, nullptr);
  CHECK(c[0] == 7.0f);
}
