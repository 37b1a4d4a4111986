// The commands of the one `tetra` binary:
//
//   tetra train --config run.json [options]     train (`tetra --config run.json ...` is the same)
//   tetra generate --config run.json [options]  text from trained weights (one process)
//   tetra data tokenize | train-tokenizer | from-llmc ...   prepare token datasets
//   tetra ckpt inspect | export-hf ...                      read and export checkpoints
//   tetra plan --config run.json --cluster NAME|FILE        rank layouts by predicted speed and memory
//   tetra plot RUN_DIR... [--out FILE.svg|.png]              draw runs' curves from metrics.jsonl
//   tetra trace merge RUN_DIR [--out F.json] [--svg F.svg]    join the ranks' timelines into one
//
// trainer/main.cpp builds one CLI11 app, lets each command add its subcommand and options to it,
// parses the line and runs the command that was named. Only `train` starts MPI: help, the data
// and checkpoint tools and generation run without it (commands of a multi-process launch print
// their help and errors once, from the launcher's rank 0: trainer/comm/launcher.h).
//
// Exit codes, every command: 0 success; 1 a runtime failure; 2 bad input (the command line, a
// config, an input file), the message naming the option or file. `train` adds 3: the watchdog
// ended a hung job (trainer/comm/watchdog.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "trainer/core/runtime_options.h"

namespace tetra::cli {

class Command {
 public:
  virtual ~Command() = default;
  // The command's subcommand of the app.
  virtual CLI::App& app() = 0;
  // Runs the command once its line parsed: the exit code. `argc` and `argv` are main's (MPI_Init
  // is given them); `runtime` is the environment's part (read once, by main).
  virtual int run(int* argc, char*** argv, const RuntimeOptions& runtime) = 0;
};

// Each adds its subcommand ("train", "generate", "data", "ckpt", "plan", "plot", "trace") to `tetra`.
std::unique_ptr<Command> add_train_command(CLI::App& tetra);
std::unique_ptr<Command> add_generate_command(CLI::App& tetra);
std::unique_ptr<Command> add_data_command(CLI::App& tetra);
std::unique_ptr<Command> add_ckpt_command(CLI::App& tetra);
std::unique_ptr<Command> add_plan_command(CLI::App& tetra);
std::unique_ptr<Command> add_plot_command(CLI::App& tetra);
std::unique_ptr<Command> add_trace_command(CLI::App& tetra);

// Runs a command's body: its exit code; "error: ..." on stderr and exit 2 for bad input
// (InputError), 1 for any other failure.
int exit_code_of(const std::function<int()>& body);

// A check for a whole-number option: "--nodes: 0: must be a whole number from 1 to 1048576".
CLI::Validator whole_number_in(int64_t lo, int64_t hi);

// `s` with &, <, > and " as XML entities (the SVG pictures of plot and trace).
std::string xml_escape(const std::string& s);

}  // namespace tetra::cli
