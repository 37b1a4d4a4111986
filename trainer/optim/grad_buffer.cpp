#include "trainer/optim/grad_buffer.h"

#include <algorithm>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

std::vector<BucketPlan> plan_buckets(const ParamLayout& layout, int64_t bucket_size) {
  TETRA_CHECK(bucket_size >= 1, "bucket_size {} must be >= 1", bucket_size);
  std::vector<BucketPlan> plan;
  for (int g = static_cast<int>(layout.groups.size()) - 1; g >= 0; --g) {
    if (plan.empty() || plan.back().end - plan.back().begin >= bucket_size) {
      BucketPlan b;
      b.end = layout.groups[g].second;
      b.last_group = g;
      plan.push_back(b);
    }
    plan.back().begin = layout.groups[g].first;
    plan.back().first_group = g;
  }
  return plan;
}

size_t GradBuffer::sp_scratch_bytes(const ParamLayout& layout) {
  std::vector<int64_t> per_group(layout.groups.size(), 0);
  for (const ParamSpec& p : layout.params)
    if (p.sp_partial) per_group[p.group] += p.numel;
  int64_t most = 0;
  for (int64_t n : per_group) most = std::max(most, n);
  return static_cast<size_t>(most) * 4;
}

GradBuffer::GradBuffer(const ParamLayout& layout, Backend& be, float* grads, Communicator* dp,
                       Communicator* tp, bool distributed_optimizer, int64_t bucket_size, bool bf16_wire)
    : layout_(layout),
      be_(be),
      grads_(grads),
      dp_(dp && dp->size() > 1 ? dp : nullptr),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      sharded_(distributed_optimizer && dp_ != nullptr),
      bf16_wire_(bf16_wire && dp_ != nullptr) {
  bucket_of_group_.assign(layout.groups.size(), -1);
  group_reported_.assign(layout.groups.size(), 0);
  for (const BucketPlan& p : plan_buckets(layout, bucket_size)) {
    Bucket b;
    b.begin = p.begin;
    b.end = p.end;
    b.first_group = p.first_group;
    b.last_group = p.last_group;
    b.pending = p.last_group - p.first_group + 1;
    for (int g = p.first_group; g <= p.last_group; ++g) bucket_of_group_[g] = static_cast<int>(buckets_.size());
    buckets_.push_back(std::move(b));
  }
  const int64_t shards = sharded_ ? dp_->size() : 1;
  const int64_t rank = sharded_ ? dp_->rank() : 0;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {  // buffer order
    const int64_t size = it->end - it->begin;
    TETRA_CHECK(size % (16 * shards) == 0,
                "bucket [{}, {}) of {} elements does not split into {} aligned shards: the layout's "
                "group_align must be a multiple of 16 * dp", it->begin, it->end, size, shards);
    const int64_t shard = size / shards;
    owned_.push_back(GradRange{it->begin + rank * shard, shard});
  }

  sp_partial_.resize(layout.groups.size());
  if (tp_) {
    for (const ParamSpec& p : layout.params)
      if (p.sp_partial) sp_partial_[p.group].push_back(GradRange{p.offset, p.numel});
    if (const size_t scratch = sp_scratch_bytes(layout); scratch > 0) {
      sp_scratch_buf_ = BackendBuffer(be_, scratch);
      sp_scratch_ = sp_scratch_buf_.as<float>();
    }
  }
  if (bf16_wire_) {
    wire_buf_ = BackendBuffer(be_, static_cast<size_t>(layout.total) * 2);
    wire_ = wire_buf_.as<uint16_t>();
  }
}

GradBuffer::~GradBuffer() {
  for (Bucket& b : buckets_)
    if (b.work) b.work->wait();
}

int64_t GradBuffer::owned_numel() const {
  int64_t n = 0;
  for (const GradRange& r : owned_) n += r.numel;
  return n;
}

void GradBuffer::reduce_sp_partial(int group) {
  const std::vector<GradRange>& ranges = sp_partial_[group];
  if (ranges.empty()) return;
  int64_t n = 0;
  for (const GradRange& r : ranges) {
    be_.copy(sp_scratch_ + n, grads_ + r.offset, static_cast<size_t>(r.numel) * 4);
    n += r.numel;
  }
  tp_->all_reduce(sp_scratch_, n, DType::F32, ReduceOp::SUM);
  n = 0;
  for (const GradRange& r : ranges) {
    be_.copy(grads_ + r.offset, sp_scratch_ + n, static_cast<size_t>(r.numel) * 4);
    n += r.numel;
  }
}

void GradBuffer::group_done(int group) {
  TETRA_CHECK(group >= 0 && group < static_cast<int>(bucket_of_group_.size()), "bad group {}", group);
  if (tp_) reduce_sp_partial(group);
  TETRA_CHECK(!group_reported_[group], "parameter group {} reported twice in one step", group);
  group_reported_[group] = 1;
  Bucket& b = buckets_[bucket_of_group_[group]];
  if (--b.pending == 0) launch(b);
}

void GradBuffer::launch(Bucket& b) {
  if (!dp_ || !reduce_) return;
  const int64_t size = b.end - b.begin;
  const int64_t shard = size / dp_->size();
  const DType type = bf16_wire_ ? DType::BF16 : DType::F32;
  void* base = grads_ + b.begin;
  if (bf16_wire_) {
    base = wire_ + b.begin;
    be_.cast(base, DType::BF16, grads_ + b.begin, DType::F32, size);
  }
  const size_t es = dtype_size(type);
  if (sharded_) {
    void* mine = static_cast<char*>(base) + static_cast<size_t>(dp_->rank() * shard) * es;
    b.work = dp_->reduce_scatter_async(mine, base, shard, type, ReduceOp::SUM);
  } else {
    b.work = dp_->all_reduce_async(base, size, type, ReduceOp::SUM);
  }
}

void GradBuffer::finish() {
  for (Bucket& b : buckets_) {
    TETRA_CHECK(b.pending == 0, "gradient bucket of groups {}..{} was never completed by backward",
                b.first_group, b.last_group);
    if (b.work) {
      dp_->wait(*b.work, sharded_ ? CommOp::REDUCE_SCATTER : CommOp::ALL_REDUCE);
      if (bf16_wire_) {  // the reduced values (this rank's shard, or the bucket) back into fp32
        const int64_t shard = (b.end - b.begin) / dp_->size();
        const int64_t at = sharded_ ? b.begin + dp_->rank() * shard : b.begin;
        be_.cast(grads_ + at, DType::F32, wire_ + at, DType::BF16, sharded_ ? shard : b.end - b.begin);
      }
    }
    b.work.reset();
    b.pending = b.last_group - b.first_group + 1;
  }
  std::fill(group_reported_.begin(), group_reported_.end(), 0);
}

void GradBuffer::gather_params(void* params, DType type) {
  if (!sharded_) return;
  const size_t es = dtype_size(type);
  char* base = static_cast<char*>(params);
  std::vector<std::unique_ptr<Work>> works;
  for (const Bucket& b : buckets_) {
    const int64_t shard = (b.end - b.begin) / dp_->size();
    char* bucket = base + static_cast<size_t>(b.begin) * es;
    works.push_back(dp_->all_gather_async(bucket, bucket + static_cast<size_t>(dp_->rank() * shard) * es,
                                          shard, type));
  }
  for (auto& w : works) dp_->wait(*w, CommOp::ALL_GATHER);
}

}  // namespace tetra
