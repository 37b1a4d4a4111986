#include "trainer/optim/weight_units.h"

#include <algorithm>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

size_t WeightUnits::buffer_bytes(const ParamLayout& layout, DType type) {
  int64_t most = 0;
  for (const auto& [begin, end] : layout.groups) most = std::max(most, end - begin);
  return 2 * static_cast<size_t>(most) * dtype_size(type);
}

WeightUnits::WeightUnits(const ParamLayout& layout, Backend& be, Communicator& dp, const void* shard, DType type)
    : layout_(layout), be_(be), dp_(dp), shard_(static_cast<const char*>(shard)), type_(type), es_(dtype_size(type)) {
  TETRA_CHECK(layout.dense_groups == static_cast<int>(layout.groups.size()), "ZeRO-3 weights of a MoE layout");
  const size_t half = buffer_bytes(layout, type) / 2;
  for (BackendBuffer& b : bufs_) b = BackendBuffer(be_, std::max<size_t>(half, 1));
}

// The shared bookkeeping of require() and count_gathers(): which buffer each group of a phase
// goes to. `load(buffer, group)` is called for each gather.
template <class Load>
static void place(const std::vector<int>& groups, int resident[2], int64_t used[2], int64_t& clock, Load load) {
  TETRA_CHECK(groups.size() <= 2, "a phase reads {} weight groups; two are held at once", groups.size());
  ++clock;
  for (int g : groups) {
    if (g < 0) continue;
    int slot = resident[0] == g ? 0 : resident[1] == g ? 1 : -1;
    if (slot < 0) {
      // The least recently used buffer the phase does not read.
      const auto needed = [&](int s) {
        return resident[s] >= 0 && std::find(groups.begin(), groups.end(), resident[s]) != groups.end();
      };
      slot = needed(0) ? 1 : needed(1) ? 0 : (used[0] <= used[1] ? 0 : 1);
      resident[slot] = g;
      load(slot, g);
    }
    used[slot] = clock;
  }
}

void WeightUnits::count_gathers(const std::vector<std::vector<int>>& phases, std::vector<int64_t>& out) {
  int r[2] = {-1, -1};
  int64_t u[2] = {0, 0}, clock = 0;
  for (const std::vector<int>& phase : phases)
    place(phase, r, u, clock, [&](int, int g) { ++out.at(static_cast<size_t>(g)); });
}

void WeightUnits::release_all() {
  resident_[0] = resident_[1] = -1;
  used_[0] = used_[1] = 0;
  clock_ = 0;
}

void WeightUnits::require(const std::vector<int>& groups) {
  place(groups, resident_, used_, clock_, [&](int slot, int g) {
    const auto& [begin, end] = layout_.groups[static_cast<size_t>(g)];
    const int64_t shard = (end - begin) / dp_.size();
    // Group g's shard sits after every earlier group's in the compact shard.
    const int64_t compact = (begin - layout_.groups.front().first) / dp_.size();
    dp_.all_gather(bufs_[slot].get(), shard_ + static_cast<size_t>(compact) * es_, shard, type_);
    ++gathers_;
  });
}

int WeightUnits::group_of(int64_t offset) const {
  const auto& groups = layout_.groups;
  auto it = std::upper_bound(groups.begin(), groups.end(), offset,
                             [](int64_t o, const std::pair<int64_t, int64_t>& g) { return o < g.first; });
  TETRA_CHECK(it != groups.begin() && offset < std::prev(it)->second, "weight offset {} in no group", offset);
  return static_cast<int>(std::prev(it) - groups.begin());
}

const void* WeightUnits::at(int64_t offset) {
  const int g = group_of(offset);
  const int slot = resident_[0] == g ? 0 : resident_[1] == g ? 1 : -1;
  TETRA_CHECK(slot >= 0, "weights of group {} read without being required", g);
  return static_cast<const char*>(bufs_[slot].get()) +
         static_cast<size_t>(offset - layout_.groups[static_cast<size_t>(g)].first) * es_;
}

}  // namespace tetra
