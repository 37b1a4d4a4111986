// The guarded-memory backend: the CPU backend's ops on memory the host cannot touch, so that a
// test on a machine without a GPU proves the trainer never reads or writes backend memory except
// through the backend (its ops and copy_to_host / copy_from_host), as a GPU backend requires.
//
// How: alloc() maps every allocation with mmap, between two guard pages, and keeps it PROT_NONE.
// Each op (copies and memset included) looks up the allocations its pointer arguments fall in,
// makes them readable and writable, runs the CPU backend's op, and protects them again. Any other
// access from the host (a loop over a gradient buffer, a memcpy from the losses, MPI reading a
// buffer) faults at the instruction that does it; a handler for SIGSEGV prints the address and
// the allocation it falls in, with a backtrace, before the process dies as it would have.
//
// The reverse mistake is caught too: an op given a pointer that is not backend memory (a host
// vector passed where the backend expects its own memory) throws tetra::Error naming the op and
// the argument, and copy_to_host / copy_from_host check that the host side is not backend memory
// and that the backend side lies within one allocation.
//
// New allocations are filled with 0xFF bytes (NaN in fp32, bf16 and fp16, -1 in int32) instead of
// the zeros a fresh mapping would hold, so a read of memory nothing wrote shows up rather than
// passing for zeros.
//
// Ops run one at a time (a mutex), since protection is per process. Numerics are the CPU
// backend's exactly: the same code runs on the same values, so a run is bitwise identical to a
// run on the CPU backend. Slow (two mprotect calls per allocation an op touches): for tests only;
// the trainer selects it with TETRA_TEST_GUARDED_MEMORY=1 (trainer/train/compute_device.h).
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace tetra {

// Wraps `inner` (the CPU backend: its ops must read and write memory directly).
std::unique_ptr<Backend> make_guarded_backend(std::unique_ptr<Backend> inner);

}  // namespace tetra
