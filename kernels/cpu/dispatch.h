// Small helpers shared by the CPU kernels: the OpenMP team size and the dispatch from a run-time
// element type to a kernel templated on its storage type.
#pragma once

#include <omp.h>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "kernels/common/dtype.h"

namespace tetra::cpu {

// The backend's thread count, or every core when it is <= 0.
inline int team_size(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

// Calls f(float{}), f(bf16{}) or f(f16{}) for a floating storage type; anything else is an Error
// naming the op and the argument.
template <typename F>
void with_float_type(DType t, const char* op, const char* what, F&& f) {
  if (t == DType::F32) {
    f(float{});
  } else if (t == DType::BF16) {
    f(bf16{});
  } else if (t == DType::F16) {
    f(f16{});
  } else {
    throw Error(fmt::format("{}: {} must be F32, BF16 or F16, got {}", op, what, dtype_name(t)));
  }
}

}  // namespace tetra::cpu
