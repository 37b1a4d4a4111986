// fp16 conversions (kernels/common/math.h: f32_to_f16_bits, f16_bits_to_f32; kernels/common/dtype.h's
// f16) against two independent references: the format's definition and a nearest-value search
// (tests/unit/f16_reference.h), and the CPU's own F16C instructions (vcvtps2ph / vcvtph2ps, IEEE
// round to nearest even) where the build targets a CPU that has them.
//
// Coverage: every one of the 65536 fp16 patterns widened and narrowed back; around every fp16 value
// and every midpoint between neighbours (where rounding decides), both signs; hand-picked ties,
// overflow to infinity, gradual underflow and NaN; and a strided sweep over all 2^32 fp32 patterns.
// Then F16 safetensors tensors, read back and loaded as a model's weights (trainer/train/generate.h).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/common/math.h"
#include "tests/unit/f16_reference.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/config/config.h"
#include "kernels/common/dtype.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/generate.h"

using namespace tetra;
using tetra_test::f16_round_by_search;
using tetra_test::f16_value_by_definition;

namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
bool is_f16_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Checks one fp32 value: against the search reference (non-NaN) and, with F16C, bit for bit
// (NaN payloads included). Returns false, with the details in `why`, on a mismatch.
bool narrow_matches(float x, std::string& why) {
  const uint16_t got = math::f32_to_f16_bits(x);
  if (std::isnan(x)) {
    if (!is_f16_nan(got)) {
      why = "NaN narrowed to a non-NaN";
      return false;
    }
  } else if (got != f16_round_by_search(x)) {
    why = "reference search gives another pattern";
    return false;
  }
#if defined(__F16C__)
  const uint16_t hw = static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
  if (got != hw) {
    why = "F16C gives another pattern";
    return false;
  }
#endif
  return true;
}

void require_narrow(float x) {
  std::string why;
  const bool ok = narrow_matches(x, why);
  INFO("x = " << x << " (bits 0x" << std::hex << float_bits(x) << "): got 0x" << math::f32_to_f16_bits(x)
              << std::dec << ": " << why);
  REQUIRE(ok);
}

}  // namespace

TEST_CASE("f16: every fp16 value widens exactly and narrows back to itself", "[f16]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float f = math::f16_bits_to_f32(b);
    INFO("pattern 0x" << std::hex << h);
    if (is_f16_nan(b)) {
      REQUIRE(std::isnan(f));
      REQUIRE(is_f16_nan(math::f32_to_f16_bits(f)));
    } else {
      REQUIRE(static_cast<double>(f) == f16_value_by_definition(b));
      REQUIRE(std::signbit(f) == ((h & 0x8000) != 0));  // -0 stays -0
      REQUIRE(math::f32_to_f16_bits(f) == b);
      REQUIRE(static_cast<float>(f16(f)) == f);
    }
#if defined(__F16C__)
    const float hw = _cvtsh_ss(b);
    REQUIRE(float_bits(f) == float_bits(hw));  // NaNs too: quiet, payload kept
#endif
  }
}

TEST_CASE("f16: fp32 -> fp16 rounds to nearest even: ties, overflow, subnormals, NaN", "[f16]") {
  struct Case {
    float x;
    uint16_t want;
  };
  const float sub = std::ldexp(1.0f, -24);  // smallest subnormal
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {65504.0f, 0x7bff},                                   // largest finite
      {std::nextafter(65520.0f, 0.0f), 0x7bff},             // just below the midpoint to 2^16
      {65520.0f, 0x7c00},                                   // the midpoint: ties to even = infinity
      {1e9f, 0x7c00},
      {-1e9f, 0xfc00},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},               // tie between 1 and 1 + 2^-10: even 1
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02},           // tie between 0x3c01 and 0x3c02: even
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3c01},
      {sub, 0x0001},
      {sub / 2, 0x0000},                                    // 2^-25: tie between 0 and 2^-24: 0
      {std::nextafter(sub / 2, 1.0f), 0x0001},
      {-sub / 2, 0x8000},
      {1.5f * sub, 0x0002},                                 // tie between 1 and 2 subnormal units: 2
      {2.5f * sub, 0x0002},                                 // tie between 2 and 3: 2
      {std::ldexp(1.0f, -14), 0x0400},                      // smallest normal
      {std::ldexp(1.0f, -14) - sub / 2, 0x0400},            // tie between 0x3ff and 0x400: even
      {std::ldexp(1.0f, -14) - sub, 0x03ff},                // largest subnormal
      {std::ldexp(1.0f, -30), 0x0000},
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {-std::numeric_limits<float>::denorm_min(), 0x8000},
  };
  for (const Case& c : cases) {
    INFO("x = " << c.x);
    CHECK(math::f32_to_f16_bits(c.x) == c.want);
    CHECK(f16_round_by_search(c.x) == c.want);  // the reference agrees with the hand values
    require_narrow(c.x);
  }
  for (float nan : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::signaling_NaN(), bits_to_float(0x7f800001u),
                    bits_to_float(0xffc00123u)}) {
    CHECK(is_f16_nan(math::f32_to_f16_bits(nan)));
    CHECK(std::isnan(math::round_f16(nan)));
    require_narrow(nan);
  }
}

TEST_CASE("f16: fp32 -> fp16 at every fp16 value and every midpoint between neighbours", "[f16]") {
  // The midpoint of two neighbouring fp16 values has 12 significant bits: an exact float. Around
  // it rounding switches from one neighbour to the other; at it the even pattern wins.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float v = math::f16_bits_to_f32(static_cast<uint16_t>(h));
    const float next = h + 1 < 0x7c00 ? math::f16_bits_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0f;
    const float mid = static_cast<float>((static_cast<double>(v) + next) / 2.0);
    REQUIRE(static_cast<double>(mid) == (static_cast<double>(v) + next) / 2.0);
    for (float x : {v, std::nextafter(v, -inf), std::nextafter(v, inf), mid, std::nextafter(mid, -inf),
                    std::nextafter(mid, inf)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  size_t bad = 0;
  std::string why;
  float first = 0.0f;
  for (float x : xs)
    if (!narrow_matches(x, why) && bad++ == 0) first = x;
  INFO(bad << " of " << xs.size() << " values wrong; first " << first << ": " << why);
  CHECK(bad == 0);
}

TEST_CASE("f16: fp32 -> fp16 over a strided sweep of all 2^32 fp32 patterns", "[f16]") {
  // 2^32 / 61 ~ 70 million patterns, every exponent and sign, NaNs and infinities included.
  size_t bad = 0, checked = 0;
  std::string why;
  uint32_t first = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 61) {
    ++checked;
    const float x = bits_to_float(static_cast<uint32_t>(u));
    if (!narrow_matches(x, why) && bad++ == 0) first = static_cast<uint32_t>(u);
  }
  INFO(bad << " of " << checked << " patterns wrong; first 0x" << std::hex << first << ": " << why);
  CHECK(bad == 0);
#if !defined(__F16C__)
  WARN("this build targets a CPU without F16C: the fp16 conversions were checked against the table "
       "reference only");
#endif
}

TEST_CASE("f16: dtype helpers", "[f16]") {
  CHECK(dtype_size(DType::F16) == 2);
  CHECK(dtype_name(DType::F16) == "F16");
  CHECK(precision_dtype(Precision::FP16) == DType::F16);
  CHECK(precision_dtype(Precision::BF16) == DType::BF16);
  CHECK(precision_dtype(Precision::FP32) == DType::F32);
  CHECK(is_half_type(DType::F16));
  CHECK(is_half_type(DType::BF16));
  CHECK_FALSE(is_half_type(DType::F32));
  CHECK(to_f32(from_f32<f16>(0.1f)) == math::round_f16(0.1f));
  CHECK(math::round_f16(0.1f) != 0.1f);  // 0.1 is not an fp16 value
  CHECK(std::fabs(math::round_f16(0.1f) - 0.1f) <= 0.1f * std::ldexp(1.0f, -11));
  CHECK(math::kF16Max == math::f16_bits_to_f32(0x7bff));
}

TEST_CASE("f16: F16 safetensors tensors round trip, and load as a model's weights", "[f16][checkpoint]") {
  const std::string dir = (std::filesystem::path(TETRA_TEST_TMPDIR) / "f16_weights").string();
  std::filesystem::create_directories(dir);
  ModelConfig m;
  m.vocab_size = 16, m.seq_len = 4, m.num_layers = 1, m.hidden_size = 8, m.num_heads = 2, m.num_kv_heads = 2;
  m.ffn_hidden_size = 16;
  const ParamLayout layout = ParamLayout::build(m);
  // Every parameter as an F16 tensor of values 0.1 * (k + 1) (k the element's index), which fp16
  // rounds (0.1 is not an fp16 value).
  std::vector<TensorRecord> records;
  for (const ParamSpec& p : layout.params) {
    TensorRecord r;
    r.name = p.name;
    r.dtype = DType::F16;
    r.shape = p.global_shape;
    r.data.resize(static_cast<size_t>(r.numel()) * 2);
    for (int64_t k = 0; k < r.numel(); ++k) {
      const uint16_t b = tetra_test::f16_round_by_search(0.1f * static_cast<float>(k + 1));
      std::memcpy(r.data.data() + 2 * k, &b, 2);
    }
    records.push_back(std::move(r));
  }
  const std::string path = dir + "/weights.safetensors";
  write_safetensors(path, records);
  const std::vector<TensorRecord> back = read_safetensors(path);
  REQUIRE(back.size() == records.size());
  for (size_t i = 0; i < back.size(); ++i) {
    CHECK(back[i].dtype == DType::F16);
    CHECK(back[i].data == records[i].data);
  }
  const std::vector<float> w = load_weights(path, layout);
  size_t bad = 0;
  for (const ParamSpec& p : layout.params)
    for (int64_t k = 0; k < p.numel; ++k) {  // the vocabulary's padding rows (past held()) load as zero
      const double want = k >= p.held() ? 0.0 : tetra_test::f16_value_by_definition(
          tetra_test::f16_round_by_search(0.1f * static_cast<float>(p.global_index(k) + 1)));
      bad += static_cast<double>(w[static_cast<size_t>(p.offset + k)]) != want;
    }
  CHECK(bad == 0);
}
