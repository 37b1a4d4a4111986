#include "trainer/train/straggler.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/comm/process_groups.h"
#include "trainer/core/log.h"

namespace tetra {

namespace {

// The median of `sorted` without one element equal to `v` (which it holds): the median of the
// rank's peers, itself left out (with two ranks a stage, the other rank's time).
double median_without(const std::vector<double>& sorted, double v) {
  const size_t n = sorted.size() - 1;  // the peers
  const size_t at = static_cast<size_t>(std::lower_bound(sorted.begin(), sorted.end(), v) - sorted.begin());
  auto peer = [&](size_t i) { return sorted[i < at ? i : i + 1]; };  // the i-th smallest peer
  return n % 2 ? peer(n / 2) : 0.5 * (peer(n / 2 - 1) + peer(n / 2));
}

// Per rank, the median of its stage's other ranks in one step (0 where it has none).
std::vector<double> peer_medians(const std::vector<double>& busy, const std::vector<int>& stage) {
  std::map<int, std::vector<double>> by_stage;
  for (size_t r = 0; r < busy.size(); ++r) by_stage[stage[r]].push_back(busy[r]);
  for (auto& [st, v] : by_stage) std::sort(v.begin(), v.end());
  std::vector<double> out(busy.size(), 0.0);
  for (size_t r = 0; r < busy.size(); ++r) {
    const std::vector<double>& v = by_stage[stage[r]];
    if (v.size() >= 2) out[r] = median_without(v, busy[r]);
  }
  return out;
}

}  // namespace

StragglerDetector::StragglerDetector(const LoggingConfig& cfg, ProcessGroups& groups, bool waits_block_host)
    : groups_(groups), factor_(cfg.straggler_factor), window_(cfg.straggler_window) {
  const int world = groups.grid.world();
  for (int r = 0; r < world; ++r) stage_.push_back(groups.grid.coord(r).pp);
  // Peers: at least two ranks in some pipeline stage.
  const bool peers = world > static_cast<int>(groups.grid.sizes().pp);
  const bool asked = factor_ > 0.0 && window_ > 0;
  enabled_ = asked && peers && waits_block_host;
  if (asked && peers && !waits_block_host && groups.rank == 0)
    spdlog::info("straggler check off: NCCL's waits do not block the host, so a rank's busy time cannot be told "
                 "from its step time (logging.straggler_factor)");
  flagged_.assign(static_cast<size_t>(world), false);
}

double StragglerDetector::blocked_s() const {
  double s = 0.0;
  for (int k = 0; k < kGroupKinds; ++k) s += groups_.stats(static_cast<GroupKind>(k)).total_blocked_s();
  return s;
}

std::vector<int> StragglerDetector::slow_ranks(const std::deque<std::vector<double>>& busy,
                                               const std::vector<int>& stage, double factor, int64_t window) {
  std::vector<int> slow;
  if (window <= 0 || static_cast<int64_t>(busy.size()) < window) return slow;
  std::vector<bool> every(stage.size(), true);
  for (size_t s = busy.size() - static_cast<size_t>(window); s < busy.size(); ++s) {
    const std::vector<double> med = peer_medians(busy[s], stage);
    for (size_t r = 0; r < stage.size(); ++r) every[r] = every[r] && med[r] > 0.0 && busy[s][r] >= factor * med[r];
  }
  for (size_t r = 0; r < stage.size(); ++r)
    if (every[r]) slow.push_back(static_cast<int>(r));
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
  if (static_cast<int64_t>(busy_.size()) > window_) busy_.pop_front();
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
    for (const std::vector<double>& b : busy_) busy_sum += b[ur], median_sum += peer_medians(b, stage_)[ur];
    const double n = static_cast<double>(busy_.size());
    rep.busy_ms = busy_sum / n * 1e3, rep.median_ms = median_sum / n * 1e3;
    const GridCoord c = groups_.grid.coord(r);
    const std::string who = fmt::format("rank {} {}", r, rank_prefix({c.tp, c.pp, c.dp, c.ep, r}));
    if (is_slow)
      rep.line = fmt::format("straggler: {} is busy {:.1f} ms per step (its step less its communication waits) "
                             "over the last {} steps, {:.2f}x the median of the other ranks of pipeline stage {} "
                             "({:.1f} ms): they wait for it (step {})",
                             who, rep.busy_ms, busy_.size(), rep.busy_ms / rep.median_ms, c.pp, rep.median_ms, step);
    else
      rep.line = fmt::format("straggler: {} is no longer slow (busy {:.1f} ms per step against its peers' median of "
                             "{:.1f} ms, step {})", who, rep.busy_ms, rep.median_ms, step);
    out.push_back(std::move(rep));
  }
  return out;
}

}  // namespace tetra
