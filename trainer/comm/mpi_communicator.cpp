// The MPI Communicator (see mpi_communicator.h): argument checks and accounting in the caller's
// thread at issue time, the MPI calls on the communicator's worker thread.
//
// In-place conventions are NCCL's (communicator.h). A reduce_scatter all-reduces its whole input
// into a scratch buffer and copies this rank's block out (in place or not: Open MPI's own
// reduce-scatter is far slower, see reduce_scatter_async); an in-place all_gather is MPI_IN_PLACE
// exactly.
//
// Compiled with MPI only; trainer/comm/single_process.cpp is the build without it.
#if defined(TETRA_HAVE_MPI)
#include "trainer/comm/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/comm_accounting.h"
#include "trainer/comm/comm_worker.h"
#include "trainer/comm/mpi_world.h"
#include "trainer/comm/self_communicator.h"
#include "trainer/comm/watchdog.h"
#include "trainer/core/trace.h"

namespace tetra {

namespace {

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

// 16-bit reductions (BF16, F16): inout[i] = in[i] (op) inout[i], in fp32, rounded to nearest even
// once per combining step, as NCCL reduces bf16 and fp16 (for fp16 the same bits as fp16
// arithmetic: fp32's 24-bit significand is wide enough that rounding the fp32 sum to fp16 is a
// correctly rounded fp16 sum). MAX propagates NaN from either side.
template <bool kF16>
float widen16(uint16_t b) {
  return kF16 ? math::f16_bits_to_f32(b) : math::bf16_bits_to_f32(b);
}
template <bool kF16>
uint16_t round16(float x) {
  return kF16 ? math::f32_to_f16_bits(x) : math::f32_to_bf16_bits(x);
}

template <bool kF16>
void half_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = round16<kF16>(widen16<kF16>(a[i]) + widen16<kF16>(b[i]));
}

template <bool kF16>
void half_max_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = widen16<kF16>(a[i]), y = widen16<kF16>(b[i]);
    if (x > y || x != x) b[i] = a[i];
  }
}

template <bool kF16>
MPI_Op half_mpi_op(ReduceOp op) {
  static std::once_flag once;
  static MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL;
  std::call_once(once, [] {
    MPI_Op_create(&half_sum_fn<kF16>, /*commute=*/1, &sum);
    MPI_Op_create(&half_max_fn<kF16>, /*commute=*/1, &max);
  });
  return op == ReduceOp::SUM ? sum : max;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::BF16: return MPI_UINT16_T;  // raw bits; reductions go through the 16-bit ops
    case DType::F16: return MPI_UINT16_T;
    case DType::I32: return MPI_INT32_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t == DType::BF16) return half_mpi_op<false>(op);
  if (t == DType::F16) return half_mpi_op<true>(op);
  return op == ReduceOp::SUM ? MPI_SUM : MPI_MAX;
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// What the queued operations use: owned jointly by the communicator and its tasks, so a worker
// left running by CommWorker::shutdown() never touches freed memory.
struct MpiGroup {
  std::string name;
  std::vector<int> members;
  int rank;
  MPI_Comm comm;
  std::string failed;         // worker thread only: the first error
  std::vector<char> scratch;  // worker thread only: reduce_scatter's whole reduced input

  int size() const { return static_cast<int>(members.size()); }

  // Completes non-blocking requests without holding a core: MPI_Test in a short spin (latency of
  // small collectives), then with sleeps growing to 100 us. A blocking MPI call would busy-poll
  // for the whole operation, and with one rank per core that takes half the core from the
  // compute it is meant to overlap (measured: 2x slower steps under data parallelism on 2 cores).
  void complete(MPI_Request* requests, int n, const char* op) const {
    int done = 0;
    long sleep_ns = 1000;
    for (int spin = 0;; ++spin) {
      check(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE), op);
      if (done) return;
      if (spin < 200) continue;
      const timespec ts{0, sleep_ns};
      nanosleep(&ts, nullptr);
      sleep_ns = std::min(sleep_ns * 2, 100000L);
    }
  }
  void complete(MPI_Request request, const char* op) const { complete(&request, 1, op); }

  void check(int rc, const char* op) const {
    if (rc == MPI_SUCCESS) return;
    throw Error(fmt::format("{} on group '{}' (rank {} of {}, global rank {}) failed: {}", op, name, rank, size(),
                            members[rank], mpi_error_text(rc)));
  }
};

struct Transfer {
  bool is_send;
  void* buf;
  int count;
  DType type;
  int peer;
  int tag;
};

// A receive must get exactly the count it asked for (NCCL's rule; MPI would accept fewer).
void check_received(const MpiGroup& g, const MPI_Status& status, const Transfer& t) {
  int got = 0;
  MPI_Get_count(&status, mpi_type(t.type), &got);
  TETRA_CHECK(got == t.count, "recv on group '{}' from group rank {} expected {} {} elements but the sender sent {}",
              g.name, t.peer, t.count, dtype_name(t.type), got);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(std::string name, std::vector<int> members, int rank, MPI_Comm comm)
      : g_(std::make_shared<MpiGroup>(MpiGroup{std::move(name), std::move(members), rank, comm, {}, {}})),
        worker_(g_->name) {}

  ~MpiCommunicator() override {
    const bool joined = worker_.shutdown();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (joined && finalized == 0) MPI_Comm_free(&g_->comm);
    if (!joined)
      std::fprintf(stderr, "communicator '%s' (global rank %d) destroyed with operations in flight; they are left "
                   "to end with the job\n", g_->name.c_str(), g_->members[g_->rank]);
  }

  const std::string& name() const override { return g_->name; }
  int rank() const override { return g_->rank; }
  int size() const override { return g_->size(); }
  const std::vector<int>& members() const override { return g_->members; }

  WorkHandle all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override {
    check_collective("all_reduce");
    const int n = to_int(count, "count", "all_reduce");
    account_call(stats_, CommOp::ALL_REDUCE, size(), count * bytes(type));
    return enqueue("all_reduce", count * bytes(type), [=](MpiGroup& g) {
      MPI_Request r;
      g.check(MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(type), mpi_op(op, type), g.comm, &r), "all_reduce");
      g.complete(r, "all_reduce");
    });
  }

  WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count, DType type,
                                  ReduceOp op) override {
    check_collective("reduce_scatter");
    const int n = to_int(recv_count * size(), "recv_count x group size", "reduce_scatter");
    const size_t block = static_cast<size_t>(recv_count) * bytes(type);
    const bool in_place = recv == static_cast<const char*>(send) + rank() * block;
    TETRA_CHECK(in_place || !overlaps(recv, block, send, block * size()),
                "reduce_scatter on group '{}': recv overlaps send without being this rank's block ({} "
                "elements at element {})", name(), recv_count, rank() * recv_count);
    account_call(stats_, CommOp::REDUCE_SCATTER, size(), size() * recv_count * bytes(type));
    // As an all-reduce of the whole input into scratch, keeping this rank's block: Open MPI 4.1's
    // non-blocking reduce-scatter (libnbc) took 113 ms for 20 MiB on two ranks of one machine where
    // its all-reduce took 7.6 ms (scripts/bench_plan.sh found ZeRO-1 steps 37% over their plan). The
    // result is the same sum; what the group is charged (account_call) is the reduce-scatter's.
    const size_t whole = block * static_cast<size_t>(size()), mine = static_cast<size_t>(rank()) * block;
    return enqueue("reduce_scatter", size() * recv_count * bytes(type), [=](MpiGroup& g) {
      if (g.scratch.size() < whole) g.scratch.resize(whole);
      MPI_Request r;
      g.check(MPI_Iallreduce(send, g.scratch.data(), n, mpi_type(type), mpi_op(op, type), g.comm, &r),
              "reduce_scatter");
      g.complete(r, "reduce_scatter");
      if (block > 0) std::memcpy(recv, g.scratch.data() + mine, block);
    });
  }

  WorkHandle all_gather_async(void* recv, const void* send, int64_t send_count, DType type) override {
    check_collective("all_gather");
    const int n = to_int(send_count, "send_count", "all_gather");
    const size_t block = static_cast<size_t>(send_count) * bytes(type);
    const bool in_place = send == static_cast<const char*>(recv) + rank() * block;
    TETRA_CHECK(in_place || !overlaps(recv, block * size(), send, block),
                "all_gather on group '{}': send overlaps recv without being this rank's block ({} elements "
                "at element {})", name(), send_count, rank() * send_count);
    account_call(stats_, CommOp::ALL_GATHER, size(), size() * send_count * bytes(type));
    return enqueue("all_gather", size() * send_count * bytes(type), [=](MpiGroup& g) {
      const MPI_Datatype t = mpi_type(type);
      MPI_Request r;
      if (in_place)
        g.check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n, t, g.comm, &r), "all_gather");
      else
        g.check(MPI_Iallgather(send, n, t, recv, n, t, g.comm, &r), "all_gather");
      g.complete(r, "all_gather");
    });
  }

  WorkHandle all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_offsets, void* recv,
                                const std::vector<int64_t>& recv_counts,
                                const std::vector<int64_t>& recv_offsets, DType type) override {
    check_collective("all_to_all_v");
    const size_t p = static_cast<size_t>(size());
    TETRA_CHECK(send_counts.size() == p && send_offsets.size() == p && recv_counts.size() == p &&
                    recv_offsets.size() == p,
                "all_to_all_v on group '{}' of size {} needs {} counts and offsets each, got {}, {}, {}, {}", name(),
                p, p, send_counts.size(), send_offsets.size(), recv_counts.size(), recv_offsets.size());
    std::vector<int> sc(p), so(p), rc(p), ro(p);
    int64_t total = 0;
    for (size_t r = 0; r < p; ++r) {
      sc[r] = to_int(send_counts[r], "send count", "all_to_all_v");
      so[r] = to_int(send_offsets[r], "send offset", "all_to_all_v");
      rc[r] = to_int(recv_counts[r], "recv count", "all_to_all_v");
      ro[r] = to_int(recv_offsets[r], "recv offset", "all_to_all_v");
      total += send_counts[r];
    }
    account_all_to_all(stats_, size(), total * bytes(type), (total - send_counts[rank()]) * bytes(type));
    return enqueue("all_to_all_v", total * bytes(type), [=](MpiGroup& g) {
      const MPI_Datatype t = mpi_type(type);
      MPI_Request r;
      g.check(MPI_Ialltoallv(send, sc.data(), so.data(), t, recv, rc.data(), ro.data(), t, g.comm, &r),
              "all_to_all_v");
      g.complete(r, "all_to_all_v");
    });
  }

  WorkHandle broadcast_async(void* buf, int64_t count, DType type, int root) override {
    check_collective("broadcast");
    TETRA_CHECK(root >= 0 && root < size(), "broadcast on group '{}' of size {} from root {}", name(), size(), root);
    const int n = to_int(count, "count", "broadcast");
    account_call(stats_, CommOp::BROADCAST, size(), count * bytes(type));
    return enqueue("broadcast", count * bytes(type),
                   [=](MpiGroup& g) {
                     MPI_Request r;
                     g.check(MPI_Ibcast(buf, n, mpi_type(type), root, g.comm, &r), "broadcast");
                     g.complete(r, "broadcast");
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
      batch_done_ = std::make_shared<Completion>();
      batch_done_->hold(fmt::format("wait() on a send/recv of group '{}' before its group_end()", name()));
    }
  }

  void group_end() override {
    TETRA_CHECK(depth_ > 0, "group_end() on group '{}' without group_start()", name());
    if (--depth_ > 0) return;
    std::shared_ptr<Completion> done = std::move(batch_done_);
    std::vector<Transfer> batch = std::move(batch_);
    batch_.clear();
    done->release();
    const WatchedWait watched(name(), members(), "send/recv group");
    int64_t batch_bytes = 0;
    for (const Transfer& t : batch) batch_bytes += static_cast<int64_t>(t.count) * bytes(t.type);
    worker_.submit(done, guarded("send/recv group", [batch = std::move(batch)](MpiGroup& g) {
                     // Every transfer posted at once, so they may match in any order; then all waited for.
                     std::vector<MPI_Request> requests(batch.size(), MPI_REQUEST_NULL);
                     for (size_t i = 0; i < batch.size(); ++i) {
                       const Transfer& t = batch[i];
                       const MPI_Datatype type = mpi_type(t.type);
                       g.check(t.is_send ? MPI_Isend(t.buf, t.count, type, t.peer, t.tag, g.comm, &requests[i])
                                         : MPI_Irecv(t.buf, t.count, type, t.peer, t.tag, g.comm, &requests[i]),
                               t.is_send ? "send (grouped)" : "recv (grouped)");
                     }
                     std::vector<MPI_Status> statuses(batch.size());
                     g.check(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), statuses.data()),
                             "send/recv group");
                     for (size_t i = 0; i < batch.size(); ++i)
                       if (!batch[i].is_send) check_received(g, statuses[i], batch[i]);
                   }, batch_bytes));
    done->wait();
  }

  void barrier() override {
    check_collective("barrier");
    const WatchedWait watched(name(), members(), "barrier");
    enqueue("barrier", 0, [](MpiGroup& g) { g.check(MPI_Barrier(g.comm), "barrier"); })->wait();
  }

 private:
  using Body = std::function<void(MpiGroup&)>;

  static int64_t bytes(DType t) { return static_cast<int64_t>(dtype_size(t)); }

  WorkHandle p2p(bool is_send, void* buf, int64_t count, DType type, int peer, int tag) {
    const char* op = is_send ? "send" : "recv";
    TETRA_CHECK(peer >= 0 && peer < size(), "{} on group '{}' of size {} with peer {}", op, name(), size(), peer);
    TETRA_CHECK(tag >= 0 && tag <= 32767, "{} on group '{}' with tag {}: tags are 0 .. 32767 (MPI's guaranteed "
                "range)", op, name(), tag);
    const Transfer t{is_send, buf, to_int(count, "count", op), type, peer, tag};
    account_call(stats_, is_send ? CommOp::SEND : CommOp::RECV, size(), count * bytes(type));
    if (depth_ > 0) {
      batch_.push_back(t);
      return make_work(batch_done_);
    }
    // Posted from the calling thread (MPI_THREAD_MULTIPLE), not queued behind this group's
    // collectives on the worker: a queued blocking send would hold back a receive queued after
    // it, and two pipeline stages sending to each other would deadlock.
    return std::make_unique<P2pWork>(g_, t);
  }

  // One posted MPI_Isend / MPI_Irecv; wait() polls it like the worker polls collectives (MPI
  // progresses only while some thread is inside it).
  class P2pWork final : public Work {
   public:
    P2pWork(std::shared_ptr<MpiGroup> g, Transfer t) : g_(std::move(g)), t_(t), posted_(trace::Clock::now()) {
      const MPI_Datatype type = mpi_type(t.type);
      g_->check(t.is_send ? MPI_Isend(t.buf, t.count, type, t.peer, t.tag, g_->comm, &request_)
                          : MPI_Irecv(t.buf, t.count, type, t.peer, t.tag, g_->comm, &request_),
                t.is_send ? "send" : "recv");
    }
    ~P2pWork() override {
      // A posted buffer must not be released while MPI may still touch it.
      if (!done_) {
        try {
          wait();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s\n", e.what());
        }
      }
    }
    bool test() override {
      if (done_) return true;
      int flag = 0;
      MPI_Status status;
      g_->check(MPI_Test(&request_, &flag, &status), t_.is_send ? "send" : "recv");
      if (flag) finish(status);
      return done_;
    }
    void wait() override {
      long sleep_ns = 1000;
      for (int spin = 0; !test(); ++spin) {
        if (spin < 200) continue;
        const timespec ts{0, sleep_ns};
        nanosleep(&ts, nullptr);
        sleep_ns = std::min(sleep_ns * 2, 100000L);
      }
    }

   private:
    void finish(const MPI_Status& status) {
      done_ = true;
      if (!t_.is_send) check_received(*g_, status, t_);
      if (trace::on())  // from posting to the completion seen here (transfers overlap: an async track)
        trace::async_span("p2p", fmt::format("{} {} {} rank {}", g_->name, t_.is_send ? "send" : "recv",
                                             t_.is_send ? "to" : "from", t_.peer),
                          posted_, trace::Clock::now(),
                          fmt::format("\"group\":{},\"bytes\":{},\"peer\":{},\"tag\":{}", trace::quote(g_->name),
                                      static_cast<int64_t>(t_.count) * bytes(t_.type), t_.peer, t_.tag));
    }
    std::shared_ptr<MpiGroup> g_;
    Transfer t_;
    trace::Clock::time_point posted_;
    MPI_Request request_ = MPI_REQUEST_NULL;
    bool done_ = false;
  };

  // `body` bound to the shared group state, and guarded: once an operation has failed, the ones
  // queued after it fail at once with the first error instead of entering MPI on a communicator
  // in an unknown state.
  // Traced (trace.h) as a span of this group's worker thread with the payload `bytes`.
  std::function<void()> guarded(const char* op, Body body, int64_t bytes) {
    return [g = g_, op, body = std::move(body), bytes] {
      if (!g->failed.empty())
        throw Error(fmt::format("{} on group '{}' not run: an earlier operation failed: {}", op, g->name, g->failed));
      trace::Span span(std::string_view(op).find("send") != std::string_view::npos ? "p2p" : "collective", op);
      span.arg("group", g->name).arg("bytes", bytes);
      try {
        body(*g);
      } catch (const std::exception& e) {
        g->failed = e.what();
        throw;
      }
    };
  }

  // `bytes`: the operation's payload (CommStats' payload_bytes), for the trace.
  WorkHandle enqueue(const char* op, int64_t bytes, Body body) {
    auto done = std::make_shared<Completion>();
    worker_.submit(done, guarded(op, std::move(body), bytes));
    return make_work(done);
  }

  void check_collective(const char* op) const {
    TETRA_CHECK(depth_ == 0, "{} on group '{}' between group_start() and group_end(): only send and recv may "
                "be grouped", op, name());
  }

  int to_int(int64_t n, const char* what, const char* op) const {
    TETRA_CHECK(n >= 0 && n <= INT_MAX, "{} on group '{}': {} {} is outside MPI's range 0 .. {}", op, name(), what, n,
                INT_MAX);
    return static_cast<int>(n);
  }

  std::shared_ptr<MpiGroup> g_;
  int depth_ = 0;                           // group_start nesting
  std::vector<Transfer> batch_;             // sends/recvs of the open group
  std::shared_ptr<Completion> batch_done_;  // their common completion
  CommWorker worker_;                       // last: stops before the rest goes
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(std::string name, std::vector<int> members) {
  if (!dist_initialized()) {
    TETRA_CHECK(members.size() == 1 && members[0] == 0,
                "group '{}' with members [{}] needs MPI: call dist_init() first", name, fmt::join(members, ", "));
    return make_self_communicator(std::move(name), 0);
  }
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(dist_world(), &world_rank);
  MPI_Comm_size(dist_world(), &world_size);

  // A bad list is reported only after taking part in the split, which every rank must call.
  std::string problem;
  int index = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    const int m = members[i];
    if (m < 0 || m >= world_size) problem = fmt::format("member {} is not a rank of the world of {}", m, world_size);
    if (m == world_rank) index = static_cast<int>(i);
  }
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end()) problem = fmt::format("member {} is listed twice", *twice);
  if (problem.empty() && index < 0) problem = fmt::format("this rank ({}) is not a member", world_rank);
  const auto fail = [&](const std::string& why) {
    return Error(fmt::format("group '{}' with members [{}] on global rank {}: {}", name, fmt::join(members, ", "),
                             world_rank, why));
  };

  const bool joins = problem.empty() && members.size() > 1;
  const int color = joins ? *std::min_element(members.begin(), members.end()) : MPI_UNDEFINED;
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_Comm_split(dist_world(), color, std::max(index, 0), &comm);
  if (rc != MPI_SUCCESS) throw fail("MPI_Comm_split failed: " + mpi_error_text(rc));
  if (!problem.empty()) throw fail(problem);
  if (comm == MPI_COMM_NULL) return make_self_communicator(std::move(name), world_rank);

  // Every rank that joined must have listed the same members, in the same order.
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int size = 0, rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  std::vector<int> joined(static_cast<size_t>(size));
  rc = MPI_Allgather(&world_rank, 1, MPI_INT, joined.data(), 1, MPI_INT, comm);
  int agree = (rc == MPI_SUCCESS && joined == members) ? 1 : 0, all_agree = 0;
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(&agree, &all_agree, 1, MPI_INT, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    throw fail("checking the members failed: " + mpi_error_text(rc));
  }
  if (all_agree == 0) {
    MPI_Comm_free(&comm);
    throw fail(fmt::format("the ranks do not agree on the group: the split for smallest member {} joined global "
                           "ranks [{}] in this order{}",
                           color, fmt::join(joined, ", "), agree ? ", and another of them listed other members" : ""));
  }
  return std::make_unique<MpiCommunicator>(std::move(name), std::move(members), rank, comm);
}

}  // namespace tetra

#endif  // TETRA_HAVE_MPI
