// Every CPU op that takes an activation (or compute) type, run in F16 against the same op in F32 on
// the same fp16-representable inputs; and the global-norm reduction's propagation of inf and NaN,
// which fp16 loss scaling reads its overflows from.
//
// Tolerances. The ops do their math in fp32 whatever the storage type (kernels/backend.h), the
// F16 and F32 runs read the same values, and the F16 run rounds each stored result once, to
// nearest fp16: |f16 - f32| <= 2^-11 |f32| in fp16's normal range, and <= 2^-25 below it
// (kHalfUlp). Where the two runs may add in another order (the GEMM, whose fp16 operands are
// widened into copies with other leading dimensions, so oneDNN may block differently), the fp32
// summation bound comes on top: (K + 2) 2^-24 sum|terms|, doubled (as in the fp32 GEMM test).
// Where the storage type plays no part (losses, log-sum-exps, norm statistics, parameter
// gradients, all fp32) the F16 run must give the F32 run's value to fp32 rounding noise.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/common/math.h"
#include "tests/unit/f16_reference.h"
#include "tests/unit/kernel_testing.h"
#include "kernels/common/check.h"

using namespace tetra;
using tetra_test::expect_bitwise_equal;
using tetra_test::expect_close;
using tetra_test::randn;
using tetra_test::Tol;

namespace {

// One rounding to fp16 (see the header).
constexpr Tol kHalfUlp{0x1p-25 * 1.01, 0x1p-11 * 1.01};
// fp32 values computed the same way from the same inputs, stored in fp32 in both runs.
constexpr Tol kF32{1e-30, 2e-6};
// fp32 sums over the N = 9 rows of a norm's parameter gradient, which the F16 and F32 kernels'
// loops may add (and fuse into FMAs) in another order: N 2^-24 sum|terms|, with sum|terms| <= ~20
// for these O(1) inputs, is ~1e-5 (absolute: the sums cancel to values far below their terms).
constexpr Tol kF32Sum{1e-5, 1e-6};

std::vector<f16> to_f16(const std::vector<float>& v) {
  std::vector<f16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f16(v[i]);
  return out;
}
std::vector<float> widen(const std::vector<f16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}
// `v` rounded to fp16 values (kept as float), so that both runs read identical values.
std::vector<float> f16_exact(std::vector<float> v) { return widen(to_f16(v)); }

}  // namespace

TEST_CASE("f16 ops: cast rounds F32 to F16 to nearest even (overflow, subnormals), widens exactly", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  std::vector<float> x = randn(4099, 1, 3.0f);
  x[0] = 70000.0f;       // overflows to infinity
  x[1] = -65519.0f;      // rounds to -65504
  x[2] = 3e-6f;          // subnormal in fp16
  x[3] = 2e-8f;          // below half the smallest subnormal: 0
  x[4] = std::numeric_limits<float>::infinity();
  x[5] = -0.0f;
  for (size_t i = 6; i < 200; ++i) x[i] = std::ldexp(x[i], -20);  // many subnormal results
  std::vector<uint16_t> h(x.size());
  be->cast(h.data(), DType::F16, x.data(), DType::F32, static_cast<int64_t>(x.size()));
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = tetra_test::f16_round_by_search(x[i]);
  expect_bitwise_equal(h, want, "F32 -> F16");
  CHECK(h[0] == 0x7c00);
  CHECK(h[1] == 0xfbff);
  CHECK(h[3] == 0x0000);

  std::vector<float> back(x.size());
  be->cast(back.data(), DType::F32, h.data(), DType::F16, static_cast<int64_t>(x.size()));
  std::vector<float> exact(x.size());
  for (size_t i = 0; i < x.size(); ++i) exact[i] = static_cast<float>(tetra_test::f16_value_by_definition(h[i]));
  expect_bitwise_equal(back, exact, "F16 -> F32");

  // Between the 16-bit types through fp32: one rounding each way.
  std::vector<uint16_t> b16(x.size()), h2(x.size());
  be->cast(b16.data(), DType::BF16, h.data(), DType::F16, static_cast<int64_t>(x.size()));
  std::vector<uint16_t> want_b16(x.size());
  for (size_t i = 0; i < x.size(); ++i) want_b16[i] = math::f32_to_bf16_bits(exact[i]);
  expect_bitwise_equal(b16, want_b16, "F16 -> BF16");
  be->cast(h2.data(), DType::F16, b16.data(), DType::BF16, static_cast<int64_t>(x.size()));
  std::vector<uint16_t> want_h2(x.size());
  for (size_t i = 0; i < x.size(); ++i) want_h2[i] = tetra_test::f16_round_by_search(math::bf16_bits_to_f32(b16[i]));
  expect_bitwise_equal(h2, want_h2, "BF16 -> F16");

  std::vector<uint16_t> copy(x.size());
  be->cast(copy.data(), DType::F16, h.data(), DType::F16, static_cast<int64_t>(x.size()));
  expect_bitwise_equal(copy, h, "F16 -> F16 copy");
}

TEST_CASE("f16 ops: gemm with F16 inputs (F32 and F16 C) and F32 inputs with an F16 C", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  struct Shape {
    bool ta, tb;
    int64_t M, N, K;
    float alpha, beta;
    bool bias;
  };
  const Shape shapes[] = {{false, true, 17, 33, 65, 1.0f, 0.0f, true},   {false, false, 64, 256, 48, 1.0f, 1.0f, false},
                          {true, false, 31, 9, 70, 0.5f, 1.0f, false},   {true, true, 5, 130, 16, 2.0f, 0.0f, true},
                          {false, true, 128, 64, 256, 1.0f, 0.0f, false}};
  uint32_t seed = 100;
  for (const Shape& g : shapes)
    for (int variant = 0; variant < 3; ++variant) {  // f16 x f16 -> f32, f16 x f16 -> f16, f32 x f32 -> f16
      const DType ab = variant < 2 ? DType::F16 : DType::F32;
      const DType c_type = variant == 0 ? DType::F32 : DType::F16;
      INFO("M " << g.M << " N " << g.N << " K " << g.K << " trans " << g.ta << g.tb << " variant " << variant);
      const int64_t lda = g.ta ? g.M : g.K, ldb = g.tb ? g.K : g.N, ldc = g.N + 3;
      const auto A = f16_exact(randn(static_cast<size_t>(g.M * g.K), ++seed));
      const auto B = f16_exact(randn(static_cast<size_t>(g.K * g.N), ++seed));
      const auto bias = f16_exact(randn(static_cast<size_t>(g.N), ++seed));
      const auto C0 = f16_exact(randn(static_cast<size_t>(g.M * ldc), ++seed));
      // Reference in double, and the fp32 summation bound of every element.
      std::vector<double> ref(C0.size()), bound(C0.size());
      for (int64_t m = 0; m < g.M; ++m)
        for (int64_t n = 0; n < g.N; ++n) {
          double s = 0, abs_s = 0;
          for (int64_t k = 0; k < g.K; ++k) {
            const double a = A[static_cast<size_t>(g.ta ? k * lda + m : m * lda + k)];
            const double b = B[static_cast<size_t>(g.tb ? n * ldb + k : k * ldb + n)];
            s += a * b;
            abs_s += std::fabs(a * b);
          }
          const size_t at = static_cast<size_t>(m * ldc + n);
          double v = g.alpha * s, terms = std::fabs(g.alpha) * abs_s;
          if (g.beta != 0.0f) v += g.beta * C0[at], terms += std::fabs(g.beta * C0[at]);
          if (g.bias) v += bias[static_cast<size_t>(n)], terms += std::fabs(bias[static_cast<size_t>(n)]);
          ref[at] = v;
          bound[at] = 2.0 * (g.K + 2) * 0x1p-24 * terms;
        }
      std::vector<f16> A16 = to_f16(A), B16 = to_f16(B), bias16 = to_f16(bias);
      const void* a = ab == DType::F16 ? static_cast<const void*>(A16.data()) : A.data();
      const void* b = ab == DType::F16 ? static_cast<const void*>(B16.data()) : B.data();
      const void* bp = !g.bias ? nullptr : ab == DType::F16 ? static_cast<const void*>(bias16.data()) : bias.data();
      std::vector<float> got(C0.size());
      if (c_type == DType::F32) {
        got = C0;
        be->gemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, a, lda, b, ldb, ab, g.beta, got.data(), ldc, c_type, bp);
      } else {
        std::vector<f16> c16 = to_f16(C0);
        be->gemm(g.ta, g.tb, g.M, g.N, g.K, g.alpha, a, lda, b, ldb, ab, g.beta, c16.data(), ldc, c_type, bp);
        got = widen(c16);
      }
      size_t bad = 0, first = 0;
      for (int64_t m = 0; m < g.M; ++m)
        for (int64_t n = 0; n < g.N; ++n) {
          const size_t at = static_cast<size_t>(m * ldc + n);
          double tol = bound[at];
          if (c_type == DType::F16) tol += 0x1p-11 * (std::fabs(ref[at]) + bound[at]) + 0x1p-25;
          if (!(std::fabs(got[at] - ref[at]) <= tol) && bad++ == 0) first = at;
        }
      INFO(bad << " elements outside tolerance; first " << first << ": got " << got[first] << " want " << ref[first]);
      CHECK(bad == 0);
      // Columns past N (ldc padding) untouched.
      for (int64_t m = 0; m < g.M; ++m)
        for (int64_t n = g.N; n < ldc; ++n) REQUIRE(got[static_cast<size_t>(m * ldc + n)] == C0[static_cast<size_t>(m * ldc + n)]);
    }
}

TEST_CASE("f16 ops: bias_backward of an F16 dout equals the F32 one", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t N = 37, OC = 300;
  const auto dout = f16_exact(randn(static_cast<size_t>(N * OC), 3));
  std::vector<float> want(OC, 0.5f), got(OC, 0.5f);
  be->bias_backward(want.data(), dout.data(), N, OC, DType::F32);
  const auto d16 = to_f16(dout);
  be->bias_backward(got.data(), d16.data(), N, OC, DType::F16);
  expect_close(got, want, kF32, "dbias");  // fp32 sums of the same values in the same order
}

TEST_CASE("f16 ops: add, gelu and swiglu forward and backward", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t N = 7, F = 129, n = N * 2 * F;
  const auto a = f16_exact(randn(static_cast<size_t>(n), 11, 3.0f));
  const auto b = f16_exact(randn(static_cast<size_t>(n), 12));
  const auto a16 = to_f16(a), b16 = to_f16(b);
  std::vector<float> y32(static_cast<size_t>(n));
  std::vector<f16> y16(static_cast<size_t>(n));
  be->add(y32.data(), a.data(), b.data(), n, DType::F32);
  be->add(y16.data(), a16.data(), b16.data(), n, DType::F16);
  expect_close(widen(y16), y32, kHalfUlp, "add");
  be->gelu_forward(y32.data(), a.data(), n, DType::F32);
  be->gelu_forward(y16.data(), a16.data(), n, DType::F16);
  expect_close(widen(y16), y32, kHalfUlp, "gelu forward");
  be->gelu_backward(y32.data(), a.data(), b.data(), n, DType::F32);
  be->gelu_backward(y16.data(), a16.data(), b16.data(), n, DType::F16);
  expect_close(widen(y16), y32, kHalfUlp, "gelu backward");
  std::vector<float> s32(static_cast<size_t>(N * F));
  std::vector<f16> s16(static_cast<size_t>(N * F));
  be->swiglu_forward(s32.data(), a.data(), N, F, DType::F32);
  be->swiglu_forward(s16.data(), a16.data(), N, F, DType::F16);
  expect_close(widen(s16), s32, kHalfUlp, "swiglu forward");
  const auto dy = f16_exact(randn(static_cast<size_t>(N * F), 13));
  const auto dy16 = to_f16(dy);
  be->swiglu_backward(y32.data(), a.data(), dy.data(), N, F, DType::F32);
  be->swiglu_backward(y16.data(), a16.data(), dy16.data(), N, F, DType::F16);
  expect_close(widen(y16), y32, kHalfUlp, "swiglu backward");
  // A result beyond fp16's range is infinity, not a wrapped or clamped value.
  std::vector<f16> big = to_f16({60000.0f, -60000.0f}), sum(2);
  be->add(sum.data(), big.data(), big.data(), 2, DType::F16);
  CHECK(std::isinf(static_cast<float>(sum[0])));
  CHECK(static_cast<float>(sum[1]) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("f16 ops: layernorm and rmsnorm forward and backward (F16 and F32 weights)", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t N = 9, C = 257;
  const float eps = 1e-5f;
  for (NormKind kind : {NormKind::LAYERNORM, NormKind::RMSNORM})
    for (DType wt : {DType::F32, DType::F16}) {
      INFO((kind == NormKind::LAYERNORM ? "layernorm" : "rmsnorm") << " weights " << dtype_name(wt));
      const auto x = f16_exact(randn(static_cast<size_t>(N * C), 21, 2.0f, 0.5f));
      const auto w = f16_exact(randn(static_cast<size_t>(C), 22, 0.2f, 1.0f));
      const auto bias = f16_exact(randn(static_cast<size_t>(C), 23, 0.2f));
      const auto dout = f16_exact(randn(static_cast<size_t>(N * C), 24));
      const auto dx0 = f16_exact(randn(static_cast<size_t>(N * C), 25));  // dx accumulates
      const bool with_bias = kind == NormKind::LAYERNORM;
      std::vector<float> out(x.size()), mean(N), rstd(N), dx = dx0, dw(C, 0.0f), db(C, 0.0f);
      be->norm_forward(kind, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                       with_bias ? bias.data() : nullptr, N, C, eps, DType::F32, DType::F32);
      be->norm_backward(kind, dx.data(), dw.data(), with_bias ? db.data() : nullptr, dout.data(), x.data(), w.data(),
                        mean.data(), rstd.data(), N, C, DType::F32, DType::F32);
      const auto x16 = to_f16(x), dout16 = to_f16(dout), w16 = to_f16(w), b16 = to_f16(bias);
      std::vector<f16> out16(x.size()), dx16 = to_f16(dx0);
      std::vector<float> mean16(N), rstd16(N), dw16(C, 0.0f), db16(C, 0.0f);
      const void* wp = wt == DType::F16 ? static_cast<const void*>(w16.data()) : w.data();
      const void* bp = !with_bias ? nullptr : wt == DType::F16 ? static_cast<const void*>(b16.data()) : bias.data();
      be->norm_forward(kind, out16.data(), mean16.data(), rstd16.data(), x16.data(), wp, bp, N, C, eps, DType::F16,
                       wt);
      be->norm_backward(kind, dx16.data(), dw16.data(), with_bias ? db16.data() : nullptr, dout16.data(),
                        x16.data(), wp, mean16.data(), rstd16.data(), N, C, DType::F16, wt);
      expect_close(widen(out16), out, kHalfUlp, "out");
      expect_close(rstd16, rstd, kF32, "rstd");
      if (with_bias) expect_close(mean16, mean, kF32, "mean");
      expect_close(widen(dx16), dx, kHalfUlp, "dx (accumulated)");
      expect_close(dw16, dw, kF32Sum, "dweight");
      if (with_bias) expect_close(db16, db, kF32Sum, "dbias");
    }
}

TEST_CASE("f16 ops: embedding forward (F16 and F32 weights) and backward", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t B = 2, T = 5, C = 33, V = 11;
  const auto wte = f16_exact(randn(static_cast<size_t>(V * C), 31));
  const auto wpe = f16_exact(randn(static_cast<size_t>(T * C), 32));
  const std::vector<int32_t> tokens = {0, 3, 3, 10, 7, 1, 1, 1, 9, 4};
  std::vector<float> out(static_cast<size_t>(B * T * C));
  be->embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, 0, V, DType::F32, DType::F32);
  for (DType w : {DType::F32, DType::F16}) {
    const auto wte16 = to_f16(wte), wpe16 = to_f16(wpe);
    std::vector<f16> out16(out.size());
    be->embedding_forward(out16.data(), tokens.data(),
                          w == DType::F16 ? static_cast<const void*>(wte16.data()) : wte.data(),
                          w == DType::F16 ? static_cast<const void*>(wpe16.data()) : wpe.data(), B, T, C, 0, V,
                          DType::F16, w);
    expect_close(widen(out16), out, kHalfUlp, std::string("forward, weights ") + std::string(dtype_name(w)));
  }
  const auto dout = f16_exact(randn(out.size(), 33));
  std::vector<float> dwte(static_cast<size_t>(V * C), 0.25f), dwpe(static_cast<size_t>(T * C), 0.25f);
  std::vector<float> dwte16 = dwte, dwpe16 = dwpe;
  be->embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, 0, V, DType::F32);
  const auto dout16 = to_f16(dout);
  be->embedding_backward(dwte16.data(), dwpe16.data(), dout16.data(), tokens.data(), B, T, C, 0, V, DType::F16);
  expect_close(dwte16, dwte, kF32, "dwte");
  expect_close(dwpe16, dwpe, kF32, "dwpe");
}

TEST_CASE("f16 ops: rope and causal attention forward and backward (MHA and GQA)", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t B = 2, T = 70, HS = 16;
  for (const auto& [NH, NKV] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}}) {
    INFO("NH " << NH << " NKV " << NKV);
    const int64_t row = (NH + 2 * NKV) * HS;
    auto qkv = f16_exact(randn(static_cast<size_t>(B * T * row), 41));
    auto qkv16 = to_f16(qkv);
    // RoPE in place: one rounding of the rotated pair.
    be->rope_forward(qkv.data(), B, T, NH, NKV, HS, 10000.0f, DType::F32);
    be->rope_forward(qkv16.data(), B, T, NH, NKV, HS, 10000.0f, DType::F16);
    expect_close(widen(qkv16), qkv, kHalfUlp, "rope forward");
    qkv = widen(qkv16);  // from here both runs read the same (fp16) rotated values
    std::vector<float> out(static_cast<size_t>(B * T * NH * HS)), lse(static_cast<size_t>(B * NH * T));
    std::vector<f16> out16(out.size());
    std::vector<float> lse16(lse.size());
    be->attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, HS, DType::F32);
    be->attention_forward(out16.data(), lse16.data(), qkv16.data(), B, T, NH, NKV, HS, DType::F16);
    expect_close(widen(out16), out, kHalfUlp, "attention out");
    expect_close(lse16, lse, kF32, "attention lse");
    // Backward on identical (fp16) out and dout values.
    const auto o = widen(out16);
    const auto dout = f16_exact(randn(out.size(), 42));
    const auto dout16 = to_f16(dout);
    std::vector<float> dqkv(qkv.size());
    std::vector<f16> dqkv16(qkv.size());
    be->attention_backward(dqkv.data(), dout.data(), qkv.data(), o.data(), lse16.data(), B, T, NH, NKV, HS,
                           DType::F32);
    be->attention_backward(dqkv16.data(), dout16.data(), qkv16.data(), out16.data(), lse16.data(), B, T, NH, NKV,
                           HS, DType::F16);
    expect_close(widen(dqkv16), dqkv, kHalfUlp, "attention dqkv");
    auto d16 = dqkv16;
    be->rope_backward(d16.data(), B, T, NH, NKV, HS, 10000.0f, DType::F16);
    auto d32 = widen(dqkv16);
    be->rope_backward(d32.data(), B, T, NH, NKV, HS, 10000.0f, DType::F32);
    expect_close(widen(d16), d32, kHalfUlp, "rope backward");
  }
}

TEST_CASE("f16 ops: cross-entropy and vocab-parallel cross-entropy with F16 logits and gradients",
          "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t N = 6, V = 301;
  auto logits = f16_exact(randn(static_cast<size_t>(N * V), 51, 4.0f));
  for (int64_t j = 0; j < V; ++j) logits[static_cast<size_t>(4 * V + j)] += 1000.0f;  // large offset
  logits = f16_exact(logits);
  const std::vector<int32_t> targets = {5, -1, 300, 0, 17, 42};
  // A loss-scaled gradient: 2^16 / (N - 1 counted rows), as fp16 training has it.
  const float dloss_scale = 65536.0f / 5.0f;
  std::vector<float> loss32(N), dl32(logits.size());
  be->cross_entropy(loss32.data(), dl32.data(), DType::F32, logits.data(), DType::F32, targets.data(), N, V,
                    dloss_scale);
  // F16 logits, gradient written over them in place.
  std::vector<f16> l16 = to_f16(logits);
  std::vector<float> loss16(N);
  be->cross_entropy(loss16.data(), l16.data(), DType::F16, l16.data(), DType::F16, targets.data(), N, V, dloss_scale);
  expect_close(loss16, loss32, kF32, "losses (F16 logits)");
  expect_close(widen(l16), dl32, kHalfUlp, "dlogits (F16, in place)");
  // F32 logits, F16 gradient.
  std::vector<f16> g16(logits.size());
  be->cross_entropy(loss16.data(), g16.data(), DType::F16, logits.data(), DType::F32, targets.data(), N, V,
                    dloss_scale);
  expect_close(widen(g16), dl32, kHalfUlp, "dlogits (F16 from F32 logits)");

  // Vocabulary split in two slices, [0, 150) and [150, 301), combined as the TP all-reduces would.
  const int64_t V0 = 150;
  std::vector<float> max32(N), max16(N), mx(N);
  std::vector<f16> lg16 = to_f16(logits);
  for (int part = 0; part < 2; ++part) {
    const int64_t v0 = part ? V0 : 0, Vl = part ? V - V0 : V0;
    std::vector<float> slice(static_cast<size_t>(N * Vl));
    std::vector<f16> slice16(slice.size());
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < Vl; ++j) {
        slice[static_cast<size_t>(i * Vl + j)] = logits[static_cast<size_t>(i * V + v0 + j)];
        slice16[static_cast<size_t>(i * Vl + j)] = lg16[static_cast<size_t>(i * V + v0 + j)];
      }
    be->vocab_ce_max(max32.data(), slice.data(), DType::F32, N, Vl);
    be->vocab_ce_max(max16.data(), slice16.data(), DType::F16, N, Vl);
    expect_close(max16, max32, kF32, "vocab_ce_max");
  }
  // Whole-row passes on one "slice" spanning the vocabulary (v0 = 0) reproduce cross_entropy.
  be->vocab_ce_max(mx.data(), lg16.data(), DType::F16, N, V);
  std::vector<float> sums(2 * N), vloss(N);
  be->vocab_ce_sums(sums.data(), sums.data() + N, lg16.data(), DType::F16, mx.data(), targets.data(), 0, N, V);
  std::vector<f16> vg16(lg16.size());
  be->vocab_ce_finish(vloss.data(), vg16.data(), DType::F16, lg16.data(), DType::F16, mx.data(), sums.data(),
                      sums.data() + N, targets.data(), 0, N, V, dloss_scale);
  expect_close(vloss, loss32, kF32, "vocab-parallel losses (F16 logits)");
  expect_close(widen(vg16), dl32, kHalfUlp, "vocab-parallel dlogits (F16)");
}

TEST_CASE("f16 ops: MoE gather, combine and combine backward", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t N = 5, K = 2, C = 19, M = 8;
  const auto src = f16_exact(randn(static_cast<size_t>(N * C), 61));
  const std::vector<int32_t> rows = {4, 0, 0, 3, 2, 1, 4, 2};
  std::vector<f16> src16 = to_f16(src), g16(static_cast<size_t>(M * C));
  be->moe_gather_rows(g16.data(), src16.data(), rows.data(), M, C, DType::F16);
  for (int64_t p = 0; p < M; ++p)
    for (int64_t c = 0; c < C; ++c)
      REQUIRE(g16[static_cast<size_t>(p * C + c)].bits == src16[static_cast<size_t>(rows[p] * C + c)].bits);
  const auto y = f16_exact(randn(static_cast<size_t>(M * C), 62));
  const std::vector<int32_t> pos = {0, 5, 1, -1, 2, 7, 3, 4, 6, -1};  // two dropped assignments
  const std::vector<float> weights = {0.7f, 0.3f, 1.0f, 0.0f, 0.25f, 0.75f, 0.5f, 0.5f, 0.9f, 0.1f};
  const auto out0 = f16_exact(randn(static_cast<size_t>(N * C), 63));
  for (bool accumulate : {false, true}) {
    std::vector<float> out = out0;
    std::vector<f16> out16 = to_f16(out0), y16 = to_f16(y);
    be->moe_combine(out.data(), y.data(), pos.data(), weights.data(), N, K, C, accumulate, DType::F32);
    be->moe_combine(out16.data(), y16.data(), pos.data(), weights.data(), N, K, C, accumulate, DType::F16);
    expect_close(widen(out16), out, kHalfUlp, accumulate ? "combine (accumulate)" : "combine");
  }
  const auto dout = f16_exact(randn(static_cast<size_t>(N * C), 64));
  std::vector<float> dy(static_cast<size_t>(M * C), 0.0f), dw(static_cast<size_t>(N * K));
  std::vector<f16> dy16(dy.size(), f16(0.0f));
  std::vector<float> dw16(dw.size());
  const auto dout16 = to_f16(dout), y16 = to_f16(y);
  be->moe_combine_backward(dy.data(), dw.data(), dout.data(), y.data(), pos.data(), weights.data(), N, K, C,
                           DType::F32);
  be->moe_combine_backward(dy16.data(), dw16.data(), dout16.data(), y16.data(), pos.data(), weights.data(), N, K,
                           C, DType::F16);
  expect_close(widen(dy16), dy, kHalfUlp, "combine backward dy");
  expect_close(dw16, dw, kF32, "combine backward dweights");
}

TEST_CASE("f16 ops: adamw writes the F16 compute copy: the updated fp32 params rounded", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const int64_t n = 1001;
  auto p32 = randn(static_cast<size_t>(n), 71, 0.05f);
  auto g32 = randn(static_cast<size_t>(n), 72, 1e3f);  // loss-scaled gradients
  std::vector<float> m(static_cast<size_t>(n), 0.0f), v = m, p = p32, g = g32;
  std::vector<float> m2 = m, v2 = v, p2 = p32, g2 = g32;
  math::AdamParams hp{};
  hp.lr = 1e-3f, hp.beta1 = 0.9f, hp.beta2 = 0.95f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
  hp.bias_correction1 = 0.1f, hp.bias_correction2 = 0.05f, hp.grad_scale = 1.0f / 1024.0f;
  std::vector<f16> copy(static_cast<size_t>(n));
  be->adamw(p.data(), g.data(), m.data(), v.data(), n, hp, copy.data(), DType::F16);
  be->adamw(p2.data(), g2.data(), m2.data(), v2.data(), n, hp, nullptr, DType::F32);
  expect_bitwise_equal(p, p2, "params: the copy's type does not change the update");
  std::vector<uint16_t> got(static_cast<size_t>(n)), want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    got[static_cast<size_t>(i)] = copy[static_cast<size_t>(i)].bits;
    want[static_cast<size_t>(i)] = tetra_test::f16_round_by_search(p[static_cast<size_t>(i)]);
  }
  expect_bitwise_equal(got, want, "F16 compute copy = params rounded to nearest even");
  for (float x : g) REQUIRE(x == 0.0f);  // gradients consumed
}

TEST_CASE("sum_squares and sum propagate inf and NaN (the fp16 overflow check reads them)", "[kernels][f16]") {
  auto be = make_cpu_backend(2);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{100003}}) {  // one chunk, a lane tail, many chunks
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      INFO("n " << n << " at " << at);
      std::vector<float> x = randn(static_cast<size_t>(n), 81);
      float out = 0.0f;
      be->sum_squares(&out, x.data(), n);
      CHECK(std::isfinite(out));
      x[static_cast<size_t>(at)] = -inf;  // squared: +inf
      be->sum_squares(&out, x.data(), n);
      CHECK(out == inf);
      x[static_cast<size_t>(at)] = nan;
      be->sum_squares(&out, x.data(), n);
      CHECK(std::isnan(out));
      if (n > 1) {  // inf beside NaN: NaN wins, as in the norm
        x[static_cast<size_t>(at == 0 ? 1 : 0)] = inf;
        be->sum_squares(&out, x.data(), n);
        CHECK(std::isnan(out));
      }
      x[static_cast<size_t>(at)] = inf;
      be->sum(&out, x.data(), n);
      CHECK(!std::isfinite(out));
    }
  }
  // Finite values whose squares overflow fp32 (but not the double accumulator): the float result
  // is infinite, which the loss scaler reads as an overflow too.
  std::vector<float> big(4, 3e19f);
  float out = 0.0f;
  be->sum_squares(&out, big.data(), 4);
  CHECK(out == inf);
}
