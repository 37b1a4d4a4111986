// Element-wise math shared by every backend.
//
// Each function here is the single definition of one piece of scalar math (bf16 and fp16 rounding, GELU,
// SiLU, RoPE, the AdamW update, the counter-based RNG used for initialisation). The CPU kernels
// call them from vectorised loops; CUDA kernels call the same functions from device code
// (TETRA_HD expands to __host__ __device__ under nvcc), so the backends cannot drift apart.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define TETRA_HD __host__ __device__ __forceinline__
#else
#define TETRA_HD inline
#endif

namespace tetra::math {

// ---------------------------------------------------------------------------------------------
// bf16: the upper 16 bits of an IEEE fp32. Conversion rounds to nearest, ties to even; NaN stays
// NaN (a quiet NaN payload is forced so rounding cannot turn it into infinity).
// ---------------------------------------------------------------------------------------------
TETRA_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TETRA_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

TETRA_HD uint16_t f32_to_bf16_bits(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

TETRA_HD float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// Round an fp32 value to the nearest bf16 and return it widened back to fp32.
TETRA_HD float round_bf16(float x) { return bf16_bits_to_f32(f32_to_bf16_bits(x)); }

// ---------------------------------------------------------------------------------------------
// fp16: IEEE 754 binary16 (1 sign, 5 exponent bits with bias 15, 10 mantissa bits): normals from
// 2^-14 to 65504, subnormals down to 2^-24. fp32 -> fp16 rounds to nearest, ties to even, with
// gradual underflow: values from 65520 up (the tie above 65504 rounds to even, which is the next
// power of two) become infinity, values up to 2^-25 become (signed) zero. A NaN stays a quiet NaN
// keeping the top 9 bits of its payload, as x86's F16C conversion does. fp16 -> fp32 is exact.
//
// The host versions compute every case and select one, without branches, so the CPU's conversion
// loops vectorise; they are integer code but for one exact product, which no floating-point mode
// such as flush-to-zero can change. The device versions are CUDA's own conversions
// (__float2half_rn, __half2float), which compute the same values (device NaNs come out as the
// canonical 0x7fff; NaN bits are never compared).
// ---------------------------------------------------------------------------------------------
TETRA_HD uint16_t f32_to_f16_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(x));
#else
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal results (|x| in [2^-14, 65520)): rebias the exponent (127 - 15 = 112) and round the
  // 13 dropped mantissa bits to nearest even; a carry out of the mantissa bumps the exponent.
  const uint32_t rebiased = a - 0x38000000u;
  const uint32_t normal = (rebiased + 0x0fffu + ((rebiased >> 13) & 1u)) >> 13;
  // Subnormal results (|x| in (2^-25, 2^-14)): the 24-bit significand m = 1.f shifted right by
  // 126 - e (14 to 24 places for biased exponents e of 102 to 112), rounded to nearest even. A
  // round-up to 0x400 is the smallest normal, which the bit pattern encodes as it stands.
  const uint32_t e = a >> 23;
  const uint32_t in_range = static_cast<uint32_t>(e >= 102u) & static_cast<uint32_t>(e <= 112u);
  const uint32_t shift = in_range * (126u - e) + (1u - in_range) * 24u;  // 24: a harmless default
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  const uint32_t round_up = static_cast<uint32_t>(rem > halfway) | (static_cast<uint32_t>(rem == halfway) & q);
  const uint32_t subnormal = q + (round_up & 1u);
  const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);  // quiet, the payload's top bits
  // NaN; >= 65520 (or infinity): infinity; >= 2^-14: normal; > 2^-25: subnormal; else (the tie at
  // 2^-25 included, rounding to the even zero) zero. Chosen by masks (all ones or zero), not ?:,
  // which compilers may keep as branches: the conversion loops vectorise.
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > 0x7f800000u);
  const uint32_t is_inf = ~is_nan & (0u - static_cast<uint32_t>(a >= 0x477ff000u));
  const uint32_t is_normal = ~is_nan & ~is_inf & (0u - static_cast<uint32_t>(a >= 0x38800000u));
  const uint32_t is_subnormal =
      ~is_nan & ~is_inf & ~is_normal & (0u - static_cast<uint32_t>(a > 0x33000000u));
  const uint32_t out = (nan & is_nan) | (0x7c00u & is_inf) | (normal & is_normal) | (subnormal & is_subnormal);
  return static_cast<uint16_t>(sign | out);
#endif
}

TETRA_HD float f16_bits_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  // Infinity, or a NaN made quiet.
  const uint32_t special = 0x7f800000u | (mant << 13) | (static_cast<uint32_t>(mant != 0) << 22);
  // Subnormal (or zero): mant * 2^-24, exact in fp32 (an integer below 2^10 times a power of two,
  // a normal fp32 value or 0), so no mode such as flush-to-zero can change it.
  const uint32_t subnormal = f32_bits(static_cast<float>(mant) * 5.9604644775390625e-8f);  // 2^-24
  // The case by masks (all ones or zero), which compilers vectorise where they keep ?: as a branch.
  const uint32_t is_special = 0u - static_cast<uint32_t>(exp == 0x1fu);
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(exp == 0);
  const uint32_t bits = (special & is_special) | (subnormal & is_subnormal) | (normal & ~(is_special | is_subnormal));
  return bits_f32(sign | bits);
#endif
}

// Round an fp32 value to the nearest fp16 and return it widened back to fp32.
TETRA_HD float round_f16(float x) { return f16_bits_to_f32(f32_to_f16_bits(x)); }

// The largest finite fp16 value.
constexpr float kF16Max = 65504.0f;

// ---------------------------------------------------------------------------------------------
// exp(x) in fp32, within 1 ulp of expf on the normal range, written so compilers vectorise it
// (glibc's expf is vectorised only under -ffast-math): x = n ln2 + r with |r| <= ln2/2, exp(r) by
// the Cephes expf polynomial, 2^n placed in the exponent field. x is clamped to [-87.3, 88.3]
// (exp of the ends: ~1e-38 and ~2.2e38, inside fp32's normal range); below -87.3 the result is 0.
// A NaN stays NaN. No branches or float selects: the clamps are integer masks, which vectorise.
// ---------------------------------------------------------------------------------------------
TETRA_HD float exp_fast(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kMin = -87.3f, kMax = 88.3f;  // round(88.3 log2 e) = 127: no overflow
  const int32_t above_min = -static_cast<int32_t>(!(x < kMin));  // all ones (also for NaN), or 0
  const int32_t below_max = -static_cast<int32_t>(!(x > kMax));
  int32_t xi = static_cast<int32_t>(f32_bits(x));
  xi = (xi & above_min) | (static_cast<int32_t>(f32_bits(kMin)) & ~above_min);
  xi = (xi & below_max) | (static_cast<int32_t>(f32_bits(kMax)) & ~below_max);
  const float xc = bits_f32(static_cast<uint32_t>(xi));
  // n = round(x log2 e) by the 1.5 * 2^23 shifter; the integer n is the low bits of the sum.
  constexpr float kShifter = 12582912.0f;
  const float shifted = xc * kLog2e + kShifter;
  const float n = shifted - kShifter;
  const int32_t ni = static_cast<int32_t>(f32_bits(shifted)) - static_cast<int32_t>(f32_bits(kShifter));
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t biased = (ni + 127) & above_min;  // exponent field 0: the result is 0
  return p * bits_f32(static_cast<uint32_t>(biased) << 23);
}

// tanh(u) = 1 - 2 / (exp(2u) + 1): exact limits (+-1) at large |u|; near 0 the absolute error is
// ~1e-7, which is what GELU and its gradient (both 0.5 (1 + tanh) ...) need.
TETRA_HD float tanh_fast(float u) { return 1.0f - 2.0f / (exp_fast(2.0f * u) + 1.0f); }

// ---------------------------------------------------------------------------------------------
// Activations. GELU is the tanh approximation used by GPT-2 (PyTorch: gelu(approximate="tanh")).
// ---------------------------------------------------------------------------------------------
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCube = 0.044715f;

TETRA_HD float gelu(float x) {
  float u = kGeluScale * (x + kGeluCube * x * x * x);
  return 0.5f * x * (1.0f + tanh_fast(u));
}

// d gelu(x) / dx
TETRA_HD float gelu_grad(float x) {
  float x2 = x * x;
  float u = kGeluScale * (x + kGeluCube * x2 * x);
  float t = tanh_fast(u);
  float sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCube * x2);
}

TETRA_HD float sigmoid(float x) { return 1.0f / (1.0f + exp_fast(-x)); }

TETRA_HD float silu(float x) { return x * sigmoid(x); }

// d silu(x) / dx = s + x s (1 - s)
TETRA_HD float silu_grad(float x) {
  float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// ---------------------------------------------------------------------------------------------
// RoPE, "rotate half" convention (GPT-NeoX, Llama in HF transformers): within one head of size
// HS, element i (i < HS/2) is paired with element i + HS/2 and the pair is rotated by the angle
// pos * theta^(-2i/HS). The inverse rotation (used in backward) is the rotation by -angle.
// ---------------------------------------------------------------------------------------------
// How the inverse frequencies are derived: Hugging Face transformers' rope types "default",
// "linear" and "llama3" (modeling_rope_utils.py), with base theta:
//   default  inv_i = theta^(-2i/HS)
//   linear   inv_i / factor (positions interpolated by the factor)
//   llama3   with wavelength w = 2 pi / inv_i and L = original_max_position: inv_i where
//            w < L / high_freq_factor, inv_i / factor where w > L / low_freq_factor, and between
//            them (1 - s) inv_i / factor + s inv_i, s = (L / w - low_freq_factor) /
//            (high_freq_factor - low_freq_factor)
struct RopeFreqs {
  enum Kind : int { DEFAULT = 0, LINEAR = 1, LLAMA3 = 2 };
  float theta = 10000.0f;
  int kind = DEFAULT;
  float factor = 1.0f;
  float low_freq_factor = 1.0f, high_freq_factor = 4.0f, original_max_position = 8192.0f;  // llama3
  RopeFreqs() = default;
  RopeFreqs(float base) : theta(base) {}  // NOLINT(google-explicit-constructor): the default type
  bool operator==(const RopeFreqs& o) const {  // spelt out: the CUDA sources are C++17
    return theta == o.theta && kind == o.kind && factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor && original_max_position == o.original_max_position;
  }
};

TETRA_HD float rope_inv_freq(int i, int head_size, const RopeFreqs& r) {
  const float inv = powf(r.theta, -2.0f * static_cast<float>(i) / static_cast<float>(head_size));
  if (r.kind == RopeFreqs::LINEAR) return inv / r.factor;
  if (r.kind != RopeFreqs::LLAMA3) return inv;
  const float wavelen = 2.0f * 3.14159265358979323846f / inv;
  const float low_wavelen = r.original_max_position / r.low_freq_factor;
  const float high_wavelen = r.original_max_position / r.high_freq_factor;
  if (wavelen > low_wavelen) return inv / r.factor;
  if (wavelen < high_wavelen) return inv;
  const float s = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return (1.0f - s) * inv / r.factor + s * inv;
}

TETRA_HD void rope_rotate(float& x0, float& x1, float cos_a, float sin_a) {
  float r0 = x0 * cos_a - x1 * sin_a;
  float r1 = x0 * sin_a + x1 * cos_a;
  x0 = r0;
  x1 = r1;
}

// ---------------------------------------------------------------------------------------------
// AdamW (Loshchilov & Hutter), decoupled weight decay, bias-corrected moments, as torch.optim.AdamW:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p = p - lr * wd * p - lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
// `grad_scale` multiplies the raw gradient first (global-norm clipping, loss-scale removal).
// ---------------------------------------------------------------------------------------------
struct AdamParams {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float bias_correction1;  // 1 - beta1^t
  float bias_correction2;  // 1 - beta2^t
  float grad_scale;
};

// a * b + c rounded once, where the target has fused multiply-add (every GPU; x86 built with FMA,
// as -march=native does on any AVX2 machine; ARMv8). Written out, not left to the compilers'
// contraction, which may fuse different products on the host and the device: the AdamW update
// below is then the same bits on both backends.
TETRA_HD float fused_mul_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__) || defined(__aarch64__)
  return fmaf(a, b, c);
#else
  return a * b + c;  // no FMA unit: a software fmaf would dominate a memory-bound loop
#endif
}

TETRA_HD float adamw_update(float& param, float& m, float& v, float grad, const AdamParams& a) {
  const float g = grad * a.grad_scale;
  m = fused_mul_add(a.beta1, m, (1.0f - a.beta1) * g);
  v = fused_mul_add(a.beta2, v, (1.0f - a.beta2) * g * g);
  const float m_hat = m / a.bias_correction1;
  const float v_hat = v / a.bias_correction2;
  const float step = fused_mul_add(a.weight_decay, param, m_hat / (sqrtf(v_hat) + a.eps));
  param = fused_mul_add(-a.lr, step, param);
  return param;
}

// ---------------------------------------------------------------------------------------------
// Counter-based RNG: Philox-4x32-10 (Salmon et al., SC'11). Element n of a tensor is a pure
// function of (seed, stream, n), so any slice of a parameter can be generated alone and every
// parallel layout starts from the same model.
// ---------------------------------------------------------------------------------------------
struct Philox4 {
  uint32_t v[4];
};

TETRA_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

TETRA_HD Philox4 philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c0, hi0, lo0);
    mulhilo32(0xCD9E8D57u, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform in (0, 1): 24 random bits, never exactly 0 (safe for log).
TETRA_HD float uint_to_unit(uint32_t x) { return (static_cast<float>(x >> 8) + 0.5f) * (1.0f / 16777216.0f); }

// Standard normal sample number `n` of stream (seed, stream_id), by Box-Muller on one Philox block.
TETRA_HD float philox_normal(uint64_t seed, uint64_t stream_id, uint64_t n) {
  Philox4 r = philox4x32(n, stream_id, seed);
  float u1 = uint_to_unit(r.v[0]);
  float u2 = uint_to_unit(r.v[1]);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}

// 64-bit FNV-1a, for turning a parameter name into an RNG stream id.
TETRA_HD uint64_t fnv1a64(const char* s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; ++s) {
    h ^= static_cast<uint8_t>(*s);
    h *= 1099511628211ull;
  }
  return h;
}

// MoE gates of one token from its K chosen router probabilities p (g and p distinct):
// g_k = scale p_k / S with S = sum_j p_j when `normalize` (top-k renormalisation: Mixtral's, and
// Megatron's softmax after top-k), else g_k = scale p_k.
TETRA_HD void moe_gates_row(float* g, const float* p, int64_t K, bool normalize, float scale) {
  float s = 0.0f;
  for (int64_t k = 0; k < K; ++k) s += p[k];
  const float f = normalize ? scale / s : scale;
  for (int64_t k = 0; k < K; ++k) g[k] = p[k] * f;
}
// Its backward: dp_m = scale (dg_m - sum_k dg_k p_k / S) / S when normalising, else scale dg_m.
TETRA_HD void moe_gates_row_backward(float* dp, const float* dg, const float* p, int64_t K, bool normalize,
                                     float scale) {
  if (!normalize) {
    for (int64_t k = 0; k < K; ++k) dp[k] = scale * dg[k];
    return;
  }
  float s = 0.0f, dot = 0.0f;
  for (int64_t k = 0; k < K; ++k) s += p[k], dot += dg[k] * p[k];
  const float f = scale / s, c = dot / s;
  for (int64_t k = 0; k < K; ++k) dp[k] = f * (dg[k] - c);
}

// The shared expert's gate of one token from its logit h . w_gate (Qwen2-MoE's shared_expert_gate),
// and the logit's gradient from dot = <dout, shared expert output>: d/dx sigmoid(x) = g (1 - g).
TETRA_HD float moe_shared_gate(float logit) { return sigmoid(logit); }
TETRA_HD float moe_shared_gate_grad(float gate, float dot) { return dot * gate * (1.0f - gate); }

// ---------------------------------------------------------------------------------------------
// Integer rounding of sizes, counts and grid dimensions (x >= 0, m > 0), in x's type (m is
// converted to it): ceil_div(x, m) = ceil(x / m); round_up(x, m) = x rounded up to a multiple of m.
// ---------------------------------------------------------------------------------------------
template <typename I, typename M>
TETRA_HD constexpr I ceil_div(I x, M m) {
  static_assert(std::is_integral_v<I> && std::is_integral_v<M>, "ceil_div takes integers");
  return (x + static_cast<I>(m) - 1) / static_cast<I>(m);
}

template <typename I, typename M>
TETRA_HD constexpr I round_up(I x, M m) {
  return ceil_div(x, m) * static_cast<I>(m);
}

}  // namespace tetra::math
