// Logging: spdlog, one logger for the process. Every line carries the rank's coordinates in the
// process mesh, "[tp0 pp0 dp0 ep0 | r0]", so a line from a 1000-rank job says where it came from.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace tetra {

struct RankCoords {
  int tp = 0, pp = 0, dp = 0, ep = 0, rank = 0;
};

// Console (stderr for warnings and errors, stdout otherwise) plus, if `dir` is non-empty,
// `dir/train.log`. `level`: trace | debug | info | warn | error.
void init_logging(const std::string& dir, const std::string& level, const RankCoords& coords);

std::string rank_prefix(const RankCoords& c);

}  // namespace tetra
