// The strict JSON reader every user file goes through (trainer/core/json_text.h): positions of
// syntax errors and out-of-range numbers, duplicate keys and NULs with their JSON path, the
// nesting limit, and the typed reads' messages.
#include <catch2/catch.hpp>

#include <string>
#include <utility>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/core/json_text.h"

using namespace tetra;
using Catch::Matchers::Contains;

namespace {

std::string error_of(const std::string& text, int64_t first_line = 1) {
  try {
    parse_json_text("f.json", text, first_line);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("json_text: a valid document, with comments, parses as nlohmann's parser does", "[json_text]") {
  const std::string text = "// a comment\n{\"a\": [1, 2.5, \"x\"], /* b */ \"b\": {\"c\": null}}";
  CHECK(parse_json_text("f.json", text) == nlohmann::json::parse(text, nullptr, true, true));
}

TEST_CASE("json_text: syntax errors and numbers beyond a double at file:line:column", "[json_text]") {
  // Line 2, column 8: the '}' where a value should be.
  CHECK_THAT(error_of("{\"a\": 1,\n  \"b\": }"), Contains("f.json:2:8: invalid JSON: syntax error"));
  // Cut short: one past the end.
  CHECK_THAT(error_of("{\"a\": 1,"), Contains("f.json:1:9: invalid JSON"));
  // 1e400 on line 3 (its last digit at column 14), and the same on line 7 of a JSON-lines file.
  CHECK_THAT(error_of("{\n\"a\": 1,\n\"b\": [2, 1e400]}"),
             Contains("f.json:3:14: invalid JSON: number overflow parsing '1e400'"));
  CHECK_THAT(error_of("{\"loss\": 1e400}", 7), Contains("f.json:7:14: invalid JSON"));
  CHECK_THAT(error_of(""), Contains("f.json:1:1: invalid JSON"));
  // Never the library's own prefix.
  CHECK_THAT(error_of("{\"a\" 1}"), !Contains("[json.exception"));
}

TEST_CASE("json_text: a key given twice and a NUL are named by their JSON path", "[json_text]") {
  CHECK_THAT(error_of("{\"gpu\": {\"tiles\": [{\"m\": 1, \"m\": 2}]}}"),
             Contains("f.json: gpu.tiles[0].m: duplicate key"));
  CHECK_THAT(error_of("{\"a\\u0000b\": 1}"), Contains("f.json: a\\u0000b: the key contains a NUL character"));
  CHECK_THAT(error_of("{\"a\": [\"x\", \"y\\u0000\"]}"), Contains("f.json: a[1]: the string contains a NUL"));
  // The same key in two objects is no duplicate.
  CHECK_NOTHROW(parse_json_text("f.json", "{\"a\": {\"k\": 1}, \"b\": {\"k\": 2}}"));
  // With a sink, every problem is reported and the document still parses.
  std::vector<std::pair<std::string, std::string>> seen;
  const nlohmann::json j = parse_json_text("f.json", "{\"k\": 1, \"k\": 2, \"l\": {\"m\": 3, \"m\": 4}}",
                                           [&](const std::string& path, const std::string& message) {
                                             seen.emplace_back(path, message);
                                           });
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].first == "k");
  CHECK(seen[1].first == "l.m");
  CHECK(j["k"] == 2);
}

TEST_CASE("json_text: nesting beyond the limit is refused before any reader recurses into it", "[json_text]") {
  const std::string ok = std::string(255, '[') + std::string(255, ']');
  CHECK_NOTHROW(parse_json_text("f.json", ok));
  for (size_t depth : {257, 100000}) {
    const std::string deep = std::string(depth, '[') + std::string(depth, ']');
    CHECK_THAT(error_of(deep), Contains("nested more than 256 levels deep"));
  }
  const std::string objects = [] {
    std::string s;
    for (int i = 0; i < 300; ++i) s += "{\"a\":";
    return s + "1" + std::string(300, '}');
  }();
  CHECK_THAT(error_of(objects), Contains("f.json: a.a.a.a") && Contains("nested more than 256 levels deep"));
}

TEST_CASE("json_text: typed reads name the file, the field and what it holds", "[json_text]") {
  const nlohmann::json j = nlohmann::json::parse(
      R"({"rank": "0", "world": 18446744073709551615, "ts": null, "name": 5, "ok": 3, "args": [1]})");
  auto message = [](auto&& read) {
    try {
      read();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(message([&] { json_integer("r.json", j["rank"], "otherData.rank"); }) ==
        "r.json: otherData.rank: must be an integer, got the string \"0\"");
  CHECK_THAT(message([&] { json_integer("r.json", j["world"], "world"); }),
             Contains("world: must be an integer, got the number 18446744073709551615"));
  CHECK(message([&] { json_number("r.json", j["ts"], "traceEvents[3].ts"); }) ==
        "r.json: traceEvents[3].ts: must be a number, got null");
  CHECK(message([&] { json_string("r.json", j["name"], "name"); }) == "r.json: name: must be a string, got the number 5");
  CHECK(message([&] { json_member("r.json", j, "otherData", "epoch_s"); }) == "r.json: otherData.epoch_s: missing");
  CHECK(message([&] { json_member("r.json", j["args"], "args", "name"); }) ==
        "r.json: args: must be an object, got an array");
  CHECK(json_integer("r.json", j["ok"], "ok") == 3);
}
