// The launchers' variables, read without MPI; see launcher.h.
#include "trainer/comm/launcher.h"

#include <cstdlib>

#include <fmt/format.h>

namespace tetra {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

}  // namespace

std::string LaunchEnvironment::describe() const {
  return size > 1 ? fmt::format("{} ({}={})", launcher, variable, size) : std::string();
}

LaunchEnvironment launch_environment() {
  struct Launcher {
    const char* name;
    const char* size_var;
    const char* rank_var;
    bool rank_required;  // the launch counts only where the rank variable is set too
  };
  const Launcher launchers[] = {{"mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", false},
                                {"a PMI launcher", "PMI_SIZE", "PMI_RANK", false},
                                {"mpirun", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", false},
                                {"srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", true}};
  for (const Launcher& l : launchers) {
    const char* size = env(l.size_var);
    if (size == nullptr || std::atoll(size) <= 1) continue;
    const char* rank = env(l.rank_var);
    if (l.rank_required && rank == nullptr) continue;
    LaunchEnvironment e;
    e.launcher = l.name;
    e.variable = l.size_var;
    e.size = std::atoll(size);
    e.rank = rank != nullptr ? std::atoll(rank) : 0;
    return e;
  }
  return {};
}

int64_t launcher_local_size() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
    const char* v = env(var);
    if (v && std::atoll(v) > 0) return std::atoll(v);  // Slurm's "4(x2)" reads as 4
  }
  return 1;
}

}  // namespace tetra
