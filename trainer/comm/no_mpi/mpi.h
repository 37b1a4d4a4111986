// Not MPI: the handful of <mpi.h> names that code outside the MPI files still spells, for a build
// without MPI (cmake -DTETRA_MPI=OFF). CMake puts this directory on tetra_trainer's include path in
// that build only. The world it describes is the one process (rank 0 of 1); such code reaches it
// only behind dist_initialized(), which is false there (trainer/comm/single_process.cpp).
// Nothing else of MPI exists in that build: a file that needs more is an MPI file, compiled only
// with TETRA_HAVE_MPI.
#pragma once

typedef int MPI_Comm;
#define MPI_COMM_WORLD 0
#define MPI_SUCCESS 0

inline int MPI_Comm_size(MPI_Comm /*comm*/, int* size) {
  *size = 1;
  return MPI_SUCCESS;
}

inline int MPI_Comm_rank(MPI_Comm /*comm*/, int* rank) {
  *rank = 0;
  return MPI_SUCCESS;
}
