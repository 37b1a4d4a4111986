// Helpers shared by the kernel tests: tolerance checks that report the first offending element,
// bitwise comparison, seeded normal inputs, the skip of the AMX tests.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/amx.h"

namespace tetra_test {

struct Tol {
  double atol, rtol;
};

// |got - want| <= atol + rtol |want| element-wise; a NaN matches only a NaN.
template <typename A, typename B>
void expect_close(const A& got, const B& want, Tol tol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(g) && std::isnan(w)) continue;
    if (!(std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w))) {
      if (bad++ == 0) first = i;
    }
  }
  std::ostringstream msg;
  msg << what << ": " << bad << " of " << got.size() << " elements outside tolerance";
  if (bad) msg << "; first [" << first << "] got " << got[first] << " want " << want[first];
  INFO(msg.str());
  CHECK(bad == 0);
}

template <typename T>
void expect_bitwise_equal(const std::vector<T>& a, const std::vector<T>& b, const std::string& what) {
  INFO(what);
  REQUIRE(a.size() == b.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// n values offset + scale * N(0, 1) from a fixed seed.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, float offset = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> r(n);
  for (auto& v : r) v = offset + scale * dist(gen);
  return r;
}

// The AMX tests (tag [amx]) run only where the CPU has AMX and the OS grants it. Elsewhere a test
// calls this first and returns: the warning is its output, which tests/CMakeLists.txt has ctest
// report as Skipped (Catch2 v2 has no skip of its own and would count the case as passed).
inline bool amx_or_skip(const char* what) {
  if (tetra::cpu::amx_available()) return true;
  WARN("skipped: this CPU has no AMX (" << what << " is not exercised here)");
  return false;
}

}  // namespace tetra_test
