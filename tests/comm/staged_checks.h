// Checks of the backend-memory role of ProcessGroups (trainer/comm/process_groups.h) and of the
// staged communicator (trainer/comm/staged_communicator.h), run by test_comm_main.cpp on every
// rank grid it builds.
#pragma once

#include "tests/comm/comm_checks.h"
#include "trainer/comm/process_groups.h"

namespace tetra_dist_test {

// Every operation of every group's staged communicator on guarded backend memory (memory the
// host cannot touch: a stray host access kills the rank), against results computed locally, with
// the accounting (counted once, in the host communicator; ProcessGroups::stats the sum); and the
// default role (the host communicator itself). Reports through `ck` (its `where` prefixes the
// messages). Collective: every rank calls it with its groups.
void check_staged_communicators(Checker& ck, tetra::ProcessGroups& pg);

}  // namespace tetra_dist_test
