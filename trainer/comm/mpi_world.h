// The job's world communicator for the MPI code of trainer/comm: MPI_COMM_WORLD when a launcher
// started the ranks together (mpirun, srun --mpi=pmix, one process), or the communicator the
// rendezvous bootstrap joined them into (rendezvous.h), where MPI_COMM_WORLD is each singleton.
#pragma once

#include <mpi.h>

namespace tetra {

// Valid between dist_init() and dist_finalize(); MPI_COMM_WORLD before.
MPI_Comm dist_world();

}  // namespace tetra
