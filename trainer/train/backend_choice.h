// Which backend a run computes on, and the communicators its memory needs.
//
// The CPU backend, unless the environment sets TETRA_TEST_GUARDED_MEMORY=1: then the CPU backend
// behind the guarded-memory decorator (kernels/cpu/guarded_backend.h), whose memory the host
// cannot touch, as a GPU's. Test-only, like the fault-injection hooks (fault_injection.h): it
// proves on a CPU-only machine that the trainer reaches backend memory only through the backend
// (tests/parity/test_guarded_memory.py runs the same configs with and without it and requires
// bitwise-identical results). Slow; logged as a warning on every rank that uses it.
#pragma once

#include <memory>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/dist/process_groups.h"

namespace tetra {

// The backend for `cfg` (training.threads threads).
std::unique_ptr<Backend> make_run_backend(const Config& cfg);

// The backend-memory communicators `be` needs (ProcessGroups::use_backend_memory): none when its
// memory is host memory (the MPI communicators serve both roles), the staged communicator
// (trainer/dist/staged_communicator.h) around each host one otherwise. `be` must outlive them.
BackendCommFactory backend_comm_factory(Backend& be);

}  // namespace tetra
