// Logging: spdlog, one logger for the process. Every line carries the rank's coordinates in the
// process mesh, "[tp0 pp0 dp0 ep0 | r0]", so a line from a 1000-rank job says where it came from.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace tetra {

struct RankCoords {
  int tp = 0, pp = 0, dp = 0, ep = 0, rank = 0;
};

// Console logging. `level`: trace | debug | info | warn | error.
void init_logging(const std::string& level, const RankCoords& coords);

// From now on also append to `dir/train.log` (creating `dir`). Called once the run's inputs have
// been checked, so a refused run leaves no files behind.
void log_to_file(const std::string& dir);

std::string rank_prefix(const RankCoords& c);

}  // namespace tetra
