// The communicator of a group of one rank: every collective is the identity (a copy when the
// output is not the input), nothing is counted in stats, nothing touches MPI or a device library.
// Used for every size-1 group (tp = 1, pp = 1, ...) and when MPI is not running at all.
#pragma once

#include <memory>
#include <string>

#include "trainer/comm/communicator.h"

namespace tetra {

std::unique_ptr<Communicator> make_self_communicator(std::string name, int global_rank);

}  // namespace tetra
