// `tetra generate --config run.json [options]`: text from the weights training exported (or a
// checkpoint's, or a Hugging Face model's), one
// process, tp 1 (trainer/train/generate.h does the work). The sampling options override the
// config's sample section under the config's own rules for it.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/comm/launcher.h"
#include "trainer/config/config.h"
#include "trainer/core/output_path.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/generate.h"

namespace tetra::cli {

namespace {

// A check for a numeric option: "--top-k: -1: must be at least 0".
CLI::Validator at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0') return fmt::format("{}: not a number", v);
        return x >= lo ? std::string() : fmt::format("{}: must be at least {}", v, lo);
      },
      fmt::format(">= {}", lo));
}

// `tetra generate`'s command line: sampling settings override the config's sample section, under
// the config's own rules for them (finite numbers, whole numbers in range): "--seed: -1: ...".
struct GenerateArgs {
  CLI::App* cmd = nullptr;
  std::string config_path, weights, prompt, prompt_ids, logits_out;
  std::vector<std::string> overrides;
  int64_t max_tokens = 0, top_k = 0;
  double temperature = 0.0;
  uint64_t seed = 0;
  bool force = false;
  CLI::Option *prompt_opt = nullptr, *prompt_ids_opt = nullptr, *max_tokens_opt = nullptr,
              *temperature_opt = nullptr, *top_k_opt = nullptr, *seed_opt = nullptr;

  // A whole number in int64_t (CLI11 would wrap, round or misreport what does not fit).
  static CLI::Validator whole_number() {
    return CLI::Validator(
        [](std::string& v) {
          int64_t x = 0;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
          if (ec == std::errc::result_out_of_range)
            return fmt::format("{}: out of range: at most {}", v, std::numeric_limits<int64_t>::max());
          if (ec != std::errc() || end != v.data() + v.size()) return fmt::format("{}: not a whole number", v);
          return std::string();
        },
        "INTEGER");
  }
  // A finite number: inf and nan are no temperature (the config refuses them too).
  static CLI::Validator finite_number() {
    return CLI::Validator(
        [](std::string& v) {
          char* end = nullptr;
          const double x = std::strtod(v.c_str(), &end);
          if (end == v.c_str() || *end != '\0') return fmt::format("{}: not a number", v);
          return std::isfinite(x) ? std::string()
                                  : fmt::format("{}: must be a finite number (0 = greedy, 1 = the model's own "
                                                "distribution, higher = flatter)", v);
        },
        "NUMBER");
  }
  // A seed: a whole number from 0 to 2^64 - 1 (a negative one would wrap around).
  static CLI::Validator seed_number() {
    return CLI::Validator(
        [](std::string& v) {
          const uint64_t hi = std::numeric_limits<uint64_t>::max();
          if (!v.empty() && v[0] == '-')
            return fmt::format("{}: must be at least 0 (a seed is a whole number from 0 to {})", v, hi);
          uint64_t x = 0;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
          if (ec == std::errc::result_out_of_range) return fmt::format("{}: out of range: at most {}", v, hi);
          if (ec != std::errc() || end != v.data() + v.size())
            return fmt::format("{}: not a whole number (a seed is a whole number from 0 to {})", v, hi);
          return std::string();
        },
        "UINT64");
  }

  void add_to(CLI::App& app) {
    cmd = app.add_subcommand("generate", "write text with trained weights (one process, tp 1); prints the "
                                         "prompt and its continuation");
    cmd->add_option("-c,--config", config_path, "run configuration (JSON): model, data.tokenizer, sample")
        ->required();
    cmd->add_option("--set", overrides, "override a config key: section.key=value (repeatable)");
    cmd->add_option("--weights", weights, "a safetensors file of the global tensors (default: "
                                          "<logging.dir>/model.safetensors, written by training), a "
                                          "checkpoint (step_* or checkpoint.dir) or a Hugging Face model "
                                          "directory");
    prompt_opt = cmd->add_option("--prompt", prompt, "text to continue (default: sample.prompt)");
    prompt_ids_opt = cmd->add_option("--prompt-ids", prompt_ids, "token ids to continue, comma-separated, instead "
                                                                 "of text: no tokenizer needed; prints the prompt and "
                                                                 "generated ids as JSON")
        ->excludes(prompt_opt);
    cmd->add_option("--logits-out", logits_out, "with --prompt-ids: write the prompt's logits (fp32, prompt length "
                                                "x vocab_size) to this safetensors file");
    cmd->add_flag("--force", force, "replace an existing --logits-out file");
    max_tokens_opt = cmd->add_option("--max-tokens", max_tokens, "most tokens to generate (default: "
                                     "sample.max_tokens)")->check(whole_number())->check(at_least(1));
    temperature_opt = cmd->add_option("--temperature", temperature, "0 = greedy (default: "
                                      "sample.temperature)")->check(finite_number())->check(at_least(0));
    top_k_opt = cmd->add_option("--top-k", top_k, "sample among the k likeliest tokens, 0 = all (default: "
                                "sample.top_k)")->check(whole_number())->check(at_least(0));
    seed_opt = cmd->add_option("--seed", seed, "sampling seed (default: sample.seed)")->check(seed_number());
  }
  void apply(tetra::SampleConfig& s) const {
    if (prompt_opt->count()) s.prompt = prompt;
    if (max_tokens_opt->count()) s.max_tokens = max_tokens;
    if (temperature_opt->count()) s.temperature = temperature;
    if (top_k_opt->count()) s.top_k = top_k;
    if (seed_opt->count()) s.seed = seed;
  }
};

// That a file can be created in the directory of `path` (named as `what`): a directory that
// access(2) calls writable may still refuse new files (/proc, /sys). A file of a name of its own
// is created and removed at once. InputError naming `what` otherwise.
void check_can_create(const std::string& what, const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string probe =
      ((parent.empty() ? std::filesystem::path(".") : parent) / fmt::format(".tetra-probe.{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return;  // a file of that name: the directory takes files
    throw tetra::InputError(fmt::format("{} {}: cannot create a file in {}: {}; write elsewhere", what, path,
                                        parent.empty() ? "." : parent.string(), std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// "3,17, 5" -> the ids; --logits-out checked before any work (check_output_file: a new file, unless --force,
// in a writable directory that takes new files).
tetra::IdPrompt parse_prompt_ids(const std::string& text, const std::string& logits_out, bool force,
                                 const std::vector<std::string>& inputs) {
  if (text.find_first_not_of(" \t") == std::string::npos)
    throw tetra::InputError(fmt::format("--prompt-ids: \"{}\": no token ids (give whole numbers >= 0, "
                                        "comma-separated, e.g. 1,15043,29892)", text));
  tetra::IdPrompt p;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    std::string item = text.substr(at, comma - at);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || v < 0 ||
        v > std::numeric_limits<int32_t>::max())
      throw tetra::InputError(fmt::format("--prompt-ids: \"{}\" is not a token id (a whole number >= 0; the list is "
                                   "comma-separated, e.g. 1,15043,29892)", item));
    p.ids.push_back(static_cast<int32_t>(v));
    at = comma + 1;
  }
  if (!logits_out.empty()) {
    tetra::check_output_file("--logits-out", logits_out, force, inputs);
    check_can_create("--logits-out", logits_out);
  }
  p.logits_out = logits_out;
  return p;
}

// `tetra generate`: one process (no MPI: a launch of several is recognised by the launcher's
// variables, and refused once); exit 0, 1 (runtime failure) or 2 (bad input).
int run_generate(const GenerateArgs& args, const tetra::RuntimeOptions& runtime) {
  const tetra::LaunchEnvironment launch = tetra::launch_environment();
  if (launch.size > 1) {
    if (launch.rank == 0)
      std::fprintf(stderr, "error: tetra generate runs as one process (launched with %lld); run it without "
                   "mpirun/srun\n", static_cast<long long>(launch.size));
    return 2;
  }
  try {
    tetra::Config cfg = tetra::load_config(args.config_path, args.overrides);
    args.apply(cfg.sample);
    std::optional<tetra::IdPrompt> ids;
    if (args.prompt_ids_opt->count()) ids = parse_prompt_ids(
          args.prompt_ids, args.logits_out, args.force,
          {args.config_path, args.weights, args.weights + "/model.safetensors",
           cfg.logging.dir.empty() ? std::string() : cfg.logging.dir + "/model.safetensors"});
    else if (!args.logits_out.empty()) throw tetra::InputError("--logits-out needs --prompt-ids (the prompt's token ids)");
    // One process: the node's first GPU (local rank 0).
    const tetra::GeneratedText text = tetra::generate_command(
        cfg, args.weights, tetra::device_options(runtime, /*local_rank=*/0), ids ? &*ids : nullptr);
    if (ids)
      fmt::print("{{\"prompt_ids\": [{}], \"ids\": [{}]}}\n", fmt::join(ids->ids, ", "), fmt::join(text.ids, ", "));
    else
      fmt::print("{}{}\n", text.prompt, text.continuation);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return dynamic_cast<const tetra::InputError*>(&e) ? 2 : 1;
  }
}

class GenerateCommand final : public Command {
 public:
  explicit GenerateCommand(CLI::App& tetra) { args_.add_to(tetra); }
  CLI::App& app() override { return *args_.cmd; }
  int run(int* /*argc*/, char*** /*argv*/, const RuntimeOptions& runtime) override {
    return run_generate(args_, runtime);
  }

 private:
  GenerateArgs args_;
};

}  // namespace

std::unique_ptr<Command> add_generate_command(CLI::App& tetra) { return std::make_unique<GenerateCommand>(tetra); }

}  // namespace tetra::cli
