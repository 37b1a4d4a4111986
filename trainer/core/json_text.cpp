#include "trainer/core/json_text.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/core/files.h"
#include "trainer/core/format.h"

namespace tetra {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxDepth = 256;  // arrays and objects inside one another

// "file:line:column" of byte offset `pos` of `text` (1-based line and column).
std::string text_position(const std::string& file, const std::string& text, size_t pos, int64_t first_line) {
  pos = std::min(pos, text.size());
  int64_t line = first_line;
  size_t line_start = 0;
  for (size_t i = 0; i < pos; ++i)
    if (text[i] == '\n') ++line, line_start = i + 1;
  return fmt::format("{}:{}:{}", file, line, pos - line_start + 1);
}

// The byte offset at which the parser stops on `text` (the end of the token it refused): a SAX
// parse that records the position of its error. nlohmann reports a number too large for a double
// (1e999) as out_of_range, without a position.
size_t error_offset(const std::string& text) {
  struct Locator : nlohmann::json_sax<json> {
    size_t at = 0;
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override { return true; }
    bool key(string_t&) override { return true; }
    bool end_object() override { return true; }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception&) override {
      at = position;
      return false;
    }
  } locator;
  json::sax_parse(text, &locator, json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/true);
  return locator.at;
}

// What the parser says, without its "[json.exception.parse_error.101] parse error at line L,
// column C: " prefix (the position is given our way).
std::string parser_reason(const std::string& what) {
  std::string why = what;
  const size_t at = why.find("parse error");
  const size_t colon = at == std::string::npos ? std::string::npos : why.find(": ", at);
  if (colon != std::string::npos) return why.substr(colon + 2);
  const size_t bracket = why.find("] ");
  return bracket == std::string::npos ? why : why.substr(bracket + 2);
}

}  // namespace

json parse_json_text(const std::string& file, const std::string& text, const JsonProblemSink& problems,
                     int64_t first_line) {
  struct Frame {
    bool array = false;
    size_t count = 0;  // elements of an array seen so far
    std::set<std::string> keys;
    std::string key;  // the object's current key
  };
  std::vector<Frame> stack;
  auto location = [&] {
    std::string s;
    for (const Frame& f : stack)
      s += f.array ? fmt::format("[{}]", f.count - 1) : (s.empty() ? "" : ".") + f.key;
    return s.empty() ? std::string("(the document)") : s;
  };
  auto element_starts = [&] {
    if (!stack.empty() && stack.back().array) ++stack.back().count;
  };
  using event = json::parse_event_t;
  auto callback = [&](int, event ev, json& parsed) {
    switch (ev) {
      case event::object_start:
      case event::array_start:
        element_starts();
        // Every reader (and dump, and destruction) of a value recurses over its nesting: a deep
        // one would exhaust the stack. No file Tetra reads nests anywhere near this.
        if (stack.size() >= kMaxDepth) {
          std::string where = location();
          if (where.size() > 60) where = where.substr(0, 60) + "...";
          throw InputError(fmt::format("{}: {}: nested more than {} levels deep; no file Tetra reads nests so deep",
                                       file, where, kMaxDepth));
        }
        stack.push_back({ev == event::array_start, 0, {}, {}});
        break;
      case event::object_end:
      case event::array_end:
        stack.pop_back();
        break;
      case event::key: {
        Frame& f = stack.back();
        f.key = parsed.get<std::string>();
        if (f.key.find('\0') != std::string::npos)
          problems(location(), "the key contains a NUL character (\\u0000); remove it");
        if (!f.keys.insert(f.key).second)
          problems(location(), "duplicate key; the later value would silently replace the earlier one");
        break;
      }
      case event::value:
        element_starts();
        if (parsed.is_string() && parsed.get_ref<const std::string&>().find('\0') != std::string::npos)
          problems(location(), "the string contains a NUL character (\\u0000); remove it");
        break;
    }
    return true;
  };
  try {
    return json::parse(text, callback, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // The offset of the last byte the parser read (one past the end when the input ended early).
    const size_t pos = e.byte > 0 ? e.byte - 1 : 0;
    throw JsonSyntaxError(fmt::format("{}: invalid JSON: {}", text_position(file, text, pos, first_line),
                                      parser_reason(e.what())));
  } catch (const json::exception& e) {  // a number out of range: 1e999, -1e999
    const size_t end = error_offset(text);
    throw InputError(fmt::format("{}: invalid JSON: {} (a double holds at most about 1.8e308)",
                                 text_position(file, text, end > 0 ? end - 1 : 0, first_line),
                                 parser_reason(e.what())));
  }
}

namespace {

// parse_json_text with the first problem an InputError "<where>: <json path>: <message>".
json parse_refusing_problems(const std::string& file, const std::string& where, const std::string& text,
                             int64_t first_line) {
  std::string first;
  json j = parse_json_text(
      file, text,
      [&](const std::string& path, const std::string& message) {
        if (first.empty()) first = fmt::format("{}: {}: {}", where, printable(path), message);
      },
      first_line);
  if (!first.empty()) throw InputError(first);
  return j;
}

}  // namespace

json parse_json_text(const std::string& file, const std::string& text, int64_t first_line) {
  return parse_refusing_problems(file, file, text, first_line);
}

json parse_json_line(const std::string& file, const std::string& text, int64_t line) {
  return parse_refusing_problems(file, fmt::format("{}:{}", file, line), text, line);
}

json read_json_file(const std::string& path, std::string_view role, std::string_view fix) {
  return parse_json_text(path, read_text(path, role, fix));
}

std::string json_kind(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return fmt::format("the boolean {}", v.dump());
    case json::value_t::string: {
      std::string s = v.dump();
      if (s.size() > 40) s = s.substr(0, 37) + "...";
      return fmt::format("the string {}", s);
    }
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return fmt::format("the number {}", v.dump());
    default: return "a binary value";
  }
}

const json& json_member(const std::string& file, const json& object, const std::string& object_path, const char* key) {
  const std::string where = object_path.empty() ? key : object_path + "." + key;
  if (!object.is_object())
    throw InputError(fmt::format("{}: {}: must be an object, got {}", file,
                                 object_path.empty() ? "(the document)" : object_path, json_kind(object)));
  const auto it = object.find(key);
  if (it == object.end()) throw InputError(fmt::format("{}: {}: missing", file, where));
  return *it;
}

int64_t json_integer(const std::string& file, const json& v, const std::string& json_path) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) return v.get<int64_t>();
  } else if (v.is_number_integer()) {
    return v.get<int64_t>();
  }
  throw InputError(fmt::format("{}: {}: must be an integer, got {}", file, json_path, json_kind(v)));
}

double json_number(const std::string& file, const json& v, const std::string& json_path) {
  if (v.is_number()) return v.get<double>();
  throw InputError(fmt::format("{}: {}: must be a number, got {}", file, json_path, json_kind(v)));
}

std::string json_string(const std::string& file, const json& v, const std::string& json_path) {
  if (v.is_string()) return v.get<std::string>();
  throw InputError(fmt::format("{}: {}: must be a string, got {}", file, json_path, json_kind(v)));
}

}  // namespace tetra
