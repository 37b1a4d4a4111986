#include "trainer/core/log.h"

#include "kernels/common/check.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace tetra {

std::string rank_prefix(const RankCoords& c) {
  return fmt::format("[tp{} pp{} dp{} ep{} | r{}]", c.tp, c.pp, c.dp, c.ep, c.rank);
}

namespace {
std::string g_pattern = "%Y-%m-%d %H:%M:%S %L %v";  // until init_logging adds the rank prefix
// The lines logged before log_to_file: a run checks everything it will read and write before it
// creates logging.dir, and train.log still starts with the run's first line.
std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> g_backlog;
constexpr size_t kBacklogLines = 1024;
}

void init_logging(const std::string& level, const RankCoords& coords) {
  g_pattern = fmt::format("%Y-%m-%d %H:%M:%S %L {} %v", rank_prefix(coords));
  auto logger = std::make_shared<spdlog::logger>("tetra", std::make_shared<spdlog::sinks::stdout_sink_mt>());
  g_backlog = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(kBacklogLines);
  logger->sinks().push_back(g_backlog);
  logger->set_pattern(g_pattern);
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void log_to_file(const std::string& dir) {
  if (dir.empty()) return;
  std::shared_ptr<spdlog::sinks::basic_file_sink_mt> sink;
  try {
    std::filesystem::create_directories(dir);
    if (g_backlog) {
      std::ofstream backlog(dir + "/train.log", std::ios::app | std::ios::binary);
      for (const std::string& line : g_backlog->last_formatted()) backlog << line;
    }
    sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(dir + "/train.log");
  } catch (const std::exception& e) {
    throw InputError(fmt::format("logging.dir: cannot write {}/train.log: {}; choose a writable "
                                 "directory", dir, e.what()));
  }
  sink->set_pattern(g_pattern);
  auto& sinks = spdlog::default_logger()->sinks();
  if (g_backlog) sinks.erase(std::remove(sinks.begin(), sinks.end(), g_backlog), sinks.end());
  g_backlog.reset();
  sinks.push_back(sink);
}

}  // namespace tetra
