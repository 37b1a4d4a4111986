// CPU backend: GEMM against a plain triple loop; attention forward against a naive loop that
// materialises the scores, backward against central finite differences; RoPE against a plain loop
// and its adjoint; bf16 storage against fp32.
//
// The CPU backend's memory is host memory, so host vectors are handed to the ops directly.
#include <catch2/catch.hpp>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/attention_testing.h"
#include "kernels/common/check.h"

using namespace tetra;
using namespace tetra::attn_testing;

namespace {

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------
struct GemmCase {
  bool trans_a, trans_b;
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  bool bias;
};

// Reference C = alpha op(A) op(B) + beta C + bias in double, and the bound on any fp32
// summation's error: (K + 2) u sum|terms| with u = 2^-24 (Higham's gamma_K for a sum of K
// products, plus the scale, the beta term and the bias), doubled for margin. It holds for any
// order of summation, blocked or not.
void reference_gemm(const GemmCase& g, const std::vector<float>& A, const std::vector<float>& B,
                    const std::vector<float>& bias, const std::vector<float>& C0,
                    std::vector<double>& ref, std::vector<double>& bound) {
  ref.assign(g.M * g.N, 0.0);
  bound.assign(g.M * g.N, 0.0);
  const double u = std::ldexp(1.0, -24);
  for (int64_t m = 0; m < g.M; ++m)
    for (int64_t n = 0; n < g.N; ++n) {
      double acc = 0.0, mag = 0.0;
      for (int64_t k = 0; k < g.K; ++k) {
        double a = g.trans_a ? A[k * g.lda + m] : A[m * g.lda + k];
        double b = g.trans_b ? B[n * g.ldb + k] : B[k * g.ldb + n];
        acc += a * b;
        mag += std::fabs(a * b);
      }
      double v = g.alpha * acc;
      mag = std::fabs(g.alpha) * mag;
      if (g.beta != 0.0f) {
        v += g.beta * static_cast<double>(C0[m * g.ldc + n]);
        mag += std::fabs(g.beta * static_cast<double>(C0[m * g.ldc + n]));
      }
      if (g.bias) {
        v += bias[n];
        mag += std::fabs(bias[n]);
      }
      ref[m * g.N + n] = v;
      bound[m * g.N + n] = 2.0 * (g.K + 2) * u * mag + 1e-30;
    }
}

// Runs one case with A/B of ab_type and C of c_type. Inputs are drawn in fp32; for BF16 they are
// rounded to bf16 first and the reference runs on the rounded values (bf16 products are exact in
// fp32, so the same fp32 accumulation bound applies). A BF16 output adds one rounding: 2^-8 |c|,
// the exact worst case of round-to-nearest, which bf16 outputs do come close to.
void run_gemm_case(Backend& be, const GemmCase& g, DType ab_type, DType c_type, uint32_t seed) {
  const int64_t a_rows = g.trans_a ? g.K : g.M, b_rows = g.trans_b ? g.N : g.K;
  std::vector<float> A = random_floats(a_rows * g.lda, seed);
  std::vector<float> B = random_floats(b_rows * g.ldb, seed + 1);
  std::vector<float> bias = random_floats(g.N, seed + 2);
  std::vector<float> C0 = random_floats(g.M * g.ldc, seed + 3);
  if (ab_type == DType::BF16) {
    A = round_bf16(A);
    B = round_bf16(B);
    bias = round_bf16(bias);
  }
  if (c_type == DType::BF16) C0 = round_bf16(C0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (g.beta == 0.0f) {
    // beta == 0 must not read C: fill it with NaN, which would poison any read.
    for (float& x : C0) x = nan;
  } else {
    // The columns past N inside ldc are not C's: NaN there must survive untouched (checked
    // after the call in both cases).
    for (int64_t m = 0; m < g.M; ++m)
      for (int64_t n = g.N; n < g.ldc; ++n) C0[m * g.ldc + n] = nan;
  }
  std::vector<double> ref, bound;
  reference_gemm(g, A, B, bias, C0, ref, bound);

  std::vector<float> got(g.M * g.N);
  std::vector<float> c_pad(g.M * g.ldc);  // what the op left in C's padding columns
  auto run = [&](const void* a, const void* b, const void* bi, void* c) {
    be.gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, a, g.lda, b, g.ldb, ab_type, g.beta, c,
            g.ldc, c_type, g.bias ? bi : nullptr);
  };
  if (ab_type == DType::F32 && c_type == DType::F32) {
    std::vector<float> C = C0;
    run(A.data(), B.data(), bias.data(), C.data());
    c_pad = C;
  } else {
    std::vector<bf16> Ab = to_bf16(A), Bb = to_bf16(B), biasb = to_bf16(bias);
    const void* a = ab_type == DType::BF16 ? static_cast<const void*>(Ab.data()) : A.data();
    const void* b = ab_type == DType::BF16 ? static_cast<const void*>(Bb.data()) : B.data();
    const void* bi = ab_type == DType::BF16 ? static_cast<const void*>(biasb.data()) : bias.data();
    if (c_type == DType::F32) {
      std::vector<float> C = C0;
      run(a, b, bi, C.data());
      c_pad = C;
    } else {
      std::vector<bf16> C = to_bf16(C0);
      run(a, b, bi, C.data());
      c_pad = to_f32(C);
    }
  }
  for (int64_t m = 0; m < g.M; ++m)
    for (int64_t n = 0; n < g.ldc; ++n) {
      if (n < g.N) got[m * g.N + n] = c_pad[m * g.ldc + n];
      else REQUIRE(std::isnan(c_pad[m * g.ldc + n]));
    }
  INFO("trans_a=" << g.trans_a << " trans_b=" << g.trans_b << " M=" << g.M << " N=" << g.N
                  << " K=" << g.K << " alpha=" << g.alpha << " beta=" << g.beta
                  << " bias=" << g.bias << " ab=" << dtype_name(ab_type)
                  << " c=" << dtype_name(c_type));
  const bool c_bf16 = c_type == DType::BF16;
  require_close("gemm", got, ref, [&](size_t i) {
    return bound[i] + (c_bf16 ? std::ldexp(std::fabs(ref[i]), -8) : 0.0);
  });
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  // {M, N, K, ld padding}. The last size has rows exactly N wide (ldb of 2 KiB in fp32): the
  // layout the backend repacks before calling oneDNN.
  const int64_t sizes[][4] = {{7, 13, 5, 1}, {33, 65, 17, 1}, {64, 48, 96, 1}, {80, 512, 40, 0}};
  const float ab[][2] = {{1.0f, 0.0f}, {1.0f, 1.0f}, {0.75f, 0.0f}, {-1.5f, 1.0f}, {1.0f, 0.5f}};
  for (auto& s : sizes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (auto& alpha_beta : ab)
          for (int bias = 0; bias < 2; ++bias) {
            const int64_t M = s[0], N = s[1], K = s[2], pad = s[3];
            // Leading dimensions larger than the stored row width.
            const int64_t lda = (ta ? M : K) + 3 * pad, ldb = (tb ? K : N) + 5 * pad,
                          ldc = N + 2 * pad;
            cases.push_back({ta == 1, tb == 1, M, N, K, lda, ldb, ldc, alpha_beta[0],
                             alpha_beta[1], bias == 1});
          }
  return cases;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
TEST_CASE("gemm: fp32 against a triple loop, every transpose, odd sizes, ld, alpha, beta, bias",
          "[kernels]") {
  auto be = make_cpu_backend(0);
  uint32_t seed = 100;
  for (const GemmCase& g : gemm_cases()) run_gemm_case(*be, g, DType::F32, DType::F32, seed += 7);
  // The primitive cache swaps data handles per call: a second call of a cached shape on other
  // buffers must see the new data.
  for (const GemmCase& g : gemm_cases()) run_gemm_case(*be, g, DType::F32, DType::F32, seed += 7);
}

TEST_CASE("gemm: fp32 with a B too tall for one padded copy, multiplied in slices of K",
          "[kernels]") {
  // B (K, N) with rows 1 KiB apart (ldb = 256 floats) is copied to padded rows at most 8192 rows
  // at a time (the tied output layer's dX GEMM, K = vocabulary): K = 2 * 8192 + 100 takes three
  // slices, whose products accumulate into C. alpha scales each slice, beta and the bias count
  // once. N is small to keep the double reference quick.
  auto be = make_cpu_backend(0);
  const int64_t M = 64, N = 16, K = 2 * 8192 + 100, ldb = 256;
  uint32_t seed = 900;
  for (int ta = 0; ta < 2; ++ta)
    for (float beta : {0.0f, 0.5f}) {
      INFO("trans_a=" << ta << " beta=" << beta);
      const GemmCase g{ta == 1, false, M, N, K, ta ? M : K, ldb, N + 3, 0.75f, beta, true};
      run_gemm_case(*be, g, DType::F32, DType::F32, seed += 7);
    }
}

TEST_CASE("gemm: bf16 inputs against the loop on bf16-rounded inputs, F32 and BF16 outputs",
          "[kernels]") {
  auto be = make_cpu_backend(0);
  uint32_t seed = 900;
  for (const GemmCase& g : gemm_cases()) {
    run_gemm_case(*be, g, DType::BF16, DType::F32, seed += 7);
    run_gemm_case(*be, g, DType::BF16, DType::BF16, seed += 7);
    run_gemm_case(*be, g, DType::F32, DType::BF16, seed += 7);
  }
}

TEST_CASE("gemm: row counts and inner dimensions cut into pieces (above 64, not a multiple of it) match the loop",
          "[kernels]") {
  // kernels/cpu/gemm.cpp runs M = 64 q + r as 64 q rows and r's powers of two (rows of C apart),
  // and such a K as pieces accumulated into an fp32 C: every offset and transpose against the
  // double loop, with bias and beta (which the pieces after the first along K must not repeat).
  auto be = make_cpu_backend(0);
  uint32_t seed = 4100;
  for (const int64_t M : {65, 127, 300})
    for (const int64_t K : {48, 131})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (const float beta : {0.0f, 0.5f}) {
            const int64_t N = 40;
            INFO("M=" << M << " K=" << K << " trans_a=" << ta << " trans_b=" << tb << " beta=" << beta);
            const GemmCase g{ta == 1, tb == 1, M, N, K, (ta ? M : K) + 3, (tb ? K : N) + 5, N + 7, 0.75f, beta, true};
            run_gemm_case(*be, g, DType::F32, DType::F32, seed += 7);
            run_gemm_case(*be, g, DType::BF16, DType::F32, seed += 7);
            run_gemm_case(*be, g, DType::BF16, DType::BF16, seed += 7);
          }
}

TEST_CASE("gemm: unsupported types and bad leading dimensions are rejected", "[kernels]") {
  auto be = make_cpu_backend(0);
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  CHECK_THROWS_AS(be->gemm(false, false, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, DType::I32,
                           0.0f, c.data(), 4, DType::F32),
                  Error);
  CHECK_THROWS_AS(be->gemm(false, false, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, DType::F32,
                           0.0f, c.data(), 4, DType::I32),
                  Error);
  CHECK_THROWS_AS(be->gemm(false, false, 4, 4, 4, 1.0f, a.data(), 3, b.data(), 4, DType::F32,
                           0.0f, c.data(), 4, DType::F32),
                  Error);
  CHECK_THROWS_AS(be->gemm(false, true, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, DType::F32,
                           0.0f, c.data(), 3, DType::F32),
                  Error);
  // bf16 too (on CPUs with AMX it takes another kernel, which must not run on bad arguments).
  CHECK_THROWS_AS(be->gemm(false, false, 4, 4, 4, 1.0f, a.data(), 3, b.data(), 4, DType::BF16,
                           0.0f, c.data(), 4, DType::F32),
                  Error);
  CHECK_THROWS_AS(be->gemm(true, false, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 3, DType::BF16,
                           0.0f, c.data(), 4, DType::BF16),
                  Error);
  CHECK_THROWS_AS(be->gemm(false, true, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, DType::BF16,
                           0.0f, c.data(), 3, DType::BF16),
                  Error);
}

TEST_CASE("attention: forward matches a naive loop (MHA, GQA, MQA, one and several blocks)",
          "[kernels]") {
  auto be = make_cpu_backend(0);
  // T = 19 fits in one tile; T = 150 spans three tiles with a partial last one, and HS = 24 is
  // not a whole number of vectors. q and k in (-2, 2) spread the scores so the running max of the
  // online softmax changes from block to block.
  const AttnDims dims[] = {{2, 19, 4, 2, 8}, {2, 19, 4, 1, 8}, {2, 19, 4, 4, 8},
                           {1, 150, 4, 2, 24}, {2, 130, 2, 2, 16}};
  uint32_t seed = 1;
  for (const AttnDims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS);
    std::vector<float> qkv = random_floats(d.qkv_size(), seed++, -2.0f, 2.0f);
    std::vector<double> out, lse;
    naive_attention<float>(d, qkv, &out, &lse, nullptr, nullptr);
    AttnRun r = run_attention(*be, d, qkv, nullptr, DType::F32);
    // fp32 kernel vs double: a softmax-weighted mean of O(1) values and a log-sum-exp of
    // O(1) scores, both with relative error a few times 2^-24 per operation over <= T terms
    // (the polynomial exp adds ~2 ulp): 2e-5 absolute is ~100x that, far below any real bug.
    require_close("out", r.out, out, [](size_t) { return 2e-5; });
    require_close("lse", r.lse, lse, [](size_t) { return 2e-5; });
  }
}

TEST_CASE("attention: backward matches finite differences of sum(out * R)", "[kernels]") {
  auto be = make_cpu_backend(0);
  const AttnDims dims[] = {{2, 19, 4, 2, 8}, {2, 19, 4, 1, 8}, {2, 19, 4, 4, 8}};
  uint32_t seed = 50;
  for (const AttnDims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS);
    std::vector<float> qkv = random_floats(d.qkv_size(), seed++);
    std::vector<float> R = random_floats(d.out_size(), seed++);
    AttnRun r = run_attention(*be, d, qkv, &R, DType::F32);

    // (1) The objective evaluated in double by the naive forward, on every element of qkv.
    // Central differences have truncation error eps^2/6 |f'''| ~ 1e-9 at eps = 1e-4 (f''' is
    // O(1) for O(1) scores), and double rounding adds ~1e-16 |L| / eps ~ 1e-11, so fd is the
    // true gradient to ~1e-8. The fp32 kernel may then differ by its own rounding: a few ulps of
    // sums of <= T*HS O(1) terms, so 5e-5 absolute (+1e-4 relative) is a bound with margin.
    std::vector<double> qkv_d(qkv.begin(), qkv.end());
    std::vector<double> fd(d.qkv_size());
    std::vector<double> out;
    auto objective = [&](const std::vector<double>& x) {
      naive_attention<double>(d, x, &out, nullptr, nullptr, nullptr);
      double L = 0.0;
      for (size_t i = 0; i < out.size(); ++i) L += out[i] * R[i];
      return L;
    };
    const double eps = 1e-4;
    for (size_t i = 0; i < qkv_d.size(); ++i) {
      const double x0 = qkv_d[i];
      qkv_d[i] = x0 + eps;
      double lp = objective(qkv_d);
      qkv_d[i] = x0 - eps;
      double lm = objective(qkv_d);
      qkv_d[i] = x0;
      fd[i] = (lp - lm) / (2.0 * eps);
    }
    REQUIRE(max_abs(fd) > 0.1);  // the check is not vacuous
    require_close("dqkv vs fd (double objective)", r.dqkv, fd,
                  [&](size_t i) { return 5e-5 + 1e-4 * std::fabs(fd[i]); });

    // (2) The same through the kernel's own fp32 forward, the objective summed in double: the
    // gradient must be that of the function the forward computes. fp32 outputs carry ~1e-7
    // relative noise; only the <= T*G*HS outputs that depend on a perturbed element change, so
    // the noise in L is ~1e-5 at worst and fd's error ~1e-5 / (2 eps) = 5e-4 at eps = 1e-2,
    // while truncation is ~eps^2/6 |f'''| ~ 2e-5. Tolerance 2e-3 + 1e-2 |g| covers both.
    // Thousands of tiny forwards: one thread avoids a team barrier per call (and, like every
    // backend constructor, sets the OpenMP thread count, which is restored afterwards).
    const int saved_threads = omp_get_max_threads();
    auto be1 = make_cpu_backend(1);
    std::vector<float> qkv_f = qkv;
    std::vector<float> outf(d.out_size()), lsef(d.lse_size());
    auto objective_f = [&](const std::vector<float>& x) {
      be1->attention_forward(outf.data(), lsef.data(), x.data(), d.B, d.T, d.NH, d.NKV, d.HS,
                            DType::F32);
      double L = 0.0;
      for (size_t i = 0; i < outf.size(); ++i) L += static_cast<double>(outf[i]) * R[i];
      return L;
    };
    std::vector<double> fd32(d.qkv_size());
    for (size_t i = 0; i < qkv_f.size(); ++i) {
      const float x0 = qkv_f[i];
      qkv_f[i] = x0 + 1e-2f;
      const double xp = qkv_f[i];
      double lp = objective_f(qkv_f);
      qkv_f[i] = x0 - 1e-2f;
      const double xm = qkv_f[i];
      double lm = objective_f(qkv_f);
      qkv_f[i] = x0;
      fd32[i] = (lp - lm) / (xp - xm);  // the step actually taken in fp32
    }
    omp_set_num_threads(saved_threads);
    require_close("dqkv vs fd (kernel forward)", r.dqkv, fd32,
                  [&](size_t i) { return 2e-3 + 1e-2 * std::fabs(fd32[i]); });
  }
}

TEST_CASE("attention: backward over several blocks matches the naive backward", "[kernels]") {
  // Finite differences on every element would be slow here; the naive backward is itself
  // checked against finite differences below on a small case, then trusted on larger ones.
  auto be = make_cpu_backend(0);
  {
    const AttnDims d{1, 7, 2, 1, 4};
    std::vector<float> qkv = random_floats(d.qkv_size(), 7), R = random_floats(d.out_size(), 8);
    std::vector<double> dq;
    naive_attention<float>(d, qkv, nullptr, nullptr, &R, &dq);
    std::vector<double> x(qkv.begin(), qkv.end()), out;
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i], eps = 1e-5;
      double l[2];
      for (int s = 0; s < 2; ++s) {
        x[i] = x0 + (s == 0 ? eps : -eps);
        naive_attention<double>(d, x, &out, nullptr, nullptr, nullptr);
        l[s] = 0.0;
        for (size_t o = 0; o < out.size(); ++o) l[s] += out[o] * R[o];
      }
      x[i] = x0;
      // Double central differences at eps = 1e-5: truncation ~1e-11, rounding ~1e-11.
      INFO("element " << i);
      REQUIRE(std::fabs((l[0] - l[1]) / (2 * eps) - dq[i]) < 1e-8);
    }
  }
  const AttnDims dims[] = {{1, 150, 4, 2, 24}, {2, 130, 2, 2, 16}, {1, 129, 4, 1, 32}};
  uint32_t seed = 70;
  for (const AttnDims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS);
    std::vector<float> qkv = random_floats(d.qkv_size(), seed++, -2.0f, 2.0f);
    std::vector<float> R = random_floats(d.out_size(), seed++);
    std::vector<double> dqkv;
    naive_attention<float>(d, qkv, nullptr, nullptr, &R, &dqkv);
    AttnRun r = run_attention(*be, d, qkv, &R, DType::F32);
    // fp32 sums of up to T * (NH / NKV) terms of O(1): 1e-4 absolute + 1e-4 relative.
    require_close("dqkv", r.dqkv, dqkv, [&](size_t i) { return 1e-4 + 1e-4 * std::fabs(dqkv[i]); });
  }
}

TEST_CASE("attention: results do not depend on the number of threads", "[kernels]") {
  const AttnDims d{2, 150, 4, 2, 24};
  std::vector<float> qkv = random_floats(d.qkv_size(), 11), R = random_floats(d.out_size(), 12);
  const int saved = omp_get_max_threads();
  auto one = make_cpu_backend(1);
  AttnRun r1 = run_attention(*one, d, qkv, &R, DType::F32);
  auto many = make_cpu_backend(3);  // more threads than cores still schedules differently
  AttnRun r3 = run_attention(*many, d, qkv, &R, DType::F32);
  omp_set_num_threads(saved);
  CHECK(std::memcmp(r1.out.data(), r3.out.data(), r1.out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(r1.lse.data(), r3.lse.data(), r1.lse.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(r1.dqkv.data(), r3.dqkv.data(), r1.dqkv.size() * sizeof(float)) == 0);
}

TEST_CASE("attention: bf16 storage matches fp32 on the same rounded inputs", "[kernels]") {
  // The flash kernels in bf16 (the path of CPUs without AMX; attention_amx has its own tests).
  auto cpu = std::make_unique<CpuBackend>(0);
  cpu->set_amx_attention(false);
  std::unique_ptr<Backend> be = std::move(cpu);
  const AttnDims dims[] = {{2, 19, 4, 2, 8}, {1, 150, 4, 1, 24}};
  uint32_t seed = 30;
  for (const AttnDims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS);
    std::vector<float> qkv = round_bf16(random_floats(d.qkv_size(), seed++));
    std::vector<float> R = round_bf16(random_floats(d.out_size(), seed++));
    AttnRun f = run_attention(*be, d, qkv, &R, DType::F32);
    AttnRun h = run_attention(*be, d, qkv, &R, DType::BF16);
    // Same fp32 math on identical inputs; the bf16 run differs by storage roundings only
    // (round-to-nearest to bf16 is off by at most 2^-8 relative, an exact bound, so `out`
    // may come close to it): out by that one rounding; lse not at all (scores are identical);
    // dqkv by its own rounding plus the rounded out used in D_i = dout_i . out_i, which shifts
    // every ds_ij by p_ij * 2^-8 |D_i|, about 2^-8 of the gradient's scale (4x margin measured).
    // So: 2^-8 |ref| + 2^-8 * max|ref|.
    const double out_scale = max_abs(std::vector<double>(f.out.begin(), f.out.end()));
    const double grad_scale = max_abs(std::vector<double>(f.dqkv.begin(), f.dqkv.end()));
    require_close("out", h.out, f.out, [&](size_t i) {
      return std::ldexp(std::fabs(f.out[i]), -8) + 1e-6 * out_scale;
    });
    require_close("lse", h.lse, f.lse, [](size_t) { return 1e-5; });
    require_close("dqkv", h.dqkv, f.dqkv, [&](size_t i) {
      return std::ldexp(std::fabs(f.dqkv[i]), -8) + std::ldexp(grad_scale, -8);
    });
  }
}

TEST_CASE("attention: rejects NH not a multiple of NKV and non-float types", "[kernels]") {
  auto be = make_cpu_backend(0);
  std::vector<float> buf(4096), lse(256);
  CHECK_THROWS_AS(be->attention_forward(buf.data(), lse.data(), buf.data(), 1, 4, 3, 2, 8,
                                        DType::F32),
                  Error);
  CHECK_THROWS_AS(be->attention_forward(buf.data(), lse.data(), buf.data(), 1, 4, 2, 2, 8,
                                        DType::I32),
                  Error);
}

TEST_CASE("rope: forward matches a plain loop, backward is its adjoint and inverse", "[kernels]") {
  auto be = make_cpu_backend(0);
  const AttnDims d{2, 19, 4, 2, 8};
  const float theta = 10000.0f;
  const int64_t half = d.HS / 2, row = d.row();
  std::vector<float> x = random_floats(d.qkv_size(), 21), y = random_floats(d.qkv_size(), 22);

  // Plain loop in double: pair (i, i + HS/2) of every q and k head rotated by t * theta^(-2i/HS).
  std::vector<double> want(x.begin(), x.end());
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t hd = 0; hd < d.NH + d.NKV; ++hd)
        for (int64_t i = 0; i < half; ++i) {
          double angle = t * std::pow(static_cast<double>(theta), -2.0 * i / d.HS);
          int64_t at = (b * d.T + t) * row + hd * d.HS + i;
          double x0 = x[at], x1 = x[at + half];
          want[at] = x0 * std::cos(angle) - x1 * std::sin(angle);
          want[at + half] = x0 * std::sin(angle) + x1 * std::cos(angle);
        }
  std::vector<float> got = x;
  be->rope_forward(got.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::F32);
  // The kernel forms the angle in fp32 (t * inv_freq): at t < 19 its error is ~19 * 2^-24 rad,
  // so 1e-5 absolute covers it; the v part must be untouched (tolerance 0 there).
  require_close("rope forward", got, want, [&](size_t i) {
    return (static_cast<int64_t>(i) % row) >= (d.NH + d.NKV) * d.HS ? 0.0 : 1e-5;
  });

  // Adjoint: <rope(x), y> == <x, rope_backward(y)>, every element of the layout taking part.
  std::vector<float> ry = y;
  be->rope_backward(ry.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::F32);
  double lhs = 0.0, rhs = 0.0, norm = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    lhs += static_cast<double>(got[i]) * y[i];
    rhs += static_cast<double>(x[i]) * ry[i];
    norm += std::fabs(static_cast<double>(x[i]) * y[i]);
  }
  // Both sides are sums of ~2400 O(1) products of fp32 values with ~1 ulp rotation error each.
  CHECK(std::fabs(lhs - rhs) <= 1e-6 * norm);

  // Inverse: backward(forward(x)) == x to a couple of fp32 roundings.
  std::vector<float> back = got;
  be->rope_backward(back.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::F32);
  require_close("rope inverse", back, x, [](size_t) { return 1e-6; });

  // bf16 storage: fp32 math on the same rounded input, one bf16 rounding of the result.
  std::vector<float> xr = round_bf16(x), ref = xr;
  be->rope_forward(ref.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::F32);
  std::vector<bf16> xb = to_bf16(xr);
  be->rope_forward(xb.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::BF16);
  require_close("rope bf16", to_f32(xb), ref,
                [&](size_t i) { return std::ldexp(std::fabs(ref[i]), -8) + 1e-30; });
  std::vector<bf16> yb = to_bf16(y);
  std::vector<float> yref = round_bf16(y);
  be->rope_backward(yb.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::BF16);
  be->rope_backward(yref.data(), d.B, d.T, d.NH, d.NKV, d.HS, theta, DType::F32);
  require_close("rope backward bf16", to_f32(yb), yref,
                [&](size_t i) { return std::ldexp(std::fabs(yref[i]), -8) + 1e-30; });

  CHECK_THROWS_AS(be->rope_forward(got.data(), 1, 4, 2, 2, 7, theta, DType::F32), Error);
}

TEST_CASE("rope: linear and llama3 scaling match Hugging Face's frequency rules", "[kernels]") {
  auto be = make_cpu_backend(0);
  const AttnDims d{1, 37, 2, 1, 64};
  const int64_t half = d.HS / 2, row = d.row();
  // transformers' _compute_llama3_parameters / _compute_linear_scaling_rope_parameters, in double.
  auto hf_inv_freq = [&](int64_t i, const math::RopeFreqs& r) {
    const double inv = 1.0 / std::pow(static_cast<double>(r.theta), 2.0 * i / d.HS);
    if (r.kind == math::RopeFreqs::LINEAR) return inv / r.factor;
    const double pi = 3.14159265358979323846, L = r.original_max_position;
    const double wavelen = 2 * pi / inv, low_wavelen = L / r.low_freq_factor, high_wavelen = L / r.high_freq_factor;
    double out = wavelen > low_wavelen ? inv / r.factor : inv;
    const double smooth = (L / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    const double smoothed = (1 - smooth) * out / r.factor + smooth * out;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) out = smoothed;
    return out;
  };
  math::RopeFreqs linear(10000.0f);
  linear.kind = math::RopeFreqs::LINEAR;
  linear.factor = 4.0f;
  // Llama 3.1's values with a short original context, so that all three bands occur at HS 64.
  math::RopeFreqs llama3(500000.0f);
  llama3.kind = math::RopeFreqs::LLAMA3;
  llama3.factor = 8.0f;
  llama3.low_freq_factor = 1.0f;
  llama3.high_freq_factor = 4.0f;
  llama3.original_max_position = 256.0f;
  int bands[3] = {0, 0, 0};  // kept, divided, blended
  for (int64_t i = 0; i < half; ++i) {
    const double inv = 1.0 / std::pow(500000.0, 2.0 * i / d.HS), w = 2 * 3.14159265358979323846 / inv;
    bands[w < 64.0 ? 0 : w > 256.0 ? 1 : 2]++;
  }
  CHECK((bands[0] > 0 && bands[1] > 0 && bands[2] > 0));
  for (const math::RopeFreqs& r : {linear, llama3}) {
    INFO("kind " << r.kind);
    for (int64_t i = 0; i < half; ++i)
      CHECK(math::rope_inv_freq(static_cast<int>(i), static_cast<int>(d.HS), r) ==
            Approx(hf_inv_freq(i, r)).epsilon(1e-6));
    std::vector<float> x = random_floats(d.qkv_size(), 31);
    std::vector<double> want(x.begin(), x.end());
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t hd = 0; hd < d.NH + d.NKV; ++hd)
        for (int64_t i = 0; i < half; ++i) {
          const double angle = t * hf_inv_freq(i, r);
          const int64_t at = t * row + hd * d.HS + i;
          const double x0 = x[at], x1 = x[at + half];
          want[at] = x0 * std::cos(angle) - x1 * std::sin(angle);
          want[at + half] = x0 * std::sin(angle) + x1 * std::cos(angle);
        }
    std::vector<float> got = x;
    be->rope_forward(got.data(), d.B, d.T, d.NH, d.NKV, d.HS, r, DType::F32);
    require_close("scaled rope forward", got, want, [](size_t) { return 2e-5; });
    std::vector<float> back = got;
    be->rope_backward(back.data(), d.B, d.T, d.NH, d.NKV, d.HS, r, DType::F32);
    require_close("scaled rope inverse", back, x, [](size_t) { return 1e-6; });
  }
  math::RopeFreqs bad = llama3;
  bad.high_freq_factor = 1.0f;  // not above low_freq_factor
  std::vector<float> x = random_floats(d.qkv_size(), 32);
  CHECK_THROWS_AS(be->rope_forward(x.data(), d.B, d.T, d.NH, d.NKV, d.HS, bad, DType::F32), Error);
}
