// `tetra train` (also `tetra --config run.json ...`, no command named): parse the training
// options, start MPI, load and validate the config, build the rank grid and its process groups,
// run.
//
// Launch: `tetra train --config run.json` (one process), `mpirun -np N tetra ...`, `srun tetra ...`.
// Exit codes: 0 success; 1 a runtime failure; 2 bad input (command line, config, layout, data
// files) — reported before anything is allocated or written. Every rank reads and checks the
// same config, so a config or layout error is printed once (by rank 0) and every rank exits 2
// without a collective. A failure after that may hit one rank only: it prints the error with its
// coordinates and ends the whole job (MPI_Abort), so no rank waits forever in a collective.
// Exit code 3: the watchdog (trainer/comm/watchdog.h) ended a job in which a step or a collective
// lasted longer than training.collective_timeout_s.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kernels/common/check.h"
#include "trainer/checkpoint/commit.h"
#include "trainer/cli/cli.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/process_groups.h"
#include "trainer/comm/rank_grid.h"
#include "trainer/comm/watchdog.h"
#include "trainer/config/config.h"
#include "trainer/core/format.h"
#include "trainer/core/log.h"
#include "trainer/model/flops.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/fault_injection.h"
#include "trainer/train/pipeline_model.h"
#include "trainer/train/trainer.h"

namespace tetra::cli {

namespace {

std::string human_count(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.2f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string mib(size_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / 1048576.0); }

void print_dry_run(const tetra::Config& cfg) {
  const tetra::ParamLayout whole = tetra::ParamLayout::build(cfg.model);
  const tetra::ParamLayout layout = tetra::rank_layout(cfg, 0);
  const tetra::ModelStats stats = tetra::model_stats(cfg.model, whole);
  const tetra::MemoryPlan mem = tetra::plan_memory(cfg, layout);
  const tetra::ParallelConfig& par = cfg.parallel;
  const double tokens = static_cast<double>(cfg.training.global_batch_size * cfg.model.seq_len);
  fmt::print("parameters:        {} ({}; {} in matmuls)\n", stats.params, human_count(stats.params),
             human_count(stats.matmul_params));
  if (cfg.model.moe.enabled())
    fmt::print("active parameters: {} per token ({} in matmuls; {} experts, top-{}, every {} blocks)\n",
               human_count(stats.active_params), human_count(stats.active_matmul_params),
               cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.every);
  fmt::print("FLOPs per token:   {} (training step: 6 x {}matmul params + 12 L C T)\n",
             human_count(stats.train_flops_per_token), cfg.model.moe.enabled() ? "active " : "");
  fmt::print("FLOPs per step:    {} ({} tokens, {} micro-batches of {} on each of {} DP ranks)\n",
             human_count(stats.train_flops_per_token * tokens), tokens, cfg.grad_accum_steps(),
             cfg.training.micro_batch_size, par.dp);
  fmt::print("layout:            {} ranks = tp {} x pp {} x dp {}{}, order {}{}{}\n", par.tp * par.pp * par.dp,
             par.tp, par.pp, par.dp, par.ep > 1 ? fmt::format(" (ep {} x edp {})", par.ep, par.dp / par.ep) : "",
             par.order, par.sequence_parallel ? ", sequence parallel" : "",
             par.distributed_optimizer ? ", distributed optimizer" : "");
  if (par.pp > 1) {
    const tetra::PipelineSchedule schedule = tetra::make_schedule(cfg, cfg.grad_accum_steps());
    fmt::print("pipeline:          schedule {}, {} stages ({} x {} chunk(s)), {} micro-batches per step, "
               "ideal bubble {:.1f}%\n", par.schedule, par.pp * par.virtual_stages, par.pp, par.virtual_stages,
               cfg.grad_accum_steps(), 100.0 * schedule.ideal_bubble());
    for (int64_t r = 0; r < par.pp; ++r) {
      const tetra::StageSlice st = tetra::stage_slice(cfg, r);
      std::string layers;
      for (const auto& [b, e] : st.chunks)
        layers += (layers.empty() ? "" : ", ") + (e > b ? fmt::format("{}-{}", b, e - 1) : std::string("none"));
      fmt::print("  rank {:<3}         layers {}{}{}; {} micro-batch(es) in flight; {}\n", r, layers,
                 st.first ? " + embedding" : "", st.last ? " + output layer and loss" : "",
                 schedule.max_in_flight(static_cast<int>(r)),
                 mib(tetra::plan_memory(cfg, tetra::rank_layout(cfg, 0, r), r).total()));
    }
  }
  fmt::print("memory per rank:   {}{}{}\n", mib(mem.total()), par.pp > 1 ? " (pipeline rank 0)" : "",
             mem.on_device && mem.compression
                 ? fmt::format(": {} on the GPU, {} on the host", mib(mem.device_bytes()), mib(mem.host_bytes()))
                 : std::string());
  fmt::print("  master weights   {} (fp32{})\n", mib(mem.master),
             par.distributed_optimizer && cfg.training.precision != "fp32" ? ", 1/dp shard" : "");
  if (mem.compute) fmt::print("  compute weights  {} ({})\n", mib(mem.compute), cfg.training.precision);
  fmt::print("  gradients        {} (fp32)\n", mib(mem.grads));
  fmt::print("  optimizer        {} (AdamW moments, fp32{})\n", mib(mem.optimizer),
             par.distributed_optimizer ? ", 1/dp shard" : "");
  if (par.distributed_optimizer && par.dp > 1) {
    tetra::Config plain = cfg;
    plain.parallel.distributed_optimizer = false;
    const tetra::MemoryPlan without = tetra::plan_memory(plain, tetra::rank_layout(plain, 0));
    fmt::print("    the distributed optimizer saves {} per rank ({} without it)\n",
               mib(without.total() - mem.total()), mib(without.total()));
  }
  fmt::print("  activations      {} (micro-batch {}, logits included)\n", mib(mem.activations),
             cfg.training.micro_batch_size);
  if (mem.compression)
    fmt::print("  compression      {} ({}: error feedback and messages{}, host memory)\n", mib(mem.compression),
               par.grad_compression, mem.on_device ? ", staging of the gradient and moments" : "");
  fmt::print("  batch buffers    {}\n", mib(mem.batch));
  if (mem.sampling)
    fmt::print("  sampling         {} (micro-batch 1 model for the text samples)\n", mib(mem.sampling));
  const tetra::StepVolume v = tetra::predict_step_volume(cfg, layout);
  fmt::print("communication per step and rank (payload; sent under ring algorithms ~ 2(p-1)/p of an "
             "all-reduce's, (p-1)/p of the others'):\n");
  fmt::print("  tp ({} ranks)      {}\n", par.tp, v.tp.describe());
  fmt::print("  dp ({} ranks)      {}\n", par.dp, v.dp.describe());
  if (par.pp > 1) {
    fmt::print("  pp ({} ranks)      {}\n", par.pp, v.pp.describe());
    fmt::print("  embedding         {}\n", v.embedding.describe());
  }
  if (cfg.model.moe.enabled()) {
    fmt::print("  edp ({} ranks)     {}\n", par.dp / par.ep, v.edp.describe());
    fmt::print("  ep ({} ranks)      {} (plus the routed tokens: all-to-all payload depends on the routing)\n",
               par.ep, v.ep.describe());
  }
}

// What a failure says to the user: Tetra's own errors as they are; a library's exception that
// escaped (a filesystem call, a JSON access) with the path or value it concerns, never the
// library's bare wording alone.
std::string describe_failure(const std::exception& e) {
  if (const auto* fe = dynamic_cast<const std::filesystem::filesystem_error*>(&e)) {
    std::string paths = fe->path1().string();
    if (!fe->path2().empty()) paths += " -> " + fe->path2().string();
    return fmt::format("{}: {} (a filesystem call failed: {})", paths.empty() ? "?" : paths, fe->code().message(),
                       fe->what());
  }
  if (dynamic_cast<const nlohmann::json::exception*>(&e))
    return fmt::format("unexpected JSON value: {}", e.what());
  return e.what();
}

// The log level of a rank: rank 0 logs at the configured level, the others warnings and errors.
std::string rank_log_level(const std::string& level, int rank) {
  if (rank == 0 || level == "error" || level == "warn") return level;
  return "warn";
}

class TrainCommand final : public Command {
 public:
  explicit TrainCommand(CLI::App& tetra) {
    cmd_ = tetra.add_subcommand("train", "train a model from a JSON config (the command `tetra --config "
                                         "run.json` runs when none is named)");
    cmd_->add_option("-c,--config", config_path_, "run configuration (JSON)")->required();
    cmd_->add_option("--set", overrides_, "override a config key: section.key=value (repeatable)");
    cmd_->add_flag("--print-config", print_config_, "print the resolved config (every key) and exit");
    cmd_->add_flag("--dry-run", dry_run_,
                   "validate, print parameters, FLOPs, memory and communication per rank, and exit");
    cmd_->add_option("--dump-dir", dump_dir_,
                     "write initial weights, step-0 gradients and the batches of the run here");
  }

  CLI::App& app() override { return *cmd_; }

  int run(int* argc, char*** argv, const RuntimeOptions& runtime) override {
    ProcessInfo proc;
    try {
      proc = dist_init(argc, argv, runtime.rendezvous_dir);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: cannot start MPI: %s\n", e.what());
      return 1;
    }
    const int code = train(proc, runtime);
    dist_finalize();
    return code;
  }

 private:
  int train(const ProcessInfo& proc, const RuntimeOptions& runtime);

  CLI::App* cmd_ = nullptr;
  std::string config_path_, dump_dir_;
  std::vector<std::string> overrides_;
  bool print_config_ = false, dry_run_ = false;
};

int TrainCommand::train(const ProcessInfo& proc, const RuntimeOptions& runtime) {
  const bool rank0 = proc.rank == 0;

  // Phase 1: identical on every rank (config, layout): report once, exit 2 everywhere.
  tetra::Config cfg;
  tetra::RankGrid grid;
  try {
    cfg = tetra::load_config(config_path_, overrides_);
    if (print_config_ || dry_run_) {
      if (rank0) {
        if (print_config_) fmt::print("{}\n", tetra::config_to_json(cfg).dump(2));
        else print_dry_run(cfg);
      }
      return 0;
    }
    const tetra::ParallelConfig& par = cfg.parallel;
    if (!tetra::dist_has_mpi() && (par.tp > 1 || par.pp > 1 || par.dp > 1 || par.ep > 1))
      throw tetra::InputError(fmt::format(
          "parallel: tp {} x pp {} x dp {} (ep {}) needs several processes, but this tetra was built without "
          "MPI and runs as one: set parallel.tp, pp, dp and ep to 1, or build it with MPI (cmake -DTETRA_MPI=ON)",
          par.tp, par.pp, par.dp, par.ep));
    tetra::GridSizes sizes;
    sizes.world = proc.size;
    sizes.tp = cfg.parallel.tp;
    sizes.pp = cfg.parallel.pp;
    sizes.dp = cfg.parallel.dp;
    sizes.ep = cfg.parallel.ep;
    sizes.order = cfg.parallel.order;
    grid = tetra::RankGrid::build(sizes);
  } catch (const std::exception& e) {  // every rank read the same input: report once, exit 2
    if (rank0) std::fprintf(stderr, "error: %s\n", tetra::printable(describe_failure(e)).c_str());
    return 2;
  }

  // Phase 2: may fail on some ranks only.
  const tetra::GridCoord c = grid.coord(proc.rank);
  tetra::init_logging(rank_log_level(cfg.logging.level, proc.rank),
                      tetra::RankCoords{c.tp, c.pp, c.dp, c.ep, proc.rank});
  tetra::watchdog_start(cfg.training.collective_timeout_s, proc.rank,
                        tetra::rank_prefix({c.tp, c.pp, c.dp, c.ep, proc.rank}), runtime.hang);
  // The test hooks (runtime_options.h): none unless a test sets them.
  tetra::set_step_faults(runtime.step_fault);
  tetra::set_save_fault_hooks(runtime.save_faults);
  struct StopWatchdog {
    ~StopWatchdog() { tetra::watchdog_stop(); }
  } stop_watchdog;
  try {
    tetra::ProcessGroups groups = tetra::ProcessGroups::create(grid, proc.rank);
    // The GPU is the bootstrap's node-local rank's.
    tetra::Trainer trainer(cfg, config_path_, groups, dump_dir_,
                           tetra::device_options(runtime, proc.local_rank));
    trainer.run();
    groups.world->barrier();
    return 0;
  } catch (const std::exception& e) {
    const int code = dynamic_cast<const tetra::InputError*>(&e) ? 2 : 1;
    std::fprintf(stderr, "error: %s %s\n", tetra::rank_prefix({c.tp, c.pp, c.dp, c.ep, proc.rank}).c_str(),
                 tetra::printable(describe_failure(e)).c_str());
    std::fflush(stderr);
    if (proc.size > 1) tetra::dist_abort(code);
    return code;
  }
}

}  // namespace

std::unique_ptr<Command> add_train_command(CLI::App& tetra) { return std::make_unique<TrainCommand>(tetra); }

}  // namespace tetra::cli
