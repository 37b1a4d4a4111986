// Checks of the backend-memory role of ProcessGroups (trainer/dist/process_groups.h) and of the
// staged communicator (trainer/dist/staged_communicator.h), run by test_comm_main.cpp on every
// rank grid it builds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/dist/process_groups.h"

namespace tetra_dist_test {

// Every operation of every group's staged communicator on guarded backend memory (memory the
// host cannot touch: a stray host access kills the rank), against results computed locally, with
// the accounting (counted once, in the host communicator; ProcessGroups::stats the sum); and the
// default role (the host communicator itself). Appends a message per failed check to `failures`;
// returns the number of checks made. Collective: every rank calls it with its groups.
int64_t check_staged_communicators(tetra::ProcessGroups& pg, int world_rank, std::vector<std::string>& failures);

}  // namespace tetra_dist_test
