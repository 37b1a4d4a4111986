// MPI start-up: yield-when-idle default, MPI_THREAD_MULTIPLE, launcher and node-local rank, and
// the rendezvous fallback (rendezvous.h) when srun cannot start MPI programs.
// Compiled with MPI only; trainer/comm/single_process.cpp is the build without it.
#if defined(TETRA_HAVE_MPI)
#include "trainer/comm/bootstrap.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include <mpi.h>

#include "kernels/common/check.h"
#include "trainer/comm/mpi_world.h"
#include "trainer/comm/rendezvous.h"

namespace tetra {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

// Which launcher started this process, from the variables each one sets (read before MPI_Init,
// which may add its own): mpirun (OpenMPI's orterun) sets OMPI_COMM_WORLD_*; srun --mpi=pmix,
// the only srun that can start OpenMPI programs, sets SLURM_PROCID and PMIX_RANK but not
// OMPI_COMM_WORLD_* (mpirun inside a Slurm allocation does the reverse). A plain run, even inside
// a batch script, sets no PMIX_RANK.
std::string detect_launcher() {
  if (env("OMPI_COMM_WORLD_SIZE") != nullptr) return "mpirun";
  if (env("SLURM_PROCID") != nullptr && env("PMIX_RANK") != nullptr) return "srun";
  return "single";
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("{} failed: {}", what, std::string(text, static_cast<size_t>(len))));
}

// What the first dist_init found; a second call returns it.
ProcessInfo g_info;
bool g_have_info = false;
MPI_Comm g_world = MPI_COMM_WORLD;  // the rendezvous' joined communicator when it is used

}  // namespace

MPI_Comm dist_world() { return g_world; }

bool dist_has_mpi() { return true; }

bool dist_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

ProcessInfo dist_init(int* argc, char*** argv, const std::string& rendezvous_dir) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  TETRA_CHECK(finalized == 0, "dist_init after dist_finalize: MPI cannot be started twice");
  if (g_have_info) return g_info;
  std::string launcher = detect_launcher();
  int initialized = 0;
  MPI_Initialized(&initialized);
  const Rendezvous rendezvous = initialized == 0 ? rendezvous_prepare(rendezvous_dir) : Rendezvous{};
  if (rendezvous.active) launcher = "srun-rendezvous";
  if (initialized == 0) {
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
    int provided = MPI_THREAD_SINGLE;
    check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    // From here on MPI errors come back as codes and become tetra::Error with a message.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      throw Error(fmt::format("the MPI library provides thread level {} but MPI_THREAD_MULTIPLE ({}) is "
                              "required: use an MPI built with thread support",
                              provided, MPI_THREAD_MULTIPLE));
    }
  } else {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    TETRA_CHECK(provided >= MPI_THREAD_MULTIPLE, "MPI was initialised with thread level {}, not MPI_THREAD_MULTIPLE",
                provided);
  }

  if (rendezvous.active) g_world = rendezvous_join(rendezvous);
  ProcessInfo info;
  check_mpi(MPI_Comm_rank(g_world, &info.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(g_world, &info.size), "MPI_Comm_size");
  info.launcher = launcher;

  const char* local = nullptr;
  if (info.launcher == "mpirun") local = env("OMPI_COMM_WORLD_LOCAL_RANK");
  if (info.launcher == "srun" || info.launcher == "srun-rendezvous") local = env("SLURM_LOCALID");
  if (local != nullptr) {
    info.local_rank = std::atoi(local);
  } else {
    // The rank among the processes that share this node's memory (collective over the world).
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(g_world, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
    check_mpi(MPI_Comm_rank(node, &info.local_rank), "MPI_Comm_rank(node)");
    MPI_Comm_free(&node);
  }
  g_info = info;
  g_have_info = true;
  return info;
}

void dist_finalize() {
  if (dist_initialized()) {
    if (g_world != MPI_COMM_WORLD) MPI_Comm_free(&g_world);
    g_world = MPI_COMM_WORLD;
    MPI_Finalize();
  }
  rendezvous_finish();
}

void dist_abort(int exit_code) {
  std::fflush(nullptr);
  if (dist_initialized()) MPI_Abort(g_world, exit_code);
  std::_Exit(exit_code);
}

}  // namespace tetra

#endif  // TETRA_HAVE_MPI
