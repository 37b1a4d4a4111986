// The parts of the NCCL communicator (nccl_communicator.cpp) that are not the Communicator itself:
// error checks, the event pool, the state that operations and their Work handles share (handles
// may outlive the communicator), the handles, and the channels that carry sends and receives
// outside a group (one per tag, direction and peer: see nccl_communicator.h). Internal to
// trainer/comm; CUDA builds only.
#pragma once

#if defined(TETRA_HAVE_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "trainer/comm/communicator.h"

namespace tetra::nccl {

// Who fails, for messages: the group, this rank in it and in the world.
struct Where {
  std::string group;
  int rank = 0, size = 1, global = 0;
};

[[noreturn]] void fail(const Where& w, const std::string& what, const std::string& why);
void check_cuda(cudaError_t e, const Where& w, const char* what);
void check_nccl(ncclResult_t r, ncclComm_t comm, const Where& w, const char* what);
// A communicator's asynchronous error (a failed peer, network or kernel) as an Error.
void check_async(ncclComm_t comm, const Where& w, const char* what);

ncclDataType_t nccl_type(DType t);
ncclRedOp_t nccl_op(ReduceOp op);

// NCCL calls that enqueue work, from any thread of the process, are made under this lock.
std::mutex& enqueue_mutex();

// A stream for communication (the device's greatest priority).
cudaStream_t make_stream(const Where& w);

// Polls `done` (and `comm`'s asynchronous error, unless null) until it has happened.
void poll_until_done(cudaEvent_t done, ncclComm_t comm, const Where& w, const char* op);

// Reused events (no timing): each Work holds one until it is released.
class EventPool {
 public:
  explicit EventPool(Where w) : where_(std::move(w)) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  cudaEvent_t get() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), where_, "cudaEventCreateWithFlags");
    return e;
  }
  void put(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(e);
  }

 private:
  Where where_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// What the operations and their Work handles share with the communicator (handles may outlive it).
struct NcclGroup {
  Where where;
  std::vector<int> members;
  int device = 0;
  cudaStream_t compute = nullptr;  // the backend's
  cudaStream_t stream = nullptr;   // collectives and grouped sends/receives
  ncclComm_t comm = nullptr;
  cudaEvent_t issued = nullptr;    // the compute stream's position at a collective's issue
  std::shared_ptr<EventPool> events;
  std::atomic<bool> closed{false};  // NCCL communicators gone: handles stop querying them
  bool blocking_wait = false;       // wait() also blocks the host until the operation has finished
};

// The sends and receives of one group_start()/group_end().
struct Batch {
  std::shared_ptr<EventPool> events;
  bool ended = false;
  cudaEvent_t done = nullptr;  // after group_end(); null when the batch moved nothing
  ~Batch() {
    if (done != nullptr) events->put(done);
  }
};

// One send or receive outside a group, on its channel.
struct ChannelOp {
  std::shared_ptr<EventPool> events;
  bool is_send;
  void* buf;
  size_t count;
  ncclDataType_t type;
  cudaEvent_t ready = nullptr;  // the compute stream at the call
  cudaEvent_t done = nullptr;   // the channel's stream after the transfer
  bool issued = false;          // on the channel's stream (guarded by the channel's mutex)
  ~ChannelOp() {
    if (ready != nullptr) events->put(ready);
    if (done != nullptr) events->put(done);
  }
};

// The messages of one tag from one rank to another: a two-rank NCCL communicator (the sender is
// its rank 0) and a stream, at each end. Until `ready`, operations queue in `queued`.
struct Channel {
  std::string label;  // "send to group rank 1, tag 0"
  std::mutex mutex;
  std::condition_variable cv;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool ready = false;
  std::string failed;
  std::deque<std::shared_ptr<ChannelOp>> queued;
  std::thread setup;
  std::atomic<bool> setup_done{false};
};

// Puts `op` on the channel's stream. Called with the channel's mutex held, once it is ready.
void enqueue_on_channel(Channel& ch, ChannelOp& op, const Where& w);

// The body of a channel's set-up thread: completes the trip of the NCCL id over the host
// communicator (`id_transfer`: its send or receive), initialises the two-rank NCCL communicator
// (blocking until the peer does the same), then issues what queued meanwhile.
void set_up_channel(std::shared_ptr<NcclGroup> g, std::shared_ptr<Channel> ch, std::shared_ptr<ncclUniqueId> id,
                    WorkHandle id_transfer, bool sender);

// Work handles. wait() makes the compute stream wait for the operation (and, with the group's
// blocking_wait, the host too); test() says whether the GPU has finished it.
// A collective (or all_to_all_v) on the group's stream, complete with `done` (returned to the pool
// with the handle).
WorkHandle make_stream_work(std::shared_ptr<NcclGroup> g, cudaEvent_t done, const char* op);
// A send or receive of a group_start()/group_end() batch (wait() before group_end() throws).
WorkHandle make_batch_work(std::shared_ptr<NcclGroup> g, std::shared_ptr<Batch> batch);
// A send or receive on a channel (wait() blocks the host only while the channel is set up).
WorkHandle make_channel_work(std::shared_ptr<NcclGroup> g, std::shared_ptr<Channel> ch, std::shared_ptr<ChannelOp> op);

}  // namespace tetra::nccl

#endif  // TETRA_HAVE_CUDA
