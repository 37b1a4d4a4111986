// load_tokenizer: data.tokenizer, or the command line's spec string ("gpt2:<dir>",
// "sentencepiece:<model file>", "hf:<dir>"), to a tokenizer. The tokenizers themselves live in
// tokenizer_gpt2.cpp, tokenizer_sentencepiece.cpp and tokenizer_hf.cpp.
#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/data/tokenizer.h"

namespace tetra {

namespace {

[[noreturn]] void bad_spec(const std::string& spec) {
  throw InputError(fmt::format("tokenizer \"{}\": expected \"gpt2:<directory with encoder.json and "
                               "vocab.bpe>\" (scripts/data.sh fetches them), \"sentencepiece:<model file>\" "
                               "or \"hf:<directory with tokenizer.json>\"",
                               spec));
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const TokenizerSpec& spec) {
  if (spec.path.empty()) bad_spec(to_string(spec));
  switch (spec.kind) {
    case TokenizerKind::GPT2: return load_gpt2_tokenizer(spec.path);
    case TokenizerKind::SENTENCEPIECE: return load_sentencepiece_tokenizer(spec.path);
    case TokenizerKind::HF: return load_hf_tokenizer(spec.path);
    case TokenizerKind::NONE: break;
  }
  bad_spec(to_string(spec));
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  const std::optional<TokenizerSpec> parsed = parse_tokenizer_spec(spec);
  if (!parsed || parsed->path.empty()) bad_spec(spec);
  return load_tokenizer(*parsed);
}

}  // namespace tetra
