// Helpers shared by the config tests (test_config.cpp, test_config_rules.cpp): the smallest valid
// config, edits by dotted path, the problems config_from_json reports, files for load_config.
#pragma once

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra::config_testing {

using nlohmann::json;

// The smallest valid config: everything default, synthetic data.
inline json base() {
  return json{{"data", {{"synthetic", true}}}};
}

// `j` with the dotted `path` set to `value` (objects created on the way).
inline json with(json j, const std::string& path, const json& value) {
  json* node = &j;
  size_t start = 0;
  for (size_t dot; (dot = path.find('.', start)) != std::string::npos; start = dot + 1)
    node = &(*node)[path.substr(start, dot - start)];
  (*node)[path.substr(start)] = value;
  return j;
}

// The problems config_from_json reports; empty when it accepts the config.
inline std::vector<std::string> problems_of(const json& j) {
  try {
    config_from_json(j);
  } catch (const ConfigError& e) {
    return e.problems();
  }
  return {};
}

inline std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

// Exactly one problem, starting with `prefix` ("path: value: ") and containing `phrase`.
inline void require_one(const json& j, const std::string& prefix, const std::string& phrase) {
  const std::vector<std::string> p = problems_of(j);
  INFO("config: " << j.dump() << "\nproblems:\n" << joined(p));
  REQUIRE(p.size() == 1);
  CHECK(p[0].rfind(prefix, 0) == 0);
  CHECK(p[0].find(phrase) != std::string::npos);
}

inline std::string tmp_dir() {
  const std::string dir = std::string(TETRA_TEST_TMPDIR) + "/config";
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = tmp_dir() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The message of the ConfigError that load_config throws ("" if it does not throw).
inline std::string load_error(const std::string& path, const std::vector<std::string>& overrides = {}) {
  try {
    load_config(path, overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace tetra::config_testing
