// The run's appended files (metrics.jsonl, the TensorBoard event file; files.h's AppendFile) when a
// write fails: one warning naming the file and the reason, nothing more written to it (its last
// record is the only cut one), the run going on; and a metrics.jsonl left with a cut last line gets
// a newline before the next run's first line.
//
// A full disk is stood for by the file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored): a write
// past it is cut where the limit lies and the next one fails with EFBIG, as on a disk that fills.
#include <catch2/catch.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include "trainer/core/files.h"
#include "trainer/train/metrics.h"
#include "trainer/train/tensorboard.h"

using namespace tetra;

namespace {

std::string test_dir(const std::string& name) {
  const std::string d = std::string(TETRA_TEST_TMPDIR) + "/metrics_files/" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Files of this process may not grow past `bytes` while it lives (SIGXFSZ ignored, so a write past
// the limit returns EFBIG instead of ending the process).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit r = saved_;
    r.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &r);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = SIG_DFL;
};

// The warnings logged while it lives.
class Warnings {
 public:
  Warnings() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64)) {
    sink_->set_pattern("%v");
    sink_->set_level(spdlog::level::warn);
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~Warnings() {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::vector<std::string> lines() const { return sink_->last_formatted(); }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

StepMetrics step(int64_t s) {
  StepMetrics m;
  m.step = s;
  m.total_steps = 100;
  m.loss = 2.5;
  m.lr = 1e-3;
  return m;
}

}  // namespace

TEST_CASE("metrics.jsonl: a failed write is warned of once, and nothing more is written", "[metrics]") {
  const std::string dir = test_dir("jsonl_full");
  const std::string path = dir + "/metrics.jsonl";
  const Warnings warnings;
  MetricsWriter w(dir);
  w.event(R"({"event":"start"})");
  w.write(step(1));
  const size_t before = read_all(path).size();
  {
    const FileSizeLimit limit(before + 20);  // the next line is cut after 20 bytes
    for (int64_t s = 2; s <= 5; ++s) w.write(step(s));
    w.event(R"({"event":"memory"})");
  }
  CHECK(w.write_failed());
  const std::string text = read_all(path);
  CHECK(text.size() == before + 20);
  CHECK(text.back() != '\n');  // the one cut line is the last
  w.write(step(6));             // the limit is gone, the file stays as it was
  CHECK(read_all(path).size() == before + 20);
  const std::vector<std::string> lines = warnings.lines();
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains(path + ": write failed: File too large"));
}

TEST_CASE("metrics.jsonl: a cut last line is ended before the next run's lines", "[metrics]") {
  const std::string dir = test_dir("jsonl_cut");
  const std::string path = dir + "/metrics.jsonl";
  std::ofstream(path) << "{\"step\":1,\"loss\":2.5}\n{\"step\":2,\"lo";
  {
    const Warnings warnings;
    MetricsWriter w(dir);
    w.event(R"({"event":"start"})");
    const std::vector<std::string> lines = warnings.lines();
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], Catch::Contains(path + ": the last line is cut short"));
  }
  CHECK(read_all(path) == "{\"step\":1,\"loss\":2.5}\n{\"step\":2,\"lo\n{\"event\":\"start\"}\n");
  // A file that ends with its newline (or is empty) is appended to as it is.
  const std::string whole = read_all(path);
  {
    const Warnings warnings;
    MetricsWriter w(dir);
    w.event(R"({"event":"start"})");
    CHECK(warnings.lines().empty());
  }
  CHECK(read_all(path) == whole + "{\"event\":\"start\"}\n");
}

TEST_CASE("TensorBoard: a failed write is warned of once, and nothing more is written", "[metrics]") {
  const std::string dir = test_dir("tensorboard_full");
  const Warnings warnings;
  TensorBoardWriter tb(dir);
  tb.scalars(1, {{"train/loss", 2.5}});
  const size_t before = read_all(tb.path()).size();
  {
    const FileSizeLimit limit(before + 10);
    for (int64_t s = 2; s <= 4; ++s) tb.scalars(s, {{"train/loss", 2.0}});
  }
  CHECK(tb.failed());
  CHECK(read_all(tb.path()).size() == before + 10);
  tb.scalars(5, {{"train/loss", 2.0}});
  CHECK(read_all(tb.path()).size() == before + 10);
  const std::vector<std::string> lines = warnings.lines();
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains(tb.path() + ": write failed: File too large"));
}
