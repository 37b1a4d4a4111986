// Input side of dataset preparation: listing input files, UTF-8 validation, cutting files into
// documents, and pulling the text out of a JSON line. See prepare_input.h.
#include "trainer/data/prepare_input.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/core/files.h"

namespace tetra {

namespace fs = std::filesystem;

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

int64_t file_size(const fs::path& p) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(p, ec);
  TETRA_INPUT_CHECK(!ec, "cannot read the size of {}: {}", p.string(), ec.message());
  return static_cast<int64_t>(size);
}

// An input file for reading; InputError if it cannot be opened or is no longer a regular file
// (replaced by a named pipe since it was listed: never block on it).
std::FILE* open_input(const std::string& path) {
  const int fd = open_regular_file(path, "input", "");
  std::FILE* f = ::fdopen(fd, "rb");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    throw InputError(fmt::format("cannot open input {}: {}", path, std::strerror(err)));
  }
  return f;
}

// The lead byte at `s[at]` and the continuation bytes after it, as "0xE2 0x82", for messages.
std::string show_bytes(std::string_view s, size_t at) {
  std::string out;
  for (size_t i = at; i < s.size() && i < at + 4; ++i) {
    if (i > at && (static_cast<uint8_t>(s[i]) & 0xC0) != 0x80) break;  // not a continuation
    if (!out.empty()) out += ' ';
    out += fmt::format("0x{:02X}", static_cast<uint8_t>(s[i]));
  }
  return out;
}

// nlohmann's DOM builder, but a failure is kept rather than thrown, with its byte column: the
// exceptions nlohmann throws carry no position for a number that overflows a double
// (out_of_range.406) and only an English sentence for the rest. sax_parse calls parse_error on
// this class (a template parameter, not a virtual call), so the DOM builder's own, which throws,
// is hidden.
class JsonLineParser : public nlohmann::detail::json_sax_dom_parser<nlohmann::json> {
 public:
  struct Failure {
    int64_t column = 0;  // 1-based byte column where the parser stopped
    std::string token;   // what it last read
    std::string why;     // nlohmann's message without its "[json.exception...] " tag or position
    bool overflow = false;
  };

  explicit JsonLineParser(nlohmann::json& result) : json_sax_dom_parser(result, false) {}

  template <class Exception>
  bool parse_error(std::size_t position, const std::string& last_token, const Exception& ex) {
    failed = true;
    failure.column = static_cast<int64_t>(position);
    failure.token = last_token;
    failure.overflow = ex.id == 406;  // out_of_range.406: "number overflow parsing"
    std::string why = ex.what();
    size_t cut = why.find("] ");
    if (cut != std::string::npos) why = why.substr(cut + 2);
    // "parse error at line 1, column 4: syntax error ..." -> "syntax error ...".
    if (why.rfind("parse error at line ", 0) == 0 && (cut = why.find(": ")) != std::string::npos)
      why = why.substr(cut + 2);
    failure.why = std::move(why);
    return false;
  }

  bool failed = false;
  Failure failure;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------------------------
std::vector<InputFile> list_input_files(const std::vector<std::string>& inputs,
                                        std::string_view dir_extension) {
  TETRA_INPUT_CHECK(!inputs.empty(), "no input files given");
  std::vector<InputFile> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(input, ec);
    TETRA_INPUT_CHECK(fs::exists(st), "input {} does not exist", input);
    if (fs::is_regular_file(st)) {
      files.push_back({input, file_size(input)});
      continue;
    }
    if (!fs::is_directory(st)) {
      struct stat raw;
      const bool known = ::stat(input.c_str(), &raw) == 0;
      throw InputError(fmt::format(
          "input {} is {}, not a regular file or a directory; give the files themselves (a named "
          "pipe or a device cannot be read twice or sized; copy its contents into a file first)",
          input, known ? file_kind_name(raw.st_mode) : "not a file"));
    }
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(input, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      // The error_code forms: the throwing ones would let a filesystem_error out.
      std::error_code type_ec;
      if (hidden(it->path())) {
        if (it->is_directory(type_ec)) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file(type_ec)) continue;  // pipes, sockets, devices, dangling links
      const std::string path = it->path().string();
      if (dir_extension.empty() || ends_with(path, dir_extension)) found.push_back(path);
    }
    TETRA_INPUT_CHECK(!ec, "cannot list directory {}: {}", input, ec.message());
    TETRA_INPUT_CHECK(
        !found.empty(), "directory {} holds no {}", input,
        dir_extension.empty() ? std::string("files") : fmt::format("{} files", dir_extension));
    std::sort(found.begin(), found.end());
    for (std::string& path : found) {
      const int64_t size = file_size(path);
      files.push_back({std::move(path), size});
    }
  }
  return files;
}

std::vector<std::string> input_paths(const std::vector<InputFile>& files) {
  std::vector<std::string> paths;
  for (const InputFile& f : files) paths.push_back(f.path);
  return paths;
}

void check_files_not_empty(const std::vector<InputFile>& files) {
  for (const InputFile& f : files)
    TETRA_INPUT_CHECK(f.size > 0, "{}: the file is empty: there is no document in it", f.path);
}

void check_output_prefix(const std::string& prefix, std::string_view what) {
  TETRA_INPUT_CHECK(!prefix.empty(), "{} is empty: give a path prefix such as data/corpus", what);
  for (std::string_view ext : {".bin", ".idx"}) {
    TETRA_INPUT_CHECK(!ends_with(prefix, ext),
                      "{} {} ends in {}: it is a prefix without extension (PREFIX.bin and "
                      "PREFIX.idx are written); did you mean {}?",
                      what, prefix, ext, prefix.substr(0, prefix.size() - ext.size()));
  }
  const std::string name = fs::path(prefix).filename().string();
  TETRA_INPUT_CHECK(!name.empty() && name != "." && name != "..",
                    "{} {} names a directory, not a prefix: give the files' name too, e.g. {}corpus", what, prefix,
                    prefix.ends_with('/') ? prefix : prefix + "/");
  fs::path dir = fs::path(prefix).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  TETRA_INPUT_CHECK(fs::is_directory(dir, ec),
                    "{} {}: the directory {} does not exist; create it first", what, prefix,
                    dir.string());
  TETRA_INPUT_CHECK(::access(dir.c_str(), W_OK) == 0, "{} {}: the directory {} is not writable: {}",
                    what, prefix, dir.string(), std::strerror(errno));
}

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------
int64_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs, 8 bytes at a time.
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    const uint8_t c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Lead byte: sequence length and the allowed range of the second byte (table 3-7).
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlong 3-byte forms
      if (c == 0xED) hi = 0x9F;  // no surrogates U+D800..U+DFFF
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // no overlong 4-byte forms
      if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
    } else {
      return static_cast<int64_t>(i);  // 0x80..0xC1 (stray continuation, overlong), 0xF5..0xFF
    }
    if (i + len > n) return static_cast<int64_t>(i);
    if (p[i + 1] < lo || p[i + 1] > hi) return static_cast<int64_t>(i);
    for (size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return static_cast<int64_t>(i);
    i += len;
  }
  return -1;
}

void check_utf8(std::string_view text, std::string_view file, int64_t first_line,
                int64_t file_offset) {
  const int64_t bad = find_invalid_utf8(text);
  if (bad < 0) return;
  const std::string_view before = text.substr(0, static_cast<size_t>(bad));
  const int64_t line = first_line + std::count(before.begin(), before.end(), '\n');
  const size_t line_start = before.rfind('\n');
  const int64_t column = static_cast<int64_t>(
      line_start == std::string_view::npos ? before.size() + 1 : before.size() - line_start);
  throw InputError(fmt::format(
      "{}:{}: invalid UTF-8 at byte {} of the file (column {}): {} is not a UTF-8 character; "
      "the input must be UTF-8 text (convert it, e.g. iconv -f latin1 -t utf-8)",
      file, line, file_offset + bad, column, show_bytes(text, static_cast<size_t>(bad))));
}

void check_text_files(const std::vector<InputFile>& files) {
  check_files_not_empty(files);
  std::vector<RawDocument> batch;
  DocumentReader reader(files, DocumentFormat::TEXT);
  std::string storage;
  while (reader.next_batch(batch, 1, 1)) document_text(batch[0], DocumentFormat::TEXT, "", storage);
}

// ---------------------------------------------------------------------------------------------
// Reading documents
// ---------------------------------------------------------------------------------------------
DocumentReader::DocumentReader(std::vector<InputFile> files, DocumentFormat format)
    : files_(std::move(files)), format_(format) {
  for (const InputFile& f : files_) bytes_total_ += f.size;
}

DocumentReader::~DocumentReader() {
  if (current_ != nullptr) std::fclose(current_);
  std::free(line_buf_);
}

bool DocumentReader::next_batch(std::vector<RawDocument>& out, size_t max_docs, int64_t max_bytes) {
  out.clear();
  int64_t bytes = 0;
  while (out.empty() || (out.size() < max_docs && bytes < max_bytes)) {
    RawDocument doc;
    if (!next_document(doc)) break;
    bytes += static_cast<int64_t>(doc.data.size());
    out.push_back(std::move(doc));
  }
  return !out.empty();
}

bool DocumentReader::next_document(RawDocument& doc) {
  if (format_ == DocumentFormat::JSONL) return next_line(doc);
  if (next_file_ == files_.size()) return false;
  const InputFile& f = files_[next_file_++];
  std::FILE* in = open_input(f.path);
  struct stat st;
  const bool sized = ::fstat(::fileno(in), &st) == 0;
  doc.data.resize(sized ? static_cast<size_t>(st.st_size) : 0);
  const size_t got = std::fread(doc.data.data(), 1, doc.data.size(), in);
  const bool failed = std::ferror(in) != 0;
  std::fclose(in);
  TETRA_INPUT_CHECK(sized && !failed && got == doc.data.size(), "cannot read {}: {}", f.path,
                    std::strerror(errno));
  TETRA_INPUT_CHECK(!doc.data.empty(), "{}: the file is empty: there is no document in it", f.path);
  doc.file = f.path;
  doc.line = 1;
  doc.offset = 0;
  bytes_read_ += static_cast<int64_t>(doc.data.size());
  return true;
}

bool DocumentReader::next_line(RawDocument& doc) {
  for (;;) {
    if (current_ == nullptr) {
      if (next_file_ == files_.size()) return false;
      current_index_ = next_file_++;
      const std::string& path = files_[current_index_].path;
      current_ = open_input(path);
      line_ = 0;
      offset_ = 0;
      documents_in_file_ = 0;
    }
    const std::string& path = files_[current_index_].path;
    errno = 0;
    const ssize_t got = ::getline(&line_buf_, &line_cap_, current_);
    if (got < 0) {
      const bool failed = std::ferror(current_) != 0;
      const int err = errno;
      std::fclose(current_);
      current_ = nullptr;
      TETRA_INPUT_CHECK(!failed, "cannot read {}: {}", path, std::strerror(err));
      TETRA_INPUT_CHECK(documents_in_file_ > 0,
                        "{}: the file is empty: it has {} blank line(s) and no JSON line", path,
                        line_);
      continue;
    }
    ++line_;
    const int64_t start = offset_;
    offset_ += got;
    bytes_read_ += got;
    size_t len = static_cast<size_t>(got);
    if (len > 0 && line_buf_[len - 1] == '\n') --len;
    if (len > 0 && line_buf_[len - 1] == '\r') --len;
    const std::string_view line(line_buf_, len);
    if (line.find_first_not_of(" \t\r\f\v") == std::string_view::npos) continue;  // blank
    doc.data.assign(line);
    doc.file = path;
    doc.line = line_;
    doc.offset = start;
    ++documents_in_file_;
    return true;
  }
}

// ---------------------------------------------------------------------------------------------
// Text of a document
// ---------------------------------------------------------------------------------------------
std::string_view document_text(const RawDocument& doc, DocumentFormat format,
                               const std::string& json_key, std::string& storage) {
  check_utf8(doc.data, doc.file, doc.line, doc.offset);
  if (format == DocumentFormat::TEXT) return doc.data;

  nlohmann::json j;
  JsonLineParser parser(j);
  if (!nlohmann::json::sax_parse(doc.data.begin(), doc.data.end(), &parser)) {
    TETRA_CHECK(parser.failed, "{}:{}: the JSON parser stopped without an error", doc.file,
                doc.line);
    const JsonLineParser::Failure& f = parser.failure;
    if (f.overflow) {
      // nlohmann reports the position of the number's last byte; the message names its first.
      const int64_t column = f.column - static_cast<int64_t>(f.token.size()) + 1;
      throw InputError(fmt::format(
          "{}:{}:{}: the number {} is too large for a double (its magnitude exceeds 1.8e308); write "
          "it as a string (\"{}\") or a smaller number",
          doc.file, doc.line, column, f.token, f.token));
    }
    throw InputError(
        fmt::format("{}:{}:{}: the line is not JSON ({}); each line must be an "
                    "object such as {{\"{}\": \"...\"}}",
                    doc.file, doc.line, f.column, f.why, json_key));
  }
  TETRA_INPUT_CHECK(j.is_object(),
                    "{}:{}: the line is a JSON {}, not an object; each line must be an object "
                    "such as {{\"{}\": \"...\"}}",
                    doc.file, doc.line, j.type_name(), json_key);
  const auto it = j.find(json_key);
  if (it == j.end()) {
    std::string keys;
    int shown = 0;
    for (const auto& [key, value] : j.items()) {
      if (shown++ == 8) {
        keys += ", ...";
        break;
      }
      keys += (keys.empty() ? "\"" : ", \"") + key + "\"";
    }
    throw InputError(fmt::format(
        "{}:{}: the object has no \"{}\" field (its fields: {}); pass --json-key to read another "
        "field",
        doc.file, doc.line, json_key, keys.empty() ? "none" : keys));
  }
  TETRA_INPUT_CHECK(it->is_string(), "{}:{}: field \"{}\" is a JSON {}, not a string", doc.file,
                    doc.line, json_key, it->type_name());
  storage = std::move(it->get_ref<std::string&>());
  return storage;
}

}  // namespace tetra
