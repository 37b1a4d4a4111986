// The straggler rule (trainer/train/straggler.h) on hand-made busy times, and the timeline
// recorder (trainer/core/trace.h) written and read back as JSON.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "trainer/core/trace.h"
#include "trainer/train/straggler.h"

using tetra::StragglerDetector;

namespace {

std::deque<std::vector<double>> steps(std::initializer_list<std::vector<double>> rows) { return {rows}; }

}  // namespace

TEST_CASE("straggler: a rank named only when its busy time exceeds its peers' median every step of the window",
          "[straggler]") {
  const std::vector<int> one_stage{0, 0, 0, 0};
  // Rank 2 at 1.3x its peers' median (10) in each of 3 steps: named with a factor 1.25, not 1.35.
  const auto busy = steps({{10, 10, 13, 10}, {10, 11, 13, 9}, {9, 10, 13, 10}});
  CHECK(StragglerDetector::slow_ranks(busy, one_stage, 1.25, 3) == std::vector<int>{2});
  CHECK(StragglerDetector::slow_ranks(busy, one_stage, 1.35, 3).empty());
  // Not in every step of the window: not named; a window longer than the history: nobody.
  const auto once = steps({{10, 10, 13, 10}, {10, 10, 10, 10}, {10, 10, 13, 10}});
  CHECK(StragglerDetector::slow_ranks(once, one_stage, 1.25, 3).empty());
  CHECK(StragglerDetector::slow_ranks(once, one_stage, 1.25, 1) == std::vector<int>{2});
  CHECK(StragglerDetector::slow_ranks(busy, one_stage, 1.25, 4).empty());
}

TEST_CASE("straggler: two ranks a stage compare with each other, stages are judged apart", "[straggler]") {
  // With two ranks the peer is the other rank (the median of a pair would hide a 2x straggler).
  CHECK(StragglerDetector::slow_ranks(steps({{10, 19}}), {0, 0}, 1.8, 1) == std::vector<int>{1});
  CHECK(StragglerDetector::slow_ranks(steps({{10, 17}}), {0, 0}, 1.8, 1).empty());
  // Stage 1 is slower than stage 0 by its work (the loss head): no straggler; within stage 1,
  // rank 3 is.
  const std::vector<int> stages{0, 0, 1, 1};
  CHECK(StragglerDetector::slow_ranks(steps({{10, 10, 20, 20}}), stages, 1.25, 1).empty());
  CHECK(StragglerDetector::slow_ranks(steps({{10, 10, 20, 30}}), stages, 1.25, 1) == std::vector<int>{3});
  // A rank alone in its stage has no peers: never named. Zero busy times: nobody.
  CHECK(StragglerDetector::slow_ranks(steps({{10, 50}}), {0, 1}, 1.25, 1).empty());
  CHECK(StragglerDetector::slow_ranks(steps({{0, 0, 0}}), {0, 0, 0}, 1.25, 1).empty());
}

TEST_CASE("trace: spans recorded only while on, written as Chrome trace JSON on the common clock", "[trace]") {
  namespace trace = tetra::trace;
  trace::name_thread("main");
  { const trace::Span off("op", "before"); }
  trace::set_common_clock(trace::now_s(), 0.25);  // this rank's clock 0.25 s ahead of rank 0's
  const auto t0 = trace::Clock::now();
  trace::start();
  {
    trace::Span outer("phase", "outer \"quoted\"\n");
    outer.arg("bytes", int64_t{4096}).arg("ratio", 0.0 / 0.0).arg("group", "dp");
    const trace::Span inner("op", "inner {}", 7);
  }
  trace::async_span("p2p", "send", t0, trace::Clock::now(), "\"bytes\":8");
  trace::stop();
  { const trace::Span after("op", "after"); }
  CHECK(trace::recorded() == 3);
  const std::string path = (std::filesystem::path(TETRA_TEST_TMPDIR) / "trace_unit.json").string();
  std::filesystem::create_directories(TETRA_TEST_TMPDIR);
  trace::ProcessInfo info;
  info.rank = 3;
  info.name = "rank 3";
  info.other_data = "\"rank\":3";
  CHECK(trace::write(path, info) == 3);
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);  // valid JSON: quotes, newline and NaN escaped
  CHECK(doc["otherData"]["rank"] == 3);
  std::map<std::string, nlohmann::json> x;
  int begins = 0, ends = 0;
  for (const auto& e : doc["traceEvents"]) {
    CHECK(e["pid"] == 3);
    if (e["ph"] == "X") x[e["name"].get<std::string>()] = e;
    begins += e["ph"] == "b";
    ends += e["ph"] == "e";
  }
  REQUIRE(x.count("outer \"quoted\"\n") == 1);
  REQUIRE(x.count("inner 7") == 1);
  CHECK(x.count("before") == 0);
  CHECK(x.count("after") == 0);
  CHECK(begins == 1);
  CHECK(ends == 1);
  const auto& outer = x["outer \"quoted\"\n"];
  const auto& inner = x["inner 7"];
  CHECK(outer["args"]["bytes"] == 4096);
  CHECK(outer["args"]["ratio"].is_null());
  CHECK(outer["args"]["group"] == "dp");
  // Nested, and on rank 0's axis: 0.25 s earlier than this clock's own reading since the epoch.
  CHECK(inner["ts"].get<double>() >= outer["ts"].get<double>());
  CHECK(inner["ts"].get<double>() + inner["dur"].get<double>() <= outer["ts"].get<double>() + outer["dur"].get<double>() + 0.002);
  CHECK(outer["ts"].get<double>() < -0.2e6);
  CHECK(outer["ts"].get<double>() > -0.3e6);
  trace::set_common_clock(0.0, 0.0);
}
