// Element types of tensors. fp32 is the reference and the type of master weights, gradients and
// optimizer state; bf16 and fp16 are the compute types of weights and activations in
// `precision: bf16` and `precision: fp16`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/common/math.h"

namespace tetra {

enum class DType : uint8_t { F32, BF16, I32, F16 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::F16: return 2;
  }
  return 0;
}

inline std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::F16: return "F16";
  }
  return "?";
}

// Storage type for one bf16 value (host side). Arithmetic happens in fp32.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float x) : bits(math::f32_to_bf16_bits(x)) {}
  explicit operator float() const { return math::bf16_bits_to_f32(bits); }
};
static_assert(sizeof(bf16) == 2);

// Storage type for one fp16 (IEEE binary16) value (host side). Arithmetic happens in fp32.
struct f16 {
  uint16_t bits;
  f16() = default;
  explicit f16(float x) : bits(math::f32_to_f16_bits(x)) {}
  explicit operator float() const { return math::f16_bits_to_f32(bits); }
};
static_assert(sizeof(f16) == 2);

// Load / store an element of any floating type as fp32. Kernels templated on T use these.
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return static_cast<float>(x); }
inline float to_f32(f16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return bf16(x); }
template <> inline f16 from_f32<f16>(float x) { return f16(x); }

// True for the 16-bit floating types (the compute types of mixed precision).
inline bool is_half_type(DType t) { return t == DType::BF16 || t == DType::F16; }

}  // namespace tetra
