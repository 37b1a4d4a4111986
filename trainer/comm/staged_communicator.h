// A backend-memory communicator built on a host-memory one: each operation copies the backend
// buffers it reads to host staging buffers (Backend::copy_to_host), runs the host communicator's
// operation on them, and copies what it wrote back (Backend::copy_from_host) when it completes.
//
// ProcessGroups gives every group two roles (process_groups.h): the host communicator (MPI) for
// host buffers and a backend-memory communicator for backend buffers. Where backend memory is host
// memory (the CPU backend) one MPI communicator serves both; on the guarded-memory test backend
// this decorator serves the backend role, and a GPU backend plugs NCCL in at the same place.
//
// Semantics are the host communicator's, with the copies around them:
//   - issue: the data read by the operation (the input blocks of an all_to_all_v, the send
//     buffer, the in-place buffer) is copied to a staging buffer, then the host operation issued
//     on staging memory. The caller may reuse its input buffer as soon as the call returns.
//   - wait() (and a test() that finds it complete): the host operation is waited for and the
//     elements it wrote are copied back into the caller's buffer: only those (an all_to_all_v's
//     receive blocks, a reduce_scatter's block), so the gaps of a receive buffer stay untouched.
//   - send/recv inside group_start()/group_end(): group_end() completes the batch and copies the
//     received data back before it returns, as the host communicator's group_end() completes it.
//   - a Work handle destroyed without wait() is waited for (and copied back) by its destructor.
// Staging buffers come from a pool owned with the communicator: the first steps allocate what
// they need, later ones reuse it (no allocation per step once the pool has grown).
//
// Accounting: the host communicator counts every call (calls, payload, wire bytes: it runs the
// operation); this one counts only the time callers block in its wait() (Communicator::wait), so
// the group's traffic is the sum of the two communicators' stats (ProcessGroups::stats), counted
// once. Waits register with the watchdog through Communicator::wait as on any communicator.
#pragma once

#include <memory>

#include "kernels/backend.h"
#include "trainer/comm/communicator.h"

namespace tetra {

// `host` and `be` must outlive the result.
std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& be);

}  // namespace tetra
