// The process bootstrap and group factory of a build without MPI (cmake -DTETRA_MPI=OFF, or AUTO
// on a machine without an MPI library, such as a GPU machine that has CUDA but not our packages):
// the world is this one process, every group is the size-1 communicator, and a launch as one of
// several processes is refused at start-up rather than left to train N unrelated copies.
//
// How a multi-process launch is recognised: the launchers' own variables (launcher.h), any of
// them above 1.
//
// Compiled without MPI only; bootstrap.cpp and mpi_communicator.cpp are the build with it.
#if !defined(TETRA_HAVE_MPI)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/launcher.h"
#include "trainer/comm/mpi_communicator.h"
#include "trainer/comm/mpi_world.h"
#include "trainer/comm/self_communicator.h"

namespace tetra {

MPI_Comm dist_world() { return MPI_COMM_WORLD; }

bool dist_has_mpi() { return false; }

bool dist_initialized() { return false; }

ProcessInfo dist_init(int* /*argc*/, char*** /*argv*/, const std::string& /*rendezvous_dir*/) {
  const std::string launch = launch_environment().describe();
  if (!launch.empty())
    throw Error(fmt::format("this tetra was built without MPI, so it runs as one process, but {} started it as one "
                            "of several: run it as a single process, or build it with MPI (cmake -DTETRA_MPI=ON, "
                            "with an MPI library such as Debian's libopenmpi-dev installed)",
                            launch));
  ProcessInfo info;
  info.launcher = "single";
  return info;
}

void dist_finalize() {}

void dist_abort(int exit_code) {
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

std::unique_ptr<Communicator> make_mpi_communicator(std::string name, std::vector<int> members) {
  TETRA_CHECK(members.size() == 1 && members[0] == 0,
              "group '{}' with members [{}]: this tetra was built without MPI, so its only process is rank 0 "
              "and every group is {{0}}",
              name, fmt::join(members, ", "));
  return make_self_communicator(std::move(name), 0);
}

}  // namespace tetra

#endif  // !TETRA_HAVE_MPI
