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
#include <optional>
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
#include "trainer/core/trace.h"
#include "trainer/model/flops.h"
#include "trainer/model/moe.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/params/param_layout.h"
#include "trainer/plan/cluster.h"
#include "trainer/plan/step_time.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/fault_injection.h"
#include "trainer/train/pipeline_model.h"
#include "trainer/train/run_report.h"
#include "trainer/train/trainer.h"

namespace tetra::cli {

namespace {

void print_dry_run(const tetra::Config& cfg) { fmt::print("{}", tetra::dry_run_report(cfg)); }

// The step time `tetra plan` predicts for the run's own device, logged beside every measured step:
// the GPU's preset (none for a GPU without one), or this CPU measured as `cpu-local` with the
// rank's threads while every rank of the run measures at once (docs/planning.md).
std::optional<tetra::PlannedStep> plan_step(const tetra::Config& cfg, const tetra::ComputeDevice& device, int64_t world) {
  std::optional<tetra::ClusterSpec> cluster;
  if (cfg.training.device == tetra::Device::CUDA) {
    cluster = tetra::cluster_for_gpu(device.gpu_name, world);
    if (!cluster) {
      spdlog::info("planned step: no cluster preset for {} (tetra plan --cluster FILE plans for any GPU)",
                   device.gpu_name);
      return std::nullopt;
    }
  } else {
    // A given training.peak_gflops says not to measure this machine (the tests' configs set it to
    // start fast): without its measured rates there is nothing to predict from.
    if (device.peak_source != "measured") {
      spdlog::info("planned step: not predicted, this machine's rates are not measured when training.peak_gflops "
                   "is set (tetra plan --cluster cpu-local --explain predicts it)");
      return std::nullopt;
    }
    cluster = tetra::cpu_local_cluster(cfg.training.precision, device.threads, device.peak_flops,
                                       /*quick=*/true, /*concurrent=*/false);
    cluster->nodes = std::max<int64_t>(1, (world + cluster->gpus_per_node - 1) / cluster->gpus_per_node);
  }
  const tetra::StepPrediction p = tetra::predict_step(cfg, *cluster);
  return tetra::PlannedStep{
      p.step_s, fmt::format("{:.1f} ms on {} (compute {:.1f} ms of which recomputation {:.1f}, pipeline bubble {:.1f}, "
                            "optimizer {:.1f}, exposed communication {:.1f} ms)",
                            p.step_s * 1e3, cluster->name, p.compute_s * 1e3, p.recompute_s * 1e3, p.bubble_s * 1e3,
                            p.optimizer_s * 1e3, p.exposed_comm_s() * 1e3)};
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
std::string rank_log_level(tetra::LogLevel level, int rank) {
  if (rank == 0 || level == tetra::LogLevel::ERROR || level == tetra::LogLevel::WARN)
    return std::string(tetra::to_string(level));
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
    } catch (const InputError& e) {  // a launch set up wrongly (TETRA_RENDEZVOUS without srun)
      std::fprintf(stderr, "error: cannot start MPI: %s\n", e.what());
      return 2;
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
    if (!tetra::dist_has_mpi() && (par.world() > 1 || par.ep > 1))
      throw tetra::InputError(fmt::format(
          "parallel: tp {} x cp {} x pp {} x dp {} (ep {}) needs several processes, but this tetra was built "
          "without MPI and runs as one: set parallel.tp, cp, pp, dp and ep to 1, or build it with MPI "
          "(cmake -DTETRA_MPI=ON)",
          par.tp, par.cp, par.pp, par.dp, par.ep));
    tetra::GridSizes sizes;
    sizes.world = proc.size;
    sizes.tp = cfg.parallel.tp;
    sizes.pp = cfg.parallel.pp;
    sizes.dp = cfg.parallel.dp;
    sizes.ep = cfg.parallel.ep;
    sizes.cp = cfg.parallel.cp;
    sizes.etp = cfg.parallel.expert_tp();
    sizes.order = tetra::to_string(cfg.parallel.order);
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
  tetra::set_slow_rank(runtime.timing);
  tetra::set_moe_route_bias(runtime.moe_route == "one"    ? tetra::MoeRouteBias::kOne
                            : runtime.moe_route == "skew" ? tetra::MoeRouteBias::kSkew
                                                          : tetra::MoeRouteBias::kNone);
  tetra::set_checkpoint_read_piece(runtime.checkpoint_piece);
  tetra::trace::set_test_skew(proc.rank * runtime.timing.clock_skew_ms * 1e-3);
  tetra::trace::name_thread("main");  // the training loop's track of this rank's timeline
  struct StopWatchdog {
    ~StopWatchdog() { tetra::watchdog_stop(); }
  } stop_watchdog;
  try {
    tetra::ProcessGroups groups = tetra::ProcessGroups::create(grid, proc.rank);
    // The GPU is the bootstrap's node-local rank's.
    tetra::Trainer trainer(cfg, config_path_, groups, dump_dir_,
                           tetra::device_options(runtime, proc.local_rank), plan_step);
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
