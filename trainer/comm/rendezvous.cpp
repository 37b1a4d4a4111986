// The rendezvous bootstrap (see rendezvous.h): files in a shared directory, ompi-server, and
// MPI_Comm_accept / MPI_Comm_connect / MPI_Intercomm_merge, one rank at a time.
// Compiled with MPI only (a build without MPI has no rendezvous: it runs one process).
#if defined(TETRA_HAVE_MPI)
#include "trainer/comm/rendezvous.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/core/files.h"

extern char** environ;

namespace tetra {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

// How long a rank waits for a file another rank writes (start-up of the job's slowest node).
constexpr double kWaitS = 300.0;

std::vector<std::pair<std::string, std::string>> g_hidden;  // Slurm/PMI variables, restored later
pid_t g_server = -1;                                          // rank 0: the ompi-server child
std::string g_dir;                                            // rank 0: the files to remove at the end

// A note other ranks poll for: one line, written atomically (trainer/core/files.h).
void write_atomically(const std::string& path, const std::string& text) { write_file_atomic(path, text + "\n"); }

// The file's first line once it exists and is complete (written by write_atomically or, for the
// server address, ending in a newline); `accept` may reject a content to keep waiting.
template <class Accept>
std::string wait_for_line(const std::string& path, const std::string& what, Accept accept) {
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    std::ifstream in(path);
    std::stringstream text;
    if (in) text << in.rdbuf();
    const std::string s = text.str();
    const size_t nl = s.find('\n');
    if (nl != std::string::npos && accept(s.substr(0, nl))) return s.substr(0, nl);
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > kWaitS)
      throw Error(fmt::format("rendezvous: waited {} s for {} ({}): is TETRA_RENDEZVOUS a directory every node "
                              "shares, and did rank 0 start?", kWaitS, what, path));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void hide_launcher_variables() {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name.rfind("SLURM", 0) == 0 || name.rfind("PMI", 0) == 0) names.push_back(name);
  }
  for (const std::string& name : names) {
    g_hidden.emplace_back(name, std::getenv(name.c_str()));
    unsetenv(name.c_str());
  }
}

void start_server(const std::string& uri_file) {
  const std::string raw = uri_file + ".raw";
  const pid_t parent = getpid();
  g_server = fork();
  TETRA_CHECK(g_server >= 0, "rendezvous: fork() for ompi-server failed: {}", std::strerror(errno));
  if (g_server == 0) {
    // The server ends with rank 0, however rank 0 ends (MPI_Abort, a crash): a server left behind
    // would keep the job step, and srun, waiting.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) std::_Exit(0);  // rank 0 ended before prctl took effect
    if (geteuid() == 0) {
      setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
      setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    }
    execlp("ompi-server", "ompi-server", "--no-daemonize", "-r", raw.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "rendezvous: cannot run ompi-server (OpenMPI's openmpi-bin): %s\n", std::strerror(errno));
    std::_Exit(127);
  }
  // ompi-server writes its address when it is ready; publish it whole, by rename.
  const std::string uri = wait_for_line(raw, "ompi-server's address", [](const std::string& s) { return !s.empty(); });
  write_atomically(uri_file, uri);
}

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("rendezvous: {} failed: {}", what, std::string(text, static_cast<size_t>(len))));
}

}  // namespace

Rendezvous rendezvous_prepare(const std::string& base_dir) {
  Rendezvous r;
  if (base_dir.empty() || env("PMIX_RANK") != nullptr || env("OMPI_COMM_WORLD_SIZE") != nullptr) return r;
  const char* base = base_dir.c_str();
  const char* procid = env("SLURM_PROCID");
  const char* ntasks = env("SLURM_NTASKS");
  if (procid == nullptr || ntasks == nullptr)
    throw InputError(fmt::format("TETRA_RENDEZVOUS={} is set but SLURM_PROCID / SLURM_NTASKS are not: the rendezvous "
                            "bootstrap is for `srun --mpi=none tetra ...`; unset it for mpirun or one process",
                            base));
  r.active = true;
  r.rank = std::atoi(procid);
  r.size = std::atoi(ntasks);
  r.local_rank = env("SLURM_LOCALID") ? std::atoi(env("SLURM_LOCALID")) : 0;
  const char* job = env("SLURM_JOB_ID");
  const char* step = env("SLURM_STEP_ID");
  const char* restart = env("SLURM_RESTART_COUNT");
  r.dir = fmt::format("{}/tetra-{}.{}.{}", base, job ? job : "0", step ? step : "0", restart ? restart : "0");
  hide_launcher_variables();
  const std::string uri_file = r.dir + "/server.uri";
  if (r.rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(r.dir, ec);
    TETRA_CHECK(!ec, "rendezvous: cannot create {}: {}", r.dir, ec.message());
    start_server(uri_file);
    g_dir = r.dir;
  } else {
    wait_for_line(uri_file, "ompi-server's address from rank 0", [](const std::string& s) { return !s.empty(); });
  }
  setenv("OMPI_MCA_pmix_server_uri", ("file:" + uri_file).c_str(), 1);
  return r;
}

MPI_Comm rendezvous_join(const Rendezvous& r) {
  for (const auto& [name, value] : g_hidden) setenv(name.c_str(), value.c_str(), 1);
  char port[MPI_MAX_PORT_NAME] = {};
  const std::string port_file = r.dir + "/port", turn_file = r.dir + "/turn";
  MPI_Comm comm = MPI_COMM_NULL;
  if (r.rank == 0) {
    check(MPI_Open_port(MPI_INFO_NULL, port), "MPI_Open_port");
    write_atomically(port_file, port);
    check(MPI_Comm_dup(MPI_COMM_SELF, &comm), "MPI_Comm_dup");
  } else {
    const std::string p = wait_for_line(port_file, "rank 0's MPI port", [](const std::string& s) { return !s.empty(); });
    std::strncpy(port, p.c_str(), MPI_MAX_PORT_NAME - 1);
    const std::string me = std::to_string(r.rank);
    wait_for_line(turn_file, fmt::format("rank {}'s turn to join", r.rank), [&](const std::string& s) { return s == me; });
    MPI_Comm inter = MPI_COMM_NULL;
    check(MPI_Comm_connect(port, MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter), "MPI_Comm_connect");
    check(MPI_Intercomm_merge(inter, /*high=*/1, &comm), "MPI_Intercomm_merge");
    MPI_Comm_free(&inter);
  }
  // The ranks already joined accept the next one together; rank 0 tells it that it is its turn.
  for (int next = r.rank + 1; next < r.size; ++next) {
    if (r.rank == 0) write_atomically(turn_file, std::to_string(next));
    MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
    check(MPI_Comm_accept(port, MPI_INFO_NULL, 0, comm, &inter), "MPI_Comm_accept");
    check(MPI_Intercomm_merge(inter, /*high=*/0, &merged), "MPI_Intercomm_merge");
    MPI_Comm_free(&inter);
    MPI_Comm_free(&comm);
    comm = merged;
  }
  if (r.rank == 0) MPI_Close_port(port);
  int rank = -1, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  TETRA_CHECK(rank == r.rank && size == r.size, "rendezvous: joined as rank {} of {}, expected {} of {}", rank, size,
              r.rank, r.size);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  return comm;
}

void rendezvous_finish() {
  if (g_server <= 0) return;
  kill(g_server, SIGTERM);
  int status = 0;
  waitpid(g_server, &status, 0);
  g_server = -1;
  // Every rank has joined (MPI_Finalize is collective over them): nobody reads the files any more.
  std::error_code ec;
  std::filesystem::remove_all(g_dir, ec);
}

}  // namespace tetra

#endif  // TETRA_HAVE_MPI
