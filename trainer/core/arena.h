// Carving one backend allocation (an activation arena) into aligned pieces. The same code sizes
// the arena and carves it: run once with base == nullptr to measure (every pointer null), allocate
// used() bytes, then run again over the allocation. So the plan and the layout cannot disagree.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "kernels/common/math.h"

namespace tetra {

class ArenaCarver {
 public:
  static constexpr size_t kAlign = 64;  // a cache line, and enough for every vector load

  explicit ArenaCarver(char* base) : base_(base) {}
  // numel elements of type t, the next kAlign-aligned piece.
  void* take(int64_t numel, DType t) {
    const size_t bytes = math::round_up(static_cast<size_t>(numel) * dtype_size(t), kAlign);
    void* p = base_ ? base_ + used_ : nullptr;
    used_ += bytes;
    return p;
  }
  float* f32(int64_t numel) { return static_cast<float*>(take(numel, DType::F32)); }
  int32_t* i32(int64_t numel) { return static_cast<int32_t*>(take(numel, DType::I32)); }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace tetra
