// Fallback bootstrap for clusters whose srun cannot start MPI programs (Slurm without PMIx):
// `srun --mpi=none tetra ...` with TETRA_RENDEZVOUS=<a directory every node can read and write>.
//
// How: each process learns its rank and the job size from Slurm (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID), hides Slurm's variables from OpenMPI (which would otherwise look for Slurm's PMI
// and fail in MPI_Init) and starts as an MPI singleton. Rank 0 starts OpenMPI's `ompi-server` (the
// rendezvous service that connect/accept between separately started processes requires) and
// publishes its address in <dir>/tetra-<job>.<step>.<restart>/server.uri; every rank points
// OpenMPI at it. After MPI_Init, rank 0 opens an MPI port and publishes it too; then the ranks
// join one at a time in rank order (rank 0 writes whose turn it is): the ranks already joined
// accept, the newcomer connects, and the two sides merge into one intra-communicator, which becomes
// the job's world (dist_world()). N ranks take N sequential joins: fine for tens of ranks, slow
// for thousands (there, build Slurm with PMIx).
//
// Measured with Debian's OpenMPI 4.1: two singletons cannot connect without ompi-server ("requires
// the support of the ompi-server tool"), and a process started by srun --mpi=none fails in
// MPI_Init unless the SLURM_* / PMI* variables are hidden. MPI_Abort ends only the calling
// process's own singleton job: launch with `srun --kill-on-bad-exit=1` so that one rank's abort
// ends the others (or they wait for the watchdog, training.collective_timeout_s).
#pragma once

#include <string>

#include <mpi.h>

namespace tetra {

struct Rendezvous {
  bool active = false;
  int rank = 0, size = 1, local_rank = 0;
  std::string dir;  // this job step's own subdirectory of TETRA_RENDEZVOUS
};

// Before MPI_Init: decides whether the fallback applies (`base_dir`, the user's TETRA_RENDEZVOUS,
// non-empty, started by srun without PMIx) and, when it does, prepares the environment for
// MPI_Init (and, on rank 0, starts ompi-server). Throws tetra::Error with what is missing.
Rendezvous rendezvous_prepare(const std::string& base_dir);
// After MPI_Init (each process a singleton): joins every rank into one communicator, ordered by
// SLURM_PROCID, and restores the Slurm variables hidden by rendezvous_prepare(). Collective.
MPI_Comm rendezvous_join(const Rendezvous& r);
// After MPI_Finalize: rank 0 stops its ompi-server and removes this job step's subdirectory.
void rendezvous_finish();

}  // namespace tetra
