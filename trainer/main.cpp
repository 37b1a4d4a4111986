// tetra: parse the command line, load and validate the config, run. Nothing else lives here.
//
// Exit codes: 0 success; 1 a runtime failure; 2 bad input (command line, config, data files) —
// reported before anything is allocated or written.
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/config/config.h"
#include "trainer/core/check.h"
#include "trainer/core/log.h"
#include "trainer/model/flops.h"
#include "trainer/model/param_layout.h"
#include "trainer/train/trainer.h"

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
  const tetra::ParamLayout layout = tetra::ParamLayout::build(cfg.model);
  const tetra::ModelStats stats = tetra::model_stats(cfg.model, layout);
  const tetra::MemoryPlan mem = tetra::plan_memory(cfg, layout);
  const double tokens = static_cast<double>(cfg.training.global_batch_size * cfg.model.seq_len);
  fmt::print("parameters:        {} ({}; {} in matmuls)\n", stats.params, human_count(stats.params),
             human_count(stats.matmul_params));
  fmt::print("FLOPs per token:   {} (training step: 6 x matmul params + 12 L C T)\n",
             human_count(stats.train_flops_per_token));
  fmt::print("FLOPs per step:    {} ({} tokens, {} micro-batches of {})\n",
             human_count(stats.train_flops_per_token * tokens), tokens, cfg.grad_accum_steps(),
             cfg.training.micro_batch_size);
  fmt::print("memory:            {}\n", mib(mem.total()));
  fmt::print("  master weights   {} (fp32)\n", mib(mem.master));
  if (mem.compute) fmt::print("  compute weights  {} ({})\n", mib(mem.compute), cfg.training.precision);
  fmt::print("  gradients        {} (fp32)\n", mib(mem.grads));
  fmt::print("  optimizer        {} (AdamW moments, fp32)\n", mib(mem.optimizer));
  fmt::print("  activations      {} (micro-batch {}, logits included)\n", mib(mem.activations),
             cfg.training.micro_batch_size);
  fmt::print("  batch buffers    {}\n", mib(mem.batch));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tetra: trains decoder-only Transformers from a JSON config"};
  std::string config_path, dump_dir;
  std::vector<std::string> overrides;
  bool print_config = false, dry_run = false;
  app.add_option("-c,--config", config_path, "run configuration (JSON)")->required();
  app.add_option("--set", overrides, "override a config key: section.key=value (repeatable)");
  app.add_flag("--print-config", print_config, "print the resolved config (every key) and exit");
  app.add_flag("--dry-run", dry_run, "validate, print parameters, FLOPs and memory, and exit");
  app.add_option("--dump-dir", dump_dir,
                 "write initial weights, step-0 gradients and the batches of the run here");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  try {
    const tetra::Config cfg = tetra::load_config(config_path, overrides);
    if (print_config) {
      fmt::print("{}\n", tetra::config_to_json(cfg).dump(2));
      return 0;
    }
    if (dry_run) {
      print_dry_run(cfg);
      return 0;
    }
    tetra::init_logging(cfg.logging.level, tetra::RankCoords{});
    tetra::Trainer trainer(cfg, config_path, dump_dir);
    trainer.run();
    return 0;
  } catch (const tetra::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
