#include "trainer/checkpoint/sharding.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/check.h"

namespace tetra {

int64_t global_cols(const ParamSpec& spec) {
  return spec.global_shape.size() > 1 ? spec.global_shape.back() : 1;
}

// Local storage is the concatenation of spec.blocks(), rectangles of the global 2-D view, each
// row-major (one column range for all of them but for a swiglu expert's fc bias under TP).
std::vector<SliceRegion> slices_of(const ParamSpec& spec, int64_t lo, int64_t hi) {
  TETRA_CHECK(0 <= lo && lo <= hi && hi <= spec.numel, "{}: local range [{}, {}) of {} elements", spec.name,
              lo, hi, spec.numel);
  hi = std::min(hi, spec.held());  // the vocabulary's padding is no part of the tensor
  std::vector<SliceRegion> out;
  int64_t start = 0;  // local flat index of the block's first element
  for (const RowBlock& b : spec.blocks()) {
    const int64_t n = b.rows * b.cols;
    const int64_t a = std::max(lo, start), e = std::min(hi, start + n);
    if (a < e) out.push_back(SliceRegion{b.global_start, b.rows, b.col0, b.cols, a - start, e - start});
    start += n;
  }
  return out;
}

int64_t local_index(const ParamSpec& spec, int64_t g) {
  const int64_t gcols = global_cols(spec);
  const int64_t r = g / gcols, c = g % gcols;
  int64_t start = 0;
  for (const RowBlock& b : spec.blocks()) {
    if (r >= b.global_start && r < b.global_start + b.rows && c >= b.col0 && c < b.col0 + b.cols)
      return start + (r - b.global_start) * b.cols + (c - b.col0);
    start += b.rows * b.cols;
  }
  return -1;
}

bool may_intersect(const ParamSpec& spec, const SliceRegion& s) {
  for (const RowBlock& b : spec.blocks())
    if (s.row0 < b.global_start + b.rows && b.global_start < s.row0 + s.rows && s.col0 < b.col0 + b.cols &&
        b.col0 < s.col0 + s.cols)
      return true;
  return false;
}

int64_t scatter_slice(const ParamSpec& spec, int64_t lo, int64_t hi, const SliceRegion& s, const float* values,
                      float* local, std::vector<uint8_t>& filled) {
  int64_t overlaps = 0;
  // Row by row: the part of each rectangle row that a block of this rank holds is one contiguous
  // run of its local tensor, copied at once.
  const std::vector<RowBlock> blocks = spec.blocks();
  for (int64_t e = s.begin; e < s.end;) {
    const int64_t c0 = e % s.cols;
    const int64_t run = std::min(s.cols - c0, s.end - e);
    const int64_t grow = s.row0 + e / s.cols, gcol = s.col0 + c0;
    int64_t start = 0;  // local flat index of the block's first element
    for (const RowBlock& b : blocks) {
      const int64_t a = std::max(gcol, b.col0), z = std::min(gcol + run, b.col0 + b.cols);
      if (grow >= b.global_start && grow < b.global_start + b.rows && a < z) {
        int64_t first = start + (grow - b.global_start) * b.cols + (a - b.col0), last = first + (z - a);
        const int64_t skip = std::max<int64_t>(0, lo - first);
        first += skip;
        last = std::min(last, hi);
        if (first < last) {
          for (int64_t i = first; i < last; ++i) overlaps += filled[static_cast<size_t>(i)];
          std::memcpy(local + first, values + (e - s.begin) + (a - gcol) + skip,
                      static_cast<size_t>(last - first) * 4);
          std::memset(filled.data() + first, 1, static_cast<size_t>(last - first));
        }
      }
      start += b.rows * b.cols;
    }
    e += run;
  }
  return overlaps;
}

}  // namespace tetra
