#include "trainer/train/comm_accounting.h"

#include <string>

#include <spdlog/spdlog.h>

namespace tetra {

CommAccounting::CommAccounting(const Config& cfg, ProcessGroups& groups) : groups_(groups) {
  // A group's traffic is what both its communicators moved (ProcessGroups::stats). The expert
  // groups communicate only in MoE models (edp: expert gradients; ep: the tokens).
  const bool moe = cfg.model.moe.enabled();
  const bool folded = cfg.parallel.expert_shares() > 1;  // folded experts' own groups (rank_grid.h)
  accounted_ = {{"tp", GroupKind::TP, true, &StepVolume::tp},
                {"dp", GroupKind::DP, true, &StepVolume::dp},
                {"pp", GroupKind::PP, true, &StepVolume::pp},
                {"embedding", GroupKind::EMBEDDING, true, &StepVolume::embedding},
                {"edp", GroupKind::EDP, moe, &StepVolume::edp},
                {"ep", GroupKind::EP, moe, &StepVolume::ep},
                {"cp", GroupKind::CP, cfg.parallel.cp > 1, &StepVolume::cp},
                {"etp", GroupKind::ETP, moe && folded, &StepVolume::etp},
                {"eshare", GroupKind::ESHARE, moe && folded, &StepVolume::eshare}};
}

std::vector<CommStats> CommAccounting::snapshot() const {
  std::vector<CommStats> out;
  for (const Group& g : accounted_) out.push_back(g.active ? groups_.stats(g.kind) : CommStats{});
  return out;
}

void CommAccounting::begin_step(const StepVolume& predicted) {
  before_ = snapshot();
  predicted_ = predicted;
}

std::vector<CommRecord> CommAccounting::records() const {
  std::vector<CommRecord> out;
  for (size_t i = 0; i < accounted_.size(); ++i) {
    const Group& g = accounted_[i];
    if (!g.active || groups_.get(g.kind).size() <= 1) continue;
    const CommStats now = groups_.stats(g.kind);
    CommRecord r;
    r.group = g.name;
    r.measured = measured_volume(now, before_[i]);
    r.predicted = predicted_.*g.predicted;
    // The tokens an expert-parallel rank sends depend on the routing: its all-to-all payload is
    // measured, not predicted (the number of calls is).
    if (g.kind == GroupKind::EP) {
      const int a2a = static_cast<int>(CommOp::ALL_TO_ALL);
      r.predicted.payload_bytes[a2a] = r.measured.payload_bytes[a2a];
    }
    r.sent_bytes = now.total_sent() - before_[i].total_sent();
    r.blocked_ms = 1e3 * (now.total_blocked_s() - before_[i].total_blocked_s());
    out.push_back(std::move(r));
  }
  return out;
}

void CommAccounting::warn_mismatches(int64_t step, const std::vector<CommRecord>& records) {
  for (const CommRecord& c : records)
    if (!(c.measured == c.predicted))
      spdlog::warn("step {}: group {} moved {} but the layout predicts {}", step, c.group, c.measured.describe(),
                   c.predicted.describe());
}

CommAccounting::Paused::Paused(CommAccounting& accounting)
    : accounting_(accounting), saved_(accounting.snapshot()) {}

CommAccounting::Paused::~Paused() {
  for (size_t i = 0; i < accounting_.accounted_.size(); ++i)
    if (accounting_.accounted_[i].active) accounting_.groups_.set_stats(accounting_.accounted_[i].kind, saved_[i]);
}

}  // namespace tetra
