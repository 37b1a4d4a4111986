// tetra: one binary, six commands (trainer/cli/cli.h):
//
//   tetra train --config run.json [options]   (`tetra --config run.json [options]` is the same)
//   tetra generate --config run.json [options]
//   tetra data tokenize | train-tokenizer | from-llmc ...
//   tetra ckpt inspect | export-hf ...
//   tetra plan --config run.json --cluster NAME|FILE
//   tetra plot RUN_DIR... [--out FILE.svg|.png]
//   tetra trace merge RUN_DIR [--out FILE.json] [--svg FILE.svg]
//
// This file only parses the command line and dispatches: a line that starts with an option (or is
// empty) is `train`'s, a word names the command, an unknown word is exit 2 naming it and the
// commands there are. Help and parse errors are printed once per job (by the launcher's rank 0)
// and exit 0 and 2. The environment is read here, once (trainer/core/runtime_options.h: a value a
// TETRA_* variable cannot take is exit 2 naming it), and handed to the command. Nothing here
// starts MPI: `train` does, when it runs.
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "trainer/cli/cli.h"
#include "trainer/comm/launcher.h"
#include "trainer/core/runtime_options.h"

namespace {

// "a, b and c" (`last` "and"), "a, b or c"
std::string listed(const std::vector<std::string>& names, const char* last) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i)
    s += (i == 0 ? "" : i + 1 == names.size() ? fmt::format(" {} ", last) : ", ") + names[i];
  return s;
}

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  return names;
}

// The command words of `args` (after the program name), checked before CLI11 parses them: each
// word where a command is expected must name one ("" when all do), and a command made of
// subcommands (`tetra data`) needs one of them.
std::string check_command_words(const CLI::App& tetra, const std::vector<std::string>& args) {
  const CLI::App* at = &tetra;
  std::string path = "tetra";
  for (size_t i = 0;; ++i) {
    const std::vector<std::string> names = subcommand_names(*at);
    if (names.empty()) return "";
    if (i == args.size())
      return fmt::format("{} needs a subcommand: {} ({} --help says more)", path, listed(names, "or"), path);
    const std::string& word = args[i];
    if (word.starts_with("-")) return "";
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == word) next = sub;
    if (next == nullptr)
      return fmt::format("unknown command \"{}\" of {}: the commands are {} ({} --help says more)", word, path,
                         listed(names, "and"), path);
    at = next;
    path += " " + word;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tetra: trains decoder-only Transformers from a JSON config, prepares their datasets and reads "
               "their checkpoints"};
  app.require_subcommand(1);
  std::vector<std::unique_ptr<tetra::cli::Command>> commands;
  commands.push_back(tetra::cli::add_train_command(app));
  commands.push_back(tetra::cli::add_generate_command(app));
  commands.push_back(tetra::cli::add_data_command(app));
  commands.push_back(tetra::cli::add_ckpt_command(app));
  commands.push_back(tetra::cli::add_plan_command(app));
  commands.push_back(tetra::cli::add_plot_command(app));
  commands.push_back(tetra::cli::add_trace_command(app));
  CLI::App& train = commands.front()->app();
  app.footer([&app, &train] {
    return "Without a command, tetra trains: `tetra --config run.json` is `tetra train --config run.json`.\n\n" +
           train.help(app.get_name());
  });

  // The line as CLI11 parses it: `train` named when the line starts with an option of its own.
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || (args[0].starts_with("-") && args[0] != "-h" && args[0] != "--help"))
    args.insert(args.begin(), "train");
  std::vector<char*> line{argv[0]};
  for (std::string& a : args) line.push_back(a.data());

  // Under a launcher every process parses the same line: one of them speaks.
  const bool speaks = tetra::launch_environment().rank == 0;
  try {
    if (const std::string error = check_command_words(app, args); !error.empty()) {
      if (speaks) std::fprintf(stderr, "error: %s\n", error.c_str());
      return 2;
    }
    app.parse(static_cast<int>(line.size()), line.data());
  } catch (const CLI::ParseError& e) {
    const int code = speaks ? app.exit(e) : e.get_exit_code();
    return code == 0 ? 0 : 2;
  }
  tetra::RuntimeOptions runtime;
  try {
    runtime = tetra::read_runtime_options();
  } catch (const std::exception& e) {
    if (speaks) std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  for (const std::unique_ptr<tetra::cli::Command>& command : commands)
    if (command->app().parsed()) return command->run(&argc, &argv, runtime);
  return 2;  // unreachable: CLI11 requires one command
}
