// Where the elements a rank holds sit in a global tensor, in the terms checkpoints store them.
//
// A checkpoint stores every tensor as its global shape plus slices. A slice is a rectangle of the
// tensor's 2-D view (rows x cols, cols the last dim and rows every other dim flattened; a 1-D
// tensor of n elements is n x 1) — rows [row0, row0 + rows),
// columns [col0, col0 + cols) — of which the row-major element range [begin, end) is held. The
// rectangle is one row block of a tensor-parallel slice (param_layout.h); the range is the part
// of it a data-parallel shard of the distributed optimizer owns (the whole rectangle otherwise).
// This is enough to describe what any layout holds, so a checkpoint written under one layout is
// read under any other: each element is found through its global index.
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/params/param_layout.h"

namespace tetra {

struct SliceRegion {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;  // the rectangle
  int64_t begin = 0, end = 0;                      // row-major elements of it held
  int64_t numel() const { return end - begin; }
  // Global flat index (into the row-major global tensor of `global_cols` columns) of element e of
  // the rectangle.
  int64_t global_index(int64_t e, int64_t global_cols) const {
    return (row0 + e / cols) * global_cols + col0 + e % cols;
  }
};

// The columns of `spec`'s global 2-D view.
int64_t global_cols(const ParamSpec& spec);

// The slices that local elements [lo, hi) of `spec` (indices into this rank's tensor) are, in
// local order: their values, concatenated, are local elements lo..hi-1 (up to spec.held(): the
// vocabulary's padding, after it, is in no slice).
std::vector<SliceRegion> slices_of(const ParamSpec& spec, int64_t lo, int64_t hi);

// This rank's local index of global flat index `g` of `spec`'s tensor, or -1 if it does not hold it.
int64_t local_index(const ParamSpec& spec, int64_t g);

// Whether a slice can contain an element `spec` holds (a cheap test on rows and columns).
bool may_intersect(const ParamSpec& spec, const SliceRegion& slice);

// Copies the elements of `slice` (`values`: its numel() values in order) that fall in local range
// [lo, hi) of `spec` into `local` (indexed by local index) and marks them in `filled`. Returns how
// many of them were already marked: slices of one tensor must not overlap, so a non-zero count
// means a corrupt index.
int64_t scatter_slice(const ParamSpec& spec, int64_t lo, int64_t hi, const SliceRegion& slice,
                   const float* values, float* local, std::vector<uint8_t>& filled);

}  // namespace tetra
