// The MoE blocks' host-side routing: the plan of each micro-batch's rows (per-expert blocks,
// capacity drops), the row bound the memory plan holds, the step's statistics, and the experts'
// selection biases of auxiliary-loss-free balancing (see moe.h).
#include <algorithm>
#include <cmath>

#include "kernels/common/check.h"
#include "trainer/model/moe.h"

namespace tetra {

MoeRoutingPlan plan_moe_routing(const int32_t* topk_idx, int64_t N, int64_t K, int64_t E, int64_t capacity,
                                const int64_t* before, int64_t segment) {
  MoeRoutingPlan plan;
  plan.routed.assign(static_cast<size_t>(E), 0);
  plan.kept.assign(static_cast<size_t>(E), 0);
  plan.pos.assign(static_cast<size_t>(N * K), -1);
  TETRA_CHECK(!before || (segment > 0 && N % segment == 0), "{} tokens in segments of {}", N, segment);
  // Rank of each assignment within its expert, in (token, k) order: position priority. With
  // `before`, its rank in the sequence's order decides whether it is kept: the assignments to its
  // expert before its segment, then its rank within the segment. The segments come in sequence
  // order, so an expert keeps a prefix of its local assignments either way.
  std::vector<int64_t> rank(static_cast<size_t>(N * K));
  std::vector<int64_t> seq(before ? static_cast<size_t>(E) : 0);
  for (int64_t a = 0; a < N * K; ++a) {
    const int32_t e = topk_idx[a];
    TETRA_CHECK(e >= 0 && e < E, "router chose expert {} of {}", e, E);
    rank[a] = plan.routed[e]++;
    if (!before) continue;
    if (a % (segment * K) == 0) std::copy(before + a / (segment * K) * E, before + (a / (segment * K) + 1) * E, seq.begin());
    if (seq[e]++ < capacity) ++plan.kept[e];
  }
  std::vector<int64_t> start(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    if (!before) plan.kept[e] = capacity < 0 ? plan.routed[e] : std::min(plan.routed[e], capacity);
    plan.dropped += plan.routed[e] - plan.kept[e];
    start[e + 1] = start[e] + plan.kept[e];
  }
  plan.rows.assign(static_cast<size_t>(start[E]), 0);
  for (int64_t a = 0; a < N * K; ++a) {
    const int32_t e = topk_idx[a];
    if (rank[a] >= plan.kept[e]) continue;
    const int64_t row = start[e] + rank[a];
    plan.pos[a] = static_cast<int32_t>(row);
    plan.rows[row] = static_cast<int32_t>(a / K);
  }
  return plan;
}

int64_t moe_row_bound(const MoeConfig& moe, int64_t N, int64_t ep, int64_t worst) {
  if (!moe_rows_can_exceed_bound(moe, ep)) return worst;  // every rank's rows are its own, or capped
  const double factor = moe.max_load_factor.value_or(MoeConfig::kDefaultMaxLoadFactor);
  const double balanced = static_cast<double>(N * moe.top_k);
  return std::min(worst, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(factor * balanced))));
}

int64_t moe_capacity(const MoeConfig& moe, int64_t N) {
  if (!moe.capacity_factor) return -1;
  return static_cast<int64_t>(std::ceil(*moe.capacity_factor * static_cast<double>(N * moe.top_k) /
                                        static_cast<double>(moe.num_experts)));
}

double MoeStepStats::objective(const MoeConfig& moe) const {
  double s = 0.0;
  for (const MoeLayerStats& l : layers) s += moe.aux_loss_coeff * l.aux_loss + moe.z_loss_coeff * l.z_loss;
  return s;
}

void MoeStepStats::merge(const MoeStepStats& other) {
  for (const MoeLayerStats& o : other.layers) {
    MoeLayerStats* mine = nullptr;
    for (MoeLayerStats& l : layers)
      if (l.layer == o.layer) mine = &l;
    if (!mine) {
      layers.push_back(o);
      continue;
    }
    const int64_t n = mine->micro_batches + o.micro_batches;
    if (n > 0) {
      mine->aux_loss = (mine->aux_loss * static_cast<double>(mine->micro_batches) +
                        o.aux_loss * static_cast<double>(o.micro_batches)) / static_cast<double>(n);
      mine->z_loss = (mine->z_loss * static_cast<double>(mine->micro_batches) +
                      o.z_loss * static_cast<double>(o.micro_batches)) / static_cast<double>(n);
    }
    mine->micro_batches = n;
    mine->dropped += o.dropped;
    mine->max_rows = std::max(mine->max_rows, o.max_rows);
    mine->bound_rows = std::max(mine->bound_rows, o.bound_rows);
    mine->over_bound += o.over_bound;
    if (mine->tokens_per_expert.size() < o.tokens_per_expert.size())
      mine->tokens_per_expert.resize(o.tokens_per_expert.size(), 0);
    for (size_t e = 0; e < o.tokens_per_expert.size(); ++e) mine->tokens_per_expert[e] += o.tokens_per_expert[e];
  }
  std::sort(layers.begin(), layers.end(), [](const MoeLayerStats& a, const MoeLayerStats& b) { return a.layer < b.layer; });
  expert_s += other.expert_s;
  dispatch_s += other.dispatch_s;
  combine_s += other.combine_s;
  dispatch_bytes += other.dispatch_bytes;
  combine_bytes += other.combine_bytes;
}

int64_t MoeLayers::block_index(int64_t l) const {
  return l >= 0 && l < static_cast<int64_t>(index_of_layer_.size()) ? index_of_layer_[static_cast<size_t>(l)] : -1;
}

std::map<int64_t, std::vector<float>> MoeLayers::expert_bias() const {
  std::map<int64_t, std::vector<float>> out;
  if (!cfg_.moe.router_enable_expert_bias) return out;
  for (int64_t l = 0; l < static_cast<int64_t>(index_of_layer_.size()); ++l)
    if (block_index(l) >= 0) out[l] = expert_bias_[static_cast<size_t>(block_index(l))];
  return out;
}

void MoeLayers::set_expert_bias(const std::map<int64_t, std::vector<float>>& bias) {
  for (const auto& [l, values] : bias) {
    if (block_index(l) < 0) continue;  // another chunk's block
    TETRA_CHECK(static_cast<int64_t>(values.size()) == E_, "MoE block {}: an expert bias of {} values for {} experts", l,
                values.size(), E_);
    expert_bias_[static_cast<size_t>(block_index(l))] = values;
  }
}

void MoeLayers::update_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert) {
  const float rate = static_cast<float>(cfg_.moe.router_bias_update_rate);
  for (const auto& [l, counts] : tokens_per_expert) {
    if (block_index(l) < 0) continue;
    TETRA_CHECK(static_cast<int64_t>(counts.size()) == E_, "MoE block {}: {} token counts for {} experts", l,
                counts.size(), E_);
    std::vector<float>& b = expert_bias_[static_cast<size_t>(block_index(l))];
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    // sign(mean - tokens_e), in integers: E tokens_e against the total.
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t d = total - E_ * counts[static_cast<size_t>(e)];
      if (d != 0) b[static_cast<size_t>(e)] += d > 0 ? rate : -rate;
    }
  }
}

}  // namespace tetra
