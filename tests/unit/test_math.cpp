// The shared scalar math (kernels/common/math.h) against the C library, computed in double.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "kernels/common/math.h"

using namespace tetra;

TEST_CASE("exp_fast is within 2 ulp of exp over fp32's normal range", "[math]") {
  double worst = 0.0;
  for (float x = -87.0f; x <= 88.25f; x += 0.001953125f) {  // 2^-9 steps: 90K points
    const double ref = std::exp(static_cast<double>(x));
    const double ulp = std::nextafter(static_cast<float>(ref), std::numeric_limits<float>::infinity()) -
                       static_cast<float>(ref);
    worst = std::max(worst, std::abs(math::exp_fast(x) - ref) / ulp);
  }
  CHECK(worst <= 2.0);
  CHECK(math::exp_fast(-200.0f) == 0.0f);
  CHECK(math::exp_fast(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(std::isfinite(math::exp_fast(1000.0f)));  // clamped, so tanh/sigmoid built on it stay finite
  CHECK(std::isnan(math::exp_fast(std::numeric_limits<float>::quiet_NaN())));
  CHECK(math::exp_fast(0.0f) == 1.0f);
}

TEST_CASE("tanh_fast, gelu and sigmoid against double-precision formulas", "[math]") {
  for (float x = -20.0f; x <= 20.0f; x += 0.01f) {
    const double xd = x;
    // tanh_fast has ~1e-7 absolute error (cancellation near 0 in 1 - 2/(e^2u + 1)).
    CHECK(std::abs(math::tanh_fast(x) - std::tanh(xd)) < 3e-7);
    const double u = 0.7978845608028654 * (xd + 0.044715 * xd * xd * xd);
    const double gelu = 0.5 * xd * (1.0 + std::tanh(u));
    CHECK(std::abs(math::gelu(x) - gelu) <= 1e-6 * std::max(1.0, std::abs(gelu)));
    const double sig = 1.0 / (1.0 + std::exp(-xd));
    CHECK(std::abs(math::sigmoid(x) - sig) <= 1e-6 * sig + 1e-12);
  }
  CHECK(math::tanh_fast(100.0f) == 1.0f);
  CHECK(math::tanh_fast(-100.0f) == -1.0f);
}

TEST_CASE("bf16 rounding is round-to-nearest-even and keeps NaN", "[math]") {
  CHECK(math::round_bf16(1.0f) == 1.0f);
  // 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
  CHECK(math::round_bf16(1.0f + 0.00390625f) == 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  CHECK(math::round_bf16(1.0f + 3 * 0.00390625f) == 1.0f + 0.015625f);
  CHECK(std::isnan(math::round_bf16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isinf(math::round_bf16(std::numeric_limits<float>::infinity())));
}

TEST_CASE("philox4x32-10 matches Random123's known-answer vectors", "[math]") {
  // kat_vectors of Random123 1.14 (philox4x32 10 rounds): counter (c0, c1, c2, c3), key (k0, k1).
  struct Kat {
    uint32_t c[4], k[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const auto word2 = [](uint32_t lo, uint32_t hi) { return uint64_t{lo} | uint64_t{hi} << 32; };
    const math::Philox4 r =
        math::philox4x32(word2(k.c[0], k.c[1]), word2(k.c[2], k.c[3]), word2(k.k[0], k.k[1]));
    for (int i = 0; i < 4; ++i) CHECK(r.v[i] == k.out[i]);
  }
}

TEST_CASE("philox normals: deterministic per (seed, stream, n) and standard normal", "[math]") {
  CHECK(math::philox_normal(1, 2, 3) == math::philox_normal(1, 2, 3));
  CHECK(math::philox_normal(1, 2, 3) != math::philox_normal(1, 3, 3));
  CHECK(math::philox_normal(1, 2, 3) != math::philox_normal(2, 2, 3));
  const int n = 200000;
  double s = 0, s2 = 0, s4 = 0;
  for (int i = 0; i < n; ++i) {
    const double z = math::philox_normal(7, 11, static_cast<uint64_t>(i));
    s += z;
    s2 += z * z;
    s4 += z * z * z * z;
  }
  // Standard errors at n = 2e5: mean 0.0022, variance 0.0032, fourth moment 0.022; 5 sigma bounds.
  CHECK(std::abs(s / n) < 0.011);
  CHECK(std::abs(s2 / n - 1.0) < 0.016);
  CHECK(std::abs(s4 / n - 3.0) < 0.11);
}
