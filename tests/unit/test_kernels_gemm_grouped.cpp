// CPU backend: gemm_grouped and gemm_grouped_k (kernels/backend.h) against the loop of gemm calls
// they stand for, bit for bit (the MoE layer's experts moved from that loop to these, and its loss
// curves must not move), and against a double-precision loop.
//
// Both ways of running the groups: in turn on the team (the default) and dealt out to the threads
// (set_grouped_threads). Groups: empty ones (first, inner and last), groups of 1 row, odd sizes,
// 64 small groups (the fine-grained experts the threads share out), a few large ones of unequal
// size (which the team runs in turn); with and without bias (some groups' bias null), beta 0 (C starts as NaN: never
// read) and beta 1 (accumulation), fp32, bf16 (fp32 and bf16 C) and fp16 inputs.
//
// Tolerance against the double loop, per element: S = |alpha| sum_k |a_mk b_kn| + |beta c| +
// |bias|, over the stored (rounded) inputs; any fp32 summation order is within (K + 2) u S of the
// exact sum (u = 2^-24), doubled for margin; a 16-bit C adds its rounding, 2^-8 (bf16) or 2^-11
// (fp16) of the value.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/common/dtype.h"
#include "tests/unit/kernel_testing.h"

using namespace tetra;

namespace {

constexpr double kU = 1.0 / 16777216.0;

// n values of `type` in host (= CPU backend) memory.
struct Buf {
  DType type;
  std::vector<uint8_t> raw;
  Buf(const std::vector<float>& v, DType t) : type(t), raw(v.size() * dtype_size(t)) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (t == DType::F32)
        reinterpret_cast<float*>(raw.data())[i] = v[i];
      else if (t == DType::BF16)
        reinterpret_cast<bf16*>(raw.data())[i] = bf16(v[i]);
      else
        reinterpret_cast<f16*>(raw.data())[i] = f16(v[i]);
    }
  }
  void* at(int64_t element) { return raw.data() + static_cast<size_t>(element) * dtype_size(type); }
  double get(int64_t i) const {
    const size_t k = static_cast<size_t>(i);
    return type == DType::F32    ? reinterpret_cast<const float*>(raw.data())[k]
           : type == DType::BF16 ? static_cast<float>(reinterpret_cast<const bf16*>(raw.data())[k])
                                 : static_cast<float>(reinterpret_cast<const f16*>(raw.data())[k]);
  }
  size_t size() const { return raw.size() / dtype_size(type); }
};

double storage_rounding(DType t) { return t == DType::BF16 ? 1.0 / 256 : t == DType::F16 ? 1.0 / 2048 : 0.0; }

struct Case {
  bool trans_a = false, trans_b = true;
  std::vector<int64_t> rows;
  int64_t N = 0, K = 0;  // gemm_grouped: N, K; gemm_grouped_k: M = N, N = K (the fixed dims)
  float alpha = 1.0f, beta = 0.0f;
  bool bias = false;
  DType ab = DType::F32, c = DType::F32;
};

std::string describe(const Case& c) {
  std::string r;
  for (int64_t v : c.rows) r += std::to_string(v) + " ";
  return "ta=" + std::to_string(c.trans_a) + " tb=" + std::to_string(c.trans_b) + " N=" + std::to_string(c.N) +
         " K=" + std::to_string(c.K) + " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta) +
         " bias=" + std::to_string(c.bias) + " " + std::string(dtype_name(c.ab)) + "->" + std::string(dtype_name(c.c)) +
         " rows " + r;
}

// gemm_grouped: op(A) (R, K), C (R, N), B[g] op (K, N), per-group bias (group 1's null).
void run_grouped(Backend& be, const Case& c, uint32_t seed) {
  INFO("gemm_grouped " << describe(c));
  const int64_t G = static_cast<int64_t>(c.rows.size());
  int64_t R = 0;
  for (int64_t r : c.rows) R += r;
  const int64_t lda = c.trans_a ? R + 3 : c.K + 1, ldb = c.trans_b ? c.K + 2 : c.N + 2, ldc = c.N + 1;
  Buf A(tetra_test::randn(static_cast<size_t>((c.trans_a ? c.K : R) * lda) + 1, seed), c.ab);
  std::vector<Buf> B, bias;
  for (int64_t g = 0; g < G; ++g) {
    B.emplace_back(tetra_test::randn(static_cast<size_t>((c.trans_b ? c.N : c.K) * ldb), seed + 10 + g), c.ab);
    bias.emplace_back(tetra_test::randn(static_cast<size_t>(c.N), seed + 500 + g), c.ab);
  }
  std::vector<const void*> b_ptr, bias_ptr;
  for (int64_t g = 0; g < G; ++g) {
    b_ptr.push_back(B[g].at(0));
    bias_ptr.push_back(g == 1 ? nullptr : bias[g].at(0));
  }
  const std::vector<float> c0 = c.beta == 0.0f
                                    ? std::vector<float>(static_cast<size_t>(R * ldc) + 1,
                                                         std::numeric_limits<float>::quiet_NaN())
                                    : tetra_test::randn(static_cast<size_t>(R * ldc) + 1, seed + 7);
  Buf grouped(c0, c.c), loop(c0, c.c);
  const Buf cin(c0, c.c);

  be.gemm_grouped(c.trans_a, c.trans_b, G, c.rows.data(), c.N, c.K, c.alpha, A.at(0), lda, b_ptr.data(), ldb, c.ab,
                  c.beta, grouped.at(0), ldc, c.c, c.bias ? bias_ptr.data() : nullptr);
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (c.rows[g] > 0)
      be.gemm(c.trans_a, c.trans_b, c.rows[g], c.N, c.K, c.alpha, A.at(c.trans_a ? o : o * lda), lda, b_ptr[g], ldb,
              c.ab, c.beta, loop.at(o * ldc), ldc, c.c, c.bias ? bias_ptr[g] : nullptr);
    o += c.rows[g];
  }
  CHECK(std::memcmp(grouped.raw.data(), loop.raw.data(), grouped.raw.size()) == 0);

  size_t bad = 0;
  o = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = o; r < o + c.rows[g]; ++r)
      for (int64_t n = 0; n < ldc; ++n) {
        const double got = grouped.get(r * ldc + n);
        if (n >= c.N) {  // the padding of C: untouched
          const double was = cin.get(r * ldc + n);
          if (!(std::isnan(was) ? std::isnan(got) : got == was)) ++bad;
          continue;
        }
        double want = 0.0, s = 0.0;
        for (int64_t k = 0; k < c.K; ++k) {
          const double a = A.get(c.trans_a ? k * lda + r : r * lda + k);
          const double b = B[g].get(c.trans_b ? n * ldb + k : k * ldb + n);
          want += a * b, s += std::fabs(a * b);
        }
        want *= c.alpha, s *= std::fabs(c.alpha);
        if (c.beta != 0.0f) want += c.beta * cin.get(r * ldc + n), s += std::fabs(c.beta * cin.get(r * ldc + n));
        if (c.bias && g != 1) want += bias[g].get(n), s += std::fabs(bias[g].get(n));
        const double tol = 2.0 * (c.K + 2) * kU * s + storage_rounding(c.c) * (std::fabs(want) + s * 1e-3);
        if (!(std::fabs(got - want) <= tol)) ++bad;
      }
    o += c.rows[g];
  }
  CHECK(bad == 0);
}

// gemm_grouped_k: op(A) (M, R), op(B) (R, N), C[g] (M, N), with M = c.N, N = c.K.
void run_grouped_k(Backend& be, const Case& c, uint32_t seed) {
  INFO("gemm_grouped_k " << describe(c));
  const int64_t G = static_cast<int64_t>(c.rows.size()), M = c.N, N = c.K;
  int64_t R = 0;
  for (int64_t r : c.rows) R += r;
  const int64_t lda = c.trans_a ? M + 3 : R + 1, ldb = c.trans_b ? R + 2 : N + 2, ldc = N + 1;
  Buf A(tetra_test::randn(static_cast<size_t>((c.trans_a ? R : M) * lda) + 1, seed), c.ab);
  Buf B(tetra_test::randn(static_cast<size_t>((c.trans_b ? N : R) * ldb) + 1, seed + 1), c.ab);
  std::vector<Buf> grouped, loop, cin;
  for (int64_t g = 0; g < G; ++g) {
    const std::vector<float> c0 = c.beta == 0.0f ? std::vector<float>(static_cast<size_t>(M * ldc),
                                                                      std::numeric_limits<float>::quiet_NaN())
                                                 : tetra_test::randn(static_cast<size_t>(M * ldc), seed + 20 + g);
    grouped.emplace_back(c0, c.c), loop.emplace_back(c0, c.c), cin.emplace_back(c0, c.c);
  }
  std::vector<void*> c_ptr;
  for (Buf& b : grouped) c_ptr.push_back(b.at(0));

  be.gemm_grouped_k(c.trans_a, c.trans_b, G, c.rows.data(), M, N, c.alpha, A.at(0), lda, B.at(0), ldb, c.ab, c.beta,
                    c_ptr.data(), ldc, c.c);
  int64_t o = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (c.rows[g] > 0)
      be.gemm(c.trans_a, c.trans_b, M, N, c.rows[g], c.alpha, A.at(c.trans_a ? o * lda : o), lda,
              B.at(c.trans_b ? o : o * ldb), ldb, c.ab, c.beta, loop[g].at(0), ldc, c.c);
    o += c.rows[g];
  }
  size_t bad = 0, differ = 0;
  o = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (grouped[g].raw != loop[g].raw) ++differ;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < ldc; ++n) {
        const double got = grouped[g].get(m * ldc + n), was = cin[g].get(m * ldc + n);
        if (n >= N || c.rows[g] == 0) {  // padding, and an empty group's C: untouched
          if (!(std::isnan(was) ? std::isnan(got) : got == was)) ++bad;
          continue;
        }
        double want = 0.0, s = 0.0;
        for (int64_t k = o; k < o + c.rows[g]; ++k) {
          const double a = A.get(c.trans_a ? k * lda + m : m * lda + k);
          const double b = B.get(c.trans_b ? n * ldb + k : k * ldb + n);
          want += a * b, s += std::fabs(a * b);
        }
        want *= c.alpha, s *= std::fabs(c.alpha);
        if (c.beta != 0.0f) want += c.beta * was, s += std::fabs(c.beta * was);
        const double tol = 2.0 * (c.rows[g] + 2) * kU * s + storage_rounding(c.c) * (std::fabs(want) + s * 1e-3);
        if (!(std::fabs(got - want) <= tol)) ++bad;
      }
    o += c.rows[g];
  }
  CHECK(differ == 0);
  CHECK(bad == 0);
}

// 64 fine-grained experts' row counts, 0 to 40, some empty.
std::vector<int64_t> fine_rows() {
  std::mt19937 gen(7);
  std::uniform_int_distribution<int64_t> d(0, 40);
  std::vector<int64_t> r(64);
  for (int64_t& v : r) v = d(gen) < 4 ? 0 : d(gen);
  return r;
}

const std::vector<std::vector<int64_t>>& row_sets() {
  static const std::vector<std::vector<int64_t>> sets = {
      {0, 1, 37, 0, 64, 130, 3, 0}, {1}, {0, 0}, {300, 257}, {700, 65, 1}, fine_rows()};
  return sets;
}

}  // namespace

TEST_CASE("cpu gemm_grouped: the gemm loop bit for bit, and the double loop", "[kernels][gemm][moe]") {
  CpuBackend cpu(2);
  Backend& be_in_turn = cpu;
  CpuBackend dealt(2);  // small groups dealt out to the threads
  dealt.set_grouped_threads(true);
  const std::pair<DType, DType> types[] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::F32}, {DType::BF16, DType::BF16}, {DType::F16, DType::F32}};
  uint32_t seed = 1;
  for (const auto& rows : row_sets())
    for (const auto& [ab, ct] : types)
      for (int t = 0; t < 3; ++t) {
        Case c;
        c.rows = rows;
        c.trans_a = t == 2, c.trans_b = t != 1;
        c.N = (seed % 2) ? 65 : 96, c.K = (seed % 3) ? 33 : 130;
        c.ab = ab, c.c = ct;
        c.bias = (seed % 2) == 0;
        c.beta = t == 1 ? 1.0f : 0.0f;
        c.alpha = t == 2 ? -0.5f : 1.0f;
        run_grouped(be_in_turn, c, seed);
        run_grouped(dealt, c, seed++);
      }
}

TEST_CASE("cpu gemm_grouped_k: the row blocks as the reduction, bit for bit with the gemm loop",
          "[kernels][gemm][moe]") {
  CpuBackend cpu(2);
  Backend& be_in_turn = cpu;
  CpuBackend dealt(2);
  dealt.set_grouped_threads(true);
  const std::pair<DType, DType> types[] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::F32}, {DType::BF16, DType::BF16}, {DType::F16, DType::F32}};
  uint32_t seed = 100;
  for (const auto& rows : row_sets())
    for (const auto& [ab, ct] : types)
      for (int t = 0; t < 3; ++t) {
        Case c;
        c.rows = rows;
        c.trans_a = t != 1, c.trans_b = t == 2;  // t = 0: the weight gradient's dY^T X
        c.N = (seed % 2) ? 65 : 96, c.K = (seed % 3) ? 33 : 130;
        c.ab = ab, c.c = ct;
        c.beta = t == 0 ? 1.0f : 0.0f;
        c.alpha = t == 2 ? 2.0f : 1.0f;
        run_grouped_k(be_in_turn, c, seed);
        run_grouped_k(dealt, c, seed++);
      }
}

TEST_CASE("cpu gemm_grouped: no groups, and a bad row count is refused", "[kernels][gemm][moe]") {
  auto be = make_cpu_backend(2);
  be->gemm_grouped(false, true, 0, nullptr, 8, 8, 1.0f, nullptr, 8, nullptr, 8, DType::F32, 0.0f, nullptr, 8,
                   DType::F32);
  be->gemm_grouped_k(true, false, 0, nullptr, 8, 8, 1.0f, nullptr, 8, nullptr, 8, DType::F32, 1.0f, nullptr, 8,
                     DType::F32);
  const int64_t rows[] = {2, -1};
  std::vector<float> a(64), b(64), c(64);
  const void* bs[] = {b.data(), b.data()};
  CHECK_THROWS(be->gemm_grouped(false, true, 2, rows, 8, 8, 1.0f, a.data(), 8, bs, 8, DType::F32, 0.0f, c.data(), 8,
                                DType::F32));
}
