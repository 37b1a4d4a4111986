// The optimizer ops on the GPU against the CPU backend: sum_squares and sum (double
// accumulation, deterministic), AdamW (math::adamw_update on both sides, compute copy, grads
// zeroed), and cast. Sizes are odd and pointers are also taken one element past the 16-byte grid,
// so both the vector and the scalar paths of every kernel run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

// Distance from |x| to the next float above it: one ulp, the larger one at a power of two.
double ulp(float x) {
  const float a = std::fabs(x);
  return static_cast<double>(std::nextafter(a, std::numeric_limits<float>::infinity())) - a;
}

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

float* at(void* p, int64_t offset) { return static_cast<float*>(p) + offset; }

}  // namespace

// Both backends sum the same n doubles (each x or x^2 exact in double) in different orders:
// each result is within n 2^-53 sum |terms| of the exact sum, and is then rounded to float. So
// they differ by at most one float ulp of the result plus 2 n 2^-53 sum |terms| (the second
// term only matters where the sum cancels, as the plain sum of signed values can).
TEST_CASE("cuda sum and sum_squares vs cpu, deterministic", "[cuda][optim]") {
  Backends& be = backends();
  uint64_t seed = 500;
  for (int64_t n : {0, 1, 3, 17, 4099, 1000003, 5000011}) {
    for (int64_t offset : {0, 1}) {
      INFO("n=" << n << " offset=" << offset);
      Twin x(random_values(static_cast<size_t>(n + offset), seed += 3, 2.0f), DType::F32);
      Twin out(4, DType::F32);
      be.cpu->sum_squares(at(out.cpu(), 0), at(x.cpu(), offset), n);
      be.cpu->sum(at(out.cpu(), 1), at(x.cpu(), offset), n);
      be.gpu->sum_squares(at(out.gpu(), 0), at(x.gpu(), offset), n);
      be.gpu->sum(at(out.gpu(), 1), at(x.gpu(), offset), n);
      be.gpu->sum_squares(at(out.gpu(), 2), at(x.gpu(), offset), n);
      be.gpu->sum(at(out.gpu(), 3), at(x.gpu(), offset), n);
      const std::vector<float> xs = x.cpu_values(), ref = out.cpu_values(), got = out.gpu_values();
      REQUIRE(bits(got[0]) == bits(got[2]));  // reruns give the same bits
      REQUIRE(bits(got[1]) == bits(got[3]));
      double abs_sum = 0.0, sq_sum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = xs[offset + i];
        abs_sum += std::fabs(v);
        sq_sum += v * v;
      }
      const double eps53 = std::ldexp(1.0, -53);
      const double slack_sq = 2.0 * n * eps53 * sq_sum, slack_abs = 2.0 * n * eps53 * abs_sum;
      CHECK(std::fabs(static_cast<double>(got[0]) - ref[0]) <= ulp(ref[0]) + slack_sq);
      CHECK(std::fabs(static_cast<double>(got[1]) - ref[1]) <= ulp(ref[1]) + slack_abs);
      // Against the host's own double sum too: half an ulp of rounding plus both double errors.
      CHECK(std::fabs(static_cast<double>(got[0]) - sq_sum) <= ulp(got[0]) + slack_sq);
    }
  }
}

// The global gradient norm's sum of squares propagates non-finite values, which fp16 loss scaling
// reads its overflows from: any inf gives inf, any NaN gives NaN (inf beside NaN too), whether the
// element falls in the 16-byte path or the scalar tail; finite values whose squares sum beyond
// fp32's range give inf as well.
TEST_CASE("cuda sum_squares propagates inf and NaN", "[cuda][optim]") {
  Backends& be = backends();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {1, 7, 4099, 1000003}) {
    for (int64_t at_i : {int64_t{0}, n / 2, n - 1}) {
      for (int64_t offset : {0, 1}) {
        INFO("n=" << n << " at=" << at_i << " offset=" << offset);
        std::vector<float> v = random_values(static_cast<size_t>(n + offset), 40 + n);
        Twin out(2, DType::F32);
        v[static_cast<size_t>(offset + at_i)] = -inf;
        Twin x_inf(v, DType::F32);
        be.gpu->sum_squares(at(out.gpu(), 0), at(x_inf.gpu(), offset), n);
        v[static_cast<size_t>(offset + at_i)] = nan;
        if (n > 1) v[static_cast<size_t>(offset + (at_i == 0 ? 1 : 0))] = inf;
        Twin x_nan(v, DType::F32);
        be.gpu->sum_squares(at(out.gpu(), 1), at(x_nan.gpu(), offset), n);
        const std::vector<float> got = out.gpu_values();
        CHECK(got[0] == inf);
        CHECK(std::isnan(got[1]));
      }
    }
  }
  Twin big(std::vector<float>(4, 3e19f), DType::F32), out(1, DType::F32);
  be.gpu->sum_squares(at(out.gpu(), 0), at(big.gpu(), 0), 4);
  CHECK(out.gpu_values()[0] == inf);
}

// AdamW: both backends evaluate math::adamw_update in IEEE fp32 (precise division and square
// root) with its multiply-adds written as fmaf (math::fused_mul_add: one rounding each, on the
// device and on an FMA host alike), so m, v and the parameters must match bit for bit. The
// compute copy is the GPU's own updated parameter, rounded (bitwise), and the gradients are zeroed
// exactly.
TEST_CASE("cuda adamw vs cpu: moments and params bitwise, copy, zeroed grads",
          "[cuda][optim]") {
  Backends& be = backends();
  math::AdamParams hp{};
  hp.lr = 1e-3f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  hp.bias_correction1 = 1.0f - std::pow(0.9f, 3.0f);
  hp.bias_correction2 = 1.0f - std::pow(0.95f, 3.0f);
  hp.grad_scale = 0.5f;
  uint64_t seed = 700;
  for (int64_t n : {1, 7, 4099, 100003}) {
    for (int64_t offset : {0, 1}) {
      for (int copy_kind = 0; copy_kind < 4; ++copy_kind) {  // none, F32, BF16, F16
        const DType copy_type = copy_kind == 2 ? DType::BF16 : copy_kind == 3 ? DType::F16 : DType::F32;
        INFO("n=" << n << " offset=" << offset << " copy=" << copy_kind);
        const size_t len = static_cast<size_t>(n + offset);
        const std::vector<float> p0 = random_values(len, seed += 5);
        std::vector<float> v0 = random_values(len, seed += 5, 0.01f);
        for (float& x : v0) x = std::fabs(x);
        Twin p(p0, DType::F32), g(random_values(len, seed += 5, 3.0f), DType::F32),
            m(random_values(len, seed += 5, 0.1f), DType::F32), v(v0, DType::F32);
        Twin copy(len, copy_type);
        const size_t cs = dtype_size(copy_type);
        void* copy_cpu = copy_kind ? static_cast<char*>(copy.cpu()) + offset * cs : nullptr;
        void* copy_gpu = copy_kind ? static_cast<char*>(copy.gpu()) + offset * cs : nullptr;
        be.cpu->adamw(at(p.cpu(), offset), at(g.cpu(), offset), at(m.cpu(), offset),
                      at(v.cpu(), offset), n, hp, copy_cpu, copy_type);
        be.gpu->adamw(at(p.gpu(), offset), at(g.gpu(), offset), at(m.gpu(), offset),
                      at(v.gpu(), offset), n, hp, copy_gpu, copy_type);
        const std::vector<float> pr = p.cpu_values(), pg = p.gpu_values();
        const std::vector<float> mr = m.cpu_values(), mg = m.gpu_values();
        const std::vector<float> vr = v.cpu_values(), vg = v.gpu_values();
        const std::vector<float> gg = g.gpu_values();
        const std::vector<float> cr = copy.cpu_values(), cg = copy.gpu_values();
        size_t moment_mismatch = 0, param_differ = 0, copy_bad = 0, grad_left = 0;
        for (size_t i = static_cast<size_t>(offset); i < len; ++i) {
          moment_mismatch += bits(mr[i]) != bits(mg[i]) || bits(vr[i]) != bits(vg[i]);
          param_differ += bits(pg[i]) != bits(pr[i]);
          grad_left += gg[i] != 0.0f;
          if (copy_kind == 1) copy_bad += bits(cg[i]) != bits(pg[i]);
          if (copy_kind == 2) {
            copy_bad += bits(cg[i]) != bits(math::round_bf16(pg[i]));
            // and within one bf16 ulp of the CPU's copy
            const double d_copy = std::fabs(static_cast<double>(cg[i]) - cr[i]);
            copy_bad += !(d_copy <= std::fabs(cr[i]) / 128.0);
          }
          if (copy_kind == 3) {
            copy_bad += bits(cg[i]) != bits(math::round_f16(pg[i]));
            // and within one fp16 ulp of the CPU's copy (2^-24 absolute below fp16's normal range)
            const double d_copy = std::fabs(static_cast<double>(cg[i]) - cr[i]);
            copy_bad += !(d_copy <= std::fabs(cr[i]) / 1024.0 + std::ldexp(1.0, -24));
          }
        }
        CHECK(moment_mismatch == 0);
        CHECK(param_differ == 0);
        CHECK(copy_bad == 0);
        CHECK(grad_left == 0);
        if (offset == 1) {  // the element before the range is untouched
          CHECK(pg[0] == p0[0]);
          CHECK(gg[0] != 0.0f);
        }
      }
    }
  }
}

// cast: F32 -> BF16 / F16 rounds to nearest even on both sides (the same bits, NaN aside: both
// NaN; fp16 overflows to infinity and underflows gradually alike); BF16 / F16 -> F32 is exact;
// between the 16-bit types through fp32; equal types copy.
TEST_CASE("cuda cast vs cpu: bitwise", "[cuda][optim]") {
  Backends& be = backends();
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.5f, 1.00390625f /* tie: 1 + 2^-8 */,
                            1.01171875f /* tie, odd: rounds up */, 3.0e38f, 3.4e38f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 1e-40f /* denormal */,
                            -3e-39f, 1.17549435e-38f, 65504.0f, 65519.0f, 65520.0f /* fp16: inf */,
                            -70000.0f, 2.98023224e-8f /* 2^-25: fp16 tie to 0 */, 3.0e-6f /* fp16 subnormal */,
                            1.00048828125f /* fp16 tie: 1 + 2^-11 */, 6.1035156e-5f /* 2^-14 */};
  uint64_t seed = 900;
  for (int64_t n : {1, 5, 14, 4099, 100003}) {
    for (int64_t offset : {0, 1}) {
      INFO("n=" << n << " offset=" << offset);
      std::vector<float> values = random_values(static_cast<size_t>(n + offset), seed += 3, 100.0f);
      for (size_t i = 0; i < std::size(specials) && offset + i < values.size(); ++i)
        values[offset + i] = specials[i];
      for (DType src_type : {DType::F32, DType::BF16, DType::F16}) {
        for (DType dst_type : {DType::F32, DType::BF16, DType::F16}) {
          INFO(dtype_name(src_type) << " -> " << dtype_name(dst_type));
          Twin src(values, src_type);
          Twin dst(std::vector<float>(values.size(), 7.0f), dst_type);
          const size_t ss = dtype_size(src_type), ds = dtype_size(dst_type);
          be.cpu->cast(static_cast<char*>(dst.cpu()) + offset * ds, dst_type,
                       static_cast<char*>(src.cpu()) + offset * ss, src_type, n);
          be.gpu->cast(static_cast<char*>(dst.gpu()) + offset * ds, dst_type,
                       static_cast<char*>(src.gpu()) + offset * ss, src_type, n);
          const std::vector<float> ref = dst.cpu_values(), got = dst.gpu_values();
          size_t bad = 0;
          for (size_t i = 0; i < ref.size(); ++i)
            bad += std::isnan(ref[i]) ? !std::isnan(got[i]) : bits(ref[i]) != bits(got[i]);
          CHECK(bad == 0);
          if (offset == 1) CHECK(got[0] == 7.0f);
        }
      }
    }
  }
}

}  // namespace tetra::cuda_testing
