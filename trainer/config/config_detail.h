// Internals shared by the config reader (config_json.cpp), the rules (config_validate.cpp) and
// the file/override front end (config.cpp). Not part of the config's public interface.
//
// Reading never stops at the first problem: every stage appends to one Problems list, which also
// remembers which JSON paths already have a problem, so that a later rule does not pile a
// misleading second message on a value that was already rejected (a hidden_size given as a string
// is not also "not divisible by num_heads").
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra::config_detail {

using nlohmann::json;

// The sections of a config file, in the order they are read and reported.
inline const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = {"model", "parallel", "training",   "optimizer",
                                                 "data",  "sample",   "checkpoint", "logging"};
  return names;
}

class Problems {
 public:
  // "<path>: <value>: <rule>"; marks `path` as bad.
  void add(const std::string& path, const std::string& value, const std::string& rule);
  // "<path>: <message>" for problems that have no value (unknown keys, duplicates).
  void add_plain(const std::string& path, const std::string& message);
  // Whether neither `path` nor an enclosing path ("data" for "data.train") has a problem yet.
  bool ok(const std::string& path) const;
  bool empty() const { return lines_.empty(); }
  // The lines grouped by section (in section_names() order, anything else first), keeping the
  // order they were found in within a section.
  std::vector<std::string> sorted() const;

 private:
  struct Line {
    std::string path, text;
  };
  std::vector<Line> lines_;
  std::set<std::string> bad_;
};

// A JSON value as it appears in a message: dumped, shortened past 60 characters.
std::string show(const json& v);

// "an integer", "a string", ... for "expected X, got <type_phrase>".
std::string type_phrase(const json& v);

// The candidate closest to `word` by edit distance (case, '-' and '_' ignored), or "" when none is
// close enough to be a plausible typo.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// Stage 1 (config_json.cpp): types, enums and unknown keys; fills every field it can read.
Config parse_config(const json& j, Problems& problems);

// Stage 2 (config_validate.cpp): single-value ranges, derived values (num_kv_heads 0 ->
// num_heads, ...), then cross-field rules.
void resolve_and_validate(Config& c, Problems& problems);

}  // namespace tetra::config_detail
