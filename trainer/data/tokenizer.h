// Tokenizers: text <-> token ids, for dataset preparation and for looking at what a model writes.
//
// Three kinds, behind one interface:
//   gpt2            OpenAI's GPT-2 byte-level BPE (tokenizer_gpt2.cpp), from its original
//                   encoder.json + vocab.bpe; ids are bit-identical to OpenAI's encoder.py.
//   sentencepiece   a SentencePiece model (tokenizer_sentencepiece.cpp), e.g. one trained here by
//                   train_sentencepiece: BPE with byte fallback, so any UTF-8 text encodes and
//                   decodes back to itself.
//   hf              a Hugging Face tokenizer.json (tokenizer_hf.cpp, read by tokenizer_hf_read.cpp):
//                   the BPE tokenizers of Llama-3, Qwen2/2.5/3, GPT-2 (byte-level) and Llama-2,
//                   Mistral (SentencePiece-style, byte fallback), with their added tokens; ids as
//                   the Hugging Face library gives them.
//
// Configs and the command line name a tokenizer by a spec string: "gpt2:<dir>" (dir holds
// encoder.json and vocab.bpe; scripts/data.sh fetches them to ~/.cache/tetra/gpt2),
// "sentencepiece:<model file>" or "hf:<dir>" (dir holds tokenizer.json and, where tokenizer.json
// alone does not name the end-of-document token, tokenizer_config.json; scripts/data.sh fetches
// Llama-3's, Qwen3's, Llama-2's and GPT-2's to ~/.cache/tetra/hf/<name>).
//
// Every problem with the files or the text is a tetra::InputError that names the file (and line)
// and says what would fix it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // "gpt2", "sentencepiece:<model file>" or "hf:<dir>"
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eod_id() const = 0;  // end-of-document token (gpt2: 50256 <|endoftext|>)
  // Appends the ids of `text` (UTF-8) to `out`. Thread-safe (const, no shared mutable state
  // without locking), so several threads may encode with one tokenizer.
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
};

// dir/encoder.json + dir/vocab.bpe. encode() throws InputError for text that is not valid UTF-8
// (the message gives the byte offset); decode() returns the tokens' raw bytes, which for a partial
// id sequence may end inside a UTF-8 character.
std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& dir);

// A SentencePiece .model file. It must have an eos piece: that is the end-of-document id.
// decode() follows SentencePiece: control pieces (eos, bos) decode to nothing, and byte pieces
// that do not form valid UTF-8 decode to U+FFFD.
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& model_file);

// A Hugging Face tokenizer: dir/tokenizer.json, and dir/tokenizer_config.json where there is one.
// encode() gives what the Hugging Face library's encode (add_special_tokens=True) gives: the
// post-processor's tokens (Llama's BOS) around the text, added tokens matched in the text. The
// end-of-document id is tokenizer_config.json's eos_token (or tokenizer.json's only special
// token). decode() follows the file's decoder; special tokens decode to their text. Anything in
// the files Tetra does not represent (another model type, an unknown normalizer, pre-tokenizer,
// post-processor or decoder, an unsupported flag) is an InputError naming the file and the field;
// docs/data.md lists what is supported.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& dir);

// data.tokenizer's tokenizer; or one given as "gpt2:<dir>", "sentencepiece:<model file>" or
// "hf:<dir>" (the command line's spelling). InputError naming the spec for any other.
std::unique_ptr<Tokenizer> load_tokenizer(const TokenizerSpec& spec);
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

struct SentencePieceTrainOptions {
  int64_t vocab_size = 4096;
  int threads = 0;                     // 0: one per hardware thread
  double character_coverage = 0.9999;  // SentencePiece accepts [0.98, 1]
  int64_t max_sentences = 0;           // 0 = all; else a random sample of this many lines
};

// Trains a BPE model from UTF-8 text files; writes <model_prefix>.model and .vocab.
//
// The model round-trips text exactly: no normalisation (rule "identity"), no dummy prefix, spaces
// kept as they are, byte fallback for characters outside the vocabulary. Special pieces:
// <unk> = 0, <s> (bos) = 1, </s> (eos, the end-of-document token) = 2, no pad piece (sequences are
// packed, never padded). Digits are split one per piece and pieces of spaces alone are allowed
// (as Llama's tokenizer does), which keeps numbers and indentation regular.
//
// Each line of the files is one training sentence. SentencePiece silently skips lines longer than
// 4192 bytes, so longer lines are cut into pieces of at most kSentencePieceMaxChunk bytes first
// (split_long_line), so that every line of the corpus is seen by the trainer.
void train_sentencepiece(const std::vector<std::string>& files, const std::string& model_prefix,
                         const SentencePieceTrainOptions& opt);

// The most bytes train_sentencepiece gives the trainer as one sentence (SentencePiece's own limit,
// max_sentence_length, is 4192).
inline constexpr size_t kSentencePieceMaxChunk = 4096;

// Cuts `line` into consecutive pieces of at most `max_bytes` bytes (max_bytes >= 4) that
// concatenate to `line`. Each cut is placed, in order of preference, after the last sentence end
// (". ", "! ", "? " and the like: the cut falls before the space) within the limit, else before the
// last space, else after the last whole UTF-8 character: a cut never falls inside a character.
std::vector<std::string_view> split_long_line(std::string_view line, size_t max_bytes);

}  // namespace tetra
