// Strict JSON for every file a user gives (configs, cluster files, manifests, Hugging Face
// config.json and tokenizers, run logs, timelines): one parser, so that every such file is held to
// the same rules and its errors read the same way.
//   - Syntax errors, and numbers beyond a double's range (1e400), are
//     "<file>:<line>:<column>: invalid JSON: <why>", the position computed from the parser's byte
//     offset so that an editor can jump to it; never the parser library's own exception text.
//   - A key given twice in one object is a problem (JSON parsers keep the last value silently,
//     hiding the first from whoever reads the file), as is a NUL character in a key or a string
//     (the system would cut a path or name there). Each is reported with its JSON path.
//   - // and /* */ comments are skipped.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kernels/common/check.h"

namespace tetra {

// A text that is not JSON at all (a syntax error), as opposed to JSON that breaks a rule above: a
// reader that also takes plain text (a `--set` value) tells them apart by it.
class JsonSyntaxError : public InputError {
 public:
  using InputError::InputError;
};

// Receives a problem that does not stop the parse: the JSON path ("training.steps", "a[2].b")
// and what is wrong ("duplicate key; ...").
using JsonProblemSink = std::function<void(const std::string& json_path, const std::string& message)>;

// Parses `text`, read from `file` (for messages). JsonSyntaxError on a syntax error, InputError on
// a number out of range or nesting too deep; duplicate keys and NULs go to `problems`. `first_line`: the line number of the text's
// first line in `file` (a line of a JSON-lines file).
nlohmann::json parse_json_text(const std::string& file, const std::string& text, const JsonProblemSink& problems,
                               int64_t first_line = 1);

// The same, with the first duplicate key or NUL an InputError: "<file>: <json path>: <message>".
nlohmann::json parse_json_text(const std::string& file, const std::string& text, int64_t first_line = 1);

// One line of a JSON-lines file (metrics.jsonl): the same, every message naming the line
// ("<file>:<line>: <json path>: <message>", "<file>:<line>:<column>: invalid JSON: ...").
nlohmann::json parse_json_line(const std::string& file, const std::string& text, int64_t line);

// read_text(path, role, fix) (a regular file, never blocking on a named pipe), then
// parse_json_text.
nlohmann::json read_json_file(const std::string& path, std::string_view role, std::string_view fix = "");

// Typed reads of a parsed document's members for readers that hold a file to a schema: each
// failure an InputError "<file>: <json path>: <want>, got <what it is>".
const nlohmann::json& json_member(const std::string& file, const nlohmann::json& object, const std::string& object_path,
                                  const char* key);
int64_t json_integer(const std::string& file, const nlohmann::json& v, const std::string& json_path);
double json_number(const std::string& file, const nlohmann::json& v, const std::string& json_path);
std::string json_string(const std::string& file, const nlohmann::json& v, const std::string& json_path);

// "a string \"abc\"", "the number 1.5", "an array", "null": what a value is, for messages.
std::string json_kind(const nlohmann::json& v);

}  // namespace tetra
