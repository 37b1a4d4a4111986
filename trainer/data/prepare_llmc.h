// llm.c's token shards (karpathy/llm.c, dev/data/data_common.py: write_datafile) converted to a
// Megatron indexed dataset: `tetra data from-llmc`.
//
// A shard, all little-endian:
//   int32 header[256]   header[0] magic, header[1] version, header[2] token count N, rest 0
//   tokens[N]           uint16 for magic 20240520 / version 1 ("gpt-2"),
//                       uint32 for magic 20240801 / version 7 ("llama-3")
// The file is exactly 1024 + N * token size bytes (llm.c's loader insists on it, and so do we).
//
// llm.c has no document index: its scripts put a delimiter token *before* every document
// (GPT-2's <|endoftext|> 50256; Llama 3's <|begin_of_text|> 128000) and cut shards at a token
// count, so a document may continue in the next shard. We read the shards, in the order given,
// as one stream and cut it at every delimiter: each document is the tokens between two delimiters
// followed by the delimiter, the end-of-document convention of prepare.h. The stream's leading
// delimiter thus moves to the end of the first document; a trailing document without one gets
// one; the tokens in between are unchanged. Output: uint16 for gpt-2 shards, int32 for llama-3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/data/prepare.h"

namespace tetra {

constexpr int32_t kLlmcHeaderInts = 256;
constexpr int32_t kLlmcMagicGpt2 = 20240520;
constexpr int32_t kLlmcVersionGpt2 = 1;
constexpr int32_t kLlmcMagicLlama3 = 20240801;
constexpr int32_t kLlmcVersionLlama3 = 7;
constexpr int64_t kLlmcEotGpt2 = 50256;     // <|endoftext|>
constexpr int64_t kLlmcEotLlama3 = 128000;  // <|begin_of_text|>

struct LlmcShard {
  std::string path;
  int32_t magic = 0;
  int32_t version = 0;
  int64_t num_tokens = 0;
  int64_t token_bytes = 0;  // 2 (gpt-2) or 4 (llama-3)
  int64_t file_bytes = 0;
};

// Reads and validates a shard's header against its size. InputError naming the file and the
// header field's byte offset for anything llm.c's own loader would refuse.
LlmcShard read_llmc_header(const std::string& path);

struct LlmcOptions {
  std::vector<std::string> inputs;  // shard files, or directories (their *.bin files)
  std::string output_prefix;
  int64_t eot = -1;  // the delimiter; -1: 50256 (gpt-2) or 128000 (llama-3)
  bool force = false;  // replace an existing dataset (else it is refused)
  ProgressCallback progress;
  double progress_interval_s = 0.5;
};

// Converts the shards into one dataset at output_prefix. Every header is checked before a token
// is read; nothing is renamed into place unless every shard was read to its end.
PrepareSummary convert_llmc_shards(const LlmcOptions& options);

}  // namespace tetra
