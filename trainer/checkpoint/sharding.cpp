#include "trainer/checkpoint/sharding.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/check.h"

namespace tetra {

namespace {

int64_t local_cols(const ParamSpec& spec) { return spec.shape.size() > 1 ? spec.shape.back() : 1; }

// The row blocks of the local tensor: the spec's, or all its rows.
std::vector<RowBlock> blocks_of(const ParamSpec& spec) {
  if (!spec.row_blocks.empty()) return spec.row_blocks;
  int64_t rows = 1;  // of the 2-D view: every dim but the last
  for (size_t d = 0; d + 1 < spec.shape.size(); ++d) rows *= spec.shape[d];
  return {RowBlock{0, spec.shape.size() > 1 ? rows : (spec.shape.empty() ? 1 : spec.shape[0])}};
}

}  // namespace

int64_t global_cols(const ParamSpec& spec) {
  return spec.global_shape.size() > 1 ? spec.global_shape.back() : 1;
}

std::vector<SliceRegion> slices_of(const ParamSpec& spec, int64_t lo, int64_t hi) {
  TETRA_CHECK(0 <= lo && lo <= hi && hi <= spec.numel, "{}: local range [{}, {}) of {} elements", spec.name,
              lo, hi, spec.numel);
  hi = std::min(hi, spec.held());  // the vocabulary's padding is no part of the tensor
  const int64_t cols = local_cols(spec);
  std::vector<SliceRegion> out;
  int64_t start = 0;  // local flat index of the block's first element
  for (const RowBlock& b : blocks_of(spec)) {
    const int64_t n = b.rows * cols;
    const int64_t a = std::max(lo, start), e = std::min(hi, start + n);
    if (a < e) out.push_back(SliceRegion{b.global_start, b.rows, spec.col_start, cols, a - start, e - start});
    start += n;
  }
  return out;
}

int64_t local_index(const ParamSpec& spec, int64_t g) {
  const int64_t gcols = global_cols(spec), cols = local_cols(spec);
  const int64_t r = g / gcols, c = g % gcols - spec.col_start;
  if (c < 0 || c >= cols) return -1;
  int64_t row = 0;
  for (const RowBlock& b : blocks_of(spec)) {
    if (r >= b.global_start && r < b.global_start + b.rows) return (row + r - b.global_start) * cols + c;
    row += b.rows;
  }
  return -1;
}

bool may_intersect(const ParamSpec& spec, const SliceRegion& s) {
  const int64_t cols = local_cols(spec);
  if (s.col0 >= spec.col_start + cols || spec.col_start >= s.col0 + s.cols) return false;
  for (const RowBlock& b : blocks_of(spec))
    if (s.row0 < b.global_start + b.rows && b.global_start < s.row0 + s.rows) return true;
  return false;
}

int64_t scatter_slice(const ParamSpec& spec, int64_t lo, int64_t hi, const SliceRegion& s, const float* values,
                      float* local, std::vector<uint8_t>& filled) {
  int64_t overlaps = 0;
  // Row by row: the part of each rectangle row that this rank holds is one contiguous run of its
  // local tensor, copied at once.
  const int64_t cols = local_cols(spec);
  const std::vector<RowBlock> blocks = blocks_of(spec);
  for (int64_t e = s.begin; e < s.end;) {
    const int64_t c0 = e % s.cols;
    const int64_t run = std::min(s.cols - c0, s.end - e);
    const int64_t grow = s.row0 + e / s.cols, gcol = s.col0 + c0;
    int64_t lrow = -1, acc = 0;
    for (const RowBlock& b : blocks) {
      if (grow >= b.global_start && grow < b.global_start + b.rows) {
        lrow = acc + grow - b.global_start;
        break;
      }
      acc += b.rows;
    }
    const int64_t a = std::max(gcol, spec.col_start), z = std::min(gcol + run, spec.col_start + cols);
    if (lrow >= 0 && a < z) {
      int64_t first = lrow * cols + (a - spec.col_start), last = first + (z - a);  // local [first, last)
      const int64_t skip = std::max<int64_t>(0, lo - first);
      first += skip;
      last = std::min(last, hi);
      if (first < last) {
        for (int64_t i = first; i < last; ++i) overlaps += filled[static_cast<size_t>(i)];
        std::memcpy(local + first, values + (e - s.begin) + (a - gcol) + skip, static_cast<size_t>(last - first) * 4);
        std::memset(filled.data() + first, 1, static_cast<size_t>(last - first));
      }
    }
    e += run;
  }
  return overlaps;
}

}  // namespace tetra
