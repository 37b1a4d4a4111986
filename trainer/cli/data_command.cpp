// `tetra data`: prepares the token datasets tetra trains on.
//
//   tetra data tokenize --tokenizer gpt2:<dir>|sentencepiece:<model>|hf:<dir> --input <files/dirs...>
//                       [--jsonl [--json-key text]] --output <prefix> [--threads N] [--split 98,2] [--force]
//   tetra data train-tokenizer --input <files/dirs...> [--vocab-size 4096] --output <prefix> [--force]
//   tetra data from-llmc --input <shard.bin/dirs...> --output <prefix> [--eot ID] [--force]
//
// An existing output is refused unless --force (a dataset or tokenizer is never replaced by
// mistake).
//
// The work is done by the library (trainer/data/prepare*.h); this file parses the command line,
// draws progress on stderr (a bar on a terminal, a line every few seconds otherwise) and prints
// the summary on stdout.
//
// Exit codes: 0 success; 2 bad input (command line, input files, output path), the message naming
// the file and line (and column, for JSON); 1 any other failure. No exception reaches the user
// raw: run() maps each kind to one "error: ..." line.
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/core/format.h"
#include "trainer/core/output_path.h"
#include "trainer/data/prepare.h"
#include "trainer/data/prepare_input.h"
#include "trainer/data/prepare_llmc.h"
#include "trainer/data/tokenizer.h"

namespace tetra::cli {

namespace {

using tetra::grouped;

std::string human(double n) {  // 1234567 -> "1.23M"
  if (n >= 1e9) return fmt::format("{:.2f}G", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string clock_time(double seconds) {  // 3725 -> "1:02:05"
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

// Progress on stderr: on a terminal a bar redrawn in place; otherwise (a log file, a pipe) a
// plain line at most every kLineInterval seconds.
class ProgressDisplay {
 public:
  static constexpr double kBarInterval = 0.2, kLineInterval = 10.0;

  explicit ProgressDisplay(std::string what)
      : what_(std::move(what)), tty_(::isatty(::fileno(stderr)) == 1) {}
  double interval() const { return tty_ ? kBarInterval : kLineInterval; }

  void operator()(const tetra::PrepareProgress& p) {
    const double frac = p.bytes_total > 0
                            ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total)
                            : 1.0;
    const double secs = std::max(p.seconds, 1e-9);
    const double mbps = static_cast<double>(p.bytes_done) / 1e6 / secs;
    const double tps = static_cast<double>(p.tokens) / secs;
    const double bytes_per_s = static_cast<double>(p.bytes_done) / secs;
    const std::string eta =
        p.done ? "done in " + clock_time(p.seconds)
               : (bytes_per_s > 0
                      ? "ETA " + clock_time(static_cast<double>(p.bytes_total - p.bytes_done) /
                                            bytes_per_s)
                      : std::string("ETA ?"));
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(frac * kWidth);
      std::fprintf(stderr, "\r%s [%s%s] %5.1f%%  %.1f MB/s  %s tokens/s  %s   ", what_.c_str(),
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                   100.0 * frac, mbps, human(tps).c_str(), eta.c_str());
      if (p.done) std::fputc('\n', stderr);
      drawn_ = !p.done;
    } else if (!p.done) {
      std::fprintf(stderr, "%s: %.1f%% of %.1f MB, %.1f MB/s, %s tokens/s, %s\n", what_.c_str(),
                   100.0 * frac, static_cast<double>(p.bytes_total) / 1e6, mbps, human(tps).c_str(),
                   eta.c_str());
    }
    std::fflush(stderr);
  }

  // Ends the bar's line should the run stop before its last progress call (an error).
  ~ProgressDisplay() {
    if (drawn_) std::fputc('\n', stderr);
  }

 private:
  std::string what_;
  bool tty_;
  bool drawn_ = false;
};

void print_summary(const tetra::PrepareSummary& s) {
  for (const tetra::PreparedDataset& d : s.datasets)
    fmt::print("wrote {}.bin and {}.idx: {} documents, {} tokens\n", d.prefix, d.prefix,
               grouped(d.documents), grouped(d.tokens));
  const double secs = std::max(s.seconds, 1e-9);
  fmt::print("files:            {}\n", grouped(s.files));
  fmt::print("documents:        {}\n", grouped(s.documents));
  fmt::print("tokens:           {} ({}, one end-of-document token per document)\n",
             grouped(s.tokens), s.dtype);
  if (s.text_bytes > 0) {
    fmt::print("bytes:            {} of text ({:.2f} MB)\n", grouped(s.text_bytes),
               static_cast<double>(s.text_bytes) / 1e6);
    fmt::print("tokens per byte:  {:.4f} ({:.2f} bytes per token)\n", s.tokens_per_byte(),
               1.0 / std::max(s.tokens_per_byte(), 1e-12));
  } else {
    fmt::print("bytes:            {} read ({:.2f} MB)\n", grouped(s.input_bytes),
               static_cast<double>(s.input_bytes) / 1e6);
  }
  fmt::print("time:             {:.2f} s ({:.1f} MB/s, {} tokens/s)\n", s.seconds,
             static_cast<double>(s.input_bytes) / 1e6 / secs,
             human(static_cast<double>(s.tokens) / secs));
}

class DataCommand final : public Command {
 public:
  explicit DataCommand(CLI::App& tetra) {
    data_ = tetra.add_subcommand("data", "tokenize text into the Megatron indexed datasets (PREFIX.bin + "
                                         "PREFIX.idx) that tetra trains on");
    data_->require_subcommand(1);

    // ---- tokenize --------------------------------------------------------------------------------
    tokenize_ = data_->add_subcommand(
        "tokenize", "tokenize documents (a file each, or a JSON line each) into a dataset");
    tokenize_->add_option("--tokenizer", tokenizer_spec_, "gpt2:<dir>, sentencepiece:<model file> or hf:<dir with tokenizer.json>")
        ->required();
    tokenize_->add_option("--input", tok_.inputs, "text files, JSONL files or directories of them")
        ->required();
    CLI::Option* jsonl_flag =
        tokenize_->add_flag("--jsonl", jsonl_, "inputs hold one JSON object per line");
    tokenize_->add_option("--json-key", tok_.json_key, "JSONL: the field that holds the text")
        ->capture_default_str()
        ->needs(jsonl_flag);
    tokenize_->add_option("--output", tok_.output_prefix, "output prefix: writes PREFIX.bin, .idx")
        ->required();
    tokenize_->add_option("--threads", tok_.threads, "tokenizer threads (0: all hardware threads)")
        ->capture_default_str();
    tokenize_->add_flag("--force", tok_.force, "replace existing datasets of the output prefix");
    tokenize_->add_option("--split", split_spec_,
                         "weights train,valid[,test], e.g. 98,2: writes PREFIX_train, "
                         "PREFIX_valid[, PREFIX_test], dealing documents in a fixed pattern");

    // ---- train-tokenizer -------------------------------------------------------------------------
    train_ =
        data_->add_subcommand("train-tokenizer", "train a SentencePiece (BPE) tokenizer on text files");
    train_->add_option("--input", spm_inputs_, "UTF-8 text files or directories of them")->required();
    train_->add_option("--vocab-size", spm_.vocab_size, "vocabulary size")->capture_default_str();
    train_->add_option("--output", spm_output_, "model prefix: writes PREFIX.model and PREFIX.vocab")
        ->required();
    train_->add_option("--threads", spm_.threads, "trainer threads (0: all hardware threads)")
        ->capture_default_str();
    train_->add_flag("--force", spm_force_, "replace an existing PREFIX.model and PREFIX.vocab");
    train_
        ->add_option("--character-coverage", spm_.character_coverage,
                     "share of characters the vocabulary covers")
        ->capture_default_str();
    train_
        ->add_option("--max-sentences", spm_.max_sentences,
                     "train on at most this many lines (0: all)")
        ->capture_default_str();

    // ---- from-llmc -------------------------------------------------------------------------------
    from_llmc_ = data_->add_subcommand(
        "from-llmc", "convert llm.c token shards (.bin with a 256-int32 header) into a dataset");
    from_llmc_->add_option("--input", llmc_.inputs, "shard files, or directories of *.bin shards")
        ->required();
    from_llmc_->add_option("--output", llmc_.output_prefix, "output prefix: writes PREFIX.bin, .idx")
        ->required();
    from_llmc_->add_flag("--force", llmc_.force, "replace an existing dataset of the output prefix");
    from_llmc_
        ->add_option("--eot", llmc_.eot,
                     "the token that starts every document (default: 50256 for gpt-2 shards, "
                     "128000 for llama-3 shards)")
        ->check(CLI::Validator(
            [](std::string& v) {  // -1 would silently mean the default (LlmcOptions::eot)
              int64_t id = 0;
              const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), id);
              if (ec == std::errc() && end == v.data() + v.size() && id < 0)
                return fmt::format("{}: a token id is at least 0 (leave --eot out for the shards' own: "
                                   "50256 in gpt-2 shards, 128000 in llama-3 ones)", v);
              return std::string();
            },
            "ID >= 0"));
  }

  CLI::App& app() override { return *data_; }

  int run(int* /*argc*/, char*** /*argv*/, const RuntimeOptions& /*runtime*/) override {
    try {
      if (*tokenize_) {
        if (!split_spec_.empty()) tok_.split = tetra::parse_split(split_spec_);
        tok_.format = jsonl_ ? tetra::DocumentFormat::JSONL : tetra::DocumentFormat::TEXT;
        const std::unique_ptr<tetra::Tokenizer> tokenizer = tetra::load_tokenizer(tokenizer_spec_);
        ProgressDisplay display("tokenize");
        tok_.progress = [&](const tetra::PrepareProgress& p) { display(p); };
        tok_.progress_interval_s = display.interval();
        print_summary(tetra::tokenize_to_dataset(*tokenizer, tok_));
      } else if (*train_) {
        for (std::string_view ext : {".model", ".vocab"}) {
          TETRA_INPUT_CHECK(!spm_output_.ends_with(ext),
                            "--output {} ends in {}: it is a prefix (PREFIX.model and PREFIX.vocab "
                            "are written); did you mean {}?",
                            spm_output_, ext, spm_output_.substr(0, spm_output_.size() - ext.size()));
        }
        tetra::check_output_prefix(spm_output_, "--output");
        const std::vector<tetra::InputFile> files = tetra::list_input_files(spm_inputs_);
        const std::vector<std::string> paths = tetra::input_paths(files);
        for (const char* ext : {".model", ".vocab"}) tetra::check_output_file("--output", spm_output_ + ext, spm_force_, paths);
        tetra::check_text_files(files);
        tetra::train_sentencepiece(paths, spm_output_, spm_);
        const std::string model = spm_output_ + ".model";
        const std::unique_ptr<tetra::Tokenizer> t = tetra::load_tokenizer("sentencepiece:" + model);
        fmt::print("wrote {} and {}.vocab: {}, vocabulary {}, end-of-document id {}\n", model,
                   spm_output_, t->name(), grouped(t->vocab_size()), t->eod_id());
      } else if (*from_llmc_) {
        ProgressDisplay display("from-llmc");
        llmc_.progress = [&](const tetra::PrepareProgress& p) { display(p); };
        llmc_.progress_interval_s = display.interval();
        print_summary(tetra::convert_llmc_shards(llmc_));
      }
      return 0;
    } catch (const tetra::InputError& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 2;
    } catch (const nlohmann::json::exception& e) {
      // The library maps JSON errors to InputErrors naming file and line; one that slips through
      // still comes from an input file (a JSONL corpus, encoder.json).
      std::fprintf(stderr, "error: an input file is not the JSON expected: %s\n", e.what());
      return 2;
    } catch (const std::filesystem::filesystem_error& e) {
      // A path given on the command line that cannot be read (permissions, a vanished directory).
      const std::string p1 = e.path1().string(), p2 = e.path2().string();
      std::fprintf(stderr, "error: %s%s%s: %s; check the path and its permissions\n", p1.c_str(),
                   p2.empty() ? "" : " and ", p2.c_str(), e.code().message().c_str());
      return 2;
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "error: out of memory; use fewer --threads or a machine with more memory\n");
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    } catch (...) {
      std::fprintf(stderr, "error: an unknown exception\n");
      return 1;
    }
  }

 private:
  CLI::App *data_ = nullptr, *tokenize_ = nullptr, *train_ = nullptr, *from_llmc_ = nullptr;
  // tokenize
  tetra::TokenizeOptions tok_;
  std::string tokenizer_spec_, split_spec_;
  bool jsonl_ = false;
  // train-tokenizer
  std::vector<std::string> spm_inputs_;
  std::string spm_output_;
  bool spm_force_ = false;
  tetra::SentencePieceTrainOptions spm_;
  // from-llmc
  tetra::LlmcOptions llmc_;
};

}  // namespace

std::unique_ptr<Command> add_data_command(CLI::App& tetra) { return std::make_unique<DataCommand>(tetra); }

}  // namespace tetra::cli
