// The size-1 communicator (see self_communicator.h). Sends to itself are allowed only between
// group_start and group_end, where they are matched in order with the receives from itself,
// as NCCL matches them; outside a group they could never complete.
#include "trainer/comm/self_communicator.h"

#include <cstring>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/comm/comm_worker.h"

namespace tetra {

namespace {

class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator(std::string name, int global_rank) : name_(std::move(name)), members_{global_rank} {}

  const std::string& name() const override { return name_; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::vector<int>& members() const override { return members_; }

  WorkHandle all_reduce_async(void*, int64_t count, DType, ReduceOp) override {
    check_collective("all_reduce", count);
    return make_done_work();
  }
  WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count, DType type,
                                  ReduceOp) override {
    check_collective("reduce_scatter", recv_count);
    copy(recv, send, recv_count, type);
    return make_done_work();
  }
  WorkHandle all_gather_async(void* recv, const void* send, int64_t send_count, DType type) override {
    check_collective("all_gather", send_count);
    copy(recv, send, send_count, type);
    return make_done_work();
  }
  WorkHandle all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_offsets, void* recv,
                                const std::vector<int64_t>& recv_counts,
                                const std::vector<int64_t>& recv_offsets, DType type) override {
    TETRA_CHECK(send_counts.size() == 1 && send_offsets.size() == 1 && recv_counts.size() == 1 &&
                    recv_offsets.size() == 1,
                "all_to_all_v on group '{}' of size 1 needs 1 count and offset each, got {}, {}, {}, {}", name_,
                send_counts.size(), send_offsets.size(), recv_counts.size(), recv_offsets.size());
    TETRA_CHECK(send_counts[0] == recv_counts[0],
                "all_to_all_v on group '{}' of size 1 sends {} elements to itself but receives {}", name_,
                send_counts[0], recv_counts[0]);
    check_collective("all_to_all_v", send_counts[0]);
    const size_t e = dtype_size(type);
    copy(static_cast<char*>(recv) + recv_offsets[0] * e, static_cast<const char*>(send) + send_offsets[0] * e,
         send_counts[0], type);
    return make_done_work();
  }
  WorkHandle broadcast_async(void*, int64_t count, DType, int root) override {
    check_collective("broadcast", count);
    TETRA_CHECK(root == 0, "broadcast on group '{}' of size 1 from root {}", name_, root);
    return make_done_work();
  }

  WorkHandle send_async(const void* buf, int64_t count, DType type, int peer, int /*tag*/) override {
    check_p2p("send", count, peer);
    sends_.push_back({const_cast<void*>(buf), count, type});
    return make_work(batch_);
  }
  WorkHandle recv_async(void* buf, int64_t count, DType type, int peer, int /*tag*/) override {
    check_p2p("recv", count, peer);
    recvs_.push_back({buf, count, type});
    return make_work(batch_);
  }
  void group_start() override {
    if (depth_++ == 0) {
      batch_ = std::make_shared<Completion>();
      batch_->hold(fmt::format("wait() on a send/recv of group '{}' before its group_end()", name_));
    }
  }
  void group_end() override {
    TETRA_CHECK(depth_ > 0, "group_end() on group '{}' without group_start()", name_);
    if (--depth_ > 0) return;
    std::shared_ptr<Completion> batch = std::move(batch_);
    batch->release();
    std::vector<Transfer> sends = std::move(sends_), recvs = std::move(recvs_);
    sends_.clear();
    recvs_.clear();
    std::exception_ptr error;
    try {
      TETRA_CHECK(sends.size() == recvs.size(), "group '{}' of size 1: {} sends to itself but {} receives",
                  name_, sends.size(), recvs.size());
      for (size_t i = 0; i < sends.size(); ++i) {
        TETRA_CHECK(sends[i].count == recvs[i].count && sends[i].type == recvs[i].type,
                    "group '{}' of size 1: send {} of {} {} to itself meets a receive of {} {}", name_, i,
                    sends[i].count, dtype_name(sends[i].type), recvs[i].count, dtype_name(recvs[i].type));
        copy(recvs[i].buf, sends[i].buf, sends[i].count, sends[i].type);
      }
    } catch (...) {
      error = std::current_exception();
    }
    batch->finish(error);
    batch->wait();  // rethrows a mismatch
  }
  void barrier() override { TETRA_CHECK(depth_ == 0, "barrier on group '{}' inside group_start()", name_); }

 private:
  struct Transfer {
    void* buf;
    int64_t count;
    DType type;
  };

  void check_collective(const char* op, int64_t count) const {
    TETRA_CHECK(depth_ == 0, "{} on group '{}' between group_start() and group_end(): only send and recv may "
                "be grouped", op, name_);
    TETRA_CHECK(count >= 0, "{} on group '{}' with a negative count ({})", op, name_, count);
  }
  void check_p2p(const char* op, int64_t count, int peer) const {
    TETRA_CHECK(peer == 0, "{} on group '{}' of size 1 to peer {}", op, name_, peer);
    TETRA_CHECK(count >= 0, "{} on group '{}' with a negative count ({})", op, name_, count);
    TETRA_CHECK(depth_ > 0, "{} to itself on group '{}' outside group_start()/group_end() could never "
                "complete", op, name_);
  }
  static void copy(void* dst, const void* src, int64_t count, DType type) {
    if (dst != src && count > 0) std::memmove(dst, src, static_cast<size_t>(count) * dtype_size(type));
  }

  std::string name_;
  std::vector<int> members_;
  int depth_ = 0;
  std::shared_ptr<Completion> batch_;
  std::vector<Transfer> sends_, recvs_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(std::string name, int global_rank) {
  return std::make_unique<SelfCommunicator>(std::move(name), global_rank);
}

}  // namespace tetra
