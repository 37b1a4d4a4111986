// Tests of the CPU backend's non-GEMM ops: norms, element-wise activations, casts, bias gradient,
// embeddings, softmax cross-entropy, reductions and AdamW.
//
// Every forward is compared with a plain-loop reference written here in double precision (it
// calls nothing from the kernels, not even their bf16 rounding). Every backward is compared with
// central finite differences of a scalar objective J = sum(out * R), R random, taken on that
// double reference (h = 1e-4 in double: truncation ~h^2 ~ 1e-8, rounding ~1e-16 J / h ~ 1e-10,
// both far below the fp32 tolerances used). BF16 variants are compared with the F32 kernel run on
// the same (bf16-representable) inputs. The CPU backend's memory is host memory, so the tests
// pass std::vector storage directly.
//
// Tolerances, used throughout:
// - kF32: fp32 kernels vs a double reference. Each fp32 operation errs by <= 2^-24 relative; the
//   reductions here have at most a few hundred terms, so n * 2^-24 ~ 2e-5 bounds the worst case;
//   1e-4 relative (plus 1e-5 absolute for values near 0) leaves a margin of 5.
// - kBf16: a bf16 result vs the fp32 result of the same math on the same inputs. The only new error
//   is the final rounding to bf16 (8 significant bits, round to nearest): <= 2^-9 of the binade,
//   so <= 2^-8 relative; plus 1e-5 of slack for fp32 reductions done in another order.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/unit/kernel_testing.h"
#include "kernels/common/check.h"

namespace {

using tetra::Backend;
using tetra::DType;
using tetra::NormKind;

using tetra_test::expect_bitwise_equal;
using tetra_test::expect_close;
using tetra_test::randn;
using tetra_test::Tol;

constexpr Tol kF32{1e-5, 1e-4};
constexpr Tol kBf16{1e-5, 1.0 / 256 + 1e-5};

// ---- independent helpers -----------------------------------------------------------------------
// bf16 = upper half of an fp32, round to nearest even (finite inputs only in these tests).
uint16_t ref_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float ref_bf16_value(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = ref_bf16_bits(x[i]);
  return r;
}
std::vector<float> from_bf16(const std::vector<uint16_t>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = ref_bf16_value(x[i]);
  return r;
}
// x rounded to bf16-representable values, kept as float.
std::vector<float> bf16_exact(const std::vector<float>& x) { return from_bf16(to_bf16(x)); }

std::vector<double> to_double(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// Central finite differences of J with respect to every element of p (p is restored).
template <typename F>
std::vector<double> finite_diff(std::vector<double>& p, F&& J, size_t stride = 1) {
  const double h = 1e-4;
  std::vector<double> g(p.size(), 0.0);
  for (size_t i = 0; i < p.size(); i += stride) {
    double keep = p[i];
    p[i] = keep + h;
    double jp = J();
    p[i] = keep - h;
    double jm = J();
    p[i] = keep;
    g[i] = (jp - jm) / (2 * h);
  }
  return g;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- norms -------------------------------------------------------------------------------------
// out (N, C); b empty = no bias. mean, rstd (N) returned through pointers if non-null.
std::vector<double> ref_norm(bool ln, const std::vector<double>& x, const std::vector<double>& w,
                             const std::vector<double>& b, int64_t N, int64_t C, double eps,
                             std::vector<double>* mean = nullptr,
                             std::vector<double>* rstd = nullptr) {
  std::vector<double> out(N * C);
  if (mean) mean->assign(N, 0.0);
  if (rstd) rstd->assign(N, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    double m = 0, var = 0;
    if (ln) {
      for (int64_t j = 0; j < C; ++j) m += x[i * C + j];
      m /= C;
    }
    for (int64_t j = 0; j < C; ++j) var += (x[i * C + j] - m) * (x[i * C + j] - m);
    double r = 1.0 / std::sqrt(var / C + eps);
    for (int64_t j = 0; j < C; ++j)
      out[i * C + j] = (x[i * C + j] - m) * r * w[j] + (b.empty() ? 0.0 : b[j]);
    if (mean) (*mean)[i] = m;
    if (rstd) (*rstd)[i] = r;
  }
  return out;
}

struct NormCase {
  NormKind kind;
  bool bias;
};
const NormCase kNormCases[] = {{NormKind::LAYERNORM, true},
                               {NormKind::LAYERNORM, false},
                               {NormKind::RMSNORM, false},
                               {NormKind::RMSNORM, true}};

TEST_CASE("norm forward and backward (F32) match a double reference and finite differences",
          "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t C = 37;
  const float eps = 1e-5f;
  for (int64_t N : {13, 300}) {  // 300 rows: several row blocks in the dweight/dbias reduction
    for (const NormCase& nc : kNormCases) {
      const bool ln = nc.kind == NormKind::LAYERNORM;
      INFO("N=" << N << " kind=" << (ln ? "layernorm" : "rmsnorm") << " bias=" << nc.bias);
      auto x = randn(N * C, 1, 1.5f, 0.5f);  // non-zero mean: LayerNorm must subtract it
      for (int64_t j = 0; j < C; ++j) x[C + j] *= 2e-3f;  // row 1: variance ~ eps, eps matters
      auto w = randn(C, 2, 0.2f, 1.0f);
      auto b = nc.bias ? randn(C, 3, 0.2f) : std::vector<float>{};
      auto dout = randn(N * C, 4);  // R of the objective J = sum(out * R)

      std::vector<float> out(N * C), mean(N), rstd(N);
      be->norm_forward(nc.kind, out.data(), ln ? mean.data() : nullptr, rstd.data(), x.data(),
                       w.data(), nc.bias ? b.data() : nullptr, N, C, eps, DType::F32, DType::F32);
      std::vector<double> xd = to_double(x), wd = to_double(w), bd = to_double(b);
      std::vector<double> rmean, rrstd;
      auto rout = ref_norm(ln, xd, wd, bd, N, C, eps, &rmean, &rrstd);
      expect_close(out, rout, kF32, "out");
      expect_close(rstd, rrstd, kF32, "rstd");
      if (ln) expect_close(mean, rmean, kF32, "mean");

      // Accumulate semantics: dx, dweight, dbias start from known values and are added to.
      auto dx = randn(N * C, 5), dw = randn(C, 6), db = randn(C, 7);
      const auto dx0 = dx, dw0 = dw, db0 = db;
      be->norm_backward(nc.kind, dx.data(), dw.data(), nc.bias ? db.data() : nullptr, dout.data(),
                        x.data(), w.data(), ln ? mean.data() : nullptr, rstd.data(), N, C,
                        DType::F32, DType::F32);
      const auto R = to_double(dout);
      auto J = [&] { return dot(ref_norm(ln, xd, wd, bd, N, C, eps), R); };
      const size_t stride = N > 100 ? 7 : 1;  // sample x on the large case; weights in full
      auto gx = finite_diff(xd, J, stride), gw = finite_diff(wd, J);
      std::vector<double> want_dx(N * C), got_dx(N * C);
      for (size_t i = 0; i < dx.size(); i += stride) {
        want_dx[i] = dx0[i] + gx[i];
        got_dx[i] = dx[i];
      }
      expect_close(got_dx, want_dx, kF32, "dx (accumulated)");
      std::vector<double> want_dw(C);
      for (int64_t j = 0; j < C; ++j) want_dw[j] = dw0[j] + gw[j];
      expect_close(dw, want_dw, kF32, "dweight (accumulated)");
      if (nc.bias) {
        auto gb = finite_diff(bd, J);
        std::vector<double> want_db(C);
        for (int64_t j = 0; j < C; ++j) want_db[j] = db0[j] + gb[j];
        expect_close(db, want_db, kF32, "dbias (accumulated)");
      } else {
        expect_bitwise_equal(db, db0, "dbias untouched without a bias");
      }
    }
  }
}

TEST_CASE("norm forward and backward in BF16 match the F32 kernel", "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t N = 13, C = 37;
  const float eps = 1e-5f;
  for (const NormCase& nc : kNormCases) {
    for (DType wt : {DType::F32, DType::BF16}) {
      const bool ln = nc.kind == NormKind::LAYERNORM;
      INFO("kind=" << (ln ? "layernorm" : "rmsnorm") << " bias=" << nc.bias
                   << " weights=" << tetra::dtype_name(wt));
      auto x = bf16_exact(randn(N * C, 11, 1.5f, 0.5f));
      auto w = bf16_exact(randn(C, 12, 0.2f, 1.0f));
      auto b = bf16_exact(randn(C, 13, 0.2f));
      auto dout = bf16_exact(randn(N * C, 14));
      auto dx_init = bf16_exact(randn(N * C, 15));
      const float* bias = nc.bias ? b.data() : nullptr;

      // fp32 run.
      std::vector<float> out(N * C), mean(N), rstd(N), dx = dx_init, dw(C, 0.5f), db(C, -0.25f);
      be->norm_forward(nc.kind, out.data(), mean.data(), rstd.data(), x.data(), w.data(), bias, N,
                       C, eps, DType::F32, DType::F32);
      be->norm_backward(nc.kind, dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                        mean.data(), rstd.data(), N, C, DType::F32, DType::F32);
      // bf16 run: activations bf16; weights bf16 or F32 (the same values).
      auto xb = to_bf16(x), doutb = to_bf16(dout), dxb = to_bf16(dx_init);
      auto wb = to_bf16(w), bb = to_bf16(b);
      const void* wp = wt == DType::BF16 ? static_cast<const void*>(wb.data()) : w.data();
      const void* bp = !nc.bias ? nullptr
                       : wt == DType::BF16 ? static_cast<const void*>(bb.data()) : b.data();
      std::vector<uint16_t> outb(N * C);
      std::vector<float> mean16(N), rstd16(N), dw16(C, 0.5f), db16(C, -0.25f);
      be->norm_forward(nc.kind, outb.data(), mean16.data(), rstd16.data(), xb.data(), wp, bp, N,
                       C, eps, DType::BF16, wt);
      be->norm_backward(nc.kind, dxb.data(), dw16.data(), db16.data(), doutb.data(), xb.data(),
                        wp, mean16.data(), rstd16.data(), N, C, DType::BF16, wt);
      expect_close(from_bf16(outb), out, kBf16, "out");
      expect_close(rstd16, rstd, kBf16, "rstd");
      expect_close(from_bf16(dxb), dx, kBf16, "dx");
      expect_close(dw16, dw, kBf16, "dweight");
      expect_close(db16, db, kBf16, "dbias");
    }
  }
}

// ---- element-wise --------------------------------------------------------------------------------
double ref_gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double ref_silu(double x) { return x / (1.0 + std::exp(-x)); }

TEST_CASE("add, gelu and swiglu (F32) match a double reference and finite differences",
          "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t N = 13, F = 37, n = N * F;
  auto a = randn(n, 21, 3.0f), b = randn(n, 22), R = randn(n, 23);

  SECTION("add, also in place") {
    std::vector<float> out(n);
    be->add(out.data(), a.data(), b.data(), n, DType::F32);
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = double(a[i]) + double(b[i]);
    // One fp32 rounding of an exact sum: <= 2^-24 relative.
    expect_close(out, want, {0.0, 1.2e-7}, "add");
    auto a2 = a;
    be->add(a2.data(), a2.data(), b.data(), n, DType::F32);
    expect_bitwise_equal(a2, out, "add in place (out aliases a)");
  }
  SECTION("gelu") {
    std::vector<float> y(n), dx(n);
    be->gelu_forward(y.data(), a.data(), n, DType::F32);
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = ref_gelu(a[i]);
    // 1 + tanh(u) cancels for x << 0: its absolute error ~2^-24 times 0.5|x| (|x| < 12 here).
    expect_close(y, want, {1e-6, 1e-5}, "gelu forward");
    be->gelu_backward(dx.data(), a.data(), R.data(), n, DType::F32);
    std::vector<double> xd = to_double(a), gx(n);
    for (int64_t i = 0; i < n; ++i) {  // J = sum gelu(x) R is separable: one term per element
      std::vector<double> xi{xd[i]};
      gx[i] = finite_diff(xi, [&] { return ref_gelu(xi[0]) * R[i]; })[0];
    }
    expect_close(dx, gx, {1e-5, 1e-4}, "gelu backward");
    auto dy = R;
    be->gelu_backward(dy.data(), a.data(), dy.data(), n, DType::F32);
    expect_bitwise_equal(dy, dx, "gelu backward in place (dx aliases dy)");
  }
  SECTION("swiglu") {
    auto x = randn(N * 2 * F, 24, 2.0f);  // rows [gate | up]
    auto Ry = randn(N * F, 25);
    std::vector<float> y(N * F), dx(N * 2 * F);
    be->swiglu_forward(y.data(), x.data(), N, F, DType::F32);
    auto xd = to_double(x);
    auto ref = [&] {
      std::vector<double> out(N * F);
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < F; ++j)
          out[i * F + j] = ref_silu(xd[i * 2 * F + j]) * xd[i * 2 * F + F + j];
      return out;
    };
    expect_close(y, ref(), {1e-6, 1e-5}, "swiglu forward");
    be->swiglu_backward(dx.data(), x.data(), Ry.data(), N, F, DType::F32);
    auto gx = finite_diff(xd, [&] { return dot(ref(), to_double(Ry)); });
    expect_close(dx, gx, {1e-5, 1e-4}, "swiglu backward");
  }
}

TEST_CASE("add, gelu and swiglu in BF16 match the F32 kernel", "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t N = 13, F = 37, n = N * F;
  auto a = bf16_exact(randn(n, 31, 3.0f)), b = bf16_exact(randn(n, 32));
  auto x = bf16_exact(randn(N * 2 * F, 33, 2.0f)), dy = bf16_exact(randn(N * F, 34));
  auto ab = to_bf16(a), bb = to_bf16(b), xb = to_bf16(x), dyb = to_bf16(dy);
  std::vector<float> f(n), f2(N * 2 * F);
  std::vector<uint16_t> h(n), h2(N * 2 * F);

  be->add(f.data(), a.data(), b.data(), n, DType::F32);
  be->add(h.data(), ab.data(), bb.data(), n, DType::BF16);
  expect_close(from_bf16(h), f, kBf16, "add");
  be->gelu_forward(f.data(), a.data(), n, DType::F32);
  be->gelu_forward(h.data(), ab.data(), n, DType::BF16);
  expect_close(from_bf16(h), f, kBf16, "gelu forward");
  be->gelu_backward(f.data(), a.data(), b.data(), n, DType::F32);
  be->gelu_backward(h.data(), ab.data(), bb.data(), n, DType::BF16);
  expect_close(from_bf16(h), f, kBf16, "gelu backward");
  be->swiglu_forward(f.data(), x.data(), N, F, DType::F32);
  be->swiglu_forward(h.data(), xb.data(), N, F, DType::BF16);
  expect_close(from_bf16(h), f, kBf16, "swiglu forward");
  be->swiglu_backward(f2.data(), x.data(), dy.data(), N, F, DType::F32);
  be->swiglu_backward(h2.data(), xb.data(), dyb.data(), N, F, DType::BF16);
  expect_close(from_bf16(h2), f2, kBf16, "swiglu backward");
}

TEST_CASE("cast rounds F32 to BF16 to nearest even and widens BF16 exactly", "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  auto x = randn(1001, 41, 10.0f);
  // Ties and edge values: 1 + 2^-8 (tie, rounds down to even 1), 1 + 3*2^-8 (tie, rounds up),
  // a value just above a tie, the largest finite float (rounds to +inf), a denormal, zeros.
  const float edge[] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f,
                        -(1.0f + 0x1p-8f), 3.4028235e38f, 1e-40f, 0.0f, -0.0f};
  std::copy(std::begin(edge), std::end(edge), x.begin());
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint16_t> h(n), h_copy(n);
  be->cast(h.data(), DType::BF16, x.data(), DType::F32, n);
  expect_bitwise_equal(h, to_bf16(x), "F32 -> BF16");
  CHECK(h[0] == 0x3f80);  // 1 + 2^-8 -> 1.0
  CHECK(h[1] == 0x3f82);  // 1 + 3*2^-8 -> 1 + 2^-6
  CHECK(h[4] == 0x7f80);  // +inf
  std::vector<float> back(n), back_copy(n);
  be->cast(back.data(), DType::F32, h.data(), DType::BF16, n);
  expect_bitwise_equal(back, from_bf16(h), "BF16 -> F32");
  be->cast(back_copy.data(), DType::F32, back.data(), DType::F32, n);
  expect_bitwise_equal(back_copy, back, "F32 -> F32 copy");
  be->cast(h_copy.data(), DType::BF16, h.data(), DType::BF16, n);
  expect_bitwise_equal(h_copy, h, "BF16 -> BF16 copy");
}

TEST_CASE("bias_backward accumulates column sums", "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t N = 13, OC = 300;  // OC spans several column tiles, the last one partial
  auto dout = bf16_exact(randn(N * OC, 51));
  auto dbias = randn(OC, 52), dbias16 = dbias;
  std::vector<double> want(OC);
  for (int64_t j = 0; j < OC; ++j) {
    want[j] = dbias[j];
    for (int64_t i = 0; i < N; ++i) want[j] += dout[i * OC + j];
  }
  be->bias_backward(dbias.data(), dout.data(), N, OC, DType::F32);
  expect_close(dbias, want, kF32, "dbias (F32 dout)");
  auto doutb = to_bf16(dout);  // same values: the fp32 sums are the same up to order
  be->bias_backward(dbias16.data(), doutb.data(), N, OC, DType::BF16);
  expect_close(dbias16, want, kF32, "dbias (BF16 dout)");
}

// ---- embeddings ----------------------------------------------------------------------------------
TEST_CASE("embedding forward and backward, with repeated tokens, whole vocabulary or a slice",
          "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t B = 3, T = 5, C = 37, V = 11;
  // Ids from a small range so that many tokens repeat (and some ids never appear).
  std::vector<int32_t> tokens = {0, 3, 3, 1, 0, 2, 3, 3, 3, 10, 1, 0, 0, 2, 3};
  auto wte = bf16_exact(randn(V * C, 61)), wpe = bf16_exact(randn(T * C, 62));
  auto R = bf16_exact(randn(B * T * C, 63));
  auto wd = to_double(wte), pd = to_double(wpe);
  const auto Rd = to_double(R);
  struct Slice {
    int64_t v0, Vl;
  };
  // The whole table; rows 2..5 (tokens 2 and 3 inside, 0, 1 and 10 outside, 4 and 5 unused);
  // the last row alone.
  for (Slice sl : {Slice{0, V}, Slice{2, 4}, Slice{10, 1}}) {
    const int64_t v0 = sl.v0, Vl = sl.Vl;
    // out = (token in the slice ? wte[token] : 0) + wpe[t], from the full table wd.
    auto ref = [&](bool pos) {
      std::vector<double> out(B * T * C);
      for (int64_t bt = 0; bt < B * T; ++bt) {
        const bool in = tokens[bt] >= v0 && tokens[bt] < v0 + Vl;
        for (int64_t c = 0; c < C; ++c) {
          const double e = in ? wd[tokens[bt] * C + c] : 0.0;
          out[bt * C + c] = e + (pos ? pd[(bt % T) * C + c] : 0.0);
        }
      }
      return out;
    };
    for (bool pos : {true, false}) {
      for (DType act : {DType::F32, DType::BF16}) {
        for (DType w : {DType::F32, DType::BF16}) {
          INFO("slice [" << v0 << ", " << v0 + Vl << ") wpe=" << pos
                         << " act=" << tetra::dtype_name(act) << " w=" << tetra::dtype_name(w));
          auto wteb = to_bf16(wte), wpeb = to_bf16(wpe);
          // The slice's table: rows [v0, v0 + Vl) of the full one.
          const void* te = w == DType::F32 ? static_cast<const void*>(wte.data() + v0 * C)
                                           : wteb.data() + v0 * C;
          const void* pe = !pos ? nullptr
                           : w == DType::F32 ? static_cast<const void*>(wpe.data()) : wpeb.data();
          std::vector<float> out(B * T * C, 7.0f);  // garbage: the zero rows must be written
          std::vector<uint16_t> outb(B * T * C, 0x40e0);
          void* o = act == DType::F32 ? static_cast<void*>(out.data()) : outb.data();
          be->embedding_forward(o, tokens.data(), te, pe, B, T, C, v0, Vl, act, w);
          if (act == DType::BF16) out = from_bf16(outb);
          // F32: one rounding of an exact sum (2^-24 relative); BF16: one rounding to bf16.
          expect_close(out, ref(pos), act == DType::F32 ? Tol{0.0, 1.2e-7} : kBf16, "forward");
        }
      }
      // Backward: accumulate into known values; J = sum(out * R) is linear in wte and wpe.
      auto J = [&] { return dot(ref(pos), Rd); };
      auto gte = finite_diff(wd, J), gpe = finite_diff(pd, J);
      for (DType act : {DType::F32, DType::BF16}) {
        INFO("slice [" << v0 << ", " << v0 + Vl << ") wpe=" << pos
                       << " act=" << tetra::dtype_name(act));
        auto dwte = randn(Vl * C, 64), dwpe = randn(T * C, 65);
        const auto dwte0 = dwte, dwpe0 = dwpe;
        auto Rb = to_bf16(R);
        const void* dout = act == DType::F32 ? static_cast<const void*>(R.data()) : Rb.data();
        be->embedding_backward(dwte.data(), pos ? dwpe.data() : nullptr, dout, tokens.data(), B,
                               T, C, v0, Vl, act);
        std::vector<double> want_te(Vl * C), want_pe(T * C);
        for (int64_t i = 0; i < Vl * C; ++i) want_te[i] = dwte0[i] + gte[v0 * C + i];
        for (int64_t i = 0; i < T * C; ++i) want_pe[i] = dwpe0[i] + gpe[i];
        expect_close(dwte, want_te, kF32, "dwte (accumulated)");
        if (pos) {
          expect_close(dwpe, want_pe, kF32, "dwpe (accumulated)");
          // Only the position gradient wanted: dwte null, dwpe still gets every position.
          auto dwpe2 = dwpe0;
          be->embedding_backward(nullptr, dwpe2.data(), dout, tokens.data(), B, T, C, v0, Vl, act);
          expect_close(dwpe2, want_pe, kF32, "dwpe with dwte null");
        } else {
          expect_bitwise_equal(dwpe, dwpe0, "dwpe untouched");
        }
      }
    }
  }
}

// ---- cross-entropy -------------------------------------------------------------------------------
// Loss of one row in double: logsumexp(l) - l[t] (max subtracted, as any careful reference).
double ref_ce_row(const double* l, int64_t V, int32_t t) {
  double mx = l[0];
  for (int64_t j = 1; j < V; ++j) mx = std::max(mx, l[j]);
  double s = 0;
  for (int64_t j = 0; j < V; ++j) s += std::exp(l[j] - mx);
  return mx + std::log(s) - l[t];
}

TEST_CASE("cross_entropy matches a double reference and finite differences of the loss",
          "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t N = 13, V = 1001;
  const float scale = 1.0f / 11;  // 11 rows count: rows 2 and 7 are ignored
  auto logits = randn(N * V, 71, 3.0f);
  for (int64_t i = 0; i < N; ++i)  // large offsets: exp without the max would overflow
    for (int64_t j = 0; j < V; ++j) logits[i * V + j] += 100.0f * static_cast<float>(i);
  for (int64_t j = 0; j < V; j += 2) logits[3 * V + j] -= 1e4f;  // exp underflows to 0 here
  for (int64_t j = 0; j < V; ++j) logits[5 * V + j] = 0.25f;     // uniform row: loss = log V
  std::mt19937 gen(72);
  std::vector<int32_t> targets(N);
  for (auto& t : targets) t = static_cast<int32_t>(gen() % V);
  targets[2] = -1;
  targets[7] = -100;
  targets[3] = 4;  // a target whose logit is 1e4 below the others: loss ~1e4, dlogit = -scale

  std::vector<float> losses(N), dl(N * V);
  be->cross_entropy(losses.data(), dl.data(), DType::F32, logits.data(), DType::F32, targets.data(), N, V,
                    scale);
  auto ld = to_double(logits);
  std::vector<double> want_loss(N, 0.0), want_grad(N * V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < 0) continue;
    double* row = ld.data() + i * V;
    want_loss[i] = ref_ce_row(row, V, targets[i]);
    std::vector<double> r(row, row + V);
    auto g = finite_diff(r, [&] { return scale * ref_ce_row(r.data(), V, targets[i]); });
    std::copy(g.begin(), g.end(), want_grad.begin() + i * V);
  }
  // Loss ~ 7 (or 1e4): an fp32 log-sum-exp of 1001 terms; gradients ~scale/V ~ 1e-4 with an
  // fp32 exp (2 ulp): relative 1e-4 bounds both, the absolute part covers the exp(-1e4) zeros.
  expect_close(losses, want_loss, {1e-5, 1e-5}, "losses");
  CHECK(losses[5] == Approx(std::log(1001.0)).epsilon(1e-6));
  expect_close(dl, want_grad, {1e-9, 1e-4}, "dlogits");

  SECTION("in place over the logits, and without a gradient") {
    auto inplace = logits;
    std::vector<float> losses2(N), losses3(N);
    be->cross_entropy(losses2.data(), inplace.data(), DType::F32, inplace.data(), DType::F32, targets.data(),
                      N, V, scale);
    expect_bitwise_equal(losses2, losses, "losses in place");
    expect_bitwise_equal(inplace, dl, "dlogits in place");
    be->cross_entropy(losses3.data(), nullptr, DType::F32, logits.data(), DType::F32, targets.data(), N, V,
                      scale);
    expect_bitwise_equal(losses3, losses, "losses without dlogits");
  }
  SECTION("a NaN logit makes its row's loss NaN, and only that row's") {
    auto bad = logits;
    bad[4 * V + 17] = std::nanf("");
    std::vector<float> losses2(N);
    be->cross_entropy(losses2.data(), dl.data(), DType::F32, bad.data(), DType::F32, targets.data(), N, V,
                      scale);
    for (int64_t i = 0; i < N; ++i) CHECK(std::isnan(losses2[i]) == (i == 4));
  }
  SECTION("BF16 gradient") {
    std::vector<float> losses2(N);
    std::vector<uint16_t> dlb(N * V);
    be->cross_entropy(losses2.data(), dlb.data(), DType::BF16, logits.data(), DType::F32, targets.data(), N,
                      V, scale);
    expect_bitwise_equal(losses2, losses, "losses");
    expect_close(from_bf16(dlb), dl, {1e-12, 1.0 / 256 + 1e-5}, "dlogits BF16");
  }
  SECTION("BF16 logits, gradient in place") {
    // Reference: the same math in double on the bf16-rounded logits. Loss and gradient are fp32
    // computations on exactly those inputs (1e-5 relative as above, here against losses ~7 and
    // ~1e4); the gradient is then rounded once to bf16 (2^-8 relative).
    std::vector<uint16_t> lb(N * V);
    std::vector<double> lr(N * V);
    for (int64_t k = 0; k < N * V; ++k) {
      lb[k] = tetra::math::f32_to_bf16_bits(logits[k]);
      lr[k] = tetra::math::bf16_bits_to_f32(lb[k]);
    }
    std::vector<double> want_loss2(N, 0.0), want_grad2(N * V, 0.0);
    for (int64_t i = 0; i < N; ++i) {
      if (targets[i] < 0) continue;
      const double* row = lr.data() + i * V;
      want_loss2[i] = ref_ce_row(row, V, targets[i]);
      double mx = row[0];
      for (int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += std::exp(row[j] - mx);
      for (int64_t j = 0; j < V; ++j)
        want_grad2[i * V + j] = scale * (std::exp(row[j] - mx) / s - (j == targets[i] ? 1.0 : 0.0));
    }
    std::vector<float> losses2(N);
    be->cross_entropy(losses2.data(), lb.data(), DType::BF16, lb.data(), DType::BF16,
                      targets.data(), N, V, scale);
    expect_close(losses2, want_loss2, {1e-5, 1e-5}, "losses from BF16 logits");
    expect_close(from_bf16(lb), want_grad2, {1e-9, 1.0 / 256 + 1e-4}, "dlogits BF16 in place");
    // Aliasing buffers of different types is refused.
    std::vector<float> lf(logits);
    CHECK_THROWS_AS(be->cross_entropy(losses2.data(), lf.data(), DType::BF16, lf.data(),
                                      DType::F32, targets.data(), N, V, scale),
                    tetra::Error);
  }
}

// ---- reductions and AdamW ------------------------------------------------------------------------
TEST_CASE("sum and sum_squares match a double reference", "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  for (int64_t n : {0, 1, 13, 100003}) {  // 100003: many chunks, the last one partial
    INFO("n=" << n);
    auto x = randn(n, 81, 2.0f, 0.1f);
    double s = 0, ss = 0;
    for (float v : x) {
      s += v;
      ss += double(v) * v;
    }
    float got_s = -1, got_ss = -1;
    be->sum(&got_s, x.data(), n);
    be->sum_squares(&got_ss, x.data(), n);
    // Double accumulation, then one rounding to float: 2^-24 relative (+ double-order noise).
    CHECK(std::fabs(got_s - s) <= 1.2e-7 * std::fabs(s) + 1e-9);
    CHECK(std::fabs(got_ss - ss) <= 1.2e-7 * ss + 1e-9);
  }
}

tetra::math::AdamParams adam_params(float lr, float b1, float b2, float eps, float wd, int step,
                                     float grad_scale) {
  return {lr, b1, b2, eps, wd, 1.0f - std::pow(b1, static_cast<float>(step)),
          1.0f - std::pow(b2, static_cast<float>(step)), grad_scale};
}

TEST_CASE("adamw reproduces a hand-computed sequence", "[kernels]") {
  // With a constant gradient g the bias-corrected moments are exactly m_hat = g, v_hat = g^2, so
  // each step is p <- p (1 - lr wd) - lr g / (|g| + eps) = 0.99 p - 0.1 sign(g) (lr 0.1, wd 0.1;
  // eps changes the result by 1e-8 relative). By hand:
  //   p = 1:    0.89, 0.7811, 0.673289        (g = +0.5)
  //   p = -2:  -1.88, -1.7612, -1.643588      (g = -0.25)
  //   p = 0.5:  0.495, 0.49005, 0.4851495     (g = 0: weight decay only)
  // The raw gradients are half of g and grad_scale = 2 restores them.
  auto be = tetra::make_cpu_backend(2);
  std::vector<float> p = {1.0f, -2.0f, 0.5f}, grad = {0.25f, -0.125f, 0.0f}, m(3, 0.0f),
                     v(3, 0.0f);
  const double want[3][3] = {{0.89, 0.7811, 0.673289},
                             {-1.88, -1.7612, -1.643588},
                             {0.495, 0.49005, 0.4851495}};
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> g = grad;  // consumed (zeroed) by the update
    be->adamw(p.data(), g.data(), m.data(), v.data(), 3,
              adam_params(0.1f, 0.9f, 0.999f, 1e-8f, 0.1f, step, 2.0f), nullptr, DType::F32);
    CHECK(g == std::vector<float>(3, 0.0f));
    for (int i = 0; i < 3; ++i) {
      INFO("step " << step << " element " << i);
      CHECK(p[i] == Approx(want[i][step - 1]).margin(1e-6));  // fp32 state: a few ulps of ~1
    }
  }
}

TEST_CASE("adamw follows torch.optim.AdamW over several steps, with compute copies",
          "[kernels]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t n = 1001;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  auto p = randn(n, 91), m = std::vector<float>(n, 0.0f), v = m;
  auto p_nocopy = p, m_nocopy = m, v_nocopy = v;
  // torch.optim.AdamW (decoupled decay, bias-corrected), written out in double:
  //   p *= 1 - lr wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
  //   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  auto rp = to_double(p), rm = std::vector<double>(n, 0.0), rv = rm;
  std::vector<uint16_t> copy16(n);
  std::vector<float> copy32(n);
  for (int step = 1; step <= 5; ++step) {
    INFO("step " << step);
    auto grad = randn(n, 100 + step, 3.0f);
    grad[0] = 0.0f;  // a parameter with no gradient: only weight decay moves it
    const auto hp = adam_params(lr, b1, b2, eps, wd, step, gs);
    const DType ct = step % 2 ? DType::BF16 : DType::F32;  // both copy types, alternately
    void* copy = ct == DType::BF16 ? static_cast<void*>(copy16.data()) : copy32.data();
    auto g1 = grad, g2 = grad;  // each update consumes (zeroes) its gradient buffer
    be->adamw(p.data(), g1.data(), m.data(), v.data(), n, hp, copy, ct);
    be->adamw(p_nocopy.data(), g2.data(), m_nocopy.data(), v_nocopy.data(), n, hp, nullptr,
              DType::F32);
    CHECK(g1 == std::vector<float>(n, 0.0f));
    CHECK(g2 == std::vector<float>(n, 0.0f));
    const double bc1 = 1.0 - std::pow(double(b1), step), bc2 = 1.0 - std::pow(double(b2), step);
    for (int64_t i = 0; i < n; ++i) {
      double g = double(grad[i]) * gs;
      rp[i] *= 1.0 - double(lr) * wd;
      rm[i] = b1 * rm[i] + (1.0 - b1) * g;
      rv[i] = b2 * rv[i] + (1.0 - b2) * g * g;
      rp[i] -= (lr / bc1) * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + eps);
    }
    // fp32 state against double: each step adds a few ulps of p (~1) and of the moments. m can
    // cancel (b1 m and (1-b1) g of opposite signs): its error is a few ulps of those terms
    // (|g| < 10, so < 1e-7 absolute), not of the small result.
    expect_close(p, rp, {1e-6, 1e-6}, "params");
    expect_close(m, rm, {1e-7, 1e-5}, "m");
    expect_close(v, rv, {1e-9, 1e-5}, "v");
    expect_bitwise_equal(p_nocopy, p, "params without a compute copy");
    if (ct == DType::BF16) {
      expect_bitwise_equal(copy16, to_bf16(p), "BF16 compute copy = params rounded");
    } else {
      expect_bitwise_equal(copy32, p, "F32 compute copy = params");
    }
  }
}

// ---- determinism ---------------------------------------------------------------------------------
TEST_CASE("reductions give the same bits for any thread count", "[kernels]") {
  auto be1 = tetra::make_cpu_backend(1);
  auto be2 = tetra::make_cpu_backend(2);
  auto be3 = tetra::make_cpu_backend(3);
  Backend* bes[] = {be1.get(), be2.get(), be3.get()};
  const int64_t N = 300, C = 100, B = 4, T = 75, V = 7;  // N = B * T rows
  auto x = randn(N * C, 111), w = randn(C, 112, 0.2f, 1.0f), dout = randn(N * C, 113);
  std::vector<int32_t> tokens(N);
  for (int64_t i = 0; i < N; ++i) tokens[i] = static_cast<int32_t>((i * 5) % V);
  auto big = randn(1000003, 114);
  std::vector<float> mean(N), rstd(N), out(N * C);
  be1->norm_forward(NormKind::LAYERNORM, out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                    nullptr, N, C, 1e-5f, DType::F32, DType::F32);

  std::vector<std::vector<float>> results(3);
  for (int k = 0; k < 3; ++k) {
    std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f), bias_grad(C, 0.0f),
        dwte(V * C, 0.0f), dwpe(T * C, 0.0f), dwte_slice(3 * C, 0.0f), sums(2);
    bes[k]->norm_backward(NormKind::LAYERNORM, dx.data(), dw.data(), db.data(), dout.data(),
                          x.data(), w.data(), mean.data(), rstd.data(), N, C, DType::F32,
                          DType::F32);
    bes[k]->bias_backward(bias_grad.data(), dout.data(), N, C, DType::F32);
    bes[k]->embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, 0,
                               V, DType::F32);
    bes[k]->embedding_backward(dwte_slice.data(), nullptr, dout.data(), tokens.data(), B, T, C, 2,
                               3, DType::F32);
    bes[k]->sum(&sums[0], big.data(), static_cast<int64_t>(big.size()));
    bes[k]->sum_squares(&sums[1], big.data(), static_cast<int64_t>(big.size()));
    for (const auto* r : {&dx, &dw, &db, &bias_grad, &dwte, &dwpe, &dwte_slice, &sums})
      results[k].insert(results[k].end(), r->begin(), r->end());
  }
  expect_bitwise_equal(results[1], results[0], "2 threads vs 1");
  expect_bitwise_equal(results[2], results[0], "3 threads vs 1");
}

}  // namespace
