#include "trainer/core/log.h"

#include <filesystem>
#include <vector>

#include <fmt/format.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace tetra {

std::string rank_prefix(const RankCoords& c) {
  return fmt::format("[tp{} pp{} dp{} ep{} | r{}]", c.tp, c.pp, c.dp, c.ep, c.rank);
}

void init_logging(const std::string& dir, const std::string& level, const RankCoords& coords) {
  std::vector<spdlog::sink_ptr> sinks;
  auto out = std::make_shared<spdlog::sinks::stdout_sink_mt>();
  sinks.push_back(out);
  if (!dir.empty()) {
    std::filesystem::create_directories(dir);
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(dir + "/train.log"));
  }
  auto logger = std::make_shared<spdlog::logger>("tetra", sinks.begin(), sinks.end());
  logger->set_pattern(fmt::format("%Y-%m-%d %H:%M:%S %^%L%$ {} %v", rank_prefix(coords)));
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace tetra
