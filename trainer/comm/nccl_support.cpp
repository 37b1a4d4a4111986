// The NCCL communicator's parts (see nccl_support.h). Compiled with CUDA only.
#if defined(TETRA_HAVE_CUDA)
#include "trainer/comm/nccl_support.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/comm/watchdog.h"

namespace tetra::nccl {

// One at a time: NCCL allows one thread at a time per communicator, and calls into several
// communicators of one device from several threads at once are not safe either (NCCL's
// thread-safety notes).
std::mutex& enqueue_mutex() {
  static std::mutex m;
  return m;
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::SUM ? ncclSum : ncclMax; }

[[noreturn]] void fail(const Where& w, const std::string& what, const std::string& why) {
  throw Error(fmt::format("{} on group '{}' (rank {} of {}, global rank {}) failed: {}", what, w.group, w.rank, w.size,
                          w.global, why));
}

void check_cuda(cudaError_t e, const Where& w, const char* what) {
  if (e != cudaSuccess) fail(w, what, fmt::format("CUDA error {}: {}", cudaGetErrorName(e), cudaGetErrorString(e)));
}

void check_nccl(ncclResult_t r, ncclComm_t comm, const Where& w, const char* what) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  fail(w, what, fmt::format("NCCL error {} ({}){}{}", static_cast<int>(r), ncclGetErrorString(r),
                            last != nullptr && last[0] != '\0' ? ": " : "", last != nullptr ? last : ""));
}

void check_async(ncclComm_t comm, const Where& w, const char* what) {
  if (comm == nullptr) return;
  ncclResult_t state = ncclSuccess;
  check_nccl(ncclCommGetAsyncError(comm, &state), comm, w, "ncclCommGetAsyncError");
  if (state != ncclSuccess && state != ncclInProgress) check_nccl(state, comm, w, what);
}

// Sleeps from 1 us up to 100 us between looks.
void poll_until_done(cudaEvent_t done, ncclComm_t comm, const Where& w, const char* op) {
  long sleep_ns = 1000;
  for (;;) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, w, op);
    check_async(comm, w, op);
    std::this_thread::sleep_for(std::chrono::nanoseconds(sleep_ns));
    sleep_ns = std::min(sleep_ns * 2, 100000L);
  }
}

// Communication streams run at the device's greatest priority: a collective's blocks are
// scheduled ahead of compute blocks queued at the same time, so compute hides it rather than
// delays it.
cudaStream_t make_stream(const Where& w) {
  int least = 0, greatest = 0;
  check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), w, "cudaDeviceGetStreamPriorityRange");
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest), w, "cudaStreamCreateWithPriority");
  return s;
}



namespace {

// A collective (or an all_to_all_v) on the group's stream, complete when `done` is.
class StreamWork final : public Work {
 public:
  StreamWork(std::shared_ptr<NcclGroup> g, cudaEvent_t done, const char* op) : g_(std::move(g)), done_(done), op_(op) {}
  ~StreamWork() override {
    // Released without wait(): the compute stream still must not run ahead of the operation.
    if (!waited_) cudaStreamWaitEvent(g_->compute, done_, 0);
    g_->events->put(done_);
  }
  void wait() override {
    if (!g_->closed) check_async(g_->comm, g_->where, op_);
    check_cuda(cudaStreamWaitEvent(g_->compute, done_, 0), g_->where, op_);
    waited_ = true;
    if (g_->blocking_wait) poll_until_done(done_, g_->closed ? nullptr : g_->comm, g_->where, op_);
  }
  bool test() override {
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) check_cuda(q, g_->where, op_);
    if (!g_->closed) check_async(g_->comm, g_->where, op_);
    return false;
  }

 private:
  std::shared_ptr<NcclGroup> g_;
  cudaEvent_t done_;
  const char* op_;
  bool waited_ = false;
};


class BatchWork final : public Work {
 public:
  BatchWork(std::shared_ptr<NcclGroup> g, std::shared_ptr<Batch> b) : g_(std::move(g)), b_(std::move(b)) {}
  void wait() override {  // group_end() already made the compute stream wait for the batch
    TETRA_CHECK(b_->ended, "wait() on a send/recv of group '{}' before its group_end()", g_->where.group);
  }
  bool test() override {
    if (!b_->ended) return false;
    if (b_->done == nullptr) return true;
    const cudaError_t q = cudaEventQuery(b_->done);
    if (q != cudaSuccess && q != cudaErrorNotReady) check_cuda(q, g_->where, "send/recv group");
    return q == cudaSuccess;
  }

 private:
  std::shared_ptr<NcclGroup> g_;
  std::shared_ptr<Batch> b_;
};

}  // namespace



void enqueue_on_channel(Channel& ch, ChannelOp& op, const Where& w) {
  std::lock_guard<std::mutex> lock(enqueue_mutex());
  check_cuda(cudaStreamWaitEvent(ch.stream, op.ready, 0), w, "cudaStreamWaitEvent (channel)");
  check_nccl(op.is_send ? ncclSend(op.buf, op.count, op.type, 1, ch.comm, ch.stream)
                        : ncclRecv(op.buf, op.count, op.type, 0, ch.comm, ch.stream),
             ch.comm, w, op.is_send ? "ncclSend" : "ncclRecv");
  check_cuda(cudaEventRecord(op.done, ch.stream), w, "cudaEventRecord (channel)");
  op.issued = true;
}

void set_up_channel(std::shared_ptr<NcclGroup> g, std::shared_ptr<Channel> ch, std::shared_ptr<ncclUniqueId> id,
                    WorkHandle id_transfer, bool sender) {
  try {
    check_cuda(cudaSetDevice(g->device), g->where, "cudaSetDevice (channel)");
    id_transfer->wait();
    id_transfer.reset();
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, 2, *id, sender ? 0 : 1), nullptr, g->where,
               fmt::format("ncclCommInitRank ({})", ch->label).c_str());
    std::lock_guard<std::mutex> lock(ch->mutex);
    ch->comm = comm;
    ch->stream = make_stream(g->where);
    for (const std::shared_ptr<ChannelOp>& op : ch->queued) enqueue_on_channel(*ch, *op, g->where);
    ch->queued.clear();
    ch->ready = true;
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(ch->mutex);
    ch->failed = e.what();
    ch->queued.clear();
  }
  ch->cv.notify_all();
  ch->setup_done = true;
}

namespace {

class ChannelWork final : public Work {
 public:
  ChannelWork(std::shared_ptr<NcclGroup> g, std::shared_ptr<Channel> ch, std::shared_ptr<ChannelOp> op)
      : g_(std::move(g)), ch_(std::move(ch)), op_(std::move(op)) {}
  ~ChannelWork() override {
    if (waited_) return;
    try {  // released without wait(): as in wait(), so the compute stream cannot run ahead of it
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  void wait() override {
    {
      std::unique_lock<std::mutex> lock(ch_->mutex);
      if (!op_->issued && ch_->failed.empty()) {  // the channel is still being set up
        const WatchedWait watched(g_->where.group, g_->members, "send/recv (channel set-up)");
        ch_->cv.wait(lock, [&] { return op_->issued || !ch_->failed.empty(); });
      }
      if (!op_->issued) fail(g_->where, ch_->label, "setting the channel up failed: " + ch_->failed);
    }
    if (!g_->closed) check_async(ch_->comm, g_->where, op_->is_send ? "send" : "recv");
    check_cuda(cudaStreamWaitEvent(g_->compute, op_->done, 0), g_->where, op_->is_send ? "send" : "recv");
    waited_ = true;
    if (g_->blocking_wait)
      poll_until_done(op_->done, g_->closed ? nullptr : ch_->comm, g_->where, op_->is_send ? "send" : "recv");
  }
  bool test() override {
    {
      std::lock_guard<std::mutex> lock(ch_->mutex);
      if (!ch_->failed.empty() && !op_->issued)
        fail(g_->where, ch_->label, "setting the channel up failed: " + ch_->failed);
      if (!op_->issued) return false;
    }
    const cudaError_t q = cudaEventQuery(op_->done);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) check_cuda(q, g_->where, op_->is_send ? "send" : "recv");
    if (!g_->closed) check_async(ch_->comm, g_->where, op_->is_send ? "send" : "recv");
    return false;
  }

 private:
  std::shared_ptr<NcclGroup> g_;
  std::shared_ptr<Channel> ch_;
  std::shared_ptr<ChannelOp> op_;
  bool waited_ = false;
};


}  // namespace

WorkHandle make_stream_work(std::shared_ptr<NcclGroup> g, cudaEvent_t done, const char* op) {
  return std::make_unique<StreamWork>(std::move(g), done, op);
}

WorkHandle make_batch_work(std::shared_ptr<NcclGroup> g, std::shared_ptr<Batch> batch) {
  return std::make_unique<BatchWork>(std::move(g), std::move(batch));
}

WorkHandle make_channel_work(std::shared_ptr<NcclGroup> g, std::shared_ptr<Channel> ch, std::shared_ptr<ChannelOp> op) {
  return std::make_unique<ChannelWork>(std::move(g), std::move(ch), std::move(op));
}

}  // namespace tetra::nccl

#endif  // TETRA_HAVE_CUDA
