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
  // numel elements of type t at `offset` (a used() taken earlier, so kAlign-aligned), over the
  // pieces taken since: for a tensor never live at the same time as they are.
  void* overlay(size_t offset, int64_t numel, DType t) {
    const size_t bytes = math::round_up(static_cast<size_t>(numel) * dtype_size(t), kAlign);
    used_ = offset + bytes > used_ ? offset + bytes : used_;
    return base_ ? base_ + offset : nullptr;
  }
  float* f32(int64_t numel) { return static_cast<float*>(take(numel, DType::F32)); }
  int32_t* i32(int64_t numel) { return static_cast<int32_t*>(take(numel, DType::I32)); }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// A model chunk's activation memory in two parts: scratch (what one forward or backward uses and
// leaves) and slots (what one micro-batch keeps from its forward to its backward, one slot per
// micro-batch in flight). Each part's size is a multiple of kAlign.
struct ActivationSizes {
  size_t scratch = 0;
  size_t slot = 0;
  ActivationSizes& operator+=(const ActivationSizes& o) {
    scratch += o.scratch;
    slot += o.slot;
    return *this;
  }
};

// Where a chunk's activations live: `scratch_bytes` at `scratch`, and `count` slots of
// `slot_stride` bytes from `slots`. A pipeline rank lays all its chunks over one such set (one
// chunk computes at a time, and however the micro-batches in flight are spread over the chunks
// they never outnumber the slots), see trainer/train/pipeline_model.h.
struct ActivationRegions {
  char* scratch = nullptr;
  size_t scratch_bytes = 0;
  char* slots = nullptr;
  size_t slot_stride = 0;
  int64_t count = 0;
  char* slot(int64_t i) const { return slots + static_cast<size_t>(i) * slot_stride; }
};

}  // namespace tetra
