// CudaBackend::gemm (cuBLASLt) and bias_backward against the CPU backend.
//
// gemm runs every combination of: the four transpose pairs, tight and padded leading dimensions
// (the padding of C must stay untouched), (alpha, beta) in {(1, 0), (1, 1), (-0.5, 1)}, with and
// without bias, F32, BF16 and F16 inputs with an F32 or a same-type output (and F32 inputs with a
// BF16 or F16 output), over shapes with 1, 17, 65 and 768 + 3 in M, N and K; then pointers off the
// 16-byte grid, the tiled staged path (a 16-bit C of another type than A and B: f32 -> bf16 / f16,
// bf16 -> f16, f16 -> bf16) and a bias too long for the scratch area. With beta == 0, C starts as
// NaN: it must not be read.
//
// Tolerance, per element, from S = |alpha| sum_k |a_mk| |b_kn| + |beta| |c_mn| + |bias_n|
// (computed in double from the stored values, i.e. after rounding to bf16 / fp16 where the inputs
// are 16-bit). Products of bf16 or fp16 values are exact in fp32, and fp32 products are rounded once, so both
// backends compute an fp32 sum of the same K + 2 terms, only in different orders; any order
// stays within (K + 2) u S of the exact sum, u = 2^-24 (tensor cores truncate instead of
// rounding: 2u per addition). Two such results differ by at most 4 (K + 4) u S. For K = 1..65
// that is far below TF32's 2^-11 relative error, so an fp32 product that silently used TF32
// fails. A 16-bit C adds each side's final rounding (one ulp, <= 2^-7 |ref| in bf16, 2^-10 in
// fp16) and, where the bias is added after the product was stored, one more rounding of the
// product (half an ulp of S).
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

// (A/B type, C type): what the model uses (same-type or fp32 outputs; fp32 weights with a 16-bit
// output), every 16-bit type.
constexpr std::pair<DType, DType> kTypePairs[] = {
    {DType::F32, DType::F32},  {DType::F32, DType::BF16}, {DType::BF16, DType::F32}, {DType::BF16, DType::BF16},
    {DType::F32, DType::F16},  {DType::F16, DType::F32},  {DType::F16, DType::F16}};

struct GemmCase {
  bool trans_a = false, trans_b = false;
  int64_t M = 1, N = 1, K = 1;
  int64_t pad = 0;      // added to every leading dimension
  int64_t offset = 0;   // elements by which A, B and C start past their allocation
  float alpha = 1.0f, beta = 0.0f;
  bool bias = false;
  DType ab = DType::F32, c = DType::F32;
};

std::string describe(const GemmCase& g) {
  return fmt::format(
      "gemm ta={} tb={} M={} N={} K={} pad={} offset={} alpha={} beta={} bias={} {}->{}",
                     g.trans_a, g.trans_b, g.M, g.N, g.K, g.pad, g.offset, g.alpha, g.beta,
                     g.bias, dtype_name(g.ab), dtype_name(g.c));
}

void run_gemm_case(const GemmCase& g, uint64_t seed) {
  const std::string what = describe(g);
  INFO(what);
  Backends& be = backends();
  const int64_t a_rows = g.trans_a ? g.K : g.M, a_cols = g.trans_a ? g.M : g.K;
  const int64_t b_rows = g.trans_b ? g.N : g.K, b_cols = g.trans_b ? g.K : g.N;
  const int64_t lda = a_cols + g.pad, ldb = b_cols + g.pad, ldc = g.N + g.pad;
  const int64_t off = g.offset;
  Twin A(random_values(off + a_rows * lda, seed), g.ab);
  Twin B(random_values(off + b_rows * ldb, seed + 1), g.ab);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> c0 = g.beta == 0.0f ? std::vector<float>(off + g.M * ldc, nan)
                                         : random_values(off + g.M * ldc, seed + 2);
  Twin C(c0, g.c);
  Twin bias(random_values(g.N, seed + 3), g.ab);
  const size_t ab_size = dtype_size(g.ab), c_size = dtype_size(g.c);
  auto at = [](void* p, int64_t elements, size_t size) {
    return static_cast<void*>(static_cast<char*>(p) + elements * static_cast<int64_t>(size));
  };

  be.cpu->gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, at(A.cpu(), off, ab_size), lda,
               at(B.cpu(), off, ab_size), ldb, g.ab, g.beta, at(C.cpu(), off, c_size), ldc, g.c,
               g.bias ? bias.cpu() : nullptr);
  be.gpu->gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, at(A.gpu(), off, ab_size), lda,
               at(B.gpu(), off, ab_size), ldb, g.ab, g.beta, at(C.gpu(), off, c_size), ldc, g.c,
               g.bias ? bias.gpu() : nullptr);

  // The stored (rounded) inputs, for the scale S.
  const std::vector<float> a = A.cpu_values(), b = B.cpu_values(), bv = bias.cpu_values();
  std::vector<float> c_in = c0;
  if (g.c == DType::BF16)
    for (float& v : c_in) v = math::round_bf16(v);
  if (g.c == DType::F16)
    for (float& v : c_in) v = math::round_f16(v);
  const std::vector<float> ref = C.cpu_values(), got = C.gpu_values();
  const double acc_tol = 4.0 * static_cast<double>(g.K + 4) * kU;
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (int64_t m = 0; m < g.M; ++m) {
    for (int64_t n = 0; n < ldc; ++n) {
      const size_t i = static_cast<size_t>(off + m * ldc + n);
      if (n >= g.N) {  // padding: untouched
        const bool same = std::isnan(c_in[i]) ? std::isnan(got[i]) : got[i] == c_in[i];
        if (!same) ++bad, worst = i, worst_excess = 1e300;
        continue;
      }
      double s = 0.0;
      for (int64_t k = 0; k < g.K; ++k) {
        const double av = a[off + (g.trans_a ? k * lda + m : m * lda + k)];
        const double bw = b[off + (g.trans_b ? n * ldb + k : k * ldb + n)];
        s += std::fabs(av * bw);
      }
      s *= std::fabs(g.alpha);
      if (g.beta != 0.0f) s += std::fabs(g.beta * c_in[i]);
      if (g.bias) s += std::fabs(bv[n]);
      double tol = acc_tol * s;
      tol += std::fabs(ref[i]) * storage_ulp(g.c) + s * storage_ulp(g.c) / 2.0;
      const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
      const double excess = std::isfinite(err) ? err - tol : 1e300;
      if (!(err <= tol)) ++bad;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  INFO(bad << " elements out of tolerance; worst at " << worst << ": cpu " << ref[worst]
            << " cuda " << got[worst]);
  REQUIRE(bad == 0);
}

}  // namespace

TEST_CASE("cuda gemm: transposes, leading dimensions, alpha/beta, bias and types vs cpu",
          "[cuda][gemm]") {
  struct Shape { int64_t M, N, K; };
  const Shape shapes[] = {{1, 1, 1},   {17, 65, 1},  {65, 17, 17}, {1, 771, 65},
                          {771, 1, 17}, {17, 17, 771}, {65, 129, 65}, {128, 96, 64}};
  const std::pair<float, float> scalings[] = {{1.0f, 0.0f}, {1.0f, 1.0f}, {-0.5f, 1.0f}};
  uint64_t seed = 100;
  for (const Shape& sh : shapes)
    for (int t = 0; t < 4; ++t)
      for (int64_t pad : {0, 3})
        for (const auto& [alpha, beta] : scalings)
          for (bool bias : {false, true})
            for (const auto& [ab, c] : kTypePairs) {
              GemmCase g;
              g.trans_a = t & 1;
              g.trans_b = (t >> 1) & 1;
              g.M = sh.M, g.N = sh.N, g.K = sh.K;
              g.pad = pad;
              g.alpha = alpha, g.beta = beta;
              g.bias = bias;
              g.ab = ab, g.c = c;
              run_gemm_case(g, seed += 10);
            }
}

TEST_CASE("cuda gemm: 768 + 3 sizes, a long K (split-K), misaligned pointers", "[cuda][gemm]") {
  uint64_t seed = 9000;
  for (int t = 0; t < 4; ++t)
    for (const auto& [ab, c] : kTypePairs) {
      GemmCase g;
      g.trans_a = t & 1, g.trans_b = (t >> 1) & 1, g.ab = ab, g.c = c;
      g.M = 771, g.N = 65, g.K = 771, g.beta = 1.0f, g.bias = true, g.pad = 8;
      run_gemm_case(g, seed += 10);
      g.M = 32, g.N = 48, g.K = 4099, g.beta = 0.0f, g.bias = true, g.pad = 0;
      run_gemm_case(g, seed += 10);
      // A, B and C one element past a 256-byte boundary: 4- or 2-byte aligned operands.
      g.M = 33, g.N = 40, g.K = 24, g.beta = 1.0f, g.bias = false, g.offset = 1;
      run_gemm_case(g, seed += 10);
    }
}

// The MoE expert GEMMs: the row count of each expert changes every step (M of the forward and
// the input gradient, K of the weight gradient). Row counts of one bucket share a plan (its
// layouts retargeted, the algorithm checked), so 48 row counts build only a few plans, and every
// product still matches the CPU.
TEST_CASE("cuda gemm: changing row counts share their bucket's plan", "[cuda][gemm]") {
  auto& gpu = dynamic_cast<CudaBackend&>(*backends().gpu);
  const CudaBackend::GemmPlanStats before = gpu.gemm_plan_stats();
  uint64_t seed = 12000;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int64_t> rows(520, 1000);  // buckets of 64 rows: 8 of them
  int64_t products = 0;
  for (int i = 0; i < 16; ++i) {
    const int64_t r = rows(rng);
    GemmCase fwd;  // y (r, 96) = x (r, 128) w (128, 96)
    fwd.ab = DType::BF16, fwd.c = DType::BF16, fwd.M = r, fwd.N = 96, fwd.K = 128;
    run_gemm_case(fwd, seed += 10);
    GemmCase dx = fwd;  // dx (r, 128) = dy (r, 96) w^T
    dx.trans_b = true, dx.N = 128, dx.K = 96;
    run_gemm_case(dx, seed += 10);
    GemmCase dw;  // dw (128, 96) += x^T (128, r) dy (r, 96), fp32
    dw.ab = DType::BF16, dw.c = DType::F32, dw.trans_a = true, dw.M = 128, dw.N = 96, dw.K = r;
    dw.beta = 1.0f;
    run_gemm_case(dw, seed += 10);
    products += 3;
  }
  const CudaBackend::GemmPlanStats after = gpu.gemm_plan_stats();
  INFO("plans built " << after.built - before.built << ", retargeted "
                      << after.retargeted - before.retargeted << ", heuristic re-asked "
                      << after.reheuristic - before.reheuristic << " for " << products
                      << " products");
  CHECK(after.built - before.built <= 3 * 8);
  CHECK(after.retargeted - before.retargeted > 0);
}

TEST_CASE("cuda gemm: the staged path between 16-bit types (bf16 -> f16, f16 -> bf16)", "[cuda][gemm]") {
  uint64_t seed = 7100;
  for (const auto& [ab, c] : {std::pair{DType::BF16, DType::F16}, std::pair{DType::F16, DType::BF16}})
    for (bool bias : {false, true}) {
      GemmCase g;
      g.ab = ab, g.c = c, g.bias = bias, g.beta = 1.0f, g.trans_b = true;
      g.M = 65, g.N = 129, g.K = 65;
      run_gemm_case(g, seed += 10);
    }
}

TEST_CASE("cuda gemm: f32 -> bf16 / f16 in several staging tiles, a bias longer than the scratch area",
          "[cuda][gemm]") {
  for (DType c16 : {DType::BF16, DType::F16}) {
    GemmCase g;
    g.ab = DType::F32, g.c = c16, g.bias = true, g.beta = 1.0f;
    g.M = 2049, g.N = 2049, g.K = 5;  // 2049^2 > 4 Mi floats: two row tiles
    run_gemm_case(g, 7001);
    g.M = 2, g.N = (int64_t{4} << 20) + 3, g.K = 2, g.beta = 0.0f, g.trans_b = true;  // column tiles
    run_gemm_case(g, 7002);
    g.ab = c16, g.c = DType::F32, g.trans_b = false;  // bias of 1 Mi + 3 floats: no widening
    g.M = 3, g.N = (int64_t{1} << 20) + 3, g.K = 3;
    run_gemm_case(g, 7003);
  }
}

// bias_backward: dbias[j] += sum_i dout[i, j]. Each backend sums N + 1 fp32 terms per column in
// its own order: each within (N + 1) u sum_i |terms| of the exact sum, so they differ by at most
// 2 (N + 2) u S_j, S_j = |dbias0_j| + sum_i |dout_ij|. Reruns on the GPU must be bitwise equal.
TEST_CASE("cuda bias_backward vs cpu, deterministic", "[cuda][gemm]") {
  Backends& be = backends();
  struct Shape { int64_t N, OC, offset; };
  const Shape shapes[] = {{1, 1, 0},      {17, 65, 0}, {771, 771, 0},  {4099, 768, 0},
                          {4099, 768, 1}, {65, 3, 0},  {200003, 5, 0}, {1000, 2048, 0},
                          {3, (int64_t{1} << 20) + 3, 0}};
  uint64_t seed = 300;
  for (const Shape& sh : shapes) {
    for (DType act : {DType::F32, DType::BF16, DType::F16}) {
      INFO("bias_backward N=" << sh.N << " OC=" << sh.OC << " offset=" << sh.offset << " "
                              << dtype_name(act));
      const size_t n = static_cast<size_t>(sh.offset + sh.N * sh.OC);
      Twin dout(random_values(n, seed += 7), act);
      const std::vector<float> db0 = random_values(static_cast<size_t>(sh.OC), seed += 7);
      Twin dbias(db0, DType::F32), dbias2(db0, DType::F32);
      const size_t es = dtype_size(act);
      const void* dc = static_cast<char*>(dout.cpu()) + sh.offset * es;
      const void* dg = static_cast<char*>(dout.gpu()) + sh.offset * es;
      be.cpu->bias_backward(dbias.cpu_f32(), dc, sh.N, sh.OC, act);
      be.gpu->bias_backward(dbias.gpu_f32(), dg, sh.N, sh.OC, act);
      be.gpu->bias_backward(dbias2.gpu_f32(), dg, sh.N, sh.OC, act);
      const std::vector<float> x = dout.cpu_values(), ref = dbias.cpu_values(),
                               got = dbias.gpu_values(), again = dbias2.gpu_values();
      REQUIRE(got == again);
      std::vector<double> s(static_cast<size_t>(sh.OC));
      for (int64_t j = 0; j < sh.OC; ++j) s[j] = std::fabs(db0[j]);
      for (int64_t i = 0; i < sh.N; ++i)
        for (int64_t j = 0; j < sh.OC; ++j) s[j] += std::fabs(x[sh.offset + i * sh.OC + j]);
      size_t bad = 0, worst = 0;
      double worst_excess = -1e300;
      for (int64_t j = 0; j < sh.OC; ++j) {
        const double tol = 2.0 * static_cast<double>(sh.N + 2) * kU * s[j];
        const double err = std::fabs(static_cast<double>(got[j]) - ref[j]);
        if (!(err <= tol)) ++bad;
        if (err - tol > worst_excess) worst_excess = err - tol, worst = j;
      }
      INFO(bad << " columns out of tolerance; worst " << worst << ": cpu " << ref[worst]
                << " cuda " << got[worst]);
      REQUIRE(bad == 0);
    }
  }
}

// gemm_gelu / gemm_dgelu: bf16 and fp16 through cuBLASLt's GELU_AUX[_BIAS] / DGELU epilogues (N % 8 == 0),
// fp32 and N % 8 != 0 through the product and the GELU kernels. Against the CPU's unfused order:
//   pre: as gemm (acc = 4 (K + 4) u S, plus each side's bf16 rounding 2^-7 |ref| in bf16);
//   out = gelu(pre): the GPU applies GELU to the fp32 accumulator, the CPU to its bf16-rounded
//     pre, so they differ by |gelu'| <= 1.13 times pre's difference (acc S + 2^-8 |pre|), plus
//     cuBLASLt's tanh (taken as accurate to 2^-11 relative, the hardware tanh.approx bound:
//     0.5 |pre| 2^-11), plus each side's final rounding (2^-7 |ref|);
//   dpre = g gelu'(pre), g = op(A)·op(B): the CPU rounds g to bf16 first (2^-8 |g|), gelu' is off
//     by at most 2^-10 (1 + |pre|) under the approximate tanh, plus the final roundings.
// fp16 is held to the bf16 bounds (its roundings are 8x finer; the tanh term is the same).
// In fp32 both backends run the same shared GELU math on the same pre, so only acc counts
// (scaled by 1.13, plus 2e-7 (1 + |pre|) for the two backends' tanh evaluation orders).
TEST_CASE("cuda gemm_gelu / gemm_dgelu vs cpu: epilogues in bf16 and fp16, unfused in fp32 and odd N",
          "[cuda][gemm]") {
  Backends& be = backends();
  struct Shape { int64_t M, N, K; };
  const Shape shapes[] = {{17, 64, 33}, {128, 96, 64}, {65, 24, 771}, {33, 13, 17}, {1, 8, 1}};
  uint64_t seed = 5000;
  for (const Shape& sh : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool with_bias : {false, true})
        for (DType act : {DType::F32, DType::BF16, DType::F16}) {
          const bool ta = t & 1, tb = (t >> 1) & 1;
          INFO("gemm_gelu ta=" << ta << " tb=" << tb << " M=" << sh.M << " N=" << sh.N << " K=" << sh.K
                               << " bias=" << with_bias << " " << dtype_name(act));
          const int64_t lda = ta ? sh.M : sh.K, ldb = tb ? sh.K : sh.N;
          const float scale = 1.5f / std::sqrt(static_cast<float>(sh.K));
          Twin A(random_values(static_cast<size_t>(sh.M * sh.K), seed += 7), act);
          Twin B(random_values(static_cast<size_t>(sh.K * sh.N), seed += 7, scale), act);
          Twin bias(random_values(static_cast<size_t>(sh.N), seed += 7, 0.5f), act);
          const size_t mn = static_cast<size_t>(sh.M * sh.N);
          Twin pre(mn, act), out(mn, act), dpre(mn, act), dpre2(mn, act);
          Twin pre_in(random_values(mn, seed += 7, 3.0f), act);
          const void* bc = with_bias ? bias.cpu() : nullptr;
          const void* bg = with_bias ? bias.gpu() : nullptr;
          be.cpu->gemm_gelu(ta, tb, sh.M, sh.N, sh.K, A.cpu(), lda, B.cpu(), ldb, bc, pre.cpu(), out.cpu(), act);
          be.gpu->gemm_gelu(ta, tb, sh.M, sh.N, sh.K, A.gpu(), lda, B.gpu(), ldb, bg, pre.gpu(), out.gpu(), act);
          be.cpu->gemm_dgelu(ta, tb, sh.M, sh.N, sh.K, A.cpu(), lda, B.cpu(), ldb, pre_in.cpu(), dpre.cpu(), act);
          be.gpu->gemm_dgelu(ta, tb, sh.M, sh.N, sh.K, A.gpu(), lda, B.gpu(), ldb, pre_in.gpu(), dpre.gpu(), act);
          be.gpu->gemm_dgelu(ta, tb, sh.M, sh.N, sh.K, A.gpu(), lda, B.gpu(), ldb, pre_in.gpu(), dpre2.gpu(), act);
          REQUIRE(dpre.gpu_values() == dpre2.gpu_values());  // reruns are bitwise equal

          const std::vector<float> a = A.cpu_values(), b = B.cpu_values(), bv = bias.cpu_values(),
                                   pin = pre_in.cpu_values();
          const std::vector<float> ref_pre = pre.cpu_values(), got_pre = pre.gpu_values(),
                                   ref_out = out.cpu_values(), got_out = out.gpu_values(),
                                   ref_d = dpre.cpu_values(), got_d = dpre.gpu_values();
          const bool half = act != DType::F32;
          const double acc = 4.0 * static_cast<double>(sh.K + 4) * kU;
          size_t bad = 0;
          std::string first;
          for (int64_t m = 0; m < sh.M; ++m)
            for (int64_t n = 0; n < sh.N; ++n) {
              double s = 0.0, g = 0.0;
              for (int64_t k = 0; k < sh.K; ++k) {
                const double x = a[static_cast<size_t>(ta ? k * lda + m : m * lda + k)];
                const double y = b[static_cast<size_t>(tb ? n * ldb + k : k * ldb + n)];
                s += std::fabs(x * y);
                g += x * y;
              }
              const size_t i = static_cast<size_t>(m * sh.N + n);
              const double sp = s + (with_bias ? std::fabs(bv[static_cast<size_t>(n)]) : 0.0);
              const double p = ref_pre[i];
              double tol_pre = acc * sp, tol_out, tol_d;
              if (half) {
                tol_pre += std::fabs(p) / 128.0;
                tol_out = 1.13 * (acc * sp + std::fabs(p) / 256.0) + std::fabs(p) / 4096.0 +
                          std::fabs(ref_out[i]) / 128.0;
                tol_d = 1.13 * (acc * s + std::fabs(g) / 256.0) +
                        std::fabs(g) * (1.0 + std::fabs(pin[i])) / 1024.0 + std::fabs(ref_d[i]) / 128.0;
              } else {
                tol_out = 1.13 * acc * sp + 2e-7 * (1.0 + std::fabs(p)) + 2.0 * kU * std::fabs(ref_out[i]);
                tol_d = 1.13 * acc * s + 2e-7 * (1.0 + std::fabs(pin[i])) * std::fabs(g) +
                        2.0 * kU * std::fabs(ref_d[i]);
              }
              const struct { const char* what; double ref, got, tol; } checks[] = {
                  {"pre", ref_pre[i], got_pre[i], tol_pre},
                  {"out", ref_out[i], got_out[i], tol_out},
                  {"dpre", ref_d[i], got_d[i], tol_d}};
              for (const auto& c : checks)
                if (!(std::fabs(c.got - c.ref) <= c.tol + 1e-30)) {
                  if (bad++ == 0)
                    first = fmt::format("{} at ({}, {}): cpu {} cuda {} tol {}", c.what, m, n, c.ref, c.got, c.tol);
                }
            }
          INFO(bad << " values out of tolerance; first: " << first);
          REQUIRE(bad == 0);
        }
}

}  // namespace tetra::cuda_testing
