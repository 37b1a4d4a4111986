// Hugging Face tokenizers (tokenizer.json): the pipeline of hf::Parts run as the Rust library
// `tokenizers` runs it, so that ids match what transformers gives (tests compare them with
// @lenml/tokenizers, the JavaScript port, on the State of the Union corpus and hard strings).
//
// encode(text):
//   1. Added tokens: leftmost-longest matches of the non-normalized added tokens in the raw text
//      (single_word: a match between word characters is skipped; lstrip / rstrip: the token takes
//      the white space beside it), then of the normalized ones in each normalized remainder.
//   2. Each remaining piece is normalized, pre-tokenized into words, and each word goes through
//      BPE. The model's symbols are bytes (byte-level files: the vocabulary is unmapped from GPT-2's
//      byte characters at load) or UTF-8 characters; a character the vocabulary lacks becomes its
//      <0xNN> byte pieces (byte_fallback) or the unk token (consecutive ones fused with fuse_unk).
//   3. The post-processor's tokens go around the whole: prefix_ids + ids + suffix_ids.
//
// BPE is the Rust library's: a heap of candidate merges ordered by (rank, position); the best is
// applied, and the pairs it forms with its neighbours are pushed at once (not after a round of
// every occurrence, as OpenAI's encoder.py does). ignore_merges: a word that is itself in the
// vocabulary is that one token.
//
// Regexes (Split, ByteLevel's GPT-2 regex) run under PCRE2 in UTF + UCP mode. The library's regex
// engine (Oniguruma) and PCRE2 agree on the syntax these files use; where a class means something
// else, it is rewritten: \s and \S are Unicode's White_Space (PCRE2's \s also takes U+180E), \w is
// Oniguruma's word class (letters, marks, decimal digits, connector punctuation). Escapes whose
// meaning differs and cannot be rewritten (\h, \R, \X, ...) are refused at load.
//
// Unicode normalization (NFC, NFD, NFKC, NFKD) is ICU's.
//
// decode(ids) follows the file's decoder (no decoder: the tokens joined by spaces, as the library
// does); special tokens decode to their text. Invalid UTF-8 from the byte-level decoder becomes
// U+FFFD per maximal invalid subsequence; from ByteFallback, U+FFFD per byte (the Rust library's
// two rules).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <queue>
#include <unordered_map>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/data/bpe_tables.h"
#include "trainer/data/prepare_input.h"
#include "trainer/data/tokenizer.h"
#include "trainer/data/tokenizer_hf_parts.h"

namespace tetra {
namespace {

using hf::Parts;

// ---- UTF-8 ------------------------------------------------------------------------------------
// The code point at s[i] of valid UTF-8 and its length.
uint32_t decode_utf8(std::string_view s, size_t i, size_t& len) {
  const auto c = static_cast<uint8_t>(s[i]);
  if (c < 0x80) {
    len = 1;
    return c;
  }
  len = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
  uint32_t cp = len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
  for (size_t k = 1; k < len && i + k < s.size(); ++k)
    cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

// Unicode's White_Space: what the Rust library's \s and char::is_whitespace mean.
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Length of the white space at the start / end of s (valid UTF-8).
size_t white_space_prefix(std::string_view s) {
  size_t i = 0, len = 0;
  while (i < s.size() && is_white_space(decode_utf8(s, i, len))) i += len;
  return i;
}
size_t white_space_suffix(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    size_t len = 0;
    if (!is_white_space(decode_utf8(s, start, len))) break;
    end = start;
  }
  return s.size() - end;
}

// Bytes to text with U+FFFD for each maximal invalid subsequence (Unicode's "best practice", what
// Rust's String::from_utf8_lossy and the WHATWG decoder do).
std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    size_t need = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    size_t k = 1;
    for (; k <= need && i + k < s.size(); ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) break;
    }
    if (k == need + 1) {
      out.append(s.substr(i, need + 1));
      i += need + 1;
    } else {
      out += "\xEF\xBF\xBD";
      i += k;  // the lead byte and the continuation bytes that fitted
    }
  }
  return out;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string_view::npos; pos = hit + from.size()) {
    out.append(s.substr(pos, hit - pos));
    out.append(to);
  }
  out.append(s.substr(pos));
  return out;
}

// ---- regexes ----------------------------------------------------------------------------------
std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

// The file's regex (Oniguruma syntax) in PCRE2's words; "" and `error` set when an escape means
// something PCRE2 cannot be made to mean.
std::string to_pcre2(std::string_view re, std::string& error) {
  constexpr const char* kWord = R"(\p{L}\p{M}\p{Nd}\p{Pc})";
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < re.size(); ++i) {
    const char c = re[i];
    if (c == '\\' && i + 1 < re.size()) {
      const char e = re[++i];
      switch (e) {
        case 's': out += R"(\p{White_Space})"; break;
        case 'S': out += R"(\P{White_Space})"; break;
        case 'w': out += in_class ? std::string(kWord) : fmt::format("[{}]", kWord); break;
        case 'W':
          if (in_class) {
            error = "\\W inside a character class";
            return "";
          }
          out += fmt::format("[^{}]", kWord);
          break;
        case 'h': case 'H': case 'v': case 'V': case 'R': case 'X': case 'K': case 'N': case 'Q':
          error = fmt::format("the escape \\{} (its meaning differs between the Hugging Face "
                              "library's regex engine and PCRE2)", e);
          return "";
        default:
          out += c;
          out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < re.size() && re[i + 1] == '^') out += re[++i];
      if (i + 1 < re.size() && re[i + 1] == ']') out += re[++i];  // a literal ']' first
      continue;
    }
    if (in_class && c == '[' && i + 1 < re.size() && re[i + 1] == ':') {  // [:alpha:]
      const size_t end = re.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(re.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

struct MatchDataFree {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
struct MatchContextFree {
  void operator()(pcre2_match_context* m) const { pcre2_match_context_free(m); }
};
struct JitStackFree {
  void operator()(pcre2_jit_stack* s) const { pcre2_jit_stack_free(s); }
};

// A compiled pattern: a regex, or a literal string.
class Matcher {
 public:
  Matcher(const hf::Pattern& p, const std::string& file) : literal_(!p.is_regex), text_(p.text) {
    if (literal_) return;
    std::string why;
    const std::string re = to_pcre2(p.text, why);
    if (re.empty())
      throw InputError(fmt::format("{}: {} \"{}\" is not supported: {}", file, p.field, p.text,
                                   why.empty() ? "an empty regex" : why));
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(), PCRE2_UTF | PCRE2_UCP,
                          &error, &offset, nullptr);
    if (code_ == nullptr)
      throw InputError(fmt::format("{}: {} \"{}\" does not compile (at offset {}: {})", file,
                                   p.field, p.text, offset, pcre2_message(error)));
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without JIT support: the interpreter
  }
  ~Matcher() { pcre2_code_free(code_); }
  Matcher(Matcher&& o) noexcept : literal_(o.literal_), text_(std::move(o.text_)), code_(o.code_) {
    o.code_ = nullptr;
  }
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;

  // Calls f(start, end) for every match in s, left to right, as the Rust regex crates iterate:
  // an empty match right where the previous match ended is skipped. s is valid UTF-8.
  template <class F>
  void for_each(std::string_view s, F&& f) const {
    if (literal_) {
      for (size_t pos = 0, hit; (hit = s.find(text_, pos)) != std::string_view::npos;
           pos = hit + text_.size())
        f(hit, hit + text_.size());
      return;
    }
    std::unique_ptr<pcre2_match_data, MatchDataFree> md(
        pcre2_match_data_create_from_pattern(code_, nullptr));
    TETRA_CHECK(md != nullptr, "out of memory for PCRE2 match data");
    std::unique_ptr<pcre2_match_context, MatchContextFree> context;
    std::unique_ptr<pcre2_jit_stack, JitStackFree> jit_stack;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t at = 0;
    int64_t last_end = -1;
    while (at <= s.size()) {
      int rc = pcre2_match(code_, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md.get(), context.get());
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !jit_stack) {
        jit_stack.reset(pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr));
        context.reset(pcre2_match_context_create(nullptr));
        TETRA_CHECK(jit_stack && context, "out of memory for a PCRE2 JIT stack");
        pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());
        rc = pcre2_match(code_, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md.get(), context.get());
      }
      if (rc == PCRE2_ERROR_NOMATCH) return;
      TETRA_CHECK(rc > 0, "PCRE2 match failed at byte {}: {}", at, pcre2_message(rc));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t start = ov[0], end = ov[1];
      if (start == end && static_cast<int64_t>(end) == last_end) {
        if (at >= s.size()) return;
        size_t len = 0;
        decode_utf8(s, at, len);
        at += len;  // step over one character and look again
        continue;
      }
      f(start, end);
      last_end = static_cast<int64_t>(end);
      at = end;
    }
  }

 private:
  bool literal_;
  std::string text_;
  pcre2_code* code_ = nullptr;
};

// ---- added tokens -----------------------------------------------------------------------------
// Leftmost-longest matching of a set of strings (a byte trie), with the Rust library's
// single_word / lstrip / rstrip rules applied to each match.
class AddedTokenMatcher {
 public:
  struct Split {
    size_t begin, end;
    int32_t id;  // -1: text
  };

  void add(const std::string& pattern, const hf::AddedToken& token) {
    if (pattern.empty()) return;
    int32_t node = 0;
    for (const char ch : pattern) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(ch);
      const auto it = edges_.find(key);
      if (it != edges_.end()) {
        node = it->second;
      } else {
        const auto next = static_cast<int32_t>(terminal_.size());
        edges_.emplace(key, next);
        terminal_.push_back(-1);
        node = next;
      }
    }
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
    terminal_[node] = static_cast<int32_t>(tokens_.size());
    tokens_.push_back(token);
  }
  bool empty() const { return tokens_.empty(); }

  // The splits of s (they cover s; text splits may be empty).
  void split(std::string_view s, std::vector<Split>& out, const Matcher* word) const {
    out.clear();
    size_t done = 0;  // the end of the last split
    size_t i = 0;
    while (i < s.size()) {
      if (!first_byte_[static_cast<uint8_t>(s[i])]) {
        ++i;
        continue;
      }
      int32_t node = 0, best = -1;
      size_t best_end = 0;
      for (size_t j = i; j < s.size(); ++j) {
        const auto it = edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(s[j]));
        if (it == edges_.end()) break;
        node = it->second;
        if (terminal_[node] >= 0) {
          best = terminal_[node];
          best_end = j + 1;
        }
      }
      if (best < 0) {
        ++i;
        continue;
      }
      const hf::AddedToken& t = tokens_[best];
      size_t start = i, stop = best_end;
      i = best_end;  // a match that is dropped is stepped over, as the library's iterator does
      if (t.single_word &&
          ((start > 0 && ends_with_word(s.substr(0, start), *word)) ||
           (stop < s.size() && starts_with_word(s.substr(stop), *word))))
        continue;
      if (t.lstrip) start = std::max(start - white_space_suffix(s.substr(0, start)), done);
      if (t.rstrip) stop += white_space_prefix(s.substr(stop));
      if (done < start) out.push_back({done, start, -1});
      out.push_back({start, stop, t.id});
      done = stop;
      i = std::max(i, stop);
    }
    if (done < s.size() || out.empty()) out.push_back({done, s.size(), -1});
  }

 private:
  // Rust's regex \w: Alphabetic, marks, decimal digits, connector punctuation, Join_Control.
  static bool is_word(std::string_view ch, const Matcher& word) {
    bool hit = false;
    word.for_each(ch, [&](size_t, size_t) { hit = true; });
    return hit;
  }
  static bool ends_with_word(std::string_view s, const Matcher& word) {
    size_t start = s.size() - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    return is_word(s.substr(start), word);
  }
  static bool starts_with_word(std::string_view s, const Matcher& word) {
    size_t len = 0;
    decode_utf8(s, 0, len);
    return is_word(s.substr(0, len), word);
  }

  std::unordered_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> node
  std::vector<int32_t> terminal_{-1};             // node -> index into tokens_, -1: none
  std::vector<hf::AddedToken> tokens_;
  bool first_byte_[256] = {};
};

// ---- BPE --------------------------------------------------------------------------------------
struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

constexpr size_t kCacheMaxPiece = 64;  // longest word kept in the per-thread cache (bytes)
constexpr size_t kCacheMaxEntries = 1 << 16;

struct WordCache {
  uint64_t owner = 0;  // serial of the tokenizer whose entries these are
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringViewHash, std::equal_to<>>
      index;
  std::vector<int32_t> ids;
};
thread_local WordCache t_word_cache;
std::atomic<uint64_t> g_next_serial{1};

struct Word {  // the symbols of one word as a linked list, and the heap of candidate merges
  std::vector<int32_t> id, prev, next;
  std::vector<uint8_t> alive;
  struct Candidate {
    int32_t rank, pos, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Candidate> heap;
};
thread_local Word t_word;

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& dir);

  std::string name() const override { return "hf:" + parts_.dir; }
  int64_t vocab_size() const override { return parts_.vocab_size; }
  int32_t eod_id() const override { return parts_.eos_id; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(std::span<const int32_t> ids) const override;

 private:
  struct Piece {
    std::string text;
    bool at_start;  // begins at byte 0 of the text (Metaspace's prepend_scheme "first")
  };
  std::string normalize(std::string s) const;
  void pre_tokenize(std::vector<Piece>& pieces) const;
  void encode_text(std::string_view s, bool at_start, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  int32_t symbol_of(std::string_view ch) const;

  Parts parts_;
  std::vector<std::unique_ptr<Matcher>> normalizer_patterns_;    // per normalizer (REPLACE)
  std::vector<std::unique_ptr<Matcher>> pre_tokenizer_patterns_;  // per pre-tokenizer (SPLIT)
  std::unique_ptr<Matcher> byte_level_regex_;                    // GPT-2's
  std::unique_ptr<Matcher> word_class_;                          // single_word's \w
  AddedTokenMatcher raw_added_, normalized_added_;
  std::vector<uint8_t> is_added_;  // (vocab_size) 1 for an added token's id

  MergeTable merges_;
  std::array<int32_t, 256> byte_symbol_{};  // byte-level: each byte's id, -1: none
  std::array<int32_t, 256> fallback_id_{};  // <0xNN>'s id, -1: none
  std::array<int32_t, 128> ascii_symbol_{};  // character models: each ASCII character's id
  std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>> vocab_;  // symbols -> id
  bool has_merges_ = false;
  uint64_t serial_ = g_next_serial.fetch_add(1);
};

HfTokenizer::HfTokenizer(const std::string& dir) : parts_(hf::read_parts(dir)) {
  const std::string& file = parts_.json_path;
  for (const hf::Normalizer& n : parts_.normalizers)
    normalizer_patterns_.push_back(n.kind == hf::NormalizerKind::REPLACE
                                       ? std::make_unique<Matcher>(n.pattern, file)
                                       : nullptr);
  for (const hf::PreTokenizer& p : parts_.pre_tokenizers) {
    pre_tokenizer_patterns_.push_back(p.kind == hf::PreTokenizerKind::SPLIT
                                          ? std::make_unique<Matcher>(p.pattern, file)
                                          : nullptr);
    if (p.kind == hf::PreTokenizerKind::BYTE_LEVEL && p.use_regex && !byte_level_regex_) {
      const hf::Pattern gpt2{true,
                             R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
                             "the ByteLevel pre-tokenizer's regex"};
      byte_level_regex_ = std::make_unique<Matcher>(gpt2, file);
    }
  }
  word_class_ = std::make_unique<Matcher>(
      hf::Pattern{true, R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", "single_word"},
      file);

  is_added_.assign(static_cast<size_t>(parts_.vocab_size), 0);
  for (const hf::AddedToken& a : parts_.added) {
    is_added_[a.id] = 1;
    if (!a.normalized) {
      raw_added_.add(a.content, a);
    } else {
      normalized_added_.add(normalize(a.content), a);
    }
  }

  std::vector<std::pair<uint64_t, MergeTable::Merge>> entries;
  entries.reserve(parts_.merges.size());
  for (size_t r = 0; r < parts_.merges.size(); ++r) {
    const Parts::Merge& m = parts_.merges[r];
    entries.push_back({MergeTable::pack(m.left, m.right), {static_cast<int32_t>(r), m.merged}});
  }
  merges_.build(entries);

  byte_symbol_.fill(-1);
  fallback_id_.fill(-1);
  ascii_symbol_.fill(-1);
  for (const auto& [symbol, id] : parts_.model_vocab) {
    if (symbol.size() == 1) {
      const auto b = static_cast<uint8_t>(symbol[0]);
      if (parts_.byte_level) byte_symbol_[b] = id;
      if (b < 0x80) ascii_symbol_[b] = id;
    }
    vocab_.emplace(symbol, id);
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = parts_.model_vocab.find(fmt::format("<0x{:02X}>", b));
    if (it != parts_.model_vocab.end()) fallback_id_[b] = it->second;
  }
  // Both live on in vocab_ and merges_.
  parts_.model_vocab = {};
  const bool has_merges = !parts_.merges.empty();
  parts_.merges = {};
  has_merges_ = has_merges;
}

std::string HfTokenizer::normalize(std::string s) const {
  for (size_t k = 0; k < parts_.normalizers.size(); ++k) {
    const hf::Normalizer& n = parts_.normalizers[k];
    switch (n.kind) {
      case hf::NormalizerKind::NFC:
      case hf::NormalizerKind::NFD:
      case hf::NormalizerKind::NFKC:
      case hf::NormalizerKind::NFKD: {
        if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; }))
          break;  // ASCII is its own normal form, in all four
        UErrorCode err = U_ZERO_ERROR;
        const UNormalizer2* form =
            n.kind == hf::NormalizerKind::NFC    ? unorm2_getNFCInstance(&err)
            : n.kind == hf::NormalizerKind::NFD  ? unorm2_getNFDInstance(&err)
            : n.kind == hf::NormalizerKind::NFKC ? unorm2_getNFKCInstance(&err)
                                                 : unorm2_getNFKDInstance(&err);
        std::u16string in(s.size(), u'\0');
        int32_t len = 0;
        u_strFromUTF8(in.data(), static_cast<int32_t>(in.size()), &len, s.data(),
                      static_cast<int32_t>(s.size()), &err);
        in.resize(static_cast<size_t>(len));
        if (U_SUCCESS(err) && unorm2_isNormalized(form, in.data(), len, &err)) break;
        err = U_ZERO_ERROR;
        std::u16string norm(in.size() * 2 + 16, u'\0');
        int32_t nlen = unorm2_normalize(form, in.data(), len, norm.data(),
                                        static_cast<int32_t>(norm.size()), &err);
        if (err == U_BUFFER_OVERFLOW_ERROR) {  // a compatibility decomposition grows up to 18x
          err = U_ZERO_ERROR;
          norm.assign(static_cast<size_t>(nlen), u'\0');
          nlen = unorm2_normalize(form, in.data(), len, norm.data(), nlen, &err);
        }
        TETRA_CHECK(U_SUCCESS(err), "ICU normalization failed: {}", u_errorName(err));
        std::string out(static_cast<size_t>(nlen) * 3, '\0');
        int32_t olen = 0;
        u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &olen, norm.data(), nlen, &err);
        TETRA_CHECK(U_SUCCESS(err), "ICU UTF-16 to UTF-8 failed: {}", u_errorName(err));
        out.resize(static_cast<size_t>(olen));
        s = std::move(out);
        break;
      }
      case hf::NormalizerKind::PREPEND:
        if (!s.empty()) s.insert(0, n.text);
        break;
      case hf::NormalizerKind::REPLACE: {
        std::string out;
        size_t pos = 0;
        normalizer_patterns_[k]->for_each(s, [&](size_t a, size_t b) {
          out.append(s, pos, a - pos);
          out += n.text;
          pos = b;
        });
        out.append(s, pos, std::string::npos);
        s = std::move(out);
        break;
      }
      case hf::NormalizerKind::STRIP: {
        const size_t tail = n.strip_right ? white_space_suffix(s) : 0;
        s.resize(s.size() - tail);
        if (n.strip_left) s.erase(0, white_space_prefix(s));
        break;
      }
    }
  }
  return s;
}

// Cuts s by the (start, end) matches of `for_each_match` as Split's behavior says; appends to out
// (a vector of {text, at_start}).
template <class ForEachMatch, class Out>
void split_pieces(const std::string& s, bool at_start, hf::SplitBehavior behavior, bool invert,
                  ForEachMatch&& for_each_match, std::vector<std::pair<size_t, size_t>>& spans,
                  std::vector<uint8_t>& is_match, Out& out) {
  spans.clear();
  is_match.clear();
  size_t prev = 0;
  for_each_match([&](size_t a, size_t b) {
    if (prev != a) {
      spans.push_back({prev, a});
      is_match.push_back(invert);
    }
    spans.push_back({a, b});
    is_match.push_back(!invert);
    prev = b;
  });
  if (prev != s.size()) {
    spans.push_back({prev, s.size()});
    is_match.push_back(invert);
  }
  // (offsets, removed) as NormalizedString::split computes them.
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> splits;
  using hf::SplitBehavior;
  bool previous = false;
  switch (behavior) {
    case SplitBehavior::ISOLATED:
      for (const auto& sp : spans) splits.push_back({sp, false});
      break;
    case SplitBehavior::REMOVED:
      for (size_t i = 0; i < spans.size(); ++i) splits.push_back({spans[i], is_match[i] != 0});
      break;
    case SplitBehavior::CONTIGUOUS:
      for (size_t i = 0; i < spans.size(); ++i) {
        if ((is_match[i] != 0) == previous && !splits.empty())
          splits.back().first.second = spans[i].second;
        else
          splits.push_back({spans[i], false});
        previous = is_match[i] != 0;
      }
      break;
    case SplitBehavior::MERGED_WITH_PREVIOUS:
      for (size_t i = 0; i < spans.size(); ++i) {
        if (is_match[i] && !previous && !splits.empty())
          splits.back().first.second = spans[i].second;
        else
          splits.push_back({spans[i], false});
        previous = is_match[i] != 0;
      }
      break;
    case SplitBehavior::MERGED_WITH_NEXT:
      for (size_t i = spans.size(); i-- > 0;) {
        if (is_match[i] && !previous && !splits.empty())
          splits.back().first.first = spans[i].first;
        else
          splits.push_back({spans[i], false});
        previous = is_match[i] != 0;
      }
      std::reverse(splits.begin(), splits.end());
      break;
  }
  for (const auto& [span, removed] : splits) {
    if (removed || span.first == span.second) continue;
    out.push_back({s.substr(span.first, span.second - span.first), at_start && span.first == 0});
  }
}

void HfTokenizer::pre_tokenize(std::vector<Piece>& pieces) const {
  std::vector<std::pair<size_t, size_t>> spans;
  std::vector<uint8_t> is_match;
  std::vector<Piece> cut;
  for (size_t k = 0; k < parts_.pre_tokenizers.size(); ++k) {
    const hf::PreTokenizer& p = parts_.pre_tokenizers[k];
    cut.clear();
    for (Piece& piece : pieces) {
      switch (p.kind) {
        case hf::PreTokenizerKind::SPLIT: {
          const Matcher& m = *pre_tokenizer_patterns_[k];
          split_pieces(piece.text, piece.at_start, p.behavior, p.invert,
                       [&](auto&& f) { m.for_each(piece.text, f); }, spans, is_match, cut);
          break;
        }
        case hf::PreTokenizerKind::BYTE_LEVEL: {
          if (p.add_prefix_space && !piece.text.starts_with(' ')) piece.text.insert(0, " ");
          if (p.use_regex) {
            split_pieces(piece.text, piece.at_start, hf::SplitBehavior::ISOLATED, false,
                         [&](auto&& f) { byte_level_regex_->for_each(piece.text, f); }, spans,
                         is_match, cut);
          } else {
            cut.push_back({std::move(piece.text), piece.at_start});
          }
          break;
        }
        case hf::PreTokenizerKind::METASPACE: {
          std::string t = replace_all(piece.text, " ", p.replacement);
          const bool prepend = !t.starts_with(p.replacement) &&
                               (p.prepend == hf::PrependScheme::ALWAYS ||
                                (p.prepend == hf::PrependScheme::FIRST && piece.at_start));
          if (prepend) t.insert(0, p.replacement);
          if (p.split) {
            const hf::Pattern literal{false, p.replacement, ""};
            const Matcher m(literal, parts_.json_path);
            split_pieces(t, piece.at_start, hf::SplitBehavior::MERGED_WITH_NEXT, false,
                         [&](auto&& f) { m.for_each(t, f); }, spans, is_match, cut);
          } else if (!t.empty()) {
            cut.push_back({std::move(t), piece.at_start});
          }
          break;
        }
      }
      // What is cut is held once: the piece's own text, and the scratch of a long one, go now.
      std::string().swap(piece.text);
      if (spans.capacity() > (size_t{1} << 16)) {
        std::vector<std::pair<size_t, size_t>>().swap(spans);
        std::vector<uint8_t>().swap(is_match);
      }
    }
    pieces.swap(cut);
    std::vector<Piece>().swap(cut);
  }
}

void HfTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  const int64_t bad = find_invalid_utf8(text);
  TETRA_INPUT_CHECK(bad < 0, "text is not valid UTF-8 at byte {}; the tokenizer {} reads UTF-8 "
                    "text only: convert or drop the document", bad, name());
  out.insert(out.end(), parts_.prefix_ids.begin(), parts_.prefix_ids.end());
  std::vector<AddedTokenMatcher::Split> splits;
  if (raw_added_.empty()) {
    splits.push_back({0, text.size(), -1});
  } else {
    raw_added_.split(text, splits, word_class_.get());
  }
  for (const auto& sp : splits) {
    if (sp.id >= 0) {
      out.push_back(sp.id);
    } else if (sp.end > sp.begin) {
      encode_text(text.substr(sp.begin, sp.end - sp.begin), sp.begin == 0, out);
    }
  }
  out.insert(out.end(), parts_.suffix_ids.begin(), parts_.suffix_ids.end());
}

// One piece of text between added tokens: normalized, its normalized added tokens taken out,
// pre-tokenized, each word through BPE.
void HfTokenizer::encode_text(std::string_view s, bool at_start, std::vector<int32_t>& out) const {
  const std::string normalized = normalize(std::string(s));
  std::vector<AddedTokenMatcher::Split> splits;
  if (normalized_added_.empty()) {
    splits.push_back({0, normalized.size(), -1});
  } else {
    normalized_added_.split(normalized, splits, word_class_.get());
  }
  std::vector<Piece> pieces;
  for (const auto& sp : splits) {
    if (sp.id >= 0) {
      out.push_back(sp.id);
      continue;
    }
    if (sp.end == sp.begin) continue;
    pieces.clear();
    pieces.push_back({normalized.substr(sp.begin, sp.end - sp.begin), at_start && sp.begin == 0});
    pre_tokenize(pieces);
    for (const Piece& p : pieces) encode_word(p.text, out);
  }
}

void HfTokenizer::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (parts_.ignore_merges) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kCacheMaxPiece) {
    bpe(word, out);
    return;
  }
  WordCache& cache = t_word_cache;
  if (cache.owner != serial_) {
    cache.index.clear();
    cache.ids.clear();
    cache.owner = serial_;
  }
  if (const auto it = cache.index.find(word); it != cache.index.end()) {
    const auto [at, count] = it->second;
    out.insert(out.end(), cache.ids.begin() + at, cache.ids.begin() + at + count);
    return;
  }
  const size_t before = out.size();
  bpe(word, out);
  if (cache.index.size() >= kCacheMaxEntries) {
    cache.index.clear();
    cache.ids.clear();
  }
  const auto at = static_cast<uint32_t>(cache.ids.size());
  cache.ids.insert(cache.ids.end(), out.begin() + before, out.end());
  cache.index.emplace(std::string(word),
                      std::pair<uint32_t, uint32_t>{at, static_cast<uint32_t>(out.size() - before)});
}

int32_t HfTokenizer::symbol_of(std::string_view ch) const {
  if (parts_.byte_level) return byte_symbol_[static_cast<uint8_t>(ch[0])];
  if (ch.size() == 1 && static_cast<uint8_t>(ch[0]) < 0x80) return ascii_symbol_[ch[0]];
  const auto it = vocab_.find(ch);
  return it == vocab_.end() ? -1 : it->second;
}

// The Rust library's BPE::merge_word and Word::merge_all.
void HfTokenizer::bpe(std::string_view word, std::vector<int32_t>& out) const {
  Word& w = t_word;
  w.id.clear();
  int32_t unk_pending = -1;  // a fused run of unknown characters waiting to be added
  const auto add = [&](int32_t id) { w.id.push_back(id); };
  for (size_t i = 0; i < word.size();) {
    size_t len = 1;
    if (!parts_.byte_level) decode_utf8(word, i, len);
    const std::string_view ch = word.substr(i, len);
    i += len;
    const int32_t id = symbol_of(ch);
    if (id >= 0) {
      if (unk_pending >= 0) add(unk_pending);
      unk_pending = -1;
      add(id);
      continue;
    }
    if (parts_.byte_fallback &&
        std::all_of(ch.begin(), ch.end(), [&](char b) { return fallback_id_[static_cast<uint8_t>(b)] >= 0; })) {
      for (const char b : ch) add(fallback_id_[static_cast<uint8_t>(b)]);
      continue;  // (as in the library, a pending unk waits for the next known character)
    }
    if (parts_.unk_id < 0) {
      size_t cl = 0;
      const uint32_t cp = decode_utf8(ch, 0, cl);
      throw InputError(fmt::format(
          "the text has {} (in \"{}\"), which the vocabulary of {} cannot encode: no token for it, "
          "{}, and no unk_token", parts_.byte_level ? fmt::format("the byte 0x{:02X}", static_cast<uint8_t>(ch[0]))
                                                    : fmt::format("the character U+{:04X}", cp),
          word.substr(0, 80), parts_.json_path,
          parts_.byte_fallback ? "no <0xNN> token for one of its bytes" : "no byte_fallback"));
    }
    if (unk_pending >= 0 && !parts_.fuse_unk) add(unk_pending);
    unk_pending = parts_.unk_id;
  }
  if (unk_pending >= 0) add(unk_pending);

  const auto n = static_cast<int32_t>(w.id.size());
  if (n > 1 && has_merges_) {
    w.prev.resize(n);
    w.next.resize(n);
    w.alive.assign(n, 1);
    w.heap.clear();
    for (int32_t i = 0; i < n; ++i) {
      w.prev[i] = i - 1;
      w.next[i] = i + 1 < n ? i + 1 : -1;
    }
    const auto push = [&](int32_t pos) {
      if (const MergeTable::Merge* m = merges_.find(w.id[pos], w.id[w.next[pos]])) {
        w.heap.push_back({m->rank, pos, m->id});
        std::push_heap(w.heap.begin(), w.heap.end(), std::greater<>());
      }
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!w.heap.empty()) {
      std::pop_heap(w.heap.begin(), w.heap.end(), std::greater<>());
      const Word::Candidate top = w.heap.back();
      w.heap.pop_back();
      if (!w.alive[top.pos] || w.next[top.pos] < 0) continue;
      const int32_t right = w.next[top.pos];
      // Stale unless the pair there now still makes the same token (the library's test).
      const MergeTable::Merge* now = merges_.find(w.id[top.pos], w.id[right]);
      if (now == nullptr || now->id != top.merged) continue;
      w.id[top.pos] = top.merged;
      w.alive[right] = 0;
      w.next[top.pos] = w.next[right];
      if (w.next[right] >= 0) w.prev[w.next[right]] = top.pos;
      if (w.prev[top.pos] >= 0) push(w.prev[top.pos]);
      if (w.next[top.pos] >= 0) push(top.pos);
    }
    for (int32_t i = 0; i >= 0; i = w.next[i]) out.push_back(w.id[i]);
    return;
  }
  out.insert(out.end(), w.id.begin(), w.id.end());
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  std::vector<std::string> tokens;
  std::vector<uint8_t> added;  // per token: an added token, kept verbatim by ByteLevel
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    TETRA_INPUT_CHECK(id >= 0 && id < parts_.vocab_size && parts_.has_id[id],
                      "token id {} (at position {}) is no token of {} (vocabulary [0, {}))", id, i,
                      name(), parts_.vocab_size);
    tokens.push_back(parts_.token_text[id]);
    added.push_back(is_added_[id]);
  }
  if (!parts_.decoders) {
    std::string text;
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    return text;
  }
  static const std::array<uint32_t, 256> cp_of_byte = byte_to_codepoint();
  static const std::unordered_map<uint32_t, uint8_t> byte_of_cp = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    for (int b = 0; b < 256; ++b) m[cp_of_byte[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  for (const hf::Decoder& d : *parts_.decoders) {
    std::vector<std::string> next;
    switch (d.kind) {
      case hf::DecoderKind::BYTE_LEVEL: {
        std::string run;  // the bytes of consecutive byte-level tokens
        bool in_run = false;
        for (size_t i = 0; i < tokens.size(); ++i) {
          if (added[i]) {
            if (in_run) next.push_back(utf8_lossy(run));
            run.clear();
            in_run = false;
            next.push_back(tokens[i]);
            continue;
          }
          in_run = true;
          const std::string& t = tokens[i];
          std::string bytes;
          bool mapped = true;
          for (size_t k = 0, len = 0; k < t.size() && mapped; k += len) {
            const auto it = byte_of_cp.find(decode_utf8(t, k, len));
            if (it == byte_of_cp.end()) mapped = false;
            else bytes += static_cast<char>(it->second);
          }
          run += mapped ? bytes : t;
        }
        if (in_run) next.push_back(utf8_lossy(run));
        added.assign(next.size(), 0);
        break;
      }
      case hf::DecoderKind::REPLACE:
        for (const std::string& t : tokens) next.push_back(replace_all(t, d.pattern, d.content));
        break;
      case hf::DecoderKind::BYTE_FALLBACK: {
        std::string run;
        size_t run_tokens = 0;
        const auto flush = [&] {
          if (run_tokens == 0) return;
          if (find_invalid_utf8(run) < 0) {
            next.push_back(run);
          } else {
            for (size_t k = 0; k < run_tokens; ++k) next.push_back("\xEF\xBF\xBD");
          }
          run.clear();
          run_tokens = 0;
        };
        for (const std::string& t : tokens) {
          const auto hex = [](char c) {
            return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
          };
          if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>' && hex(t[3]) && hex(t[4])) {
            run += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++run_tokens;
          } else {
            flush();
            next.push_back(t);
          }
        }
        flush();
        break;
      }
      case hf::DecoderKind::FUSE: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        next.push_back(std::move(all));
        break;
      }
      case hf::DecoderKind::STRIP:
        for (const std::string& t : tokens) {
          size_t begin = 0, end = t.size();
          for (int64_t k = 0; k < d.start && t.compare(begin, d.strip.size(), d.strip) == 0; ++k)
            begin += d.strip.size();
          for (int64_t k = 0; k < d.stop && end >= begin + d.strip.size() &&
                              t.compare(end - d.strip.size(), d.strip.size(), d.strip) == 0;
               ++k)
            end -= d.strip.size();
          next.push_back(t.substr(begin, end - begin));
        }
        break;
      case hf::DecoderKind::METASPACE:
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && d.prepend != hf::PrependScheme::NEVER;
          next.push_back(replace_all(tokens[i], d.replacement, drop ? "" : " "));
        }
        break;
    }
    // Replace, Strip and Metaspace map token to token; the others fuse tokens into text.
    if (d.kind == hf::DecoderKind::FUSE || d.kind == hf::DecoderKind::BYTE_FALLBACK)
      added.assign(next.size(), 0);
    tokens = std::move(next);
  }
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& dir) {
  return std::make_unique<HfTokenizer>(dir);
}

}  // namespace tetra
