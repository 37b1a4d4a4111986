#include "trainer/train/straggler.h"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/comm/process_groups.h"
#include "trainer/core/log.h"

namespace tetra {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

StragglerDetector::StragglerDetector(const LoggingConfig& cfg, ProcessGroups& groups)
    : groups_(groups), factor_(cfg.straggler_factor), window_(cfg.straggler_window) {
  const int world = groups.grid.world();
  for (int r = 0; r < world; ++r) stage_.push_back(groups.grid.coord(r).pp);
  // Peers: at least two ranks in some pipeline stage.
  const bool peers = world > static_cast<int>(groups.grid.sizes().pp);
  enabled_ = factor_ > 0.0 && window_ > 0 && peers;
  flagged_.assign(static_cast<size_t>(world), false);
}

double StragglerDetector::blocked_s() const {
  double s = 0.0;
  for (int k = 0; k < kGroupKinds; ++k) s += groups_.stats(static_cast<GroupKind>(k)).total_blocked_s();
  return s;
}

std::vector<int> StragglerDetector::slow_ranks(const std::vector<std::vector<double>>& busy,
                                               const std::vector<int>& stage, double factor, int64_t window) {
  std::vector<int> slow;
  if (static_cast<int64_t>(busy.size()) < window) return slow;
  const size_t world = stage.size();
  for (size_t r = 0; r < world; ++r) {
    bool every = true;
    for (size_t s = busy.size() - static_cast<size_t>(window); s < busy.size() && every; ++s) {
      std::vector<double> peers;
      for (size_t q = 0; q < world; ++q)
        if (stage[q] == stage[r]) peers.push_back(busy[s][q]);
      every = peers.size() >= 2 && busy[s][r] >= factor * median(peers);
    }
    if (every) slow.push_back(static_cast<int>(r));
  }
  return slow;
}

std::vector<StragglerReport> StragglerDetector::observe(int64_t step, double busy_s) {
  std::vector<StragglerReport> out;
  if (!enabled_) return out;
  const int world = groups_.grid.world();
  std::vector<float> all(static_cast<size_t>(world));
  const float mine = static_cast<float>(busy_s);
  groups_.get(GroupKind::WORLD).all_gather(all.data(), &mine, 1, DType::F32);
  busy_.emplace_back(all.begin(), all.end());
  if (static_cast<int64_t>(busy_.size()) > window_) busy_.erase(busy_.begin());
  const std::vector<int> slow = slow_ranks(busy_, stage_, factor_, window_);
  for (int r = 0; r < world; ++r) {
    const bool is_slow = std::find(slow.begin(), slow.end(), r) != slow.end();
    const size_t ur = static_cast<size_t>(r);
    if (is_slow == flagged_[ur]) continue;
    flagged_[ur] = is_slow;
    StragglerReport rep;
    rep.rank = r;
    rep.slow = is_slow;
    double busy_sum = 0.0, median_sum = 0.0;
    for (const std::vector<double>& b : busy_) {
      std::vector<double> peers;
      for (int q = 0; q < world; ++q)
        if (stage_[static_cast<size_t>(q)] == stage_[ur]) peers.push_back(b[static_cast<size_t>(q)]);
      busy_sum += b[ur], median_sum += median(peers);
    }
    const double n = static_cast<double>(busy_.size());
    rep.busy_ms = busy_sum / n * 1e3, rep.median_ms = median_sum / n * 1e3;
    const GridCoord c = groups_.grid.coord(r);
    const std::string who = fmt::format("rank {} {}", r, rank_prefix({c.tp, c.pp, c.dp, c.ep, r}));
    if (is_slow)
      rep.line = fmt::format("straggler: {} is busy {:.1f} ms per step (its step less its communication waits) "
                             "over the last {} steps, {:.2f}x the median of pipeline stage {}'s ranks ({:.1f} ms): "
                             "the others wait for it (step {})",
                             who, rep.busy_ms, busy_.size(), rep.busy_ms / rep.median_ms, c.pp, rep.median_ms, step);
    else
      rep.line = fmt::format("straggler: {} is no longer slow (busy {:.1f} ms per step against a median of {:.1f} ms, "
                             "step {})", who, rep.busy_ms, rep.median_ms, step);
    out.push_back(std::move(rep));
  }
  return out;
}

}  // namespace tetra
