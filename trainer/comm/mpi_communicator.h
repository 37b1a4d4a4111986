// The CPU Communicator: MPI (OpenMPI) over a sub-communicator of MPI_COMM_WORLD.
//
// Each communicator of two or more ranks owns an MPI communicator and a worker thread that
// executes its operations in issue order with blocking MPI calls (comm_worker.h says why), so
// asynchronous operations progress while the caller computes. BF16 / F16 reductions use user-defined
// MPI ops that add (or compare) in fp32 and round to nearest even at every combining step. Groups
// of one rank get the size-1 communicator: no MPI call, no accounting.
//
// MPI errors come back as codes and become tetra::Error naming the group and the operation. MPI's
// counts are int: a count or offset above 2^31 - 1 elements is refused with a message.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "trainer/comm/communicator.h"

namespace tetra {

// Collective over MPI_COMM_WORLD: every rank calls it (in the same order as every other rank),
// each with the members (global ranks, in group-rank order) of its own group, which must include
// itself. Ranks whose lists disagree get a tetra::Error. Without MPI running, the only valid group
// is {0}, and it gets the size-1 communicator.
std::unique_ptr<Communicator> make_mpi_communicator(std::string name, std::vector<int> members);

}  // namespace tetra
