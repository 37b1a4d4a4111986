#include "trainer/plan/planner.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

std::vector<int64_t> powers_of_two_dividing(int64_t n, int64_t most) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= std::min(n, most); i *= 2)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The largest part of a plan that does not fit, in words.
std::string binding(const MemoryPlan& p, double held, double usable) {
  const std::pair<const char*, size_t> parts[] = {
      {"activations", p.activations}, {"gradients", p.grads},         {"optimizer state", p.optimizer},
      {"master weights", p.master},   {"compute weights", p.compute}, {"ZeRO-3 units", p.units},
      {"weight staging", p.staging}};
  const auto* largest = std::max_element(std::begin(parts), std::end(parts),
                                         [](const auto& x, const auto& y) { return x.second < y.second; });
  return fmt::format("{:.2f} GiB over the {:.1f} GiB usable ({} the largest part: {:.1f} GiB)", (held - usable) / kGiB,
                     usable / kGiB, largest->first, static_cast<double>(largest->second) / kGiB);
}

}  // namespace

std::string PlannedLayout::describe() const {
  const ParallelConfig& p = cfg.parallel;
  std::string pipe = p.pp > 1 ? fmt::format(" ({}{})", to_string(p.schedule),
                                            p.schedule == ScheduleKind::INTERLEAVED ? fmt::format(" x{}", p.virtual_stages) : "")
                              : "";
  std::string ep = cfg.model.moe.enabled()
                       ? fmt::format(" ep {}{}", p.ep, p.expert_shares() > 1 ? fmt::format(" (etp {})", p.expert_tp()) : "")
                       : "";
  std::string cp = p.cp > 1 ? fmt::format(" cp {} ({})", p.cp, to_string(p.cp_comm)) : " cp 1";
  return fmt::format("tp {}{} pp {}{} dp {}{} zero {} mbs {} recompute {}", p.tp, cp, p.pp, pipe, p.dp, ep, p.zero_stage,
                     cfg.training.micro_batch_size, to_string(cfg.training.recompute));
}

double usable_bytes(const ClusterSpec& cluster) { return cluster.gpu.memory_bytes - cluster.gpu.reserved_bytes; }

PlannedLayout evaluate_layout(const Config& cfg, const ClusterSpec& cluster, const PlanOptions& opt, bool always_time) {
  PlannedLayout out;
  out.cfg = cfg;
  const bool device = cluster.name != "cpu-local";
  // Under an even split the first pipeline rank holds the most micro-batches in flight and the
  // embedding, the last the head: one of the two has the peak; otherwise every rank is planned.
  const std::vector<int64_t> stages = cfg.pipeline_stage_layers();
  const bool even = std::all_of(stages.begin(), stages.end(), [&](int64_t n) { return n == stages[0]; });
  for (int64_t r = 0; r < cfg.parallel.pp; ++r) {
    if (even && r != 0 && r != cfg.parallel.pp - 1) continue;
    MemoryPlan plan = plan_memory(cfg, rank_layout(cfg, 0, r, 0), r);
    // On a GPU everything but the host-side compression buffers is device memory.
    const double held = static_cast<double>(device ? plan.peak() - plan.compression : plan.peak());
    if (held > out.memory_bytes || r == 0) out.memory = plan, out.memory_bytes = held, out.memory_pp_rank = r;
  }
  const double usable = usable_bytes(cluster);
  out.fits = out.memory_bytes <= usable;
  if (!out.fits) out.binds = binding(out.memory, out.memory_bytes, usable);
  if (out.fits || always_time) out.time = predict_step(cfg, cluster, opt);
  return out;
}

PlanSearch search_layouts(const Config& base, const ClusterSpec& cluster, const PlanOptions& opt) {
  const int64_t world = cluster.gpus();
  const ModelConfig& M = base.model;
  const int64_t gbs = base.training.global_batch_size;
  if (gbs <= 0) throw InputError("training.global_batch_size: the plan needs the global batch (set it)");
  nlohmann::json j = config_to_json(base);
  PlanSearch out;
  std::vector<PlannedLayout> all_big;
  const std::vector<int64_t> eps = M.moe.enabled() ? divisors(M.moe.num_experts) : std::vector<int64_t>{1};
  const std::vector<Recompute> recomputes = {Recompute::NONE, Recompute::SELECTIVE, Recompute::FULL};
  // Tensor parallelism inside a node (its collectives are on the critical path of every layer).
  for (int64_t tp : powers_of_two_dividing(world, std::min(M.num_heads, cluster.gpus_per_node)))
    for (int64_t cp : powers_of_two_dividing(world / tp, M.seq_len))
      for (int64_t pp : divisors(world / (tp * cp))) {
        if (pp > M.num_layers) continue;
        const int64_t dp = world / (tp * cp * pp);
        // Schedules: 1f1b (gpipe runs the same table order's forwards first: the same time, more
        // memory, never better), interleaved over every chunk count that splits the layers evenly.
        std::vector<std::pair<ScheduleKind, int64_t>> schedules = {{ScheduleKind::ONE_F_ONE_B, 1}};
        if (pp > 1)
          for (int64_t v = 2; v * pp <= M.num_layers; ++v)
            if (M.num_layers % (v * pp) == 0) schedules.push_back({ScheduleKind::INTERLEAVED, v});
        // MoE: the experts split over tp like the dense MLP, or folded (whole experts, etp 1, expert
        // parallelism over the tp ranks too).
        std::vector<int64_t> etps = {tp};
        if (M.moe.enabled() && tp > 1) etps.push_back(1);
        for (const auto& [schedule, vp] : schedules)
          for (int64_t etp : etps)
          for (int64_t ep : eps) {
            if ((tp / etp * dp) % ep != 0 || (etp < tp && ep == 1)) continue;
            for (int64_t mbs : {1, 2, 4, 8, 16}) {
              if (gbs % (mbs * dp) != 0) continue;
              for (int64_t zero = 0; zero <= (dp * cp > 1 ? 3 : 0); ++zero)
                // Recomputation only adds compute: once a mode fits, the heavier modes of the same
                // layout cannot be faster and are not evaluated (counted as dominated).
                for (size_t ri = 0; ri < recomputes.size(); ++ri) {
                  const Recompute rc = recomputes[ri];
                  ++out.candidates;
                  nlohmann::json c = j;
                  nlohmann::json& p = c["parallel"];
                  p["tp"] = tp, p["cp"] = cp, p["pp"] = pp, p["dp"] = dp, p["ep"] = ep;
                  p["etp"] = etp;
                  // the config's overlap of the expert exchanges, where this layout has them
                  p["ep_overlap_chunks"] = ep > 1 ? std::min(base.parallel.ep_overlap_chunks, M.moe.num_experts / ep) : 1;
                  p["sequence_parallel"] = tp > 1;
                  p["zero_stage"] = zero, p["distributed_optimizer"] = zero >= 1;
                  p["schedule"] = schedule, p["virtual_stages"] = vp;
                  p["stage_layers"] = nlohmann::json::array();
                  p["reshard_after_forward"] = nullptr;
                  p["order"] = "tp-cp-dp-pp";
                  nlohmann::json& t = c["training"];
                  t["micro_batch_size"] = mbs, t["global_batch_size"] = gbs;
                  t["recompute"] = rc;
                  if (rc == Recompute::SELECTIVE && base.training.recompute != Recompute::SELECTIVE)
                    t["recompute_modules"] = {"core_attn"};
                  Config cfg;
                  try {
                    cfg = config_from_json(c);
                  } catch (const ConfigError& e) {
                    ++out.refused;
                    const std::string first = e.problems().empty() ? "?" : e.problems().front();
                    ++out.refusal_keys[first.substr(0, first.find(':'))];
                    continue;
                  }
                  PlannedLayout l = evaluate_layout(cfg, cluster, opt, false);
                  if (l.fits) {
                    out.fitting.push_back(std::move(l));
                    out.dominated += static_cast<int64_t>(recomputes.size() - ri - 1);
                    out.candidates += static_cast<int64_t>(recomputes.size() - ri - 1);
                    break;
                  }
                  // Keep the three least over.
                  ++out.too_big;
                  if (all_big.size() < 3 || l.memory_bytes < all_big.back().memory_bytes) {
                    if (all_big.size() == 3) all_big.pop_back();
                    all_big.push_back(std::move(l));
                    std::stable_sort(all_big.begin(), all_big.end(), [](const PlannedLayout& x, const PlannedLayout& y) {
                      return x.memory_bytes < y.memory_bytes;
                    });
                  }
                }
            }
          }
      }
  std::stable_sort(out.fitting.begin(), out.fitting.end(), [](const PlannedLayout& x, const PlannedLayout& y) {
    return x.time.tokens_per_s_per_gpu > y.time.tokens_per_s_per_gpu;
  });
  out.closest_too_big = std::move(all_big);
  return out;
}

}  // namespace tetra
