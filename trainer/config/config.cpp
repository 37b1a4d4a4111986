// The front end of the config: ConfigError, reading the file, command-line overrides.
//
// load_config reports I/O and JSON syntax errors with the file name and a line:column computed
// from the parser's byte offset, so an editor can jump to them. The file may carry // and /* */
// comments (the parser skips them). A key given twice in one object is reported: JSON parsers
// keep the last value silently, which hides the first one from whoever reads the file.
//
// Overrides ("section.key=value", e.g. from `--set training.steps=10`) are applied to the JSON
// before it is parsed, so an overridden value goes through exactly the same checks as one in the
// file. The value is parsed as JSON (10, 3e-4, true, ["a","b"]); if it is not valid JSON it is
// taken as a string, so `logging.dir=runs/a` needs no quotes.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "trainer/config/config_detail.h"
#include "trainer/core/format.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/core/runtime_options.h"

namespace tetra {
namespace config_detail {

void Problems::add(const std::string& path, const std::string& value, const std::string& rule) {
  lines_.push_back({path, printable(path + ": " + value + ": " + rule)});
  bad_.insert(path);
}

void Problems::add_plain(const std::string& path, const std::string& message) {
  lines_.push_back({path, printable(path + ": " + message)});
  bad_.insert(path);
}

bool Problems::ok(const std::string& path) const {
  for (size_t i = 0; i < path.size(); ++i)
    if ((path[i] == '.' || path[i] == '[') && bad_.count(path.substr(0, i))) return false;
  return bad_.count(path) == 0;
}

std::vector<std::string> Problems::sorted() const {
  auto rank = [](const std::string& path) {
    const std::string first = path.substr(0, path.find_first_of(".["));
    const auto& names = section_names();
    const auto it = std::find(names.begin(), names.end(), first);
    return it == names.end() ? -1 : static_cast<int>(it - names.begin());
  };
  std::vector<Line> lines = lines_;
  std::stable_sort(lines.begin(), lines.end(),
                   [&](const Line& a, const Line& b) { return rank(a.path) < rank(b.path); });
  std::vector<std::string> out;
  for (const Line& l : lines) out.push_back(l.text);
  return out;
}

}  // namespace config_detail

namespace {

using config_detail::json;
using config_detail::Problems;

std::string join_lines(const std::vector<std::string>& lines) {
  if (lines.empty()) return "invalid configuration";
  std::string s;
  for (const std::string& l : lines) s += (s.empty() ? "" : "\n") + l;
  return s;
}

Config build(const json& j, Problems& problems) {
  Config c = config_detail::parse_config(j, problems);
  if (j.is_object()) config_detail::resolve_and_validate(c, problems);  // else nothing was read
  if (!problems.empty()) throw ConfigError(problems.sorted());
  return c;
}

std::string read_file(const std::string& path) {
  try {
    return read_text(path, "config file", "give a JSON file");
  } catch (const ConfigError&) {
    throw;
  } catch (const InputError& e) {
    throw ConfigError({e.what()});
  }
}

// Parses `text`, reporting every key that appears twice in one object (json_text.h's rules).
json parse_text(const std::string& path, const std::string& text, Problems& problems) {
  try {
    return parse_json_text(path, text, [&](const std::string& where, const std::string& message) {
      problems.add_plain(where, message);
    });
  } catch (const ConfigError&) {
    throw;
  } catch (const InputError& e) {
    throw ConfigError({e.what()});
  }
}

void apply_override(json& j, const std::string& text, Problems& problems) {
  const std::string where = "override \"" + (text.size() > 80 ? text.substr(0, 77) + "..." : text) + "\"";
  const size_t eq = text.find('=');
  if (eq == std::string::npos) {
    problems.add_plain(where, "expected section.key=value");
    return;
  }
  const std::string key_path = text.substr(0, eq), value_text = text.substr(eq + 1);
  std::vector<std::string> keys;
  for (size_t start = 0;;) {
    const size_t dot = key_path.find('.', start);
    keys.push_back(key_path.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return k.empty(); })) {
    problems.add_plain(where,
                       "expected section.key=value, with no empty name in \"" + key_path + "\"");
    return;
  }
  // Strict JSON (json_text.h's rules), else the text as a string (`logging.dir=runs/a`). What is
  // meant as JSON (an array or object, a number too large for a double) and breaks the rules is
  // reported, not taken as a string.
  json value;
  try {
    value = parse_json_text(where, value_text);
  } catch (const InputError& e) {
    // Not JSON at all, and not meant as an array or object: the text itself. JSON that breaks a
    // rule (a number beyond a double, a key twice) is reported.
    const size_t first = value_text.find_first_not_of(" \t");
    const bool structured = first != std::string::npos && (value_text[first] == '[' || value_text[first] == '{');
    if (dynamic_cast<const JsonSyntaxError*>(&e) == nullptr || structured) {
      const std::string why = e.what();
      problems.add_plain(where, why.substr(why.find(": ") + 2));
      return;
    }
    value = value_text;
  }
  if (!j.is_object()) return;  // parse_config reports the root itself
  json* node = &j;
  std::string walked;
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    walked += (walked.empty() ? "" : ".") + keys[i];
    json& next = (*node)[keys[i]];
    if (next.is_null()) next = json::object();
    if (!next.is_object()) {
      problems.add_plain(where, walked + " is " + config_detail::show(next) + ", not an object");
      return;
    }
    node = &next;
  }
  (*node)[keys.back()] = value;
}

}  // namespace

std::vector<int64_t> Config::pipeline_stage_layers() const {
  const int64_t stages = parallel.pp * parallel.virtual_stages;
  if (!parallel.stage_layers.empty()) return parallel.stage_layers;
  return std::vector<int64_t>(static_cast<size_t>(stages), model.num_layers / stages);
}

ConfigError::ConfigError(std::vector<std::string> problems)
    : InputError(join_lines(problems)), problems_(std::move(problems)) {}

Config config_from_json(const nlohmann::json& j) {
  Problems problems;
  return build(j, problems);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string text = read_file(path);
  Problems problems;
  json j = parse_text(path, text, problems);
  for (const std::string& o : overrides) apply_override(j, o, problems);
  return build(j, problems);
}

std::vector<double> parse_data_split(const std::string& split) {
  std::vector<double> parts;
  size_t start = 0;
  while (start <= split.size()) {
    const size_t comma = std::min(split.find(',', start), split.size());
    const std::string item = split.substr(start, comma - start);
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || end != item.c_str() + item.size() || !std::isfinite(v) || v < 0) return {};
    parts.push_back(v);
    start = comma + 1;
  }
  if (parts.size() < 2 || parts.size() > 3 || parts[0] <= 0) return {};
  parts.resize(3, 0.0);
  return parts;
}

bool expand_path(const std::string& path, std::string& out, std::string& why) {
  std::string r;
  size_t i = 0;
  if (path == "~" || path.rfind("~/", 0) == 0) {
    const char* home = environment_variable("HOME");
    if (!home) {
      why = "it starts with ~ but HOME is not set";
      return false;
    }
    r = home;
    i = 1;
  }
  while (i < path.size()) {
    if (path.compare(i, 2, "${") == 0) {
      const size_t close = path.find('}', i + 2);
      if (close == std::string::npos) {
        why = "\"${\" without a closing \"}\"";
        return false;
      }
      const std::string name = path.substr(i + 2, close - i - 2);
      const char* value = environment_variable(name.c_str());
      if (!value) {
        why = fmt::format("the environment variable {} is not set", name);
        return false;
      }
      r += value;
      i = close + 1;
    } else {
      r += path[i++];
    }
  }
  out = r;
  return true;
}

}  // namespace tetra
