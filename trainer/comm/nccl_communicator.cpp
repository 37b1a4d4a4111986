// The NCCL Communicator (see nccl_communicator.h): argument checks and accounting at issue time in
// the caller's thread, as in the MPI one; collectives and grouped sends/receives on the group's
// NCCL communicator and stream; sends and receives outside a group on per-(tag, direction, peer)
// channels set up on first use by a thread of their own (their parts in nccl_support.h).
//
// Every operation follows one pattern: an event recorded on the compute stream at the call, the
// communication stream made to wait for it, the NCCL call on that stream, a `done` event recorded
// after it; Work::wait() makes the compute stream wait for `done`.
//
// Compiled with CUDA only.
#if defined(TETRA_HAVE_CUDA)
#include "trainer/comm/nccl_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/comm/comm_accounting.h"
#include "trainer/comm/comm_worker.h"
#include "trainer/comm/nccl_support.h"
#include "trainer/comm/watchdog.h"

namespace tetra {

namespace {

using namespace nccl;

constexpr int kMaxTag = 1023;
constexpr int kIdTagBase = 31744;  // host tags of the channels' NCCL ids: kIdTagBase + tag <= 32767
static_assert(kIdTagBase + kMaxTag <= 32767, "MPI guarantees tags up to 32767 only");
static_assert(sizeof(ncclUniqueId) % 4 == 0, "the NCCL id travels as int32 elements");
constexpr int64_t kIdInts = static_cast<int64_t>(sizeof(ncclUniqueId) / 4);

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& host, cudaStream_t compute, bool blocking_wait)
      : host_(host), g_(std::make_shared<NcclGroup>()) {
    NcclGroup& g = *g_;
    g.blocking_wait = blocking_wait;
    g.where = Where{host.name(), host.rank(), host.size(), host.members()[static_cast<size_t>(host.rank())]};
    g.members = host.members();
    g.compute = compute;
    g.events = std::make_shared<EventPool>(g.where);
    check_cuda(cudaGetDevice(&g.device), g.where, "cudaGetDevice");

    // Rank 0's id, and whether it could make one, to every member (so all fail together).
    std::vector<int32_t> msg(static_cast<size_t>(kIdInts + 1), 0);
    std::string problem;
    if (host.rank() == 0) {
      ncclUniqueId id{};
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r == ncclSuccess) {
        std::memcpy(msg.data(), &id, sizeof(id));
        msg.back() = 1;
      } else {
        problem = fmt::format("ncclGetUniqueId: {} ({})", ncclGetErrorString(r), ncclGetLastError(nullptr));
      }
    }
    const CommStats saved = host.stats();  // setting up is not the group's traffic
    host.broadcast(msg.data(), kIdInts + 1, DType::I32, 0);
    host.stats() = saved;
    if (msg.back() != 1)
      fail(g.where, "creating the NCCL communicator", problem.empty() ? "rank 0 could not make an NCCL id" : problem);
    ncclUniqueId id{};
    std::memcpy(&id, msg.data(), sizeof(id));
    {
      const WatchedWait watched(g.where.group, g.members, "ncclCommInitRank");
      check_nccl(ncclCommInitRank(&g.comm, size(), id, rank()), nullptr, g.where, "ncclCommInitRank");
    }
    g.stream = make_stream(g.where);
    check_cuda(cudaEventCreateWithFlags(&g.issued, cudaEventDisableTiming), g.where, "cudaEventCreateWithFlags");
  }

  ~NcclCommunicator() override;

  const std::string& name() const override { return g_->where.group; }
  int rank() const override { return g_->where.rank; }
  int size() const override { return g_->where.size; }
  const std::vector<int>& members() const override { return g_->members; }

  WorkHandle all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override {
    check_collective("all_reduce", count);
    account_call(stats_, CommOp::ALL_REDUCE, size(), count * bytes(type));
    if (count == 0) return make_done_work();
    return issue("ncclAllReduce", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(buf, buf, static_cast<size_t>(count), nccl_type(type), nccl_op(op), c, s);
    });
  }

  WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count, DType type,
                                  ReduceOp op) override {
    check_collective("reduce_scatter", recv_count);
    const size_t block = static_cast<size_t>(recv_count) * dtype_size(type);
    const bool in_place = recv == static_cast<const char*>(send) + static_cast<size_t>(rank()) * block;
    TETRA_CHECK(in_place || !overlaps(recv, block, send, block * static_cast<size_t>(size())),
                "reduce_scatter on group '{}': recv overlaps send without being this rank's block ({} elements at "
                "element {})", name(), recv_count, rank() * recv_count);
    account_call(stats_, CommOp::REDUCE_SCATTER, size(), size() * recv_count * bytes(type));
    if (recv_count == 0) return make_done_work();
    return issue("ncclReduceScatter", [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(send, recv, static_cast<size_t>(recv_count), nccl_type(type), nccl_op(op), c, s);
    });
  }

  WorkHandle all_gather_async(void* recv, const void* send, int64_t send_count, DType type) override {
    check_collective("all_gather", send_count);
    const size_t block = static_cast<size_t>(send_count) * dtype_size(type);
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<size_t>(rank()) * block;
    TETRA_CHECK(in_place || !overlaps(recv, block * static_cast<size_t>(size()), send, block),
                "all_gather on group '{}': send overlaps recv without being this rank's block ({} elements at "
                "element {})", name(), send_count, rank() * send_count);
    account_call(stats_, CommOp::ALL_GATHER, size(), size() * send_count * bytes(type));
    if (send_count == 0) return make_done_work();
    return issue("ncclAllGather", [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(send, recv, static_cast<size_t>(send_count), nccl_type(type), c, s);
    });
  }

  WorkHandle all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_offsets, void* recv,
                                const std::vector<int64_t>& recv_counts,
                                const std::vector<int64_t>& recv_offsets, DType type) override {
    check_collective("all_to_all_v", 0);
    const size_t p = static_cast<size_t>(size());
    TETRA_CHECK(send_counts.size() == p && send_offsets.size() == p && recv_counts.size() == p &&
                    recv_offsets.size() == p,
                "all_to_all_v on group '{}' of size {} needs {} counts and offsets each, got {}, {}, {}, {}", name(),
                p, p, send_counts.size(), send_offsets.size(), recv_counts.size(), recv_offsets.size());
    int64_t total = 0;
    for (size_t r = 0; r < p; ++r) {
      TETRA_CHECK(send_counts[r] >= 0 && send_offsets[r] >= 0 && recv_counts[r] >= 0 && recv_offsets[r] >= 0,
                  "all_to_all_v on group '{}': negative count or offset for group rank {}", name(), r);
      total += send_counts[r];
    }
    const int64_t to_others = total - send_counts[static_cast<size_t>(rank())];
    account_all_to_all(stats_, size(), total * bytes(type), to_others * bytes(type));
    const size_t e = dtype_size(type);
    const ncclDataType_t t = nccl_type(type);
    // Empty blocks are skipped on both sides (a receiver's count from r is r's count to it).
    return issue("all_to_all_v", [&](ncclComm_t c, cudaStream_t s) {
      ncclResult_t first = ncclGroupStart();
      if (first != ncclSuccess) return first;
      for (size_t r = 0; r < p; ++r) {
        const int peer = static_cast<int>(r);
        ncclResult_t res = ncclSuccess;
        if (send_counts[r] > 0)
          res = ncclSend(static_cast<const char*>(send) + static_cast<size_t>(send_offsets[r]) * e,
                         static_cast<size_t>(send_counts[r]), t, peer, c, s);
        if (first == ncclSuccess) first = res;
        if (recv_counts[r] > 0)
          res = ncclRecv(static_cast<char*>(recv) + static_cast<size_t>(recv_offsets[r]) * e,
                         static_cast<size_t>(recv_counts[r]), t, peer, c, s);
        if (first == ncclSuccess) first = res;
      }
      const ncclResult_t end = ncclGroupEnd();
      return first != ncclSuccess ? first : end;
    });
  }

  WorkHandle broadcast_async(void* buf, int64_t count, DType type, int root) override {
    check_collective("broadcast", count);
    TETRA_CHECK(root >= 0 && root < size(), "broadcast on group '{}' of size {} from root {}", name(), size(), root);
    account_call(stats_, CommOp::BROADCAST, size(), count * bytes(type));
    if (count == 0) return make_done_work();
    return issue("ncclBroadcast", [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(buf, buf, static_cast<size_t>(count), nccl_type(type), root, c, s);
    });
  }

  WorkHandle send_async(const void* buf, int64_t count, DType type, int peer, int tag) override {
    return p2p(true, const_cast<void*>(buf), count, type, peer, tag);
  }
  WorkHandle recv_async(void* buf, int64_t count, DType type, int peer, int tag) override {
    return p2p(false, buf, count, type, peer, tag);
  }

  void group_start() override {
    if (depth_++ == 0) {
      batch_ = std::make_shared<Batch>();
      batch_->events = g_->events;
    }
  }

  void group_end() override {
    TETRA_CHECK(depth_ > 0, "group_end() on group '{}' without group_start()", name());
    if (--depth_ > 0) return;
    std::shared_ptr<Batch> batch = std::move(batch_);
    std::vector<Transfer> transfers = std::move(transfers_);
    transfers_.clear();
    // Per pair, NCCL matches a group's sends and receives in issue order; ordered by tag (stably)
    // on both sides, they match as the interface says: per tag, in issue order.
    std::stable_sort(transfers.begin(), transfers.end(),
                     [](const Transfer& a, const Transfer& b) { return a.tag < b.tag; });
    transfers.erase(std::remove_if(transfers.begin(), transfers.end(), [](const Transfer& x) { return x.count == 0; }),
                    transfers.end());
    if (!transfers.empty()) {
      std::lock_guard<std::mutex> lock(enqueue_mutex());
      NcclGroup& g = *g_;
      check_cuda(cudaEventRecord(g.issued, g.compute), g.where, "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(g.stream, g.issued, 0), g.where, "cudaStreamWaitEvent");
      ncclResult_t first = ncclGroupStart();
      check_nccl(first, g.comm, g.where, "ncclGroupStart");
      for (const Transfer& x : transfers) {
        const ncclResult_t r = x.is_send ? ncclSend(x.buf, x.count, nccl_type(x.type), x.peer, g.comm, g.stream)
                                         : ncclRecv(x.buf, x.count, nccl_type(x.type), x.peer, g.comm, g.stream);
        if (first == ncclSuccess) first = r;
      }
      const ncclResult_t end = ncclGroupEnd();
      check_nccl(first != ncclSuccess ? first : end, g.comm, g.where, "send/recv group");
      batch->done = g.events->get();
      check_cuda(cudaEventRecord(batch->done, g.stream), g.where, "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(g.compute, batch->done, 0), g.where, "cudaStreamWaitEvent");
    }
    batch->ended = true;
    if (g_->blocking_wait && batch->done != nullptr) {
      const WatchedWait watched(name(), members(), "send/recv group");
      poll_until_done(batch->done, g_->comm, g_->where, "send/recv group");
    }
  }

  // Host-level, like the MPI barrier: every member has reached it. It does not wait for the GPU.
  void barrier() override {
    TETRA_CHECK(depth_ == 0, "barrier on group '{}' between group_start() and group_end()", name());
    host_.barrier();
  }

 private:
  struct Transfer {
    bool is_send;
    void* buf;
    size_t count;
    DType type;
    int peer;
    int tag;
  };

  static int64_t bytes(DType t) { return static_cast<int64_t>(dtype_size(t)); }

  void check_collective(const char* op, int64_t count) const {
    TETRA_CHECK(depth_ == 0, "{} on group '{}' between group_start() and group_end(): only send and recv may "
                "be grouped", op, name());
    TETRA_CHECK(count >= 0, "{} on group '{}' with a negative count ({})", op, name(), count);
  }

  // The NCCL collective `call(comm, stream)` on the group's stream, after the compute stream's work.
  template <typename Call>
  WorkHandle issue(const char* what, Call&& call) {
    std::lock_guard<std::mutex> lock(enqueue_mutex());
    NcclGroup& g = *g_;
    check_cuda(cudaEventRecord(g.issued, g.compute), g.where, "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(g.stream, g.issued, 0), g.where, "cudaStreamWaitEvent");
    check_nccl(call(g.comm, g.stream), g.comm, g.where, what);
    cudaEvent_t done = g.events->get();
    const cudaError_t rec = cudaEventRecord(done, g.stream);
    if (rec != cudaSuccess) g.events->put(done);
    check_cuda(rec, g.where, "cudaEventRecord");
    return make_stream_work(g_, done, what);
  }

  WorkHandle p2p(bool is_send, void* buf, int64_t count, DType type, int peer, int tag) {
    const char* op = is_send ? "send" : "recv";
    TETRA_CHECK(peer >= 0 && peer < size(), "{} on group '{}' of size {} with peer {}", op, name(), size(), peer);
    TETRA_CHECK(tag >= 0 && tag <= kMaxTag, "{} on group '{}' with tag {}: the NCCL communicator's tags are 0 .. {}",
                op, name(), tag, kMaxTag);
    TETRA_CHECK(count >= 0, "{} on group '{}' with a negative count ({})", op, name(), count);
    TETRA_CHECK(depth_ > 0 || peer != rank(),
                "{} to itself on group '{}' outside group_start()/group_end() could never complete", op, name());
    account_call(stats_, is_send ? CommOp::SEND : CommOp::RECV, size(), count * bytes(type));
    if (depth_ > 0) {
      transfers_.push_back(Transfer{is_send, buf, static_cast<size_t>(count), type, peer, tag});
      return make_batch_work(g_, batch_);
    }
    if (count == 0) return make_done_work();  // skipped at both ends: the receiver asks for 0 too

    std::shared_ptr<Channel> ch = channel(is_send, peer, tag);
    auto x = std::make_shared<ChannelOp>();
    x->events = g_->events;
    x->is_send = is_send;
    x->buf = buf;
    x->count = static_cast<size_t>(count);
    x->type = nccl_type(type);
    x->ready = g_->events->get();
    x->done = g_->events->get();
    check_cuda(cudaEventRecord(x->ready, g_->compute), g_->where, "cudaEventRecord");
    {
      std::lock_guard<std::mutex> lock(ch->mutex);
      if (!ch->failed.empty()) fail(g_->where, ch->label, "setting the channel up failed: " + ch->failed);
      if (ch->ready)
        enqueue_on_channel(*ch, *x, g_->where);
      else
        ch->queued.push_back(x);
    }
    return make_channel_work(g_, std::move(ch), std::move(x));
  }

  // The channel of (direction, peer, tag), set up on first use: the sender makes the NCCL id and
  // sends it over the host communicator, the receiver posts the receive; the channel's thread
  // does the rest.
  std::shared_ptr<Channel> channel(bool is_send, int peer, int tag) {
    const auto key = std::make_tuple(is_send, peer, tag);
    if (auto it = channels_.find(key); it != channels_.end()) return it->second;
    auto ch = std::make_shared<Channel>();
    ch->label = fmt::format("{} group rank {}, tag {}", is_send ? "send to" : "recv from", peer, tag);
    auto id = std::make_shared<ncclUniqueId>();
    if (is_send) check_nccl(ncclGetUniqueId(id.get()), nullptr, g_->where, "ncclGetUniqueId (channel)");
    const CommStats saved = host_.stats();  // setting up is not the group's traffic
    WorkHandle transfer = is_send ? host_.send_async(id.get(), kIdInts, DType::I32, peer, kIdTagBase + tag)
                                  : host_.recv_async(id.get(), kIdInts, DType::I32, peer, kIdTagBase + tag);
    host_.stats() = saved;
    ch->setup = std::thread(set_up_channel, g_, ch, std::move(id), std::move(transfer), is_send);
    channels_.emplace(key, ch);
    return ch;
  }

  Communicator& host_;
  std::shared_ptr<NcclGroup> g_;
  std::map<std::tuple<bool, int, int>, std::shared_ptr<Channel>> channels_;
  int depth_ = 0;                   // group_start nesting
  std::vector<Transfer> transfers_;  // sends/recvs of the open group
  std::shared_ptr<Batch> batch_;     // their shared completion
};

// Destroys the NCCL communicators once their streams are idle (a normal end: within moments);
// with work still in flight after a while (a peer gone), aborts them instead of hanging, as the
// MPI communicator leaves such operations to end with the job.
NcclCommunicator::~NcclCommunicator() {
  NcclGroup& g = *g_;
  cudaSetDevice(g.device);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  const auto settle = [&](auto&& done) {  // false when `done` is still false at the deadline
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  };
  bool stuck = false;
  for (auto& kv : channels_) {
    Channel& ch = *kv.second;
    if (!ch.setup.joinable()) continue;
    if (settle([&] { return ch.setup_done.load(); })) {
      ch.setup.join();
    } else {
      ch.setup.detach();  // waiting for a peer that never came: left to end with the job
      stuck = true;
    }
  }
  std::vector<cudaStream_t> streams{g.stream};
  for (auto& kv : channels_)
    if (kv.second->setup_done && kv.second->stream != nullptr) streams.push_back(kv.second->stream);
  for (cudaStream_t s : streams)
    if (s != nullptr && !settle([&] { return cudaStreamQuery(s) != cudaErrorNotReady; })) stuck = true;
  g.closed = true;
  const auto close = [stuck](ncclComm_t c) {
    if (c != nullptr) stuck ? ncclCommAbort(c) : ncclCommDestroy(c);
  };
  for (auto& kv : channels_) {
    Channel& ch = *kv.second;
    if (!ch.setup_done) continue;
    close(ch.comm);
    if (ch.stream != nullptr) cudaStreamDestroy(ch.stream);
  }
  close(g.comm);
  if (g.stream != nullptr) cudaStreamDestroy(g.stream);
  if (g.issued != nullptr) cudaEventDestroy(g.issued);
  if (stuck)
    std::fprintf(stderr, "communicator '%s' (global rank %d) destroyed with NCCL operations in flight; they were "
                 "aborted\n", g.where.group.c_str(), g.where.global);
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, void* cuda_stream, bool blocking_wait) {
  return std::make_unique<NcclCommunicator>(host, static_cast<cudaStream_t>(cuda_stream), blocking_wait);
}

}  // namespace tetra

#endif  // TETRA_HAVE_CUDA
