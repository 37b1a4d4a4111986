// Dataset preparation: raw text (one document per file) or JSON lines (one document per line)
// tokenized into a Megatron indexed dataset (indexed_dataset.h), the library behind
// `tetra data tokenize` (trainer/cli/data_command.cpp).
//
// Each document becomes one sequence: its tokens, then the tokenizer's end-of-document token, so a
// sample that crosses documents sees where one ends. Tokens are stored as uint16 when the
// vocabulary fits (token_dtype_for_vocab), else int32.
//
// Tokenization runs on a pool of threads, a batch of documents at a time; results are written in
// input order, so the files are byte-identical whatever the thread count. With a split (--split
// 98,2) documents are dealt to PREFIX_train / PREFIX_valid [/ PREFIX_test] by DocumentSplitter,
// again the same for every thread count.
//
// Failure leaves nothing that looks like a dataset: IndexedDatasetWriter writes temporary files
// and renames them only at finish(), which runs after the last document was checked; an error in
// any document (reported as InputError with file and line) removes the temporary files.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/data/prepare_input.h"

namespace tetra {

class Tokenizer;

// Where a preparation stands; passed to the progress callback from the calling thread.
struct PrepareProgress {
  int64_t bytes_done = 0;   // input bytes read and processed
  int64_t bytes_total = 0;  // input bytes in all
  int64_t documents = 0;
  int64_t tokens = 0;
  double seconds = 0;  // since the start
  bool done = false;   // the last call, after every dataset was written
};
using ProgressCallback = std::function<void(const PrepareProgress&)>;

// One dataset written: PREFIX.bin + PREFIX.idx.
struct PreparedDataset {
  std::string prefix;
  int64_t documents = 0;
  int64_t tokens = 0;
};

struct PrepareSummary {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t tokens = 0;       // written, the end-of-document tokens included
  int64_t text_bytes = 0;   // UTF-8 bytes of the documents' text (0 where there is no text)
  int64_t input_bytes = 0;  // bytes of the input files
  double seconds = 0;
  std::string dtype;  // element type of the .bin files: "uint16" or "int32"
  std::vector<PreparedDataset> datasets;

  // Tokens of text per byte of text (end-of-document tokens not counted); 0 without text.
  double tokens_per_byte() const;
};

// Deals documents to the parts of a split by smooth weighted round robin: each document goes to
// the part whose running credit (its weight added every document, the total weight W taken away
// when it is chosen) is largest, the first such part on ties. Every block of W documents from the
// start gives part k exactly weights[k] documents, spread evenly: weights 3,1 deal
// train, train, valid, train and repeat.
class DocumentSplitter {
 public:
  explicit DocumentSplitter(std::vector<int64_t> weights);
  size_t next();

 private:
  std::vector<int64_t> weights_;
  std::vector<int64_t> credit_;
  int64_t total_ = 0;
};

// "98,2" -> {98, 2}: two or three positive whole numbers (train, valid[, test]). InputError else.
std::vector<int64_t> parse_split(std::string_view spec);
// The prefixes a split writes: PREFIX_train, PREFIX_valid[, PREFIX_test].
std::vector<std::string> split_prefixes(const std::string& prefix, size_t parts);

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files and directories (list_input_files)
  DocumentFormat format = DocumentFormat::TEXT;
  std::string json_key = "text";  // JSONL: the field that holds the text
  std::string output_prefix;
  int threads = 0;                   // 0: one per hardware thread
  std::vector<int64_t> split;        // empty: one dataset at output_prefix; else parse_split's
  bool force = false;                // replace existing datasets (else they are refused)
  ProgressCallback progress;         // may be empty
  double progress_interval_s = 0.5;  // least time between two progress calls (the last is extra)
};

// Tokenizes every document of the inputs and writes the dataset(s). InputError for bad input or
// an unwritable output, before any dataset is renamed into place.
PrepareSummary tokenize_to_dataset(const Tokenizer& tokenizer, const TokenizeOptions& options);

}  // namespace tetra
