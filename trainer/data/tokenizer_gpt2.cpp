// GPT-2's byte-level BPE tokenizer, the algorithm of OpenAI's encoder.py (gpt-2/src/encoder.py)
// reproduced id for id, from the original encoder.json and vocab.bpe.
//
// encode(text):
//   1. Pre-tokenisation: the text is cut into pieces by OpenAI's regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      compiled with PCRE2 in UTF + UCP mode (\p{L}, \p{N} by Unicode properties) and JIT.
//      Every character matches some alternative, so the pieces tile the text. \s is spelled out
//      as Unicode's White_Space set, what \s means to tiktoken (OpenAI's Rust implementation);
//      PCRE2's own \s also takes U+180E MONGOLIAN VOWEL SEPARATOR, a space only before Unicode 6.3.
//   2. Each piece's UTF-8 bytes go through BPE: start from one symbol per byte; repeatedly take the
//      adjacent pair with the lowest merge rank (its line in vocab.bpe) and merge every occurrence
//      of it, left to right, without overlap; stop when no adjacent pair has a rank.
//
// OpenAI works on strings in which every byte is shown as a printable character (bytes_to_unicode,
// so that the BPE files are text). That mapping is a bijection, so it is undone once, at load: the
// vocabulary is kept as raw byte strings and BPE runs on token ids, each merge a lookup of the pair
// (left id, right id) -> (rank, merged id) in an open-addressing table.
//
// BPE of a piece of n bytes costs O(n^2) done literally. Pieces up to kShortPiece bytes (nearly all
// of them) take that literal path; longer ones (runs of spaces, long numbers or strings without
// spaces) use a heap of candidate pairs ordered by (rank, position) over a linked list of symbols,
// O(n log n). Both give OpenAI's result: the heap is drained one rank at a time, and pairs that a
// merge creates enter the heap only after every occurrence of the current rank was merged, exactly
// as OpenAI's round of "merge every occurrence of the best pair" does.
//
// Encoded pieces are remembered in a per-thread cache (no locking, no sharing), keyed by the
// tokenizer's serial number so that two tokenizers never see each other's entries.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <queue>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/data/bpe_tables.h"
#include "trainer/data/tokenizer.h"

namespace tetra {
namespace {

// OpenAI's pattern with \s as [WS] and \S as [^WS], WS = Unicode's White_Space characters.
#define TETRA_WS \
  R"(\t\n\x0B\f\r\x20\x85\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})"
constexpr const char* kPretokenizePattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^)" TETRA_WS R"(\p{L}\p{N}]+|[)" TETRA_WS
    R"(]+(?![^)" TETRA_WS R"(])|[)" TETRA_WS R"(]+)";
#undef TETRA_WS
constexpr size_t kShortPiece = 64;         // longest piece for the literal BPE loop (bytes)
constexpr size_t kCacheMaxPiece = 64;      // longest piece kept in the cache (bytes)
constexpr size_t kCacheMaxEntries = 1 << 16;
constexpr const char* kFetchHint = "run scripts/data.sh to fetch GPT-2's original files";

// Undoes bytes_to_unicode on `s` (UTF-8). Returns false, with the offending code point in
// `bad_cp`, when `s` has a character outside the 256 that stand for bytes.
bool unmap_token(std::string_view s, const std::unordered_map<uint32_t, uint8_t>& byte_of_cp,
                 std::string& out, uint32_t& bad_cp) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    uint32_t cp = 0;
    size_t len = 1;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      cp = c & 0x1F, len = 2;
    } else if ((c & 0xF0) == 0xE0) {
      cp = c & 0x0F, len = 3;
    } else {
      cp = c & 0x07, len = 4;
    }
    if (i + len > s.size()) len = s.size() - i;
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
    i += len;
    const auto it = byte_of_cp.find(cp);
    if (it == byte_of_cp.end()) {
      bad_cp = cp;
      return false;
    }
    out.push_back(static_cast<char>(it->second));
  }
  return true;
}

std::string read_whole_file(const std::string& path) {
  // A regular file only: a named pipe would block, a directory reads as nothing.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw InputError(fmt::format("{}: cannot open GPT-2 tokenizer file ({}); {}", path,
                                 std::strerror(errno), kFetchHint));
  const int fd = open_regular_file(path, "GPT-2 tokenizer file", kFetchHint);
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      TETRA_INPUT_CHECK(got == 0, "{}: read error ({}); {}", path, std::strerror(err),
                        kFetchHint);
      return text;
    }
    text.append(buf, static_cast<size_t>(got));
  }
}

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Per-thread cache of encoded pieces: piece bytes -> [offset, offset + count) in `ids`.
struct PieceCache {
  uint64_t owner = 0;  // serial of the tokenizer whose entries these are
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringViewHash, std::equal_to<>>
      index;
  std::vector<int32_t> ids;
};
thread_local PieceCache t_piece_cache;
std::atomic<uint64_t> g_next_serial{1};

struct MatchDataFree {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
struct MatchContextFree {
  void operator()(pcre2_match_context* m) const { pcre2_match_context_free(m); }
};
struct JitStackFree {
  void operator()(pcre2_jit_stack* s) const { pcre2_jit_stack_free(s); }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

class Gpt2Tokenizer final : public Tokenizer {
 public:
  explicit Gpt2Tokenizer(const std::string& dir);
  ~Gpt2Tokenizer() override { pcre2_code_free(regex_); }
  Gpt2Tokenizer(const Gpt2Tokenizer&) = delete;
  Gpt2Tokenizer& operator=(const Gpt2Tokenizer&) = delete;

  std::string name() const override { return "gpt2"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_bytes_.size()); }
  int32_t eod_id() const override { return eod_id_; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(std::span<const int32_t> ids) const override;

 private:
  void load_encoder(const std::string& path, std::unordered_map<std::string, int32_t>& bytes_to_id);
  void load_merges(const std::string& path,
                   const std::unordered_map<std::string, int32_t>& bytes_to_id);
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_short(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe_long(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> id_to_bytes_;  // (V) each token's bytes
  std::array<int32_t, 256> byte_id_{};    // the token of each single byte
  MergeTable merges_;
  int32_t eod_id_ = -1;
  pcre2_code* regex_ = nullptr;
  uint64_t serial_ = g_next_serial.fetch_add(1);
};

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& dir) {
  std::unordered_map<std::string, int32_t> bytes_to_id;
  load_encoder(dir + "/encoder.json", bytes_to_id);
  load_merges(dir + "/vocab.bpe", bytes_to_id);

  int error = 0;
  PCRE2_SIZE error_offset = 0;
  regex_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPretokenizePattern), PCRE2_ZERO_TERMINATED,
                         PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
  TETRA_CHECK(regex_ != nullptr, "GPT-2 pre-tokenisation regex does not compile at offset {}: {}",
              error_offset, pcre2_message(error));
  // Without JIT support (some platforms) pcre2_match falls back to the interpreter: same matches.
  pcre2_jit_compile(regex_, PCRE2_JIT_COMPLETE);
}

void Gpt2Tokenizer::load_encoder(const std::string& path,
                                 std::unordered_map<std::string, int32_t>& bytes_to_id) {
  const std::string text = read_whole_file(path);
  nlohmann::json j;
  try {
    j = parse_json_text(path, text);
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}; {}", e.what(), kFetchHint));
  }
  TETRA_INPUT_CHECK(j.is_object() && !j.empty(),
                    "{}: expected a JSON object mapping each token to its id; {}", path,
                    kFetchHint);

  const std::array<uint32_t, 256> cp_of_byte = byte_to_codepoint();
  std::unordered_map<uint32_t, uint8_t> byte_of_cp;
  for (int b = 0; b < 256; ++b) byte_of_cp[cp_of_byte[b]] = static_cast<uint8_t>(b);

  const auto n = static_cast<int64_t>(j.size());
  id_to_bytes_.assign(n, std::string());
  std::vector<bool> seen(n, false);
  byte_id_.fill(-1);
  std::string bytes;
  for (const auto& [token, value] : j.items()) {
    TETRA_INPUT_CHECK(value.is_number_integer(), "{}: token \"{}\" has id {}, expected an integer",
                      path, token, value.dump());
    const int64_t id = value.get<int64_t>();
    TETRA_INPUT_CHECK(id >= 0 && id < n,
                      "{}: token \"{}\" has id {}, outside [0, {}): the ids of {} tokens must be "
                      "0..{}; {}", path, token, id, n, n, n - 1, kFetchHint);
    TETRA_INPUT_CHECK(!seen[id], "{}: id {} is given to two tokens (one is \"{}\"); {}", path, id,
                      token, kFetchHint);
    seen[id] = true;
    uint32_t bad_cp = 0;
    TETRA_INPUT_CHECK(unmap_token(token, byte_of_cp, bytes, bad_cp),
                      "{}: token \"{}\" (id {}) has the character U+{:04X}, which is not one of "
                      "GPT-2's 256 byte characters; is this a byte-level BPE vocabulary? {}",
                      path, token, id, bad_cp, kFetchHint);
    if (bytes.size() == 1) byte_id_[static_cast<uint8_t>(bytes[0])] = static_cast<int32_t>(id);
    bytes_to_id[bytes] = static_cast<int32_t>(id);
    id_to_bytes_[id] = bytes;
    if (token == "<|endoftext|>") eod_id_ = static_cast<int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    TETRA_INPUT_CHECK(byte_id_[b] >= 0,
                      "{}: no token for the single byte 0x{:02X} (character U+{:04X}); a "
                      "byte-level vocabulary has all 256; {}", path, b, cp_of_byte[b], kFetchHint);
  }
  TETRA_INPUT_CHECK(eod_id_ >= 0, "{}: no \"<|endoftext|>\" token (GPT-2's end of document); {}",
                    path, kFetchHint);
}

void Gpt2Tokenizer::load_merges(const std::string& path,
                                const std::unordered_map<std::string, int32_t>& bytes_to_id) {
  const std::string text = read_whole_file(path);
  const std::array<uint32_t, 256> cp_of_byte = byte_to_codepoint();
  std::unordered_map<uint32_t, uint8_t> byte_of_cp;
  for (int b = 0; b < 256; ++b) byte_of_cp[cp_of_byte[b]] = static_cast<uint8_t>(b);

  std::vector<std::pair<uint64_t, MergeTable::Merge>> entries;
  int32_t rank = 0;
  int64_t line_no = 0;
  std::string left, right;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    if (line_no == 1 && line.starts_with("#version")) continue;  // OpenAI skips the first line
    const size_t space = line.find(' ');
    TETRA_INPUT_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                          line.find(' ', space + 1) == std::string_view::npos,
                      "{}:{}: expected a merge, two tokens separated by one space, got \"{}\"; {}",
                      path, line_no, line, kFetchHint);
    uint32_t bad_cp = 0;
    const bool ok = unmap_token(line.substr(0, space), byte_of_cp, left, bad_cp) &&
                    unmap_token(line.substr(space + 1), byte_of_cp, right, bad_cp);
    TETRA_INPUT_CHECK(ok, "{}:{}: the character U+{:04X} is not one of GPT-2's 256 byte "
                      "characters; {}", path, line_no, bad_cp, kFetchHint);
    const auto l = bytes_to_id.find(left), r = bytes_to_id.find(right),
               m = bytes_to_id.find(left + right);
    TETRA_INPUT_CHECK(l != bytes_to_id.end() && r != bytes_to_id.end() && m != bytes_to_id.end(),
                      "{}:{}: the merge \"{}\" names a token that is not in encoder.json (its "
                      "parts and their concatenation must all be): encoder.json and vocab.bpe do "
                      "not belong together; {}", path, line_no, line, kFetchHint);
    entries.push_back({MergeTable::pack(l->second, r->second), {rank++, m->second}});
  }
  TETRA_INPUT_CHECK(!entries.empty(), "{}: no merges; {}", path, kFetchHint);
  merges_.build(entries);
}

void Gpt2Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::unique_ptr<pcre2_match_data, MatchDataFree> md(
      pcre2_match_data_create_from_pattern(regex_, nullptr));
  TETRA_CHECK(md != nullptr, "out of memory for PCRE2 match data");
  // Made only if the JIT's default 32 KiB stack proves too small for some piece.
  std::unique_ptr<pcre2_match_context, MatchContextFree> context;
  std::unique_ptr<pcre2_jit_stack, JitStackFree> jit_stack;

  PieceCache& cache = t_piece_cache;
  if (cache.owner != serial_) {
    cache.index.clear();
    cache.ids.clear();
    cache.owner = serial_;
  }

  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE offset = 0;
  uint32_t options = 0;  // the first match validates the whole text as UTF-8; later ones skip it
  while (offset < text.size()) {
    int rc = pcre2_match(regex_, subject, text.size(), offset, options, md.get(), context.get());
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !jit_stack) {
      jit_stack.reset(pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr));
      context.reset(pcre2_match_context_create(nullptr));
      TETRA_CHECK(jit_stack && context, "out of memory for a PCRE2 JIT stack");
      pcre2_jit_stack_assign(context.get(), nullptr, jit_stack.get());
      rc = pcre2_match(regex_, subject, text.size(), offset, options, md.get(), context.get());
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
      throw InputError(fmt::format(
          "text is not valid UTF-8 at byte {} ({}); GPT-2's tokenizer reads UTF-8 text only: "
          "convert or drop the document", pcre2_get_startchar(md.get()), pcre2_message(rc)));
    }
    TETRA_CHECK(rc > 0, "PCRE2 match failed at byte {}: {}", offset, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    TETRA_CHECK(ov[1] > ov[0], "empty pre-tokenisation match at byte {}", ov[0]);
    encode_piece(text.substr(ov[0], ov[1] - ov[0]), out);
    offset = ov[1];
    options = PCRE2_NO_UTF_CHECK;
  }
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (piece.size() > kCacheMaxPiece) {
    bpe_long(piece, out);
    return;
  }
  PieceCache& cache = t_piece_cache;
  if (const auto it = cache.index.find(piece); it != cache.index.end()) {
    const auto [at, count] = it->second;
    out.insert(out.end(), cache.ids.begin() + at, cache.ids.begin() + at + count);
    return;
  }
  const size_t before = out.size();
  bpe_short(piece, out);
  if (cache.index.size() >= kCacheMaxEntries) {
    cache.index.clear();
    cache.ids.clear();
  }
  const auto at = static_cast<uint32_t>(cache.ids.size());
  cache.ids.insert(cache.ids.end(), out.begin() + before, out.end());
  const auto count = static_cast<uint32_t>(out.size() - before);
  cache.index.emplace(std::string(piece), std::pair<uint32_t, uint32_t>{at, count});
}

// OpenAI's loop, literally: find the best-ranked adjacent pair, merge all its occurrences.
void Gpt2Tokenizer::bpe_short(std::string_view piece, std::vector<int32_t>& out) const {
  static_assert(kCacheMaxPiece <= kShortPiece);
  if (piece.size() > kShortPiece) {
    bpe_long(piece, out);
    return;
  }
  std::array<int32_t, kShortPiece> sym;
  size_t m = piece.size();
  for (size_t i = 0; i < m; ++i) sym[i] = byte_id_[static_cast<uint8_t>(piece[i])];
  while (m > 1) {
    int32_t best_rank = INT32_MAX, best_id = -1, left = -1, right = -1;
    for (size_t i = 0; i + 1 < m; ++i) {
      const MergeTable::Merge* merge = merges_.find(sym[i], sym[i + 1]);
      if (merge != nullptr && merge->rank < best_rank) {
        best_rank = merge->rank;
        best_id = merge->id;
        left = sym[i];
        right = sym[i + 1];
      }
    }
    if (best_id < 0) break;
    size_t j = 0;
    for (size_t i = 0; i < m;) {
      if (i + 1 < m && sym[i] == left && sym[i + 1] == right) {
        sym[j++] = best_id;
        i += 2;
      } else {
        sym[j++] = sym[i++];
      }
    }
    m = j;
  }
  out.insert(out.end(), sym.begin(), sym.begin() + m);
}

// The same result in O(n log n): symbols in a linked list, candidate pairs in a min-heap ordered
// by (rank, position of the left symbol), drained one rank at a time.
void Gpt2Tokenizer::bpe_long(std::string_view piece, std::vector<int32_t>& out) const {
  const auto n = static_cast<int32_t>(piece.size());
  std::vector<int32_t> id(n), next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    id[i] = byte_id_[static_cast<uint8_t>(piece[i])];
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  std::vector<bool> alive(n, true);
  struct Candidate {
    int32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  std::vector<Candidate> created;  // pairs made by this round's merges, queued after the round
  auto consider = [&](int32_t pos, std::vector<Candidate>& into) {
    const int32_t nx = next[pos];
    if (nx < 0) return;
    if (const MergeTable::Merge* m = merges_.find(id[pos], id[nx]))
      into.push_back({m->rank, pos, id[pos], id[nx]});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i, created);
  for (const Candidate& c : created) heap.push(c);

  while (!heap.empty()) {
    const int32_t rank = heap.top().rank;
    created.clear();
    while (!heap.empty() && heap.top().rank == rank) {
      const Candidate c = heap.top();
      heap.pop();
      const int32_t nx = alive[c.pos] ? next[c.pos] : -1;
      if (nx < 0 || id[c.pos] != c.left || id[nx] != c.right) continue;  // stale
      id[c.pos] = merges_.find(c.left, c.right)->id;
      alive[nx] = false;
      next[c.pos] = next[nx];
      if (next[nx] >= 0) prev[next[nx]] = c.pos;
      if (prev[c.pos] >= 0) consider(prev[c.pos], created);
      consider(c.pos, created);
    }
    for (const Candidate& c : created) heap.push(c);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  const auto v = static_cast<int64_t>(id_to_bytes_.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    TETRA_INPUT_CHECK(ids[i] >= 0 && ids[i] < v,
                      "token id {} (at position {}) is outside GPT-2's vocabulary [0, {})", ids[i],
                      i, v);
    text += id_to_bytes_[ids[i]];
  }
  return text;
}

}  // namespace

std::unique_ptr<Tokenizer> load_gpt2_tokenizer(const std::string& dir) {
  return std::make_unique<Gpt2Tokenizer>(dir);
}

}  // namespace tetra
