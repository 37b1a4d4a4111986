// The GPU Communicator: NCCL over one process group, for buffers in CUDA device memory.
//
// Built from the group's host communicator (MPI; host memory) and the CUDA backend's compute
// stream (CudaBackend::stream()). Defined only in builds with CUDA (TETRA_HAVE_CUDA); callers
// guard their use the same way.
//
// Semantics (communicator.h, seen from the compute stream):
// - Stream-ordered. An operation reads its inputs after everything enqueued on the compute stream
//   before the call, and runs on the communicator's own stream, so compute issued after the call
//   overlaps it. Work::wait() makes the compute stream wait for the operation (no host block):
//   every kernel enqueued after wait() sees the result, and the host sees it through
//   Backend::copy_to_host, which synchronises. The blocking forms (all_reduce(), ...) are such a
//   wait too. Work::test() says whether the GPU has finished it.
// - Ordered per communicator: collectives and grouped sends/receives go, in issue order, to one
//   NCCL communicator of the whole group (ncclCommInitRank, the id broadcast over the host
//   communicator at construction, which is therefore collective over the group).
// - Sends and receives outside a group complete independently, as the interface promises. NCCL
//   has no tags, and a send on an NCCL stream holds that stream until its receive starts, so one
//   NCCL communicator would make a pipeline's sends and receives wait for each other in the order
//   they were issued (two stages that both send first would deadlock). Each (tag, direction,
//   peer) therefore gets its own channel: a two-rank NCCL communicator and CUDA stream that carry
//   only the messages from one rank to another with one tag. On a channel, messages match in
//   issue order (the interface's rule: a receive matches its peer's sends of the same tag in
//   order), and nothing on one channel waits for another. A channel is created at its first use,
//   without blocking the caller: the sender makes the NCCL id and sends it over the host
//   communicator (tags 31744 + tag there, reserved), a thread of the channel initialises it, then
//   issues the operations queued meanwhile. A pipeline's rank uses 4 channels (activations and
//   gradients, to each neighbour). Tags are 0 .. 1023.
// - Inside group_start()/group_end(), sends and receives go to the group's NCCL communicator as
//   one ncclGroup, ordered by tag (stably), so per pair and tag they match in issue order as
//   outside. A message sent inside a group must be received inside a group. group_end() returns
//   once the compute stream waits for the whole batch.
// - A group of one rank is a one-rank NCCL communicator: collectives copy where the output is not
//   the input; sends to itself only inside a group.
// - BF16 and F16 reduce as NCCL does (ncclBfloat16, ncclFloat16); F32 and I32; SUM and MAX.
// - Counts are size_t in NCCL: no 2^31 limit. Zero-element operations move nothing and are still
//   counted as calls.
//
// Accounting is exactly the MPI communicator's (comm_accounting.h), at issue time. blocked_s is the
// host time spent in waits, which is ~0 here: the waits are on the GPU.
//
// Errors and hangs: NCCL and CUDA failures become tetra::Error naming the group, the rank and the
// operation; each wait() and test() also reads ncclCommGetAsyncError, so a failed peer or network
// surfaces as an Error at the next wait. A hang (a peer that never joins) does not block the host
// in wait() (it is stream-ordered), so it shows where the host next waits for the GPU
// (copy_to_host, synchronize): the watchdog's step timeout (training.collective_timeout_s) then
// ends the job, its report saying "not waiting in any collective". With `blocking_wait` (the
// user's TETRA_NCCL_BLOCKING_WAIT=1), wait() (and group_end()) also block the host until the
// operation has finished, polling it and ncclCommGetAsyncError: inside Communicator::wait's watchdog
// registration, so a hang is reported with its group and operation (for diagnosis; it costs the
// host's run-ahead). The host otherwise blocks only for a channel whose first message was issued
// before the channel was set up (wait() before the peer has taken part), registered likewise.
//
// Caveat (NCCL's, for every program that runs several NCCL communicators at once): kernels of
// different communicators run concurrently only while they fit on the GPU together; NCCL's
// p2p and collective kernels take a few SMs each, far below an H100/H200's 132.
#pragma once

#include <memory>

#include "trainer/comm/communicator.h"

namespace tetra {

// Collective over `host`'s group: every member calls it, in the same order relative to its other
// collectives on `host`. `cuda_stream` is the compute stream (a cudaStream_t) of the calling
// thread's current CUDA device. `host` must outlive the result (channels are set up over it).
// `blocking_wait`: wait() and group_end() also block the host (see above).
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void* cuda_stream,
                                                     bool blocking_wait = false);

}  // namespace tetra
