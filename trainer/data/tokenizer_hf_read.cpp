// Reading a Hugging Face tokenizer: tokenizer.json (and tokenizer_config.json) to hf::Parts.
//
// Strict by design: every object of the pipeline is read field by field, and a type, a field or
// a value Tetra does not represent is an InputError that names the file and the field's path, e.g.
//   .../tokenizer.json: pre_tokenizer.pretokenizers[1].type "Digits" is not supported (...)
// A tokenizer that loads encodes as the Hugging Face library would; one that does not says why.
// (Unknown top-level keys are skipped, as the Rust library skips them.)
//
// Added tokens take the ids the Rust library gives them on loading (the vocabulary's id for a
// token it has, else the next free id); the file's "id" must be that id, so that every reader of
// the file agrees on it.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/data/bpe_tables.h"
#include "trainer/data/tokenizer_hf_parts.h"

namespace tetra::hf {
namespace {

using json = nlohmann::json;

std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string read_text_file(const std::string& path, const char* what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw InputError(fmt::format("{}: cannot open ({}); hf:<dir> needs the directory of a Hugging "
                                 "Face tokenizer ({})", path, std::strerror(errno), what));
  return read_text(path, what, "give the directory that holds tokenizer.json");
}


// A JSON object of the file at `path` ("model", "added_tokens[3]"), read field by field.
class Obj {
 public:
  Obj(const std::string& file, const json& j, std::string path)
      : file_(file), j_(j), path_(std::move(path)) {
    if (!j.is_object()) fail(path_, "must be an object, got " + show(j));
  }

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError(fmt::format("{}: {} {}", file_, field.empty() ? "the document" : field, what));
  }
  std::string at(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const std::string& path() const { return path_; }
  const std::string& file() const { return file_; }

  // Refuses any key outside `keys`: a field Tetra does not know could change the ids.
  void allow_only(std::initializer_list<const char*> keys) const {
    for (const auto& [key, value] : j_.items()) {
      bool known = false;
      for (const char* k : keys) known = known || key == k;
      if (!known) fail(at(key), show(value) + " is not supported (Tetra does not represent this field)");
    }
  }

  const json* find(const char* key) const {
    const auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  const json* find_non_null(const char* key) const {
    const json* v = find(key);
    return v == nullptr || v->is_null() ? nullptr : v;
  }
  const json& need(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) fail(at(key), "is missing");
    return *v;
  }
  std::string str(const char* key) const {
    const json& v = need(key);
    if (!v.is_string()) fail(at(key), "must be a string, got " + show(v));
    return v.get<std::string>();
  }
  std::optional<std::string> opt_str(const char* key) const {
    const json* v = find_non_null(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) fail(at(key), "must be a string or null, got " + show(*v));
    return v->get<std::string>();
  }
  bool flag(const char* key, bool dflt) const {
    const json* v = find_non_null(key);
    if (v == nullptr) return dflt;
    if (!v->is_boolean()) fail(at(key), "must be true or false, got " + show(*v));
    return v->get<bool>();
  }
  std::optional<bool> opt_flag(const char* key) const {
    if (find_non_null(key) == nullptr) return std::nullopt;
    return flag(key, false);
  }
  int64_t integer(const char* key, int64_t lo, int64_t hi) const {
    const json& v = need(key);
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      fail(at(key), fmt::format("must be an integer in [{}, {}], got {}", lo, hi, show(v)));
    return v.get<int64_t>();
  }
  const json& array(const char* key) const {
    const json& v = need(key);
    if (!v.is_array()) fail(at(key), "must be an array, got " + show(v));
    return v;
  }
  Obj obj(const char* key) const { return Obj(file_, need(key), at(key)); }
  Obj element(const char* key, size_t i) const {
    return Obj(file_, (*find(key))[i], fmt::format("{}[{}]", at(key), i));
  }
  [[noreturn]] void unsupported_type(const std::string& type, const char* supported) const {
    fail(at("type"), fmt::format("\"{}\" is not supported (Tetra reads {})", type, supported));
  }

 private:
  const std::string& file_;
  const json& j_;
  std::string path_;
};

// One UTF-8 character: its length in bytes (1 for a bad lead byte), or 0 at the end.
size_t utf8_length(std::string_view s) {
  if (s.empty()) return 0;
  const auto c = static_cast<uint8_t>(s[0]);
  const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size());
}

std::string one_character(const Obj& o, const char* key) {
  const std::string s = o.str(key);
  if (s.empty() || utf8_length(s) != s.size())
    o.fail(o.at(key), fmt::format("\"{}\" must be a single character", s));
  return s;
}

Pattern read_pattern(const Obj& o, const char* key) {
  const Obj p = o.obj(key);
  Pattern out;
  out.field = p.path();
  if (p.find("String") != nullptr) {
    p.allow_only({"String"});
    out.text = p.str("String");
    if (out.text.empty()) p.fail(p.at("String"), "is empty: an empty pattern matches nowhere");
  } else if (p.find("Regex") != nullptr) {
    p.allow_only({"Regex"});
    out.is_regex = true;
    out.text = p.str("Regex");
    out.field = p.at("Regex");
  } else {
    p.fail(p.path(), "must be {\"String\": ...} or {\"Regex\": ...}");
  }
  return out;
}

PrependScheme read_prepend_scheme(const Obj& o) {
  if (const std::optional<std::string> s = o.opt_str("prepend_scheme")) {
    if (*s == "always") return PrependScheme::ALWAYS;
    if (*s == "first") return PrependScheme::FIRST;
    if (*s == "never") return PrependScheme::NEVER;
    o.fail(o.at("prepend_scheme"), fmt::format("\"{}\" must be \"always\", \"first\" or \"never\"", *s));
  }
  // Files written before prepend_scheme existed say add_prefix_space.
  return o.flag("add_prefix_space", true) ? PrependScheme::ALWAYS : PrependScheme::NEVER;
}

void read_normalizer(const Obj& o, std::vector<Normalizer>& out) {
  const std::string type = o.str("type");
  Normalizer n;
  if (type == "Sequence") {
    o.allow_only({"type", "normalizers"});
    const json& list = o.array("normalizers");
    for (size_t i = 0; i < list.size(); ++i) read_normalizer(o.element("normalizers", i), out);
    return;
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    o.allow_only({"type"});
    n.kind = type == "NFC" ? NormalizerKind::NFC : type == "NFD" ? NormalizerKind::NFD
             : type == "NFKC" ? NormalizerKind::NFKC : NormalizerKind::NFKD;
  } else if (type == "Prepend") {
    o.allow_only({"type", "prepend"});
    n.kind = NormalizerKind::PREPEND;
    n.text = o.str("prepend");
  } else if (type == "Replace") {
    o.allow_only({"type", "pattern", "content"});
    n.kind = NormalizerKind::REPLACE;
    n.pattern = read_pattern(o, "pattern");
    n.text = o.str("content");
  } else if (type == "Strip") {
    o.allow_only({"type", "strip_left", "strip_right"});
    n.kind = NormalizerKind::STRIP;
    n.strip_left = o.flag("strip_left", false);
    n.strip_right = o.flag("strip_right", false);
  } else {
    o.unsupported_type(type, "Sequence, NFC, NFD, NFKC, NFKD, Prepend, Replace, Strip");
  }
  out.push_back(std::move(n));
}

void read_pre_tokenizer(const Obj& o, std::vector<PreTokenizer>& out) {
  const std::string type = o.str("type");
  PreTokenizer p;
  if (!out.empty() && out.back().kind == PreTokenizerKind::BYTE_LEVEL)
    o.fail(o.path(), "follows a ByteLevel pre-tokenizer: Tetra supports ByteLevel only as the last");
  if (type == "Sequence") {
    o.allow_only({"type", "pretokenizers"});
    const json& list = o.array("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) read_pre_tokenizer(o.element("pretokenizers", i), out);
    return;
  } else if (type == "Split") {
    o.allow_only({"type", "pattern", "behavior", "invert"});
    p.kind = PreTokenizerKind::SPLIT;
    p.pattern = read_pattern(o, "pattern");
    const std::string b = o.str("behavior");
    if (b == "Removed") p.behavior = SplitBehavior::REMOVED;
    else if (b == "Isolated") p.behavior = SplitBehavior::ISOLATED;
    else if (b == "MergedWithPrevious") p.behavior = SplitBehavior::MERGED_WITH_PREVIOUS;
    else if (b == "MergedWithNext") p.behavior = SplitBehavior::MERGED_WITH_NEXT;
    else if (b == "Contiguous") p.behavior = SplitBehavior::CONTIGUOUS;
    else
      o.fail(o.at("behavior"), fmt::format("\"{}\" is not supported (Removed, Isolated, "
                                           "MergedWithPrevious, MergedWithNext, Contiguous)", b));
    p.invert = o.flag("invert", false);
  } else if (type == "ByteLevel") {
    // trim_offsets concerns the offsets HF reports beside the ids, never the ids.
    o.allow_only({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    p.kind = PreTokenizerKind::BYTE_LEVEL;
    p.add_prefix_space = o.flag("add_prefix_space", true);
    p.use_regex = o.flag("use_regex", true);
  } else if (type == "Metaspace") {
    o.allow_only({"type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"});
    p.kind = PreTokenizerKind::METASPACE;
    p.replacement = one_character(o, "replacement");
    if (const auto rep = o.opt_str("str_rep"); rep && *rep != p.replacement)
      o.fail(o.at("str_rep"), fmt::format("\"{}\" differs from replacement \"{}\": not supported",
                                          *rep, p.replacement));
    p.prepend = read_prepend_scheme(o);
    p.split = o.flag("split", true);
  } else {
    o.unsupported_type(type, "Sequence, Split, ByteLevel, Metaspace");
  }
  out.push_back(std::move(p));
}

void read_decoder(const Obj& o, std::vector<Decoder>& out) {
  const std::string type = o.str("type");
  Decoder d;
  if (type == "Sequence") {
    o.allow_only({"type", "decoders"});
    const json& list = o.array("decoders");
    for (size_t i = 0; i < list.size(); ++i) read_decoder(o.element("decoders", i), out);
    return;
  } else if (type == "ByteLevel") {
    o.allow_only({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    d.kind = DecoderKind::BYTE_LEVEL;
  } else if (type == "Replace") {
    o.allow_only({"type", "pattern", "content"});
    d.kind = DecoderKind::REPLACE;
    const Pattern p = read_pattern(o, "pattern");
    if (p.is_regex) o.fail(p.field, "is not supported in a decoder (a String pattern is)");
    d.pattern = p.text;
    d.content = o.str("content");
  } else if (type == "ByteFallback") {
    o.allow_only({"type"});
    d.kind = DecoderKind::BYTE_FALLBACK;
  } else if (type == "Fuse") {
    o.allow_only({"type"});
    d.kind = DecoderKind::FUSE;
  } else if (type == "Strip") {
    o.allow_only({"type", "content", "start", "stop"});
    d.kind = DecoderKind::STRIP;
    d.strip = one_character(o, "content");
    d.start = o.integer("start", 0, INT32_MAX);
    d.stop = o.integer("stop", 0, INT32_MAX);
  } else if (type == "Metaspace") {
    o.allow_only({"type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep"});
    d.kind = DecoderKind::METASPACE;
    d.replacement = one_character(o, "replacement");
    d.prepend = read_prepend_scheme(o);
  } else {
    o.unsupported_type(type, "Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace");
  }
  out.push_back(std::move(d));
}

// Undoes the byte-level mapping of `s`; false when `s` has a character that stands for no byte.
bool unmap_bytes(std::string_view s, const std::unordered_map<uint32_t, uint8_t>& byte_of_cp,
                 std::string& out) {
  out.clear();
  while (!s.empty()) {
    const size_t len = utf8_length(s);
    const auto c = static_cast<uint8_t>(s[0]);
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[k]) & 0x3F);
    s.remove_prefix(len);
    const auto it = byte_of_cp.find(cp);
    if (it == byte_of_cp.end()) return false;
    out.push_back(static_cast<char>(it->second));
  }
  return true;
}

void read_model(const Obj& root, Parts& parts,
                std::unordered_map<std::string, int32_t>& file_vocab) {
  const Obj m = root.obj("model");
  m.allow_only({"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
  const json* type = m.find("type");
  if (type == nullptr) m.fail(m.at("type"), "is missing (Tetra reads \"BPE\" models)");
  if (!type->is_string() || *type != "BPE")
    m.fail(m.at("type"), show(*type) + " is not supported (Tetra reads \"BPE\" models)");
  if (const json* d = m.find_non_null("dropout");
      d != nullptr && !(d->is_number() && d->get<double>() == 0.0))
    m.fail(m.at("dropout"), show(*d) + " is not supported: BPE dropout makes encoding random");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const auto s = m.opt_str(key); s && !s->empty())
      m.fail(m.at(key), fmt::format("\"{}\" is not supported (only an empty one)", *s));
  }
  parts.fuse_unk = m.flag("fuse_unk", false);
  parts.byte_fallback = m.flag("byte_fallback", false);
  parts.ignore_merges = m.flag("ignore_merges", false);

  const json& vocab = m.need("vocab");
  if (!vocab.is_object() || vocab.empty())
    m.fail(m.at("vocab"), "must be a non-empty object mapping each token to its id");
  std::unordered_map<uint32_t, uint8_t> byte_of_cp;
  const std::array<uint32_t, 256> cp_of_byte = byte_to_codepoint();
  for (int b = 0; b < 256; ++b) byte_of_cp[cp_of_byte[b]] = static_cast<uint8_t>(b);
  std::string bytes;
  int64_t max_id = -1;
  for (const auto& [token, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= INT32_MAX)
      m.fail(m.at("vocab"), fmt::format("\"{}\" has id {}: ids are integers in [0, 2^31-1)", token,
                                        show(value)));
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    max_id = std::max<int64_t>(max_id, id);
    file_vocab.emplace(token, id);
    if (!parts.byte_level) {
      parts.model_vocab.emplace(token, id);
    } else if (unmap_bytes(token, byte_of_cp, bytes)) {
      parts.model_vocab.emplace(bytes, id);
    }
    // (A byte-level token with a character that stands for no byte can never come out of the
    // byte-level pre-tokenizer: it stays for decoding only, as in the Rust library.)
  }
  // The id tables are dense (one entry per id up to the largest), so an id far beyond the number
  // of tokens would size them by the id rather than by the file: such an id is refused.
  const auto tokens = static_cast<int64_t>(file_vocab.size());
  const int64_t id_limit = 2 * tokens + 65536;
  if (max_id >= id_limit) {
    for (const auto& [token, id] : file_vocab) {
      if (id == max_id)
        m.fail(m.at("vocab"),
               fmt::format("\"{}\" has id {} but the vocabulary has {} tokens: Tetra reads ids "
                           "below 2 x tokens + 65536 ({}); renumber the vocabulary densely",
                           token, id, tokens, id_limit));
    }
  }
  parts.vocab_size = max_id + 1;
  parts.token_text.assign(static_cast<size_t>(parts.vocab_size), std::string());
  parts.has_id.assign(static_cast<size_t>(parts.vocab_size), 0);
  for (const auto& [token, id] : file_vocab) {
    if (parts.has_id[id])
      m.fail(m.at("vocab"), fmt::format("gives id {} to two tokens (\"{}\" and \"{}\")", id,
                                        parts.token_text[id], token));
    parts.has_id[id] = 1;
    parts.token_text[id] = token;
  }
  if (const auto unk = m.opt_str("unk_token")) {
    const auto it = file_vocab.find(*unk);
    if (it == file_vocab.end())
      m.fail(m.at("unk_token"), fmt::format("\"{}\" is not in model.vocab", *unk));
    parts.unk_id = it->second;
  }

  const json& merges = m.array("merges");
  parts.merges.reserve(merges.size());
  std::string left, right;
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& e = merges[i];
    const std::string at = fmt::format("{}[{}]", m.at("merges"), i);
    if (e.is_string()) {  // "left right" (files written before tokenizers 0.20)
      const std::string& s = e.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos)
        m.fail(at, fmt::format("\"{}\" must be two tokens separated by one space", s));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      m.fail(at, show(e) + " must be \"left right\" or [\"left\", \"right\"]");
    }
    const auto l = file_vocab.find(left), r = file_vocab.find(right),
               merged = file_vocab.find(left + right);
    if (l == file_vocab.end() || r == file_vocab.end() || merged == file_vocab.end())
      m.fail(at, fmt::format("\"{}\" + \"{}\": {} is not in model.vocab", left, right,
                             l == file_vocab.end()   ? "\"" + left + "\""
                             : r == file_vocab.end() ? "\"" + right + "\""
                                                     : "the merged \"" + left + right + "\""));
    parts.merges.push_back({l->second, r->second, merged->second});
  }
}

void read_added_tokens(const Obj& root, Parts& parts,
                       std::unordered_map<std::string, int32_t>& file_vocab) {
  const json* list = root.find_non_null("added_tokens");
  if (list == nullptr) return;
  if (!list->is_array()) root.fail("added_tokens", "must be an array, got " + show(*list));
  const auto model_size = static_cast<int64_t>(file_vocab.size());
  std::map<std::string, int32_t> added_ids;  // content -> id, as the Rust library assigns them
  int64_t max_added = -1;
  for (size_t i = 0; i < list->size(); ++i) {
    const Obj t = root.element("added_tokens", i);
    t.allow_only({"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    AddedToken a;
    a.id = static_cast<int32_t>(t.integer("id", 0, INT32_MAX - 1));
    a.content = t.str("content");
    if (a.content.empty()) t.fail(t.at("content"), "is empty");
    a.special = t.flag("special", false);
    a.single_word = t.flag("single_word", false);
    a.lstrip = t.flag("lstrip", false);
    a.rstrip = t.flag("rstrip", false);
    a.normalized = t.flag("normalized", !a.special);
    // The id the Rust library gives it: its own if it has one, else the vocabulary's, else the
    // next free one.
    int64_t expect = 0;
    if (const auto it = added_ids.find(a.content); it != added_ids.end()) {
      expect = it->second;
    } else if (const auto v = file_vocab.find(a.content); v != file_vocab.end()) {
      expect = v->second;
    } else {
      expect = max_added < 0 ? model_size
               : (max_added >= model_size || model_size == 0) ? max_added + 1
                                                              : model_size;
    }
    if (a.id != expect)
      t.fail(t.at("id"), fmt::format("{} for \"{}\" is not the id the Hugging Face library gives "
                                     "this token when it loads the file ({}): the file is "
                                     "inconsistent", a.id, a.content, expect));
    added_ids[a.content] = a.id;
    max_added = std::max<int64_t>(max_added, a.id);
    if (a.id >= parts.vocab_size) {
      parts.vocab_size = a.id + 1;
      parts.token_text.resize(a.id + 1);
      parts.has_id.resize(a.id + 1, 0);
    }
    parts.has_id[a.id] = 1;
    parts.token_text[a.id] = a.content;
    file_vocab[a.content] = a.id;
    bool dup = false;
    for (AddedToken& old : parts.added) {
      if (old.content == a.content) {
        old = a;  // a later entry of the same token replaces the earlier one
        dup = true;
      }
    }
    if (!dup) parts.added.push_back(std::move(a));
  }
}

// The TemplateProcessing's single-sequence template: the special tokens before and after $A.
void read_template(const Obj& p, Parts& parts) {
  p.allow_only({"type", "single", "pair", "special_tokens"});
  const Obj specials = p.obj("special_tokens");
  const json& single = p.array("single");
  bool seen_a = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const Obj item = p.element("single", i);
    if (item.find("SpecialToken") != nullptr) {
      item.allow_only({"SpecialToken"});
      const Obj st = item.obj("SpecialToken");
      st.allow_only({"id", "type_id"});
      const std::string name = st.str("id");
      const json* entry = specials.find(name.c_str());
      if (entry == nullptr)
        st.fail(st.at("id"), fmt::format("\"{}\" is not in {}", name, specials.path()));
      const Obj e(p.file(), *entry, specials.at(name));
      e.allow_only({"id", "ids", "tokens"});
      const json& ids = e.array("ids");
      for (size_t k = 0; k < ids.size(); ++k) {
        if (!ids[k].is_number_integer() || ids[k].get<int64_t>() < 0 ||
            ids[k].get<int64_t>() >= parts.vocab_size || !parts.has_id[ids[k].get<int64_t>()])
          e.fail(fmt::format("{}[{}]", e.at("ids"), k), show(ids[k]) + " is no token's id");
        (seen_a ? parts.suffix_ids : parts.prefix_ids).push_back(ids[k].get<int32_t>());
      }
    } else if (item.find("Sequence") != nullptr) {
      item.allow_only({"Sequence"});
      const Obj seq = item.obj("Sequence");
      seq.allow_only({"id", "type_id"});
      if (seq.str("id") != "A" || seen_a)
        seq.fail(seq.at("id"), "must be \"A\", once: a single-sequence template holds its text once");
      seen_a = true;
    } else {
      item.fail(item.path(), "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
  }
  if (!seen_a) p.fail(p.at("single"), "has no {\"Sequence\": {\"id\": \"A\"}}: where does the text go?");
}

void read_post_processor(const Obj& p, Parts& parts, bool& has_template) {
  const std::string type = p.str("type");
  if (type == "ByteLevel") {  // offsets only
    p.allow_only({"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "TemplateProcessing") {
    if (has_template) p.fail(p.path(), "is a second TemplateProcessing: not supported");
    has_template = true;
    read_template(p, parts);
  } else if (type == "Sequence") {
    p.allow_only({"type", "processors"});
    const json& list = p.array("processors");
    for (size_t i = 0; i < list.size(); ++i)
      read_post_processor(p.element("processors", i), parts, has_template);
  } else {
    p.unsupported_type(type, "ByteLevel, TemplateProcessing, Sequence");
  }
}

// bos_token / eos_token of tokenizer_config.json: a string, null, or {"content": ...}.
int32_t read_special(const Obj& c, const char* key,
                     const std::unordered_map<std::string, int32_t>& file_vocab,
                     const std::string& json_path) {
  const json* v = c.find_non_null(key);
  if (v == nullptr) return -1;
  std::string content;
  if (v->is_string()) {
    content = v->get<std::string>();
  } else if (v->is_object() && v->contains("content") && (*v)["content"].is_string()) {
    content = (*v)["content"].get<std::string>();
  } else {
    c.fail(key, show(*v) + " must be a token (a string, or an object with \"content\")");
  }
  const auto it = file_vocab.find(content);
  if (it == file_vocab.end())
    c.fail(key, fmt::format("\"{}\" is no token of {}", content, json_path));
  return it->second;
}

void read_config(const std::string& path, Parts& parts,
                 const std::unordered_map<std::string, int32_t>& file_vocab) {
  const json j = parse_json_text(path, read_text_file(path, "tokenizer_config.json"));
  const Obj c(path, j, "");
  parts.bos_id = read_special(c, "bos_token", file_vocab, parts.json_path);
  parts.eos_id = read_special(c, "eos_token", file_vocab, parts.json_path);
  // add_bos_token / add_eos_token rebuild the template as transformers' Llama tokenizers do:
  // [bos] $A [eos], each where asked for; a side the config says nothing of keeps the template's.
  const std::optional<bool> add_bos = c.opt_flag("add_bos_token");
  const std::optional<bool> add_eos = c.opt_flag("add_eos_token");
  if (add_bos) {
    if (*add_bos && parts.bos_id < 0) c.fail("add_bos_token", "is true but bos_token names no token");
    parts.prefix_ids.clear();
    if (*add_bos) parts.prefix_ids.push_back(parts.bos_id);
  }
  if (add_eos) {
    if (*add_eos && parts.eos_id < 0) c.fail("add_eos_token", "is true but eos_token names no token");
    parts.suffix_ids.clear();
    if (*add_eos) parts.suffix_ids.push_back(parts.eos_id);
  }
  if (c.flag("split_special_tokens", false))
    c.fail("split_special_tokens", "true is not supported: added tokens are always matched");
  // add_prefix_space makes transformers rebuild the pre-tokenizer; Tetra reads it only where it
  // agrees with tokenizer.json.
  if (const std::optional<bool> aps = c.opt_flag("add_prefix_space")) {
    bool file_adds = false;
    for (const PreTokenizer& p : parts.pre_tokenizers) {
      if (p.kind == PreTokenizerKind::BYTE_LEVEL) file_adds = file_adds || p.add_prefix_space;
      if (p.kind == PreTokenizerKind::METASPACE) file_adds = file_adds || p.prepend != PrependScheme::NEVER;
    }
    if (*aps != file_adds)
      c.fail("add_prefix_space", fmt::format("{} disagrees with the pre-tokenizer of {} (which {}): "
                                             "not supported", *aps, parts.json_path,
                                             file_adds ? "adds one" : "adds none"));
  }
}

}  // namespace

Parts read_parts(const std::string& dir) {
  Parts parts;
  parts.dir = dir;
  parts.json_path = dir + "/tokenizer.json";
  const json j = parse_json_text(parts.json_path, read_text_file(parts.json_path, "tokenizer.json"));
  const Obj root(parts.json_path, j, "");

  if (const auto v = root.opt_str("version"); v && *v != "1.0")
    root.fail("version", fmt::format("\"{}\" is not supported (\"1.0\")", *v));
  for (const char* key : {"truncation", "padding"}) {
    if (const json* v = root.find_non_null(key))
      root.fail(key, show(*v) + " is not supported: Tetra encodes whole documents (set it to null)");
  }
  if (const json* n = root.find_non_null("normalizer"); n != nullptr)
    read_normalizer(Obj(parts.json_path, *n, "normalizer"), parts.normalizers);
  if (const json* p = root.find_non_null("pre_tokenizer"); p != nullptr)
    read_pre_tokenizer(Obj(parts.json_path, *p, "pre_tokenizer"), parts.pre_tokenizers);
  parts.byte_level = !parts.pre_tokenizers.empty() &&
                     parts.pre_tokenizers.back().kind == PreTokenizerKind::BYTE_LEVEL;

  std::unordered_map<std::string, int32_t> file_vocab;  // the file's spelling -> id
  read_model(root, parts, file_vocab);
  read_added_tokens(root, parts, file_vocab);

  bool has_template = false;
  if (const json* p = root.find_non_null("post_processor"); p != nullptr)
    read_post_processor(Obj(parts.json_path, *p, "post_processor"), parts, has_template);
  if (const json* d = root.find_non_null("decoder"); d != nullptr) {
    parts.decoders.emplace();
    read_decoder(Obj(parts.json_path, *d, "decoder"), *parts.decoders);
  }

  const std::string config = dir + "/tokenizer_config.json";
  struct stat st;
  if (::stat(config.c_str(), &st) == 0) {
    parts.config_path = config;
    read_config(config, parts, file_vocab);
  }
  if (parts.eos_id < 0) {
    // Without tokenizer_config.json's eos_token, a file with one special token means that one.
    int32_t only = -1, count = 0;
    for (const AddedToken& a : parts.added) {
      if (a.special) {
        only = a.id;
        ++count;
      }
    }
    if (count != 1)
      throw InputError(fmt::format(
          "{}: {}: Tetra ends every document with the end-of-document (EOS) token, and {} has {} "
          "special tokens to choose from; give tokenizer_config.json with \"eos_token\"",
          config, parts.config_path.empty() ? "is missing" : "eos_token is missing or null",
          parts.json_path, count));
    parts.eos_id = only;
  }
  return parts;
}

}  // namespace tetra::hf
