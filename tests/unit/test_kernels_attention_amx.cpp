// bf16 attention on AMX tiles (kernels/cpu/attention_amx.cpp) against the double reference, with
// error bounds derived from the kernel's roundings; the bf16 flash kernels (the path where the CPU
// has no AMX) stay covered by test_kernels_gemm_attention.cpp, which turns AMX off.
//
// The cases tagged [amx] need AMX: on a CPU without it they say so and return, and ctest lists them
// as skipped (kernel_testing.h, amx_or_skip). One case checks the fallback to the flash kernels.
#include <catch2/catch.hpp>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/attention_amx.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/attention_testing.h"
#include "tests/unit/kernel_testing.h"

using namespace tetra;
using namespace tetra::attn_testing;

namespace {

// Sums of absolute values of the terms behind every element of out and dqkv, for error bounds:
//   out_i:  sum_j p_ij |v_j|
//   dV_j:   sum_i p_ij |dO_i|
//   dQ_i:   scale sum_j a_ij |k_j|,   dK_j: scale sum_i a_ij |q_i|
// with a_ij = p_ij (|dP_ij| + |D_i| + sum_x |dO_ix out_ix|) bounding |dS_ij| and the part of it
// that depends on the rounded out.
void term_magnitudes(const AttnDims& d, const std::vector<float>& qkv, const std::vector<float>& R,
                     std::vector<double>* out_abs, std::vector<double>* grad_abs) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.HS));
  out_abs->assign(d.out_size(), 0.0);
  grad_abs->assign(d.qkv_size(), 0.0);
  std::vector<double> p(d.T), o(d.HS);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h)
      for (int64_t i = 0; i < d.T; ++i) {
        softmax_row(d, qkv, b, h, i, p);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t x = 0; x < d.HS; ++x) {
            o[x] += p[j] * qkv[d.v(b, j, h) + x];
            (*out_abs)[d.o(b, i, h) + x] += p[j] * std::fabs(qkv[d.v(b, j, h) + x]);
          }
        }
        double D = 0.0, D_abs = 0.0;
        for (int64_t x = 0; x < d.HS; ++x) {
          D += R[d.o(b, i, h) + x] * o[x];
          D_abs += std::fabs(R[d.o(b, i, h) + x] * o[x]);
        }
        for (int64_t j = 0; j <= i; ++j) {
          double dp = 0.0;
          for (int64_t x = 0; x < d.HS; ++x)
            dp += static_cast<double>(R[d.o(b, i, h) + x]) * qkv[d.v(b, j, h) + x];
          const double a = p[j] * (std::fabs(dp) + std::fabs(D) + D_abs);
          for (int64_t x = 0; x < d.HS; ++x) {
            (*grad_abs)[d.v(b, j, h) + x] += p[j] * std::fabs(R[d.o(b, i, h) + x]);
            (*grad_abs)[d.q(b, i, h) + x] += scale * a * std::fabs(qkv[d.k(b, j, h) + x]);
            (*grad_abs)[d.k(b, j, h) + x] += scale * a * std::fabs(qkv[d.q(b, i, h) + x]);
          }
        }
      }
}

constexpr const char* kPath = "the AMX attention path";

}  // namespace

TEST_CASE("attention: bf16 runs the flash kernels where AMX is absent or off, and says so",
          "[kernels]") {
  CpuBackend be(0);
  if (cpu::amx_available()) be.set_amx_attention(false);
  const std::vector<float> qkv = round_bf16(random_floats(AttnDims{1, 8, 2, 2, 8}.qkv_size(), 1));
  run_attention(be, AttnDims{1, 8, 2, 2, 8}, qkv, nullptr, DType::BF16);
  CHECK(be.kernel_report() == "attention forward flash (fp32 tiles)");
}

TEST_CASE("attention: bf16 on AMX tiles matches the double reference within its roundings",
          "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  CpuBackend be(0);
  // Odd T (one block, a partial last block, exactly one and two blocks), HS not a multiple of 32
  // (padded), MHA / GQA / MQA, and the GPT-2 head size.
  const AttnDims dims[] = {{2, 19, 4, 2, 8},   {1, 150, 4, 2, 24}, {2, 130, 2, 2, 16},
                           {1, 129, 4, 1, 32}, {1, 64, 2, 2, 64},  {2, 200, 4, 4, 20},
                           {1, 256, 2, 1, 64}, {1, 97, 3, 3, 96}};
  uint32_t seed = 500;
  for (const AttnDims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS);
    // bf16 inputs; q and k in (-2, 2) so the softmax is far from uniform.
    const std::vector<float> qkv = round_bf16(random_floats(d.qkv_size(), seed++, -2.0f, 2.0f));
    const std::vector<float> R = round_bf16(random_floats(d.out_size(), seed++));
    std::vector<double> out, lse, dqkv, out_abs, grad_abs;
    naive_attention<float>(d, qkv, &out, &lse, &R, &dqkv);
    term_magnitudes(d, qkv, R, &out_abs, &grad_abs);
    AttnRun r = run_attention(be, d, qkv, &R, DType::BF16);
    CHECK(be.kernel_report() == "attention forward amx (bf16 tiles), backward amx (bf16 tiles)");
    // The kernel rounds to bf16 (unit roundoff u = 2^-8): P before P V, and out -> |err(out)| <=
    // u |out| + u sum_j p_j |v_j| (fp32 accumulation adds ~2^-24 per term, far below).
    require_close("out", r.out, out, [&](size_t i) {
      return std::ldexp(std::fabs(out[i]) + out_abs[i], -8) + 1e-6;
    });
    // Scores are exact bf16 products summed in fp32 and the statistics are fp32: as the flash
    // kernels' bound (a few ulp of O(1) values over <= T terms).
    require_close("lse", r.lse, lse, [](size_t) { return 2e-5; });
    // dqkv: its own rounding, plus P (u), dS (u), and the rounded out inside D_i (u): 3 u relative
    // on each term's magnitude, bounded by 4 u of grad_abs.
    require_close("dqkv", r.dqkv, dqkv, [&](size_t i) {
      return std::ldexp(std::fabs(dqkv[i]), -8) + std::ldexp(grad_abs[i], -6) + 1e-6;
    });
  }
}

TEST_CASE("attention: AMX results do not depend on the number of threads", "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  const AttnDims d{2, 150, 4, 2, 24};
  const std::vector<float> qkv = round_bf16(random_floats(d.qkv_size(), 11, -2.0f, 2.0f));
  const std::vector<float> R = round_bf16(random_floats(d.out_size(), 12));
  const int saved = omp_get_max_threads();
  CpuBackend one(1), many(3);  // more threads than cores still schedules differently
  AttnRun r1 = run_attention(one, d, qkv, &R, DType::BF16);
  AttnRun r3 = run_attention(many, d, qkv, &R, DType::BF16);
  omp_set_num_threads(saved);
  CHECK(std::memcmp(r1.out.data(), r3.out.data(), r1.out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(r1.lse.data(), r3.lse.data(), r1.lse.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(r1.dqkv.data(), r3.dqkv.data(), r1.dqkv.size() * sizeof(float)) == 0);
}

TEST_CASE("attention: AMX and the bf16 flash kernels agree on a GPT-2 head", "[kernels][amx]") {
  if (!tetra_test::amx_or_skip(kPath)) return;
  // The two paths differ only by the roundings of P and dS (the flash kernels keep them fp32):
  // the same bound as against the reference, with the flash result as the reference.
  const AttnDims d{2, 256, 2, 2, 64};
  const std::vector<float> qkv = round_bf16(random_floats(d.qkv_size(), 21, -2.0f, 2.0f));
  const std::vector<float> R = round_bf16(random_floats(d.out_size(), 22));
  CpuBackend amx(0), flash(0);
  flash.set_amx_attention(false);
  AttnRun a = run_attention(amx, d, qkv, &R, DType::BF16);
  AttnRun f = run_attention(flash, d, qkv, &R, DType::BF16);
  CHECK(flash.kernel_report() ==
        "attention forward flash (fp32 tiles), backward flash (fp32 tiles)");
  std::vector<double> out_abs, grad_abs;
  term_magnitudes(d, qkv, R, &out_abs, &grad_abs);
  require_close("out", a.out, f.out, [&](size_t i) {
    return std::ldexp(2 * std::fabs(f.out[i]) + out_abs[i], -8) + 1e-6;
  });
  require_close("lse", a.lse, f.lse, [](size_t) { return 2e-5; });
  require_close("dqkv", a.dqkv, f.dqkv, [&](size_t i) {
    return std::ldexp(2 * std::fabs(f.dqkv[i]), -8) + std::ldexp(grad_abs[i], -6) + 1e-6;
  });
}
