// CudaBackend::gemm_grouped and gemm_grouped_k against the CPU backend's, on the MoE experts'
// shapes: the projections (x W_g^T + b_g, then dY W_g) and the weight gradients (dW_g += dY_g^T X_g)
// of 64 fine-grained experts (empty groups and groups of 1 row among them) and of 8 larger ones,
// fp32 and bf16 (fp32 and bf16 C). Each group is one gemm on both backends, so the tolerance is
// test_gemm.cpp's for one gemm: 4 (K + 4) u S plus a 16-bit C's rounding on each side, with
// S = sum_k |a b| (+ |beta c| + |bias|) over the stored inputs.
#include <cmath>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

std::vector<int64_t> expert_rows(int64_t G, int64_t max_rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, max_rows);
  std::vector<int64_t> r(static_cast<size_t>(G));
  for (int64_t& v : r) v = d(rng) % 7 == 0 ? (d(rng) % 2) : d(rng);  // some empty, some of 1 row
  return r;
}

// Requires |got - ref| <= tol(i) for the elements of C that the op writes.
void require_within(const std::vector<float>& ref, const std::vector<float>& got, const std::vector<double>& tol,
                    const std::string& what) {
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double excess = std::isfinite(err) ? err - tol[i] : 1e300;
    if (!(err <= tol[i])) ++bad;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  INFO(what << ": " << bad << " elements out of tolerance; worst at " << worst << ": cpu " << ref[worst] << " cuda "
            << got[worst]);
  REQUIRE(bad == 0);
}

// The projection form: x (R, K) · W_g^T (W_g (N, K)) + b_g, beta 0.
void run_projection(int64_t G, int64_t N, int64_t K, DType ab, DType ct, bool trans_b, uint64_t seed) {
  const std::string what = fmt::format("gemm_grouped G={} N={} K={} tb={} {}->{}", G, N, K, trans_b, type_name(ab),
                                       type_name(ct));
  INFO(what);
  Backends& be = backends();
  const std::vector<int64_t> rows = expert_rows(G, 40, seed);
  int64_t R = 0;
  for (int64_t r : rows) R += r;
  Twin A(random_values(static_cast<size_t>(R * K) + 1, seed + 1), ab);
  Twin W(random_values(static_cast<size_t>(G * N * K), seed + 2), ab);
  Twin bias(random_values(static_cast<size_t>(G * N), seed + 3), ab);
  Twin C(static_cast<size_t>(R * N) + 1, ct);
  const size_t es = dtype_size(ab);
  std::vector<const void*> wc, wg, bc, bg;
  for (int64_t g = 0; g < G; ++g) {
    wc.push_back(static_cast<char*>(W.cpu()) + g * N * K * es), wg.push_back(static_cast<char*>(W.gpu()) + g * N * K * es);
    bc.push_back(static_cast<char*>(bias.cpu()) + g * N * es), bg.push_back(static_cast<char*>(bias.gpu()) + g * N * es);
  }
  const int64_t ldb = trans_b ? K : N;  // W_g stored (N, K), or read as (K, N)
  be.cpu->gemm_grouped(false, trans_b, G, rows.data(), N, K, 1.0f, A.cpu(), K, wc.data(), ldb, ab, 0.0f, C.cpu(), N,
                       ct, bc.data());
  be.gpu->gemm_grouped(false, trans_b, G, rows.data(), N, K, 1.0f, A.gpu(), K, wg.data(), ldb, ab, 0.0f, C.gpu(), N,
                       ct, bg.data());
  const std::vector<float> a = A.cpu_values(), w = W.cpu_values(), b = bias.cpu_values();
  std::vector<double> tol(C.size(), 0.0);
  const std::vector<float> ref = C.cpu_values();
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = o; r < o + rows[g]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double s = std::fabs(b[static_cast<size_t>(g * N + n)]);
        for (int64_t k = 0; k < K; ++k) {
          const double wv = w[static_cast<size_t>(g * N * K + (trans_b ? n * K + k : k * N + n))];
          s += std::fabs(a[static_cast<size_t>(r * K + k)] * wv);
        }
        const size_t i = static_cast<size_t>(r * N + n);
        tol[i] = 4.0 * static_cast<double>(K + 4) * kU * s + std::fabs(ref[i]) * storage_ulp(ct) +
                 s * storage_ulp(ct) / 2.0;
      }
    o += rows[g];
  }
  require_within(ref, C.gpu_values(), tol, what);
}

// The weight-gradient form: dW_g (M, N) += dY_g^T (M, rows) X_g (rows, N), fp32 C, beta 1.
void run_weight_grad(int64_t G, int64_t M, int64_t N, DType ab, uint64_t seed) {
  const std::string what = fmt::format("gemm_grouped_k G={} M={} N={} {}", G, M, N, type_name(ab));
  INFO(what);
  Backends& be = backends();
  const std::vector<int64_t> rows = expert_rows(G, 40, seed);
  int64_t R = 0;
  for (int64_t r : rows) R += r;
  Twin dY(random_values(static_cast<size_t>(R * M) + 1, seed + 1), ab);
  Twin X(random_values(static_cast<size_t>(R * N) + 1, seed + 2), ab);
  const std::vector<float> dw0 = random_values(static_cast<size_t>(G * M * N), seed + 3);
  Twin dW(dw0, DType::F32);
  std::vector<void*> cc, cg;
  for (int64_t g = 0; g < G; ++g) cc.push_back(dW.cpu_f32() + g * M * N), cg.push_back(dW.gpu_f32() + g * M * N);
  be.cpu->gemm_grouped_k(true, false, G, rows.data(), M, N, 1.0f, dY.cpu(), M, X.cpu(), N, ab, 1.0f, cc.data(), N,
                         DType::F32);
  be.gpu->gemm_grouped_k(true, false, G, rows.data(), M, N, 1.0f, dY.gpu(), M, X.gpu(), N, ab, 1.0f, cg.data(), N,
                         DType::F32);
  const std::vector<float> y = dY.cpu_values(), x = X.cpu_values();
  std::vector<double> tol(dW.size(), 0.0);
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const size_t i = static_cast<size_t>(g * M * N + m * N + n);
        double s = std::fabs(dw0[i]);
        for (int64_t k = o; k < o + rows[g]; ++k)
          s += std::fabs(y[static_cast<size_t>(k * M + m)] * x[static_cast<size_t>(k * N + n)]);
        tol[i] = 4.0 * static_cast<double>(rows[g] + 4) * kU * s;
      }
    o += rows[g];
  }
  require_within(dW.cpu_values(), dW.gpu_values(), tol, what);
}

}  // namespace

TEST_CASE("cuda gemm_grouped: MoE expert projections vs cpu", "[cuda][gemm][moe]") {
  uint64_t seed = 900;
  for (const auto& [G, N, K] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 65}, {8, 257, 128}})
    for (bool trans_b : {true, false})
      for (const auto& [ab, ct] : {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::BF16},
                                   {DType::BF16, DType::F32}})
        run_projection(G, N, K, ab, ct, trans_b, seed++);
}

TEST_CASE("cuda gemm_grouped_k: MoE expert weight gradients vs cpu", "[cuda][gemm][moe]") {
  uint64_t seed = 1900;
  for (const auto& [G, M, N] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 65}, {8, 128, 257}})
    for (DType ab : {DType::F32, DType::BF16}) run_weight_grad(G, M, N, ab, seed++);
}

}  // namespace tetra::cuda_testing
