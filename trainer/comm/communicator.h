// The Communicator: collectives and point-to-point transfers over one process group.
//
// One Communicator per group of the rank grid (tp, dp, pp, ep, expert-dp, ...), created by
// ProcessGroups and passed explicitly to every layer that communicates: no global group state.
//
// The interface is NCCL-shaped so the GPU backend (NCCL) drops in behind it:
// - Buffers are raw pointers into backend memory with an element count and a DType.
// - Every operation is ordered: operations on one communicator execute in the order they were
//   issued, on every rank of the group. The blocking calls return when the result is in place.
//   The `_async` variants return a Work handle at once; `wait()` returns when the result is in
//   place. Between issue and wait the caller must not touch the buffers.
// - Reductions are element-wise; BF16 and F16 are reduced in fp32 and rounded once per element per
//   combining step, the way NCCL reduces them.
// - group_start()/group_end() bracket point-to-point calls that must be matched as one batch
//   (NCCL's ncclGroupStart/End): sends and receives issued inside a group may complete in any
//   order, and group_end() returns when all of them have.
//
// Accounting: every call adds to stats() the payload it moved, so a step's communication volume
// can be compared exactly with the volume the layout predicts (a redundant collective shows up as
// a mismatch). A group of size 1 communicates nothing and counts nothing.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/common/dtype.h"
#include "trainer/comm/watchdog.h"
#include "trainer/core/trace.h"

namespace tetra {

enum class ReduceOp : uint8_t { SUM, MAX };

enum class CommOp : uint8_t {
  ALL_REDUCE,
  REDUCE_SCATTER,
  ALL_GATHER,
  ALL_TO_ALL,
  BROADCAST,
  SEND,
  RECV,
  COUNT_  // number of ops
};
constexpr int kCommOps = static_cast<int>(CommOp::COUNT_);
const char* comm_op_name(CommOp op);

// What one rank moved through one communicator, per op kind.
//   payload_bytes: the size of the operation's full buffer as seen by this rank:
//     all_reduce: count * elem; reduce_scatter: size * recv_count * elem (the input);
//     all_gather: size * send_count * elem (the output); all_to_all: bytes this rank sends;
//     broadcast: count * elem; send / recv: count * elem.
//   sent_bytes: what this rank puts on the wire under the bandwidth-optimal (ring) algorithms:
//     all_reduce 2(p-1)/p * payload, reduce_scatter and all_gather (p-1)/p * payload,
//     all_to_all (p-1)/p of its send buffer (the part for other ranks; exact for all_to_all_v:
//     the bytes addressed to other ranks), broadcast payload on every rank but the ring's last
//     (counted as payload on each rank, the pipelined-ring bound), send payload, recv 0.
//   blocked_s: seconds the calling thread spent waiting for results (blocking calls, and waits on
//     asynchronous ones through Communicator::wait): the communication time compute did not hide.
struct CommStats {
  std::array<int64_t, kCommOps> calls{};
  std::array<int64_t, kCommOps> payload_bytes{};
  std::array<double, kCommOps> sent_bytes{};
  std::array<double, kCommOps> blocked_s{};
  double total_sent() const;
  double total_blocked_s() const;
  void reset();
  void add(const CommStats& other);  // element-wise sum
};

// Handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;      // blocks until the operation's result is in place
  virtual bool test() = 0;      // true once complete (never blocks)
};
using WorkHandle = std::unique_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual const std::string& name() const = 0;  // the group's name in logs: "tp", "dp", ...
  virtual int rank() const = 0;                 // rank within the group
  virtual int size() const = 0;
  // Global ranks of the members, in group-rank order.
  virtual const std::vector<int>& members() const = 0;

  // In place: buf (count) = op over the group of buf.
  virtual WorkHandle all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) = 0;
  // send (size() * recv_count) → recv (recv_count): this rank's block of the reduction.
  // recv may not alias send except recv == send + rank() * recv_count (in place, NCCL-style).
  virtual WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count,
                                          DType type, ReduceOp op) = 0;
  // send (send_count) → recv (size() * send_count), rank r's block at r * send_count.
  // In place allowed when send == recv + rank() * send_count.
  virtual WorkHandle all_gather_async(void* recv, const void* send, int64_t send_count,
                                      DType type) = 0;
  // send_counts[r] elements of send at send_offsets[r] go to rank r; recv_counts[r] elements
  // from rank r land at recv_offsets[r]. Each vector has size() entries (element units).
  virtual WorkHandle all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                        const std::vector<int64_t>& send_offsets, void* recv,
                                        const std::vector<int64_t>& recv_counts,
                                        const std::vector<int64_t>& recv_offsets, DType type) = 0;
  virtual WorkHandle broadcast_async(void* buf, int64_t count, DType type, int root) = 0;
  // Point to point, `peer` a group rank. A receive matches the sends of its peer with the same
  // `tag` in the order they were issued (MPI's and NCCL's rule); tags keep streams apart (a
  // pipeline's activations and gradients between the same two stages). Outside a group, each is
  // posted at once and completes independently of other operations, so one rank may have several
  // in flight in any order without deadlock.
  virtual WorkHandle send_async(const void* buf, int64_t count, DType type, int peer, int tag = 0) = 0;
  virtual WorkHandle recv_async(void* buf, int64_t count, DType type, int peer, int tag = 0) = 0;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void barrier() = 0;

  // Waits for `work`, an operation of kind `op` issued on this communicator, and counts the time
  // blocked in stats().blocked_s. The wait is registered with the watchdog (watchdog.h).
  void wait(Work& work, CommOp op) {
    const WatchedWait watched(name(), members(), comm_op_name(op));
    const auto t0 = std::chrono::steady_clock::now();
    work.wait();
    const auto t1 = std::chrono::steady_clock::now();
    stats_.blocked_s[static_cast<int>(op)] += std::chrono::duration<double>(t1 - t0).count();
    if (trace::on()) trace_wait(op, t0, t1);
  }

  // Blocking forms.
  void all_reduce(void* buf, int64_t count, DType type, ReduceOp op = ReduceOp::SUM) {
    wait(*all_reduce_async(buf, count, type, op), CommOp::ALL_REDUCE);
  }
  void reduce_scatter(void* recv, const void* send, int64_t recv_count, DType type,
                      ReduceOp op = ReduceOp::SUM) {
    wait(*reduce_scatter_async(recv, send, recv_count, type, op), CommOp::REDUCE_SCATTER);
  }
  void all_gather(void* recv, const void* send, int64_t send_count, DType type) {
    wait(*all_gather_async(recv, send, send_count, type), CommOp::ALL_GATHER);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets, void* recv,
                    const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, DType type) {
    wait(*all_to_all_v_async(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, type),
         CommOp::ALL_TO_ALL);
  }
  void broadcast(void* buf, int64_t count, DType type, int root) {
    wait(*broadcast_async(buf, count, type, root), CommOp::BROADCAST);
  }
  void send(const void* buf, int64_t count, DType type, int peer, int tag = 0) {
    wait(*send_async(buf, count, type, peer, tag), CommOp::SEND);
  }
  void recv(void* buf, int64_t count, DType type, int peer, int tag = 0) {
    wait(*recv_async(buf, count, type, peer, tag), CommOp::RECV);
  }

  const CommStats& stats() const { return stats_; }
  CommStats& stats() { return stats_; }

 protected:
  CommStats stats_;

 private:
  // The wait as a span of the calling thread's timeline (trace.h): "wait dp all_reduce".
  void trace_wait(CommOp op, std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1);
};

}  // namespace tetra
