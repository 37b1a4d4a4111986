// The run's backend and its backend-memory communicators (see backend_choice.h).
#include "trainer/train/backend_choice.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/cpu/guarded_backend.h"
#include "trainer/dist/staged_communicator.h"

namespace tetra {

namespace {

bool guarded_memory_requested() {
  const char* v = std::getenv("TETRA_TEST_GUARDED_MEMORY");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

std::unique_ptr<Backend> make_run_backend(const Config& cfg) {
  std::unique_ptr<Backend> be = make_cpu_backend(static_cast<int>(cfg.training.threads));
  if (!guarded_memory_requested()) return be;
  // On stderr, from every rank (and not on stdout, which `tetra generate` keeps for its text).
  std::fprintf(stderr, "warning: TETRA_TEST_GUARDED_MEMORY=1: backend memory is guarded (backend 'cpu-guarded': the "
               "host may touch it only through the backend; collectives on it are staged through host buffers). A "
               "test mode, slow: not for production runs\n");
  return make_guarded_backend(std::move(be));
}

BackendCommFactory backend_comm_factory(Backend& be) {
  if (be.host_memory()) return {};
  return [&be](const std::string&, const std::vector<int>&, Communicator& host) {
    return make_staged_communicator(host, be);
  };
}

}  // namespace tetra
