// The staged communicator (see staged_communicator.h): host staging around a host communicator.
#include "trainer/comm/staged_communicator.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <vector>

#include "kernels/common/check.h"

namespace tetra {

namespace {

// Host buffers reused across operations: one per operation in flight.
class StagingPool {
 public:
  // A buffer of at least `bytes`: the smallest free one that is large enough, else the largest
  // free one grown (or a new one).
  std::vector<char> acquire(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t best = free_.size(), largest = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t n = free_[i].size();
      if (n >= bytes && (best == free_.size() || n < free_[best].size())) best = i;
      if (largest == free_.size() || n > free_[largest].size()) largest = i;
    }
    const size_t pick = best != free_.size() ? best : largest;
    std::vector<char> out;
    if (pick != free_.size()) {
      out = std::move(free_[pick]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
    }
    if (out.size() < bytes) out.resize(bytes);
    return out;
  }
  void release(std::vector<char> buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(buffer));
  }

 private:
  std::mutex mutex_;
  std::vector<std::vector<char>> free_;
};

// One issued operation: its host work, its staging buffer and what to copy back from it.
struct Pending {
  struct CopyBack {
    void* dst;      // backend memory
    size_t offset;  // into the staging buffer
    size_t bytes;
  };
  Backend* be = nullptr;
  std::shared_ptr<StagingPool> pool;
  std::vector<char> staging;
  WorkHandle inner;
  std::vector<CopyBack> back;
  bool done = false;

  char* at(size_t offset) { return staging.data() + offset; }
  // Waits for the host operation and copies its results back; once. A wait that throws (a send
  // or recv waited for before its group_end) changes nothing: a later call tries again.
  void finish() {
    if (done) return;
    inner->wait();
    done = true;
    try {
      for (const CopyBack& c : back) be->copy_from_host(c.dst, at(c.offset), c.bytes);
    } catch (...) {
      pool->release(std::move(staging));
      throw;
    }
    pool->release(std::move(staging));
  }
};

class StagedWork final : public Work {
 public:
  explicit StagedWork(std::shared_ptr<Pending> p) : p_(std::move(p)) {}
  ~StagedWork() override {
    if (p_->done) return;
    try {
      p_->finish();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  void wait() override { p_->finish(); }
  bool test() override {
    if (p_->done) return true;
    if (!p_->inner->test()) return false;
    p_->finish();
    return true;
  }

 private:
  std::shared_ptr<Pending> p_;
};

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(Communicator& host, Backend& be)
      : host_(host), be_(be), pool_(std::make_shared<StagingPool>()) {}

  const std::string& name() const override { return host_.name(); }
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const std::vector<int>& members() const override { return host_.members(); }

  WorkHandle all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override {
    const size_t bytes = nbytes(count, type, "all_reduce");
    auto p = stage(bytes);
    be_.copy_to_host(p->at(0), buf, bytes);
    p->back.push_back({buf, 0, bytes});
    p->inner = host_.all_reduce_async(p->at(0), count, type, op);
    return std::make_unique<StagedWork>(std::move(p));
  }

  WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count, DType type,
                                  ReduceOp op) override {
    const size_t block = nbytes(recv_count, type, "reduce_scatter");
    const size_t total = block * static_cast<size_t>(size());
    const size_t mine = block * static_cast<size_t>(rank());
    const bool in_place = recv == static_cast<const char*>(send) + mine;
    TETRA_CHECK(in_place || !overlaps(recv, block, send, total),
                "reduce_scatter on group '{}': recv overlaps send without being this rank's block ({} elements at "
                "element {})", name(), recv_count, rank() * recv_count);
    auto p = stage(in_place ? total : total + block);
    be_.copy_to_host(p->at(0), send, total);
    const size_t out = in_place ? mine : total;
    p->back.push_back({recv, out, block});
    p->inner = host_.reduce_scatter_async(p->at(out), p->at(0), recv_count, type, op);
    return std::make_unique<StagedWork>(std::move(p));
  }

  WorkHandle all_gather_async(void* recv, const void* send, int64_t send_count, DType type) override {
    const size_t block = nbytes(send_count, type, "all_gather");
    const size_t total = block * static_cast<size_t>(size());
    const size_t mine = block * static_cast<size_t>(rank());
    const bool in_place = send == static_cast<const char*>(recv) + mine;
    TETRA_CHECK(in_place || !overlaps(recv, total, send, block),
                "all_gather on group '{}': send overlaps recv without being this rank's block ({} elements at "
                "element {})", name(), send_count, rank() * send_count);
    auto p = stage(in_place ? total : total + block);
    const size_t in = in_place ? mine : total;
    be_.copy_to_host(p->at(in), send, block);
    p->back.push_back({recv, 0, total});
    p->inner = host_.all_gather_async(p->at(0), p->at(in), send_count, type);
    return std::make_unique<StagedWork>(std::move(p));
  }

  WorkHandle all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts,
                                const std::vector<int64_t>& send_offsets, void* recv,
                                const std::vector<int64_t>& recv_counts,
                                const std::vector<int64_t>& recv_offsets, DType type) override {
    const size_t n = static_cast<size_t>(size());
    TETRA_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                    recv_offsets.size() == n,
                "all_to_all_v on group '{}' of size {} needs {} counts and offsets each, got {}, {}, {}, {}", name(),
                n, n, send_counts.size(), send_offsets.size(), recv_counts.size(), recv_offsets.size());
    // Staging: the send buffer's extent, then the receive buffer's, blocks at their own offsets.
    const size_t es = dtype_size(type);
    size_t send_extent = 0, recv_extent = 0;
    for (size_t r = 0; r < n; ++r) {
      TETRA_CHECK(send_counts[r] >= 0 && send_offsets[r] >= 0 && recv_counts[r] >= 0 && recv_offsets[r] >= 0,
                  "all_to_all_v on group '{}': a negative count or offset for rank {}", name(), r);
      send_extent = std::max(send_extent, static_cast<size_t>(send_offsets[r] + send_counts[r]) * es);
      recv_extent = std::max(recv_extent, static_cast<size_t>(recv_offsets[r] + recv_counts[r]) * es);
    }
    auto p = stage(send_extent + recv_extent);
    for (size_t r = 0; r < n; ++r) {
      const size_t at = static_cast<size_t>(send_offsets[r]) * es;
      be_.copy_to_host(p->at(at), static_cast<const char*>(send) + at, static_cast<size_t>(send_counts[r]) * es);
      const size_t to = static_cast<size_t>(recv_offsets[r]) * es;
      if (recv_counts[r] > 0)
        p->back.push_back({static_cast<char*>(recv) + to, send_extent + to, static_cast<size_t>(recv_counts[r]) * es});
    }
    p->inner = host_.all_to_all_v_async(p->at(0), send_counts, send_offsets, p->at(send_extent), recv_counts,
                                        recv_offsets, type);
    return std::make_unique<StagedWork>(std::move(p));
  }

  WorkHandle broadcast_async(void* buf, int64_t count, DType type, int root) override {
    const size_t bytes = nbytes(count, type, "broadcast");
    auto p = stage(bytes);
    if (rank() == root)
      be_.copy_to_host(p->at(0), buf, bytes);
    else
      p->back.push_back({buf, 0, bytes});
    p->inner = host_.broadcast_async(p->at(0), count, type, root);
    return std::make_unique<StagedWork>(std::move(p));
  }

  WorkHandle send_async(const void* buf, int64_t count, DType type, int peer, int tag) override {
    const size_t bytes = nbytes(count, type, "send");
    auto p = stage(bytes);
    be_.copy_to_host(p->at(0), buf, bytes);
    p->inner = host_.send_async(p->at(0), count, type, peer, tag);
    return grouped(std::move(p));
  }
  WorkHandle recv_async(void* buf, int64_t count, DType type, int peer, int tag) override {
    const size_t bytes = nbytes(count, type, "recv");
    auto p = stage(bytes);
    p->back.push_back({buf, 0, bytes});
    p->inner = host_.recv_async(p->at(0), count, type, peer, tag);
    return grouped(std::move(p));
  }

  void group_start() override {
    host_.group_start();
    ++depth_;
  }
  void group_end() override {
    TETRA_CHECK(depth_ > 0, "group_end() on group '{}' without group_start()", name());
    std::vector<std::shared_ptr<Pending>> batch;
    if (--depth_ == 0) {
      batch = std::move(batch_);
      batch_.clear();
    }
    host_.group_end();  // completes the batch (or throws its error)
    for (const auto& p : batch) p->finish();
  }
  void barrier() override { host_.barrier(); }

 private:
  std::shared_ptr<Pending> stage(size_t bytes) {
    auto p = std::make_shared<Pending>();
    p->be = &be_;
    p->pool = pool_;
    p->staging = pool_->acquire(bytes);
    return p;
  }
  WorkHandle grouped(std::shared_ptr<Pending> p) {
    if (depth_ > 0) batch_.push_back(p);
    return std::make_unique<StagedWork>(std::move(p));
  }
  size_t nbytes(int64_t count, DType type, const char* op) const {
    TETRA_CHECK(count >= 0, "{} on group '{}' with a negative count ({})", op, name(), count);
    return static_cast<size_t>(count) * dtype_size(type);
  }

  Communicator& host_;
  Backend& be_;
  std::shared_ptr<StagingPool> pool_;
  int depth_ = 0;                                // group_start nesting
  std::vector<std::shared_ptr<Pending>> batch_;  // send/recv of the open group
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& be) {
  return std::make_unique<StagedCommunicator>(host, be);
}

}  // namespace tetra
