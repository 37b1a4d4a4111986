// A Hugging Face tokenizer as read from <dir>/tokenizer.json and <dir>/tokenizer_config.json:
// the parts of the pipeline Tetra represents, each checked once at load (tokenizer_hf_read.cpp),
// then run by tokenizer_hf.cpp.
//
// The pipeline of the Hugging Face tokenizers library, for one text:
//   added tokens   matched in the raw text first (those with normalized=false), then, in each
//                  normalized remainder, the ones with normalized=true; matches become their id
//   normalizer     on each remaining piece of text: NFC/NFD/NFKC/NFKD, Prepend, Replace, Strip
//   pre-tokenizer  cuts the normalized text into words: Split (a regex), ByteLevel (bytes shown as
//                  characters, optionally GPT-2's regex), Metaspace (spaces as U+2581)
//   model          BPE over each word, with byte fallback (<0xNN> pieces) and unk fusing
//   post-processor special tokens around the sequence (TemplateProcessing)
//   decoder        ids back to text: ByteLevel, or Replace / ByteFallback / Fuse / Strip / Metaspace
// Everything else a tokenizer.json can say is refused at load, naming the file and the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace tetra::hf {

// A normalizer's or pre-tokenizer's pattern: {"String": s} (a literal) or {"Regex": r}.
struct Pattern {
  bool is_regex = false;
  std::string text;   // the literal or the regex as the file gives it
  std::string field;  // where it was read ("pre_tokenizer.pretokenizers[0].pattern"), for messages
};

enum class NormalizerKind : uint8_t { NFC, NFD, NFKC, NFKD, PREPEND, REPLACE, STRIP };

struct Normalizer {
  NormalizerKind kind = NormalizerKind::NFC;
  std::string text;  // PREPEND: what is put in front; REPLACE: the replacement
  Pattern pattern;   // REPLACE
  bool strip_left = false, strip_right = false;  // STRIP
};

// How a Split pre-tokenizer treats the pattern's matches (the delimiters): as the Rust library's
// SplitDelimiterBehavior, e.g. "the-final--countdown" split on "-":
//   REMOVED the final countdown; ISOLATED the - final - - countdown;
//   MERGED_WITH_PREVIOUS the- final- - countdown; MERGED_WITH_NEXT the -final - -countdown;
//   CONTIGUOUS the - final -- countdown.
enum class SplitBehavior : uint8_t { REMOVED, ISOLATED, MERGED_WITH_PREVIOUS, MERGED_WITH_NEXT,
                                     CONTIGUOUS };
enum class PrependScheme : uint8_t { ALWAYS, FIRST, NEVER };  // Metaspace's prefix U+2581
enum class PreTokenizerKind : uint8_t { SPLIT, BYTE_LEVEL, METASPACE };

struct PreTokenizer {
  PreTokenizerKind kind = PreTokenizerKind::SPLIT;
  Pattern pattern;  // SPLIT
  SplitBehavior behavior = SplitBehavior::ISOLATED;
  bool invert = false;                // SPLIT: the matches are the words, the rest delimiters
  bool add_prefix_space = false;      // BYTE_LEVEL: a space before each piece not starting with one
  bool use_regex = true;              // BYTE_LEVEL: cut with GPT-2's regex first
  std::string replacement = "\u2581";  // METASPACE: one character
  PrependScheme prepend = PrependScheme::ALWAYS;
  bool split = true;                  // METASPACE: cut before each replacement character
};

enum class DecoderKind : uint8_t { BYTE_LEVEL, REPLACE, BYTE_FALLBACK, FUSE, STRIP, METASPACE };

struct Decoder {
  DecoderKind kind = DecoderKind::BYTE_LEVEL;
  std::string pattern, content;  // REPLACE: a literal and its replacement
  std::string strip;             // STRIP: one character, cut up to `start` times from the front
  int64_t start = 0, stop = 0;   //        of each token and up to `stop` times from the back
  std::string replacement = "\u2581";  // METASPACE
  PrependScheme prepend = PrependScheme::ALWAYS;
};

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

struct Parts {
  std::string dir;          // as given
  std::string json_path;    // dir/tokenizer.json
  std::string config_path;  // dir/tokenizer_config.json ("" when there is none)

  std::vector<Normalizer> normalizers;  // applied in order
  std::vector<PreTokenizer> pre_tokenizers;  // applied in order; a BYTE_LEVEL one is the last
  bool byte_level = false;  // a ByteLevel pre-tokenizer: the model's vocabulary is over bytes

  // The model (BPE). Symbols are the model's alphabet: single bytes when byte_level, else single
  // UTF-8 characters. token_text[id] is each id's string as the file spells it (for the decoder);
  // model_vocab maps a symbol string (bytes, unmapped, when byte_level) to its id.
  int64_t vocab_size = 0;                 // the largest id + 1 (model and added tokens)
  std::vector<std::string> token_text;    // (vocab_size) "" for an id nothing has
  std::vector<uint8_t> has_id;            // (vocab_size) 1 where some token has the id
  std::unordered_map<std::string, int32_t> model_vocab;
  struct Merge {
    int32_t left, right, merged;
  };
  std::vector<Merge> merges;  // in rank order
  int32_t unk_id = -1;        // -1: no unk_token
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;

  std::vector<AddedToken> added;

  // What the post-processor (and tokenizer_config.json's add_bos_token / add_eos_token) puts
  // around each encoded text.
  std::vector<int32_t> prefix_ids, suffix_ids;

  std::optional<std::vector<Decoder>> decoders;  // nullopt: no decoder (tokens joined by spaces)

  int32_t bos_id = -1;  // -1 where there is none
  int32_t eos_id = -1;  // the end-of-document token
};

// Reads and checks dir/tokenizer.json and dir/tokenizer_config.json (optional where
// tokenizer.json alone names the end-of-document token). InputError naming the file and the JSON
// field for anything missing, malformed or not represented.
Parts read_parts(const std::string& dir);

}  // namespace tetra::hf
