// `tetra plan`: which layout to run before a job is launched (trainer/plan/planner.h).
//
//   tetra plan --config run.json --cluster h100-80gb|FILE [--nodes N] [--top N] [--json]
//   tetra plan --config run.json --cluster ... --explain        the config's own layout, itemised
//   tetra plan ... --write-config best.json [--force]           the best layout (or, with --explain,
//                                                               the config's own) as a config
//
// The run config gives the model, sequence length, global batch and precision; the cluster its
// GPUs (cluster.h, docs/clusters.md). Exit 0; 2 on bad input (config, cluster file, an existing
// --write-config file without --force, no layout that fits), the message naming the key or file.
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/config/config.h"
#include "trainer/core/files.h"
#include "trainer/core/output_path.h"
#include "trainer/plan/cluster.h"
#include "trainer/plan/planner.h"

namespace tetra::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string ms(double s) { return fmt::format("{:.1f}", s * 1e3); }

nlohmann::json layout_json(const PlannedLayout& l) {
  nlohmann::json groups = nlohmann::json::object();
  for (int g = 0; g < kPlanGroups; ++g) {
    const GroupTime& t = l.time.groups[static_cast<size_t>(g)];
    if (t.size <= 1) continue;
    groups[plan_group_name(static_cast<PlanGroup>(g))] = {
        {"size", t.size}, {"link", t.inter_node ? "inter_node" : "intra_node"}, {"total_s", t.total_s}, {"exposed_s", t.exposed_s}};
  }
  const ParallelConfig& p = l.cfg.parallel;
  return {{"layout", l.describe()},
          {"parallel", {{"tp", p.tp}, {"cp", p.cp}, {"pp", p.pp}, {"dp", p.dp}, {"ep", p.ep}, {"schedule", p.schedule},
                        {"virtual_stages", p.virtual_stages}, {"zero_stage", p.zero_stage}, {"sequence_parallel", p.sequence_parallel}}},
          {"training", {{"micro_batch_size", l.cfg.training.micro_batch_size}, {"recompute", l.cfg.training.recompute}}},
          {"memory_gib", l.memory_bytes / kGiB},
          {"memory_pp_rank", l.memory_pp_rank},
          {"fits", l.fits},
          {"step_s", l.time.step_s},
          {"compute_s", l.time.compute_s},
          {"recompute_s", l.time.recompute_s},
          {"bubble_s", l.time.bubble_s},
          {"optimizer_s", l.time.optimizer_s},
          {"exposed_comm_s", l.time.exposed_comm_s()},
          {"groups", groups},
          {"tokens_per_s_per_gpu", l.time.tokens_per_s_per_gpu},
          {"mfu", l.time.mfu}};
}

std::string exposed_words(const StepPrediction& t) {
  std::string s;
  for (int g = 0; g < kPlanGroups; ++g) {
    const GroupTime& x = t.groups[static_cast<size_t>(g)];
    if (x.size > 1 && x.exposed_s > 0)
      s += fmt::format("{}{} {}", s.empty() ? "" : " ", plan_group_name(static_cast<PlanGroup>(g)), ms(x.exposed_s));
  }
  return s.empty() ? "-" : s;
}

std::string explain(const PlannedLayout& l, const ClusterSpec& c) {
  const StepPrediction& t = l.time;
  std::string s;
  s += fmt::format("layout:        {} on {} GPUs ({} nodes x {} of {})\n", l.describe(), l.cfg.parallel.world(), c.nodes,
                   c.gpus_per_node, c.name);
  s += fmt::format("memory:        {:.1f} GiB at the peak (pipeline rank {}) of {:.1f} GiB usable: {}\n", l.memory_bytes / kGiB,
                   l.memory_pp_rank, usable_bytes(c) / kGiB, l.fits ? "fits" : "does not fit, " + l.binds);
  const MemoryPlan& m = l.memory;
  s += fmt::format("  weights {:.1f} (master {:.1f}, compute {:.1f}), gradients {:.1f}, optimizer {:.1f}, activations {:.1f}, "
                   "ZeRO-3 units {:.1f}, buffers {:.1f}, staging {:.1f} GiB\n",
                   (m.master + m.compute) / kGiB, m.master / kGiB, m.compute / kGiB, m.grads / kGiB, m.optimizer / kGiB,
                   m.activations / kGiB, m.units / kGiB, (m.buffers + m.batch) / kGiB, m.staging / kGiB);
  s += fmt::format("step:          {} ms predicted: {:.0f} tokens/s/GPU, MFU {:.1f}% of {:.1f} TFLOP/s\n", ms(t.step_s),
                   t.tokens_per_s_per_gpu, 100 * t.mfu, c.gpu.peak(l.cfg.training.precision) / 1e12);
  s += fmt::format("  compute      {} ms on pipeline rank {} (recomputation {} ms)\n", ms(t.compute_s), t.critical_pp_rank,
                   ms(t.recompute_s));
  s += fmt::format("  bubble       {} ms\n", ms(t.bubble_s));
  s += fmt::format("  optimizer    {} ms\n", ms(t.optimizer_s));
  for (int g = 0; g < kPlanGroups; ++g) {
    const GroupTime& x = t.groups[static_cast<size_t>(g)];
    if (x.size <= 1) continue;
    s += fmt::format("  {:<12} {} ms exposed of {} ms ({} ranks, {})\n", plan_group_name(static_cast<PlanGroup>(g)),
                     ms(x.exposed_s), ms(x.total_s), x.size, x.inter_node ? "across nodes" : "inside a node");
  }
  s += "per layer and micro-batch (ms, forward / backward):\n";
  for (const auto& [name, fb] : t.ops) s += fmt::format("  {:<28} {:>9.3f} {:>9.3f}\n", name, fb.first * 1e3, fb.second * 1e3);
  return s;
}

void write_config(const Config& cfg, const std::string& path, bool force) {
  check_output_file("--write-config", path, force);
  try {
    write_file_atomic(path, config_to_json(cfg).dump(2) + "\n");
  } catch (const Error& e) {
    throw InputError(fmt::format("--write-config {}: cannot write it: {}", path, e.what()));
  }
}

class PlanCommand final : public Command {
 public:
  explicit PlanCommand(CLI::App& tetra) {
    std::string presets;
    for (const std::string& n : cluster_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
    cmd_ = tetra.add_subcommand("plan", "rank the layouts of a model on a cluster by predicted speed and memory, "
                                        "before any GPU is used");
    cmd_->add_option("-c,--config", config_path_, "run configuration (model, seq_len, global batch, precision)")->required();
    cmd_->add_option("--set", overrides_, "override a config key: section.key=value (repeatable)");
    cmd_->add_option("--cluster", cluster_, "a preset (" + presets + ") or a cluster JSON file (docs/clusters.md)")
        ->required();
    cmd_->add_option("--nodes", nodes_, "nodes of the cluster (a preset has one)")->check(whole_number_in(1, 1 << 20));
    cmd_->add_option("--top", top_, "layouts to print (default 10)")->check(whole_number_in(1, 1 << 20));
    cmd_->add_flag("--json", json_, "print JSON instead of a table");
    cmd_->add_flag("--explain", explain_, "itemise the config's own layout instead of searching");
    cmd_->add_option("--write-config", write_path_, "write the best layout (with --explain: the config's) as a config");
    cmd_->add_flag("--force", force_, "let --write-config replace an existing file");
    cmd_->add_flag("--assume-tp-overlap", options_.tp_overlap,
                   "predict for an implementation that hides TP collectives behind its GEMMs (Megatron's "
                   "--tp-comm-overlap); Tetra does not");
    cmd_->add_flag("--assume-param-gather-overlap", options_.param_gather_overlap,
                   "predict for an implementation that all-gathers the distributed optimizer's weights behind the "
                   "next forward (Megatron's --overlap-param-gather); Tetra does not");
  }

  CLI::App& app() override { return *cmd_; }

  int run(int*, char***, const RuntimeOptions&) override {
    return exit_code_of([this] { return plan(); });
  }

 private:
  int plan() {
    const Config cfg = load_config(config_path_, overrides_);
    if (!write_path_.empty()) check_output_file("--write-config", write_path_, force_, {config_path_, cluster_});
    ClusterSpec cluster = load_cluster(cluster_, cfg.training.precision, nodes_);
    if (explain_) {
      const int64_t world = cfg.parallel.world();
      if (world > cluster.gpus())
        throw InputError(fmt::format("--cluster {}: {} GPUs ({} nodes x {}) for a layout of {} ranks: give --nodes {}", cluster_,
                                     cluster.gpus(), cluster.nodes, cluster.gpus_per_node, world,
                                     (world + cluster.gpus_per_node - 1) / cluster.gpus_per_node));
      const PlannedLayout l = evaluate_layout(cfg, cluster, options_);
      if (json_) fmt::print("{}\n", layout_json(l).dump(2));
      else fmt::print("{}", explain(l, cluster));
      if (!write_path_.empty()) write_config(cfg, write_path_, force_);
      return 0;
    }
    const PlanSearch found = search_layouts(cfg, cluster, options_);
    const size_t top = std::min(found.fitting.size(), static_cast<size_t>(top_));
    if (json_) {
      nlohmann::json j = {{"cluster", cluster_to_json(cluster)},
                          {"candidates", found.candidates},
                          {"refused", found.refused},
                          {"too_big", found.too_big},
                          {"dominated", found.dominated},
                          {"fitting", found.fitting.size()},
                          {"layouts", nlohmann::json::array()}};
      for (size_t i = 0; i < top; ++i) j["layouts"].push_back(layout_json(found.fitting[i]));
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print("cluster: {} ({} nodes x {} GPUs, {:.1f} GiB usable each); {} layouts: {} refused by the config "
                 "rules, {} over the memory, {} fit and ranked, {} slower by construction (more recomputation than "
                 "a fitting twin)\n",
                 cluster.name, cluster.nodes, cluster.gpus_per_node, usable_bytes(cluster) / kGiB, found.candidates,
                 found.refused, found.too_big, found.fitting.size(), found.dominated);
      if (top > 0) {
        fmt::print("{:>3}  {:<72} {:>8} {:>10} {:>9} {:>8} {:>10} {:>6}  {}\n", "#", "layout", "GiB/GPU", "step ms",
                   "compute", "bubble", "tokens/s", "MFU", "exposed comm ms");
        for (size_t i = 0; i < top; ++i) {
          const PlannedLayout& l = found.fitting[i];
          fmt::print("{:>3}  {:<72} {:>8.1f} {:>10} {:>9} {:>8} {:>10.0f} {:>5.1f}%  {}\n", i + 1, l.describe(),
                     l.memory_bytes / kGiB, ms(l.time.step_s), ms(l.time.compute_s), ms(l.time.bubble_s),
                     l.time.tokens_per_s_per_gpu, 100 * l.time.mfu, exposed_words(l.time));
        }
      }
      for (const PlannedLayout& l : found.closest_too_big)
        fmt::print("over the memory: {}: {:.1f} GiB, {}\n", l.describe(), l.memory_bytes / kGiB, l.binds);
      for (const auto& [key, n] : found.refusal_keys) fmt::print("refused: {} layout(s) by {}\n", n, key);
    }
    if (found.fitting.empty() && found.candidates == 0)
      throw InputError(fmt::format(
          "no layout of this model spans {} x {} GPUs: tensor parallelism is a power of two up to {} (the heads, a "
          "node's GPUs), context parallelism a power of two dividing model.seq_len ({}), pipeline parallelism at most "
          "model.num_layers ({}), and the data-parallel rest times a micro-batch (1 to 16) must divide "
          "training.global_batch_size ({}); give fewer GPUs (--nodes) or a larger global batch",
          cluster.nodes, cluster.gpus_per_node, std::min(cfg.model.num_heads, cluster.gpus_per_node),
          cfg.model.seq_len, cfg.model.num_layers, cfg.training.global_batch_size));
    if (found.fitting.empty() && found.too_big == 0)
      throw InputError(fmt::format("every layout of this model on {} x {} GPUs is refused by the config rules (the "
                                   "keys are counted above): give another GPU count (--nodes) or change the model "
                                   "or batch to suit them", cluster.nodes, cluster.gpus_per_node));
    if (found.fitting.empty())
      throw InputError(fmt::format("no layout of this model fits {} x {} GPUs of {:.1f} GiB (see above): add nodes or "
                                   "shrink the model, sequence or batch", cluster.nodes, cluster.gpus_per_node,
                                   usable_bytes(cluster) / kGiB));
    if (!write_path_.empty()) write_config(found.fitting.front().cfg, write_path_, force_);
    return 0;
  }

  CLI::App* cmd_ = nullptr;
  std::string config_path_, cluster_, write_path_;
  std::vector<std::string> overrides_;
  int64_t nodes_ = 0, top_ = 10;
  bool json_ = false, explain_ = false, force_ = false;
  PlanOptions options_;
};

}  // namespace

std::unique_ptr<Command> add_plan_command(CLI::App& tetra) { return std::make_unique<PlanCommand>(tetra); }

CLI::Validator whole_number_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& v) {
        int64_t x = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if (ec == std::errc() && end == v.data() + v.size() && x >= lo && x <= hi) return std::string();
        return fmt::format("{}: must be a whole number from {} to {}", v, lo, hi);
      },
      fmt::format("{}..{}", lo, hi));
}

int exit_code_of(const std::function<int()>& body) {
  try {
    return body();
  } catch (const InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace tetra::cli
