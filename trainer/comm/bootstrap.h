// Process bootstrap: MPI start-up and shutdown, and what the launcher told this process.
//
// The same binary runs three ways: `mpirun -np N tetra`, `srun tetra` (Slurm with --mpi=pmix) and
// a plain `tetra`, which OpenMPI starts as a singleton (world size 1, no launcher needed). A
// fourth, for Slurm without PMIx: `srun --mpi=none tetra` with TETRA_RENDEZVOUS set
// (rendezvous.h).
// MPI_THREAD_MULTIPLE is required: each communicator drives its operations from its own thread.
//
// Before MPI_Init, OMPI_MCA_mpi_yield_when_idle=1 is set unless the user set it. A rank waiting in
// MPI then yields its core instead of spinning on it; without it, ranks sharing cores (srun and
// mpirun inside a Slurm allocation do not turn it on) make a small collective cost tens of
// milliseconds instead of a fraction of one.
#pragma once

#include <string>

namespace tetra {

struct ProcessInfo {
  int rank = 0, size = 1, local_rank = 0;  // local_rank: index among this node's processes
  std::string launcher;                    // "mpirun", "srun", "srun-rendezvous" or "single"
};

// Initialises MPI (once; a second call returns the same information). `rendezvous_dir` non-empty
// (the user's TETRA_RENDEZVOUS): the rendezvous bootstrap where srun started the process without
// PMIx (rendezvous.h). Throws tetra::Error if the MPI library cannot provide MPI_THREAD_MULTIPLE.
ProcessInfo dist_init(int* argc, char*** argv, const std::string& rendezvous_dir = "");
// Shuts MPI down; does nothing if it is not running. Every communicator must be gone by then.
void dist_finalize();
// Ends the whole job (every rank) with this exit code: MPI_Abort on MPI_COMM_WORLD, or a plain
// exit when MPI is not running.
[[noreturn]] void dist_abort(int exit_code);
// True between dist_init (or any MPI_Init) and dist_finalize.
bool dist_initialized();

// Whether this build has MPI. A build without it (cmake -DTETRA_MPI=OFF, or AUTO where no MPI was
// found) runs one process: dist_init gives rank 0 of 1, launcher "single", and refuses a launch as
// one of several processes (mpirun, srun) with an error that says "this tetra was built without
// MPI"; dist_initialized() is false and dist_abort a plain exit.
bool dist_has_mpi();

}  // namespace tetra
