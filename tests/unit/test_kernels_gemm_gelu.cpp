// CPU backend: gemm_gelu (pre = op(A)·op(B) + bias, out = gelu(pre)) and gemm_dgelu
// (dpre = (op(A)·op(B)) * gelu'(pre)) against a double-precision loop with the exact tanh.
//
// Tolerances, per element. S = sum_k |a_mk b_kn| (+ |bias_n|) from the stored inputs; any fp32
// summation order is within (K + 2) u S of the exact sum (u = 2^-24), doubled for margin. GELU and
// its derivative are 1.13-Lipschitz in their argument (|gelu'| <= 1.13, |gelu''| <= 0.8) and the
// shared math's tanh is within 2e-7 of tanh, so out and dpre carry 1.13 x the product's error plus
// 2e-7 (1 + |pre|) (the tanh error scaled by the factors around it) plus one fp32 rounding. In
// bf16 and fp16 every stored value is rounded once more (relative 2^-8, 2^-11): pre and the product
// before the GELU step, and the result; the reference is evaluated on the backend's own rounded pre, so only
// the roundings of this op count.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/common/check.h"
#include "kernels/common/dtype.h"

using namespace tetra;

namespace {

constexpr double kU = 1.0 / 16777216.0;

double gelu_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

double gelu_grad_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Host storage of n values of `type`, and back to float.
std::vector<uint8_t> store(const std::vector<float>& v, DType type) {
  std::vector<uint8_t> out(v.size() * dtype_size(type));
  for (size_t i = 0; i < v.size(); ++i) {
    if (type == DType::F32)
      reinterpret_cast<float*>(out.data())[i] = v[i];
    else if (type == DType::BF16)
      reinterpret_cast<bf16*>(out.data())[i] = bf16(v[i]);
    else
      reinterpret_cast<f16*>(out.data())[i] = f16(v[i]);
  }
  return out;
}

std::vector<float> load(const std::vector<uint8_t>& raw, DType type) {
  const size_t n = raw.size() / dtype_size(type);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = type == DType::F32    ? reinterpret_cast<const float*>(raw.data())[i]
           : type == DType::BF16 ? static_cast<float>(reinterpret_cast<const bf16*>(raw.data())[i])
                                 : static_cast<float>(reinterpret_cast<const f16*>(raw.data())[i]);
  return v;
}

struct Case {
  bool trans_a, trans_b, bias;
  int64_t M, N, K;
  DType type;
};

void run_case(Backend& be, const Case& c, uint32_t seed) {
  INFO("ta=" << c.trans_a << " tb=" << c.trans_b << " bias=" << c.bias << " M=" << c.M << " N=" << c.N
             << " K=" << c.K << " " << dtype_name(c.type));
  const int64_t lda = c.trans_a ? c.M : c.K, ldb = c.trans_b ? c.K : c.N;
  // Scales put pre around [-3, 3], where GELU bends.
  const float scale = static_cast<float>(1.5 / std::sqrt(static_cast<double>(c.K)));
  auto A = store(random_floats(static_cast<size_t>(c.M * c.K), seed, 1.0f), c.type);
  auto B = store(random_floats(static_cast<size_t>(c.K * c.N), seed + 1, scale), c.type);
  auto bias = store(random_floats(static_cast<size_t>(c.N), seed + 2, 0.5f), c.type);
  auto pre_in = store(random_floats(static_cast<size_t>(c.M * c.N), seed + 3, 1.5f), c.type);
  const std::vector<float> a = load(A, c.type), b = load(B, c.type), bv = load(bias, c.type);
  const std::vector<float> p_in = load(pre_in, c.type);
  const size_t mn = static_cast<size_t>(c.M * c.N), es = dtype_size(c.type);
  std::vector<uint8_t> pre(mn * es), out(mn * es), dpre(mn * es);
  be.gemm_gelu(c.trans_a, c.trans_b, c.M, c.N, c.K, A.data(), lda, B.data(), ldb,
               c.bias ? bias.data() : nullptr, pre.data(), out.data(), c.type);
  be.gemm_dgelu(c.trans_a, c.trans_b, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, pre_in.data(),
                dpre.data(), c.type);
  const std::vector<float> got_pre = load(pre, c.type), got_out = load(out, c.type),
                           got_dpre = load(dpre, c.type);
  const bool half = c.type != DType::F32;
  // one rounding of a stored result: 2^-8 relative in bf16, 2^-11 in fp16 (the values here are far
  // above fp16's subnormal range, 6e-5, except near zeros of the product, covered by acc * s)
  const double r = c.type == DType::BF16 ? 1.0 / 256.0 : c.type == DType::F16 ? 1.0 / 2048.0 : kU;
  const double acc = 2.0 * static_cast<double>(c.K + 2) * kU;
  size_t bad = 0;
  double worst = 0.0;
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t n = 0; n < c.N; ++n) {
      double prod = 0.0, s = 0.0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double x = a[static_cast<size_t>(c.trans_a ? k * lda + m : m * lda + k)];
        const double y = b[static_cast<size_t>(c.trans_b ? n * ldb + k : k * ldb + n)];
        prod += x * y;
        s += std::fabs(x * y);
      }
      const size_t i = static_cast<size_t>(m * c.N + n);
      const double want_pre = prod + (c.bias ? bv[static_cast<size_t>(n)] : 0.0);
      const double s_pre = s + (c.bias ? std::fabs(bv[static_cast<size_t>(n)]) : 0.0);
      const double tol_pre = acc * s_pre + r * std::fabs(want_pre);
      // out from the backend's own (rounded) pre: only the GELU step and its rounding count.
      const double gp = got_pre[i];
      const double want_out = gelu_ref(gp);
      const double tol_out = 2e-7 * (1.0 + std::fabs(gp)) + r * std::fabs(want_out) + 1e-30;
      // dpre: the product's error (and, in bf16, its rounding before the GELU step) times gelu'.
      const double pi = p_in[i];
      const double want_dpre = prod * gelu_grad_ref(pi);
      const double tol_dpre = 1.13 * (acc * s + (half ? r * std::fabs(prod) : 0.0)) +
                              2e-7 * (1.0 + std::fabs(pi)) * std::fabs(prod) + r * std::fabs(want_dpre) + 1e-30;
      const double e1 = std::fabs(got_pre[i] - want_pre) / tol_pre;
      const double e2 = std::fabs(got_out[i] - want_out) / tol_out;
      const double e3 = std::fabs(got_dpre[i] - want_dpre) / tol_dpre;
      for (double e : {e1, e2, e3}) {
        if (!(e <= 1.0)) ++bad;
        if (!(e <= worst)) worst = e;
      }
    }
  INFO(bad << " values out of tolerance, worst error / tolerance " << worst);
  REQUIRE(bad == 0);
}

}  // namespace

TEST_CASE("gemm_gelu / gemm_dgelu: against a double loop, every transpose, odd sizes, fp32, bf16, fp16",
          "[kernels][gemm]") {
  auto be = make_cpu_backend(2);
  uint32_t seed = 1;
  const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {33, 24, 65}, {64, 96, 48}};
  for (const auto& sh : shapes)
    for (int t = 0; t < 4; ++t)
      for (bool bias : {false, true})
        for (DType type : {DType::F32, DType::BF16, DType::F16})
          run_case(*be, Case{(t & 1) != 0, (t & 2) != 0, bias, sh[0], sh[1], sh[2], type}, seed += 7);
}

TEST_CASE("gemm_gelu refuses out aliasing pre, gemm_dgelu refuses dpre aliasing pre", "[kernels][gemm]") {
  auto be = make_cpu_backend(1);
  std::vector<float> a(4, 1.0f), b(4, 1.0f), c(4, 0.0f);
  REQUIRE_THROWS_AS(be->gemm_gelu(false, false, 2, 2, 2, a.data(), 2, b.data(), 2, nullptr, c.data(), c.data(),
                                  DType::F32),
                    Error);
  REQUIRE_THROWS_AS(be->gemm_dgelu(false, false, 2, 2, 2, a.data(), 2, b.data(), 2, c.data(), c.data(), DType::F32),
                    Error);
}
