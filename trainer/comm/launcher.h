// What a launcher told this process through its environment, read without MPI: whether mpirun,
// srun or a PMI launcher started it as one of several processes, and which one it is. The
// commands that never start MPI (`tetra --help`, `tetra generate`, `tetra data`, `tetra ckpt`)
// use it to print once per job and to refuse a multi-process launch; the memory plan uses the
// number of processes per node. The MPI bootstrap (bootstrap.h) is the authority once MPI runs.
//
// The variables, any of them above 1 (bootstrap.cpp reads the same ones): OpenMPI's mpirun
// OMPI_COMM_WORLD_SIZE / _RANK; MPICH and Intel MPI's hydra and srun's PMI-2 PMI_SIZE / PMI_RANK;
// MVAPICH MV2_COMM_WORLD_SIZE / _RANK; srun SLURM_STEP_NUM_TASKS / SLURM_PROCID, on a task it
// started (SLURM_PROCID set: a batch script alone sets no task's variables).
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

struct LaunchEnvironment {
  std::string launcher;  // "mpirun", "a PMI launcher" or "srun"; "" when no launcher started several
  std::string variable;  // the variable that told: "OMPI_COMM_WORLD_SIZE"
  int64_t size = 1;      // processes the launcher started together (1: a single process)
  int64_t rank = 0;      // this process's index among them

  // "mpirun (OMPI_COMM_WORLD_SIZE=4)"; "" for a single process.
  std::string describe() const;
};

// The launch this process is part of, from the launchers' variables.
LaunchEnvironment launch_environment();

// Processes of this job on this machine, as the launcher says (OMPI_COMM_WORLD_LOCAL_SIZE,
// SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE; Slurm's "4(x2)" reads as 4); 1 when none says.
int64_t launcher_local_size();

}  // namespace tetra
