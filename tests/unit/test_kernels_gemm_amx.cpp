// The bf16 GEMM on AMX tiles (kernels/cpu/gemm_amx.cpp), through CpuBackend::gemm: against a
// double-precision loop with a bound derived from its arithmetic, bitwise independent of the
// thread count, never touching C outside (M, N) nor reading it when beta == 0, and reported.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_amx.h"
#include "tests/unit/attention_testing.h"
#include "tests/unit/kernel_testing.h"

using namespace tetra;
using namespace tetra::attn_testing;

namespace {

struct Case {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha, beta;
  bool bias;
  DType c_type;
  int64_t pad = 0;  // extra elements per row of A, B and C (and the offset of A and B's start)
};

// Operands with leading dimensions padded by `pad`, started `pad` elements into their buffers (an
// odd pad puts rows off cache lines, which the kernel must pack rather than read in place).
struct Operands {
  int64_t lda, ldb, ldc;
  std::vector<bf16> a, b, bias;
  std::vector<float> c0;  // C before the product (bf16-representable when C is bf16)
  const bf16* A() const { return a.data() + off; }
  const bf16* B() const { return b.data() + off; }
  int64_t off;
};

Operands make_operands(const Case& g, uint32_t seed) {
  Operands o;
  o.off = g.pad;
  o.lda = (g.trans_a ? g.M : g.K) + g.pad;
  o.ldb = (g.trans_b ? g.K : g.N) + g.pad;
  o.ldc = g.N + g.pad;
  o.a = to_bf16(random_floats((g.trans_a ? g.K : g.M) * o.lda + o.off, seed));
  o.b = to_bf16(random_floats((g.trans_b ? g.N : g.K) * o.ldb + o.off, seed + 1));
  o.bias = to_bf16(random_floats(g.N, seed + 2));
  o.c0 = random_floats(g.M * o.ldc, seed + 3);
  if (g.c_type == DType::BF16) o.c0 = round_bf16(o.c0);
  return o;
}

// C as fp32 values after the backend's gemm; C starts as c0, or as NaN where beta == 0 (never
// read, so it must not leak).
std::vector<float> run_gemm(CpuBackend& be, const Case& g, const Operands& o) {
  std::vector<float> c = o.c0;
  if (g.beta == 0.0f)
    for (int64_t m = 0; m < g.M; ++m)
      for (int64_t n = 0; n < g.N; ++n) c[m * o.ldc + n] = std::numeric_limits<float>::quiet_NaN();
  if (g.c_type == DType::F32) {
    be.gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, o.A(), o.lda, o.B(), o.ldb, DType::BF16,
            g.beta, c.data(), o.ldc, DType::F32, g.bias ? o.bias.data() : nullptr);
    return c;
  }
  std::vector<bf16> c16 = to_bf16(c);
  be.gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, o.A(), o.lda, o.B(), o.ldb, DType::BF16,
          g.beta, c16.data(), o.ldc, DType::BF16, g.bias ? o.bias.data() : nullptr);
  return to_f32(c16);
}

constexpr const char* kPath = "the AMX GEMM path";

}  // namespace

TEST_CASE("gemm: bf16 on AMX tiles matches a double loop within fp32 accumulation",
          "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  CpuBackend be(2);
  // Every transpose combination over: whole tiles; ragged M, N and K (K odd, so a pair is half
  // padding); one row / column; K over the kernel's 4096-long pass (fp32 accumulation across
  // passes, into a buffer or into C itself); alpha, beta and bias; fp32 and bf16 C; rows off
  // cache lines. The shapes are big enough for both threads to split rows and columns.
  const Case shapes[] = {
      {false, false, 64, 96, 64, 1.0f, 0.0f, false, DType::F32},
      {false, false, 37, 53, 71, 0.5f, 0.75f, true, DType::BF16},
      {false, false, 1, 17, 3, 1.0f, 1.0f, false, DType::F32},
      {false, false, 130, 33, 129, 1.0f, 1.0f, false, DType::F32, 1},
      {false, false, 65, 97, 8195, 2.0f, 0.0f, true, DType::BF16},
      {false, false, 70, 40, 9000, 1.0f, 1.0f, false, DType::F32, 3},
      {false, false, 96, 200, 300, 1.0f, 0.5f, true, DType::F32, 1},
      {false, false, 40, 7, 33, 1.0f, 0.0f, false, DType::BF16, 5},
  };
  uint32_t seed = 900;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (Case g : shapes) {
        g.trans_a = ta;
        g.trans_b = tb;
        INFO("trans_a=" << ta << " trans_b=" << tb << " M=" << g.M << " N=" << g.N << " K=" << g.K
                        << " alpha=" << g.alpha << " beta=" << g.beta << " bias=" << g.bias
                        << " C=" << dtype_name(g.c_type) << " pad=" << g.pad);
        const Operands o = make_operands(g, seed);
        seed += 4;
        const std::vector<float> c = run_gemm(be, g, o);
        CHECK(be.kernel_report() == "bf16 gemm amx (bf16 tiles)");
        // Reference in double from the same bf16 values. bf16 x bf16 products are exact in fp32,
        // so the kernel's error is its fp32 sums: at most (K + 3) u sum|terms| (u = 2^-24: K
        // products, then scale, beta term and bias), doubled for margin; a bf16 C adds its
        // rounding, u = 2^-8 of the value.
        std::vector<double> want(c.size()), tol(c.size(), 0.0);
        for (int64_t m = 0; m < g.M; ++m)
          for (int64_t n = 0; n < g.N; ++n) {
            double acc = 0.0, mag = 0.0;
            for (int64_t k = 0; k < g.K; ++k) {
              const double a = static_cast<float>(ta ? o.A()[k * o.lda + m] : o.A()[m * o.lda + k]);
              const double b = static_cast<float>(tb ? o.B()[n * o.ldb + k] : o.B()[k * o.ldb + n]);
              acc += a * b;
              mag += std::fabs(a * b);
            }
            double v = g.alpha * acc;
            mag *= std::fabs(g.alpha);
            const double c0 = o.c0[m * o.ldc + n];
            if (g.beta != 0.0f) {
              v += g.beta * c0;
              mag += std::fabs(g.beta * c0);
            }
            if (g.bias) {
              v += static_cast<float>(o.bias[n]);
              mag += std::fabs(static_cast<float>(o.bias[n]));
            }
            const size_t i = static_cast<size_t>(m * o.ldc + n);
            want[i] = v;
            tol[i] = 2.0 * (g.K + 3) * std::ldexp(mag, -24) +
                     (g.c_type == DType::BF16 ? std::ldexp(std::fabs(v), -8) : 0.0);
          }
        // Columns past N (the padding of each row) are untouched: want = tol-free c0 there.
        for (int64_t m = 0; m < g.M; ++m)
          for (int64_t n = g.N; n < o.ldc; ++n) want[m * o.ldc + n] = o.c0[m * o.ldc + n];
        require_close("C", c, want, [&](size_t i) { return tol[i] > 0.0 ? tol[i] : 1e-300; });
      }
}

TEST_CASE("gemm: bf16 on AMX tiles is bitwise independent of the thread count",
          "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  CpuBackend one(1), two(2);
  // The GPT-2 MLP shapes, cut down: forward (B stored transposed, bias, bf16 C), dX, and the
  // weight gradient accumulating into fp32 (A transposed, beta 1); plus a K over one pass.
  const Case shapes[] = {
      {false, true, 256, 384, 96, 1.0f, 0.0f, true, DType::BF16},
      {false, false, 256, 96, 384, 1.0f, 1.0f, false, DType::BF16},
      {true, false, 384, 96, 256, 1.0f, 1.0f, false, DType::F32},
      {false, false, 64, 96, 5000, 1.0f, 0.0f, false, DType::BF16, 1},
  };
  uint32_t seed = 1300;
  for (const Case& g : shapes) {
    INFO("trans_a=" << g.trans_a << " trans_b=" << g.trans_b << " M=" << g.M << " N=" << g.N
                    << " K=" << g.K);
    const Operands o = make_operands(g, seed);
    seed += 4;
    const std::vector<float> c1 = run_gemm(one, g, o), c2 = run_gemm(two, g, o);
    REQUIRE(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("gemm: bf16 on AMX tiles from two host threads at once, two backends",
          "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  // K over one pass and a bf16 C: the calls use the packing buffers their threads share and the
  // fp32 accumulator, which each backend must have to itself.
  const Case g{false, false, 128, 96, 9000, 1.0f, 0.0f, false, DType::BF16, 1};
  // Different operands on each thread, so that a shared buffer would mix the two products.
  const Operands o[2] = {make_operands(g, 4242), make_operands(g, 4343)};
  CpuBackend reference(2);
  const std::vector<float> want[2] = {run_gemm(reference, g, o[0]), run_gemm(reference, g, o[1])};
  int mismatches[2] = {0, 0};
  std::vector<std::thread> host;
  for (int t = 0; t < 2; ++t)
    host.emplace_back([&, t] {
      CpuBackend be(1);
      for (int i = 0; i < 40; ++i)
        if (run_gemm(be, g, o[t]) != want[t]) ++mismatches[t];
    });
  for (std::thread& h : host) h.join();
  CHECK(mismatches[0] == 0);
  CHECK(mismatches[1] == 0);
}

// The product both bf16 cases below run: B transposed, a bias, an fp32 C.
constexpr Case kReported{false, true, 96, 160, 200, 1.0f, 0.0f, true, DType::F32};

TEST_CASE("gemm: bf16 with AMX off runs on oneDNN (or the loops) and says so", "[kernels]") {
  CpuBackend other(2);
  other.set_amx_gemm(false);
  run_gemm(other, kReported, make_operands(kReported, 77));
  CHECK_THAT(other.kernel_report(), Catch::Equals("bf16 gemm onednn") ||
                                        Catch::Equals("bf16 gemm loops"));
}

TEST_CASE("gemm: bf16 on AMX tiles is reported, and agrees with oneDNN's", "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  CpuBackend amx(2), other(2);
  other.set_amx_gemm(false);
  const Case& g = kReported;
  const Operands o = make_operands(g, 77);
  const std::vector<float> c_other = run_gemm(other, g, o);
  const std::vector<float> c_amx = run_gemm(amx, g, o);
  CHECK(amx.kernel_report() == "bf16 gemm amx (bf16 tiles)");
  // Both sum exact products in fp32, in different orders: within twice the fp32 bound of each.
  require_close("C", c_amx, c_other, [&](size_t) { return 4.0 * (g.K + 3) * std::ldexp(1.0, -24) * 200; });
}
