#include "trainer/checkpoint/sharding.h"

#include <algorithm>

#include "trainer/core/check.h"

namespace tetra {

namespace {

int64_t local_cols(const ParamSpec& spec) { return spec.shape.size() > 1 ? spec.shape[1] : 1; }

// The row blocks of the local tensor: the spec's, or all its rows.
std::vector<RowBlock> blocks_of(const ParamSpec& spec) {
  if (!spec.row_blocks.empty()) return spec.row_blocks;
  return {RowBlock{0, spec.shape.empty() ? 1 : spec.shape[0]}};
}

}  // namespace

int64_t global_cols(const ParamSpec& spec) {
  return spec.global_shape.size() > 1 ? spec.global_shape[1] : 1;
}

std::vector<SliceRegion> slices_of(const ParamSpec& spec, int64_t lo, int64_t hi) {
  TETRA_CHECK(0 <= lo && lo <= hi && hi <= spec.numel, "{}: local range [{}, {}) of {} elements", spec.name,
              lo, hi, spec.numel);
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

void scatter_slice(const ParamSpec& spec, int64_t lo, int64_t hi, const SliceRegion& s, const float* values,
                   float* local, std::vector<uint8_t>& filled) {
  const int64_t gcols = global_cols(spec);
  for (int64_t e = s.begin; e < s.end; ++e) {
    const int64_t li = local_index(spec, s.global_index(e, gcols));
    if (li < lo || li >= hi) continue;
    local[li] = values[e - s.begin];
    filled[static_cast<size_t>(li)] = 1;
  }
}

}  // namespace tetra
