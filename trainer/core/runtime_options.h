// The process environment, read once. main reads every TETRA_* variable below into a
// RuntimeOptions before any command runs and hands each part to the code that uses it: the
// backend (its attention path, its device), the NCCL communicators, the bootstrap, the test
// hooks. Nothing else reads the environment, but for two readers that must: the MPI bootstrap
// (trainer/comm: the launchers' variables, which belong to it) and the config's path expansion
// ("~" and "${VAR}" in paths, through environment_variable below). docs/environment.md is the
// user's page of the same list.
//
//   TETRA_ATTENTION            auto | fused | cudnn: the CUDA backend's attention path (auto: cuDNN
//                              where it has a plan, else the fused kernels)
//   TETRA_NCCL_BLOCKING_WAIT   1: an NCCL wait also blocks the host until the operation is done (a
//                              hang is then reported with its group and collective)
//   TETRA_RENDEZVOUS           a directory every node shares: the bootstrap of `srun --mpi=none`
//                              (trainer/comm/rendezvous.h)
//   CUDA_VISIBLE_DEVICES       (CUDA's) quoted when no GPU is visible
//
// Test hooks (no config key, no production code path; each test names its own):
//   TETRA_TEST_GUARDED_MEMORY  1: the CPU backend's memory is guarded (kernels/cpu/guarded_backend.h)
//   TETRA_TEST_FAULT           nan-loss | inf-loss | spike-loss | nan-grad: a fault injected into a
//                              step (trainer/train/fault_injection.h)
//   TETRA_TEST_FAULT_STEPS     the 1-based steps it hits: "4" or "4,5,6"
//   TETRA_TEST_FAULT_RANK      the global rank it hits (default 0)
//   TETRA_TEST_HANG_RANK       the global rank that sleeps at the start of a step (watchdog.h)
//   TETRA_TEST_HANG_STEP       the step it sleeps at
//   TETRA_TEST_HANG_SECONDS    how long it sleeps (default 3600)
//   TETRA_TEST_SLOW_RANK       the global rank that sleeps inside every step (the straggler test)
//   TETRA_TEST_SLOW_MS         how long it sleeps per step (default 100)
//   TETRA_TEST_CLOCK_SKEW_MS   rank r's trace clock runs r times this ahead (trace alignment test)
//   TETRA_TEST_MOE_ROUTE       one | skew: the MoE router's logits biased so that every token
//                              chooses experts 0..top_k-1 (one), or expert 0 is favoured (skew)
//   TETRA_TEST_CHECKPOINT_PIECE n: a checkpoint's slices are read n elements at a time (default
//                              2^22), so that a test's small slices are read in several pieces
//   TETRA_FAULT_SAVE_AT        k: a save kills its process (SIGKILL) just before its k-th
//                              filesystem call (trainer/checkpoint/commit.h)
//   TETRA_FAULT_SAVE_LOG       a file each filesystem call of a save is appended to
//   TETRA_FAULT_NO_EXCHANGE    1: saves act as on a filesystem without RENAME_EXCHANGE
//
// An empty variable is an unset one. A value that is not one of the variable's (TETRA_ATTENTION=
// flash, a switch other than 1 or 0, a number that is not a whole number, a fault kind without its
// steps) is an InputError naming the variable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tetra {

// TETRA_TEST_FAULT*: which steps of which rank get which fault.
struct StepFaultHook {
  std::string kind;            // "" (none), nan-loss, inf-loss, spike-loss or nan-grad
  std::vector<int64_t> steps;  // 1-based
  int rank = 0;
};

// TETRA_TEST_HANG_*: the rank that sleeps at the start of a step (-1: none).
struct HangHook {
  int64_t rank = -1, step = -1, seconds = 3600;
};

// TETRA_TEST_SLOW_*, TETRA_TEST_CLOCK_SKEW_MS: a slow rank and skewed clocks (trace.h, straggler.h).
struct TimingHooks {
  int64_t slow_rank = -1;       // -1: none
  double slow_ms = 100.0;
  double clock_skew_ms = 0.0;   // per global rank
};

// TETRA_FAULT_*: the checkpoint commit protocol's fault points.
struct SaveFaultHooks {
  int64_t kill_at_call = 0;  // 0: never
  std::string call_log;      // "": no log
  bool no_exchange = false;
};

struct RuntimeOptions {
  std::string attention = "auto";  // TETRA_ATTENTION: auto, fused or cudnn
  bool nccl_blocking_wait = false;  // TETRA_NCCL_BLOCKING_WAIT
  std::string rendezvous_dir;       // TETRA_RENDEZVOUS ("": not that bootstrap)
  std::optional<std::string> cuda_visible_devices;  // CUDA_VISIBLE_DEVICES, for messages

  bool guarded_memory = false;  // TETRA_TEST_GUARDED_MEMORY
  StepFaultHook step_fault;     // TETRA_TEST_FAULT, _STEPS, _RANK
  HangHook hang;                // TETRA_TEST_HANG_RANK, _STEP, _SECONDS
  TimingHooks timing;           // TETRA_TEST_SLOW_RANK, _SLOW_MS, _CLOCK_SKEW_MS
  SaveFaultHooks save_faults;   // TETRA_FAULT_SAVE_AT, _SAVE_LOG, _NO_EXCHANGE
  std::string moe_route;        // TETRA_TEST_MOE_ROUTE: "", one or skew
  int64_t checkpoint_piece = 0; // TETRA_TEST_CHECKPOINT_PIECE: 0 = the default
};

// The options of this process's environment. InputError naming the variable for a value it
// cannot take.
RuntimeOptions read_runtime_options();

// An environment variable's value, nullptr when it is unset: for the config's "~" (HOME) and
// "${VAR}" in paths, which name variables of the user's choosing.
const char* environment_variable(const char* name);

}  // namespace tetra
