#include "trainer/optim/weight_units.h"

#include <algorithm>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

bool contains(const std::vector<int>& v, int g) { return std::find(v.begin(), v.end(), g) != v.end(); }

}  // namespace

size_t WeightUnits::buffer_bytes(const ParamLayout& layout, DType type, bool keep) {
  int64_t most = 0, all = 0;
  for (const auto& [begin, end] : layout.groups) {
    most = std::max(most, end - begin);
    all += end - begin;
  }
  return static_cast<size_t>(keep ? all : 2 * most) * dtype_size(type);
}

WeightUnits::WeightUnits(const ParamLayout& layout, Backend& be, Communicator& dp, Communicator& edp,
                         const void* shard, DType type, bool keep)
    : layout_(layout),
      be_(be),
      dp_(dp),
      edp_(edp),
      shard_(static_cast<const char*>(shard)),
      type_(type),
      es_(dtype_size(type)),
      keep_(keep) {
  const size_t d = static_cast<size_t>(layout.dense_groups);
  if (d > 0 && d < layout.groups.size())
    expert_compact_ = (layout.groups[d - 1].second - layout.groups.front().first) / dp.size();
  if (keep_) {
    for (const auto& [begin, end] : layout.groups)
      bufs_.emplace_back(be_, std::max<size_t>(static_cast<size_t>(end - begin) * es_, 1));
    placer_.kept.assign(layout.groups.size(), 0);
  } else {
    const size_t half = buffer_bytes(layout, type) / 2;
    for (int i = 0; i < 2; ++i) bufs_.emplace_back(be_, std::max<size_t>(half, 1));
  }
  pending_.resize(bufs_.size());
  pending_comm_.assign(bufs_.size(), nullptr);
}

WeightUnits::~WeightUnits() {
  for (auto& w : pending_)
    if (w) w->wait();
}

// The two buffers' rule, shared by the run and the prediction. `load(buffer, group)` is called
// for each gather.
template <class Load>
void WeightUnits::Placer::need(const std::vector<int>& groups, Load load) {
  if (!kept.empty()) {  // keep mode: each group in its own buffer, gathered once a step
    for (int g : groups)
      if (g >= 0 && !kept[static_cast<size_t>(g)]) {
        kept[static_cast<size_t>(g)] = 1;
        load(g, g);
      }
    return;
  }
  TETRA_CHECK(groups.size() <= 2, "a phase reads {} weight groups; two are held at once", groups.size());
  ++clock;
  for (int g : groups) {
    if (g < 0) continue;
    int slot = resident[0] == g ? 0 : resident[1] == g ? 1 : -1;
    if (slot < 0) {  // the least recently used buffer the phase does not read
      const auto needed = [&](int s) { return resident[s] >= 0 && contains(groups, resident[s]); };
      slot = needed(0) ? 1 : needed(1) ? 0 : (used[0] <= used[1] ? 0 : 1);
      resident[slot] = g;
      load(slot, g);
    }
    used[slot] = clock;
  }
}

template <class Load>
void WeightUnits::Placer::ahead(const std::vector<int>& current, const std::vector<int>& next, Load load) {
  if (!kept.empty()) {
    need(next, load);
    return;
  }
  for (int g : next) {
    if (g < 0 || resident[0] == g || resident[1] == g) continue;
    // Only into a buffer the current phase does not read (it is being computed with) and the
    // next phase does not need either.
    int slot = -1;
    for (int s = 0; s < 2; ++s)
      if (!(resident[s] >= 0 && (contains(current, resident[s]) || contains(next, resident[s]))) &&
          (slot < 0 || used[s] < used[slot]))
        slot = s;
    if (slot < 0) return;
    resident[slot] = g;
    used[slot] = clock;
    load(slot, g);
  }
}

void WeightUnits::count_gathers(const std::vector<std::vector<int>>& phases, std::vector<int64_t>& out, bool keep) {
  Placer p;
  if (keep) p.kept.assign(out.size(), 0);
  const auto count = [&](int, int g) { ++out.at(static_cast<size_t>(g)); };
  for (size_t i = 0; i < phases.size(); ++i) {
    p.need(phases[i], count);
    if (i + 1 < phases.size()) p.ahead(phases[i], phases[i + 1], count);
  }
}

void WeightUnits::set_step_phases(std::vector<std::vector<int>> phases) { phases_ = std::move(phases); }

void WeightUnits::release_all(bool step) {
  for (size_t s = 0; s < bufs_.size(); ++s) wait_slot(static_cast<int>(s));
  placer_ = Placer{};
  if (keep_) placer_.kept.assign(layout_.groups.size(), 0);
  cursor_ = step && !phases_.empty() ? 0 : -1;
}

void WeightUnits::gather(int slot, int g, bool async) {
  const auto& [begin, end] = layout_.groups[static_cast<size_t>(g)];
  // Group g's shard sits after every earlier group's of its kind in the compact shard; the
  // expert groups' after the dense ones', over expert-DP.
  const bool expert = g >= layout_.dense_groups;
  Communicator& c = expert ? edp_ : dp_;
  const int64_t first = layout_.groups[static_cast<size_t>(expert ? layout_.dense_groups : 0)].first;
  const int64_t shard = (end - begin) / c.size();
  const int64_t compact = (expert ? expert_compact_ : 0) + (begin - first) / c.size();
  wait_slot(slot);  // a buffer is reused only once its last gather is in
  const char* mine = shard_ + static_cast<size_t>(compact) * es_;
  ++gathers_;
  if (c.size() == 1) {  // expert-DP of 1: this rank holds its experts whole
    be_.copy(bufs_[slot].get(), mine, static_cast<size_t>(shard) * es_);
    return;
  }
  auto work = c.all_gather_async(bufs_[slot].get(), mine, shard, type_);
  if (async) {
    pending_[slot] = std::move(work);
    pending_comm_[slot] = &c;
  } else {
    c.wait(*work, CommOp::ALL_GATHER);
  }
}

void WeightUnits::wait_slot(int slot) {
  if (!pending_[slot]) return;
  pending_comm_[slot]->wait(*pending_[slot], CommOp::ALL_GATHER);
  pending_[slot].reset();
}

void WeightUnits::require(const std::vector<int>& groups) {
  if (cursor_ >= 0) {  // a training step: the phases come in the planned order
    TETRA_CHECK(cursor_ < static_cast<int64_t>(phases_.size()) && phases_[static_cast<size_t>(cursor_)] == groups,
                "the model's weight phase {} is not the planned one", cursor_);
  }
  placer_.need(groups, [&](int slot, int g) { gather(slot, g, false); });
  for (int g : groups)  // prefetched ones: wait for them now
    if (g >= 0) wait_slot(slot_of(g));
  if (cursor_ >= 0) {
    const size_t next = static_cast<size_t>(++cursor_);
    if (next < phases_.size()) placer_.ahead(groups, phases_[next], [&](int slot, int g) { gather(slot, g, true); });
  }
}

int WeightUnits::slot_of(int g) const {
  if (keep_) return placer_.kept[static_cast<size_t>(g)] ? g : -1;
  return placer_.resident[0] == g ? 0 : placer_.resident[1] == g ? 1 : -1;
}

const void* WeightUnits::at(int64_t offset) {
  const int g = layout_.group_of(offset);
  const int slot = slot_of(g);
  TETRA_CHECK(slot >= 0 && !pending_[slot], "weights of group {} read without being required", g);
  return static_cast<const char*>(bufs_[slot].get()) +
         static_cast<size_t>(offset - layout_.groups[static_cast<size_t>(g)].first) * es_;
}

}  // namespace tetra
