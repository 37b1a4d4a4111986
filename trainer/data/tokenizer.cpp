// load_tokenizer: the spec strings of configs and the command line ("gpt2:<dir>",
// "sentencepiece:<model file>") to a tokenizer. The tokenizers themselves live in
// tokenizer_gpt2.cpp and tokenizer_sentencepiece.cpp.
#include "kernels/common/check.h"
#include "trainer/data/tokenizer.h"

namespace tetra {

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  const size_t colon = spec.find(':');
  const std::string kind = spec.substr(0, colon);
  const std::string path = colon == std::string::npos ? "" : spec.substr(colon + 1);
  TETRA_INPUT_CHECK((kind == "gpt2" || kind == "sentencepiece") && !path.empty(),
                    "tokenizer \"{}\": expected \"gpt2:<directory with encoder.json and "
                    "vocab.bpe>\" (scripts/data.sh fetches them) or \"sentencepiece:<model file>\"",
                    spec);
  if (kind == "gpt2") return load_gpt2_tokenizer(path);
  return load_sentencepiece_tokenizer(path);
}

}  // namespace tetra
