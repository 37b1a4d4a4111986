// Test helpers for the CUDA backend: every CUDA op is run beside the CPU op (the numerical
// reference) on the same inputs, and the outputs are compared element by element.
//
// A Twin is one tensor held by both backends with identical contents: upload once, run the op on
// each backend with twin.cpu() / twin.gpu(), then compare twin.cpu_values() with gpu_values().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kernels/backend.h"
#include "kernels/common/dtype.h"

namespace tetra::cuda_testing {

// The CPU reference takes every core (OMP_NUM_THREADS, where set): on a GPU machine its
// attention and GEMM references are most of the test's time.
struct Backends {
  std::unique_ptr<Backend> cpu = make_cpu_backend(0);
  std::unique_ptr<Backend> gpu = make_cuda_backend(0);
};

// One process-wide pair: creating a CUDA context per test case would dominate the run time.
inline Backends& backends() {
  static Backends b;
  return b;
}

class Twin {
 public:
  Twin(size_t n, DType type) : n_(n), type_(type), bytes_(n * dtype_size(type)) {
    Backends& b = backends();
    cpu_ = b.cpu->alloc(bytes_);
    gpu_ = b.gpu->alloc(bytes_);
    b.cpu->memset_zero(cpu_, bytes_);
    b.gpu->memset_zero(gpu_, bytes_);
  }
  Twin(const std::vector<float>& values, DType type) : Twin(values.size(), type) { upload(values); }
  Twin(const std::vector<int32_t>& values) : Twin(values.size(), DType::I32) {
    Backends& b = backends();
    b.cpu->copy_from_host(cpu_, values.data(), bytes_);
    b.gpu->copy_from_host(gpu_, values.data(), bytes_);
  }
  ~Twin() {
    backends().cpu->free(cpu_);
    backends().gpu->free(gpu_);
  }
  Twin(const Twin&) = delete;
  Twin& operator=(const Twin&) = delete;

  // Stores values as the twin's type (bf16, fp16: rounded to nearest even) on both backends.
  void upload(const std::vector<float>& values) {
    REQUIRE(values.size() == n_);
    std::vector<uint8_t> host(bytes_);
    if (type_ == DType::F32) {
      std::memcpy(host.data(), values.data(), bytes_);
    } else if (type_ == DType::BF16) {
      auto* p = reinterpret_cast<uint16_t*>(host.data());
      for (size_t i = 0; i < n_; ++i) p[i] = math::f32_to_bf16_bits(values[i]);
    } else if (type_ == DType::F16) {
      auto* p = reinterpret_cast<uint16_t*>(host.data());
      for (size_t i = 0; i < n_; ++i) p[i] = math::f32_to_f16_bits(values[i]);
    } else {
      FAIL("upload of floats into an I32 twin");
    }
    backends().cpu->copy_from_host(cpu_, host.data(), bytes_);
    backends().gpu->copy_from_host(gpu_, host.data(), bytes_);
  }

  void* cpu() { return cpu_; }
  void* gpu() { return gpu_; }
  float* cpu_f32() { return static_cast<float*>(cpu_); }
  float* gpu_f32() { return static_cast<float*>(gpu_); }
  const int32_t* cpu_i32() { return static_cast<const int32_t*>(cpu_); }
  const int32_t* gpu_i32() { return static_cast<const int32_t*>(gpu_); }
  size_t size() const { return n_; }
  DType type() const { return type_; }

  std::vector<float> cpu_values() { return values(*backends().cpu, cpu_); }
  std::vector<float> gpu_values() { return values(*backends().gpu, gpu_); }

 private:
  std::vector<float> values(Backend& be, const void* p) {
    std::vector<uint8_t> host(bytes_);
    be.copy_to_host(host.data(), p, bytes_);
    std::vector<float> out(n_);
    for (size_t i = 0; i < n_; ++i) {
      if (type_ == DType::F32) {
        std::memcpy(&out[i], host.data() + 4 * i, 4);
      } else if (type_ == DType::BF16 || type_ == DType::F16) {
        uint16_t bits;
        std::memcpy(&bits, host.data() + 2 * i, 2);
        out[i] = type_ == DType::F16 ? math::f16_bits_to_f32(bits) : math::bf16_bits_to_f32(bits);
      } else {
        int32_t v;
        std::memcpy(&v, host.data() + 4 * i, 4);
        out[i] = static_cast<float>(v);
      }
    }
    return out;
  }
  size_t n_;
  DType type_;
  size_t bytes_;
  void* cpu_ = nullptr;
  void* gpu_ = nullptr;
};

// One unit in the last place of a 16-bit storage type, relative to the value it rounds (at most):
// bf16 keeps 8 significant bits (2^-7), fp16 11 (2^-10, in its normal range, |v| >= 2^-14; below
// it the ulp is 2^-24 absolute, which the tests' absolute tolerances cover); fp32 0 (the tests'
// fp32 tolerances are their own).
inline double storage_ulp(DType t) {
  return t == DType::BF16 ? 1.0 / 128.0 : t == DType::F16 ? 1.0 / 1024.0 : 0.0;
}

inline const char* type_name(DType t) {
  return t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : t == DType::F32 ? "f32" : "i32";
}

// n values uniform in [-scale, scale), reproducible from the seed.
inline std::vector<float> random_values(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// Requires |got - ref| <= atol + rtol * |ref| for every element, reporting the worst element.
inline void require_close(const std::vector<float>& ref, const std::vector<float>& got, double rtol,
                          double atol, const std::string& what) {
  REQUIRE(ref.size() == got.size());
  size_t worst = 0, bad = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double allowed = atol + rtol * std::fabs(static_cast<double>(ref[i]));
    const bool finite = std::isfinite(got[i]) == std::isfinite(ref[i]);
    if (err > allowed || !finite || std::isnan(got[i]) != std::isnan(ref[i])) ++bad;
    const double excess = std::isfinite(err) ? err - allowed : 1e30;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  INFO(what << ": " << bad << " of " << ref.size() << " elements outside atol " << atol << " + rtol "
            << rtol << "; worst at " << worst << ": cpu " << ref[worst] << " cuda " << got[worst]);
  REQUIRE(bad == 0);
}

}  // namespace tetra::cuda_testing
