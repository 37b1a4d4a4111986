// Helpers shared by the CPU attention and GEMM tests: seeded inputs, bf16 rounding, element-wise
// tolerance checks naming the worst element, and the attention references (double, scores
// materialised) with a runner for the backend's attention ops.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.h"

namespace tetra::attn_testing {

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16(v[i]);
  return out;
}

inline std::vector<float> to_f32(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

inline std::vector<float> round_bf16(const std::vector<float>& v) { return to_f32(to_bf16(v)); }

// Every element satisfies |got - want| <= tol[i]; on failure names the worst element.
template <typename G, typename W, typename Tol>
inline void require_close(const char* what, const G& got, const W& want, Tol tol_of) {
  REQUIRE(got.size() == want.size());
  size_t worst = 0;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    double err = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    double ratio = err == 0.0 ? 0.0 : err / tol_of(i);
    if (!(ratio <= worst_ratio)) {  // also catches NaN
      worst_ratio = ratio;
      worst = i;
      if (std::isnan(ratio)) break;
    }
  }
  INFO(what << ": worst element " << worst << " got " << static_cast<double>(got[worst])
            << " want " << static_cast<double>(want[worst]) << " tol " << tol_of(worst));
  REQUIRE(worst_ratio <= 1.0);
}


// ---------------------------------------------------------------------------------------------
// Attention references (double, scores materialised)
// ---------------------------------------------------------------------------------------------
struct AttnDims {
  int64_t B, T, NH, NKV, HS;
  int64_t row() const { return (NH + 2 * NKV) * HS; }
  size_t qkv_size() const { return B * T * row(); }
  size_t out_size() const { return B * T * NH * HS; }
  size_t lse_size() const { return B * NH * T; }
  int64_t q(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * row() + h * HS; }
  int64_t k(int64_t b, int64_t t, int64_t h) const {
    return (b * T + t) * row() + (NH + h / (NH / NKV)) * HS;
  }
  int64_t v(int64_t b, int64_t t, int64_t h) const {
    return (b * T + t) * row() + (NH + NKV + h / (NH / NKV)) * HS;
  }
  int64_t o(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * NH * HS + h * HS; }
};

// p[0, i] = the softmax over keys j <= i of query i's scaled scores (head h, batch b), in double;
// returns their log-sum-exp.
template <typename X>
inline double softmax_row(const AttnDims& d, const std::vector<X>& qkv, int64_t b, int64_t h,
                          int64_t i, std::vector<double>& p) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.HS));
  double mx = -1e300;
  for (int64_t j = 0; j <= i; ++j) {
    double acc = 0.0;
    for (int64_t x = 0; x < d.HS; ++x)
      acc += static_cast<double>(qkv[d.q(b, i, h) + x]) * qkv[d.k(b, j, h) + x];
    p[j] = acc * scale;
    mx = std::max(mx, p[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[j] - mx);
  for (int64_t j = 0; j <= i; ++j) p[j] = std::exp(p[j] - mx) / sum;
  return mx + std::log(sum);
}

// out, lse of causal softmax attention; with dout non-null, also dqkv from the softmax Jacobian
// (ds_j = p_j (dp_j - sum_k p_k dp_k)), written independently of the kernel's lse formulation.
template <typename X>
inline void naive_attention(const AttnDims& d, const std::vector<X>& qkv,
                            std::vector<double>* out, std::vector<double>* lse,
                            const std::vector<X>* dout, std::vector<double>* dqkv) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.HS));
  if (out) out->assign(d.out_size(), 0.0);
  if (lse) lse->assign(d.lse_size(), 0.0);
  if (dqkv) dqkv->assign(d.qkv_size(), 0.0);
  std::vector<double> p(d.T), dp(d.T);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.NH; ++h)
      for (int64_t i = 0; i < d.T; ++i) {
        const double row_lse = softmax_row(d, qkv, b, h, i, p);
        if (lse) (*lse)[(b * d.NH + h) * d.T + i] = row_lse;
        if (out)
          for (int64_t j = 0; j <= i; ++j)
            for (int64_t x = 0; x < d.HS; ++x)
              (*out)[d.o(b, i, h) + x] += p[j] * static_cast<double>(qkv[d.v(b, j, h) + x]);
        if (!dout) continue;
        double pdp = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double acc = 0.0;
          for (int64_t x = 0; x < d.HS; ++x)
            acc += static_cast<double>((*dout)[d.o(b, i, h) + x]) * qkv[d.v(b, j, h) + x];
          dp[j] = acc;
          pdp += p[j] * acc;
        }
        for (int64_t j = 0; j <= i; ++j) {
          double ds = p[j] * (dp[j] - pdp);
          for (int64_t x = 0; x < d.HS; ++x) {
            (*dqkv)[d.v(b, j, h) + x] += p[j] * static_cast<double>((*dout)[d.o(b, i, h) + x]);
            (*dqkv)[d.q(b, i, h) + x] += scale * ds * qkv[d.k(b, j, h) + x];
            (*dqkv)[d.k(b, j, h) + x] += scale * ds * qkv[d.q(b, i, h) + x];
          }
        }
      }
}

struct AttnRun {
  std::vector<float> out, lse, dqkv;
};

// Kernel forward and (with dout) backward, storage F32 or BF16; results widened to float.
inline AttnRun run_attention(Backend& be, const AttnDims& d, const std::vector<float>& qkv,
                             const std::vector<float>* dout, DType act) {
  AttnRun r;
  r.lse.assign(d.lse_size(), 0.0f);
  if (act == DType::F32) {
    r.out.assign(d.out_size(), 0.0f);
    be.attention_forward(r.out.data(), r.lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS, act);
    if (dout) {
      r.dqkv.assign(d.qkv_size(), std::numeric_limits<float>::quiet_NaN());  // must be overwritten
      be.attention_backward(r.dqkv.data(), dout->data(), qkv.data(), r.out.data(), r.lse.data(),
                            d.B, d.T, d.NH, d.NKV, d.HS, act);
    }
  } else {
    std::vector<bf16> q16 = to_bf16(qkv), out16(d.out_size());
    be.attention_forward(out16.data(), r.lse.data(), q16.data(), d.B, d.T, d.NH, d.NKV, d.HS, act);
    r.out = to_f32(out16);
    if (dout) {
      std::vector<bf16> dout16 = to_bf16(*dout), dqkv16(d.qkv_size(), bf16(NAN));
      be.attention_backward(dqkv16.data(), dout16.data(), q16.data(), out16.data(), r.lse.data(),
                            d.B, d.T, d.NH, d.NKV, d.HS, act);
      r.dqkv = to_f32(dqkv16);
    }
  }
  return r;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}


}  // namespace tetra::attn_testing
