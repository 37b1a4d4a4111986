// SentencePiece tokenizers: a wrapper of SentencePieceProcessor behind the Tokenizer interface, and
// training of a BPE model from text files.
//
// Training feeds the trainer through a SentenceIterator rather than its file reader, for one
// reason: SentencePiece silently skips every input line longer than max_sentence_length (4192
// bytes). Real corpora have paragraphs far longer than that (a State of the Union address has lines
// of 200 kB), and a character or word that appears only in long lines would never reach the
// vocabulary. The iterator reads the files line by line and cuts long lines with split_long_line
// at sentence ends or spaces into pieces of at most kSentencePieceMaxChunk bytes, never inside a
// UTF-8 character. It also checks each line is UTF-8 and reports file:line when not.
//
// The trained model is set up to reproduce its input exactly (decode(encode(x)) == x): identity
// normalisation, no dummy prefix, whitespace kept, byte fallback. tokenizer.h lists the choices.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <unordered_map>

#include "kernels/common/check.h"
#include "trainer/data/prepare_input.h"
#include "trainer/core/files.h"
#include "trainer/data/tokenizer.h"

namespace tetra {
namespace {

constexpr int kMaxSentenceLength = 4192;  // SentencePiece's default, set explicitly
static_assert(kSentencePieceMaxChunk <= static_cast<size_t>(kMaxSentenceLength));
constexpr unsigned kTrainingSeed = 20240601;  // sampling of max_sentences is reproducible

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& model_file) : model_file_(model_file) {
    check_not_special_file(model_file, "SentencePiece model", "give the .model file itself");
    std::error_code ec;
    TETRA_INPUT_CHECK(std::filesystem::is_regular_file(model_file, ec),
                      "{}: no such SentencePiece model file; train one (train_sentencepiece "
                      "writes <prefix>.model) or fix the path", model_file);
    const auto status = processor_.Load(model_file);
    if (!status.ok()) {
      // A file that is no serialized model fails in the protobuf parse: said so, without the
      // library's source location.
      const std::string why = status.ToString();
      throw InputError(why.find("ParseFromArray") != std::string::npos
                           ? fmt::format("{}: not a SentencePiece model (its bytes do not parse as one); give the "
                                         ".model file SentencePiece wrote", model_file)
                           : fmt::format("{}: cannot load the SentencePiece model ({}); is it a .model file "
                                         "written by SentencePiece?", model_file, why));
    }
    eod_id_ = processor_.eos_id();
    TETRA_INPUT_CHECK(eod_id_ >= 0 && eod_id_ < processor_.GetPieceSize(),
                      "{}: the model has no eos piece (eos_id {}), which Tetra uses as the "
                      "end-of-document token; retrain it with eos enabled (train_sentencepiece "
                      "does)", model_file, eod_id_);
  }

  std::string name() const override { return "sentencepiece:" + model_file_; }
  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  int32_t eod_id() const override { return eod_id_; }

  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    TETRA_INPUT_CHECK(status.ok(), "{}: encoding {} bytes of text failed: {}", model_file_,
                      text.size(), status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }

  std::string decode(std::span<const int32_t> ids) const override {
    const int32_t v = processor_.GetPieceSize();
    for (size_t i = 0; i < ids.size(); ++i) {
      TETRA_INPUT_CHECK(ids[i] >= 0 && ids[i] < v,
                        "token id {} (at position {}) is outside the vocabulary [0, {}) of {}",
                        ids[i], i, v, model_file_);
    }
    std::string text;
    const auto status = processor_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    TETRA_INPUT_CHECK(status.ok(), "{}: decoding {} ids failed: {}", model_file_, ids.size(),
                      status.ToString());
    return text;
  }

 private:
  sentencepiece::SentencePieceProcessor processor_;
  std::string model_file_;
  int32_t eod_id_ = -1;
};

// The lines of `files`, long ones cut by split_long_line. Stops at the first unreadable file or
// line that is not UTF-8, with error() saying where.
class ChunkedLineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit ChunkedLineIterator(const std::vector<std::string>& files) : files_(files) { advance(); }

  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override {
    if (error_.empty()) return sentencepiece::util::Status();
    return sentencepiece::util::Status(sentencepiece::util::StatusCode::kInvalidArgument, error_);
  }
  const std::string& error() const { return error_; }

 private:
  void fail(std::string message) {
    error_ = std::move(message);
    done_ = true;
    value_.clear();
  }

  void advance() {
    for (;;) {
      if (chunk_ < chunks_.size()) {
        value_.assign(chunks_[chunk_++]);
        return;
      }
      if (!in_.is_open()) {
        if (file_ == files_.size()) {
          done_ = true;
          value_.clear();
          return;
        }
        in_.open(files_[file_], std::ios::binary);
        line_no_ = 0;
        if (!in_) {
          return fail(fmt::format("{}: cannot open for reading ({}); check the path",
                                  files_[file_], std::strerror(errno)));
        }
      }
      if (!std::getline(in_, line_)) {
        if (in_.bad()) return fail(fmt::format("{}: read error", files_[file_]));
        in_.close();
        in_.clear();
        ++file_;
        continue;
      }
      ++line_no_;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (line_.empty()) continue;
      const int64_t bad = find_invalid_utf8(line_);
      if (bad >= 0) {
        return fail(fmt::format("{}:{}: invalid UTF-8 at byte {} of the line; the trainer reads "
                                "UTF-8 text: convert the file (e.g. iconv -t UTF-8) or drop it",
                                files_[file_], line_no_, bad));
      }
      chunks_ = split_long_line(line_, kSentencePieceMaxChunk);
      chunk_ = 0;
    }
  }

  std::vector<std::string> files_;
  size_t file_ = 0;
  std::ifstream in_;
  int64_t line_no_ = 0;
  std::string line_;
  std::vector<std::string_view> chunks_;  // views into line_
  size_t chunk_ = 0;
  std::string value_;
  bool done_ = false;
  std::string error_;
};

bool is_utf8_continuation(char c) { return (static_cast<uint8_t>(c) & 0xC0) == 0x80; }

// True when line[0, c) ends a sentence: '.', '!' or '?', possibly followed by closing quotes or
// brackets (" ' ) ] and the curly ” ’).
bool ends_sentence(std::string_view head) {
  for (;;) {
    if (head.empty()) return false;
    const char last = head.back();
    if (last == '.' || last == '!' || last == '?') return true;
    if (last == '"' || last == '\'' || last == ')' || last == ']') {
      head.remove_suffix(1);
    } else if (head.ends_with("\u201D") || head.ends_with("\u2019")) {
      head.remove_suffix(3);
    } else {
      return false;
    }
  }
}

}  // namespace

std::vector<std::string_view> split_long_line(std::string_view line, size_t max_bytes) {
  TETRA_CHECK(max_bytes >= 4, "max_bytes {} cannot hold every UTF-8 character (4 bytes)",
              max_bytes);
  std::vector<std::string_view> pieces;
  while (line.size() > max_bytes) {
    size_t cut = 0;
    // A cut at c keeps line[0, c) and starts the rest at line[c]; cutting before a space keeps
    // the space with the word that follows it, as SentencePiece's pieces ("▁word") do.
    for (size_t c = max_bytes; c > 0 && cut == 0; --c) {
      if (line[c] == ' ' && ends_sentence(line.substr(0, c))) cut = c;
    }
    for (size_t c = max_bytes; c > 0 && cut == 0; --c) {
      if (line[c] == ' ') cut = c;
    }
    for (size_t c = max_bytes; c > 0 && cut == 0; --c) {
      if (!is_utf8_continuation(line[c])) cut = c;
    }
    if (cut == 0) cut = max_bytes;  // not UTF-8 at all: any cut is as good
    pieces.push_back(line.substr(0, cut));
    line.remove_prefix(cut);
  }
  if (!line.empty()) pieces.push_back(line);
  return pieces;
}

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(model_file);
}

void train_sentencepiece(const std::vector<std::string>& files, const std::string& model_prefix,
                         const SentencePieceTrainOptions& opt) {
  TETRA_INPUT_CHECK(!files.empty(), "SentencePiece training needs at least one text file");
  for (const std::string& f : files) {
    std::error_code ec;
    TETRA_INPUT_CHECK(std::filesystem::is_regular_file(f, ec),
                      "{}: no such file (a SentencePiece training input); check the path", f);
  }
  TETRA_INPUT_CHECK(!model_prefix.empty(), "SentencePiece training needs a model prefix");
  const std::filesystem::path parent = std::filesystem::path(model_prefix).parent_path();
  std::error_code ec;
  TETRA_INPUT_CHECK(parent.empty() || std::filesystem::is_directory(parent, ec),
                    "{}: the directory {} does not exist; create it first (the model is written "
                    "to {}.model and {}.vocab)", model_prefix, parent.string(), model_prefix,
                    model_prefix);
  // 256 byte pieces + <unk>, <s>, </s>, and at least one piece learned.
  TETRA_INPUT_CHECK(opt.vocab_size >= 260 && opt.vocab_size <= INT32_MAX,
                    "SentencePiece vocab_size {} is out of range: byte fallback alone takes 259 "
                    "pieces (256 bytes, <unk>, <s>, </s>); use at least 260", opt.vocab_size);
  TETRA_INPUT_CHECK(opt.character_coverage >= 0.98 && opt.character_coverage <= 1.0,
                    "SentencePiece character_coverage {} must be in [0.98, 1]",
                    opt.character_coverage);
  TETRA_INPUT_CHECK(opt.max_sentences >= 0, "SentencePiece max_sentences {} must be >= 0 (0: all)",
                    opt.max_sentences);
  TETRA_INPUT_CHECK(opt.threads >= 0 && opt.threads <= 128,
                    "--threads {}: give 0 (all cores, at most 128) or 1 to 128 (SentencePiece's trainer threads)",
                    opt.threads);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = std::clamp<int>(opt.threads > 0 ? opt.threads : cores, 1, 128);

  const std::unordered_map<std::string, std::string> args = {
      {"model_prefix", model_prefix},
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(opt.vocab_size)},
      {"character_coverage", fmt::format("{}", opt.character_coverage)},
      {"input_sentence_size", std::to_string(opt.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(threads)},
      {"max_sentence_length", std::to_string(kMaxSentenceLength)},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", "1"},  // SentencePiece's progress lines off; warnings and errors stay
  };
  sentencepiece::SetRandomGeneratorSeed(kTrainingSeed);
  ChunkedLineIterator lines(files);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines);
  if (!lines.error().empty()) throw InputError(lines.error());
  TETRA_INPUT_CHECK(status.ok(), "training a SentencePiece model ({}.model) from {} file(s) "
                    "failed: {}; change vocab_size (or character_coverage) as the message says, "
                    "or give more text", model_prefix, files.size(), status.ToString());
}

}  // namespace tetra
