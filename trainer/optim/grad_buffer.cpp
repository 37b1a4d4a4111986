#include "trainer/optim/grad_buffer.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {
// ZeRO-2: reductions in flight at once. One overlaps the backward of the next bucket (double
// buffering, as DeepSpeed's overlap_comm); each more would hold one more bucket's staging.
constexpr int kZero2InFlight = 1;
}  // namespace

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

GradBuffer::StagingPlan GradBuffer::staging_plan(const ParamLayout& layout, int64_t bucket_size,
                                                 bool tied_embeddings) {
  StagingPlan s;
  const std::vector<BucketPlan> plan = plan_buckets(layout, bucket_size);
  // The embedding's group (the model's first stage) and the output layer's (the last); an expert
  // part (dense_groups 0, renumbered groups) has neither.
  const bool dense = layout.dense_groups > 0;
  const int emb = dense && layout.stage.first ? layout.embedding_group : -1;
  const int head = dense && layout.stage.last ? layout.head_group : -1;
  // Tied embeddings hold one of them open (the first stage's embedding bucket; a last stage's
  // output layer's under pp > 1).
  const int held = !tied_embeddings ? -1 : emb >= 0 ? emb : head;
  const auto holds = [&](const BucketPlan& b, int g) { return g >= 0 && g >= b.first_group && g <= b.last_group; };
  const int64_t chunks = std::max<int64_t>(1, static_cast<int64_t>(layout.stage.chunks.size()));
  // The plan with `own` buckets having buffers of their own and the rest sharing the pool.
  const auto with_own = [&](const std::vector<char>& own) {
    StagingPlan p;
    int64_t others = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      const int64_t n = plan[i].end - plan[i].begin;
      if (own[i]) {
        p.own.push_back(static_cast<int>(i));
        p.own_numel.push_back(n);
      } else {
        p.buffer_numel = std::max(p.buffer_numel, n);
        ++others;
      }
    }
    p.buffers = std::min<int64_t>(others, kZero2InFlight + 1 + (chunks - 1));
    return p;
  };
  // The held bucket has its own buffer; the embedding's and the output layer's (the largest, a
  // vocabulary's rows) have theirs where that takes fewer bytes than pool buffers their size.
  std::vector<char> own(plan.size(), 0);
  std::vector<size_t> optional;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (holds(plan[i], held))
      own[i] = 1;
    else if (holds(plan[i], emb) || holds(plan[i], head))
      optional.push_back(i);
  }
  s = with_own(own);
  for (size_t mask = 1; mask < (size_t{1} << optional.size()); ++mask) {
    std::vector<char> o = own;
    for (size_t k = 0; k < optional.size(); ++k)
      if (mask & (size_t{1} << k)) o[optional[k]] = 1;
    const StagingPlan p = with_own(o);
    if (p.bytes() < s.bytes()) s = p;
  }
  return s;
}

size_t GradBuffer::staging_bytes() const {
  size_t n = pool_.size() * static_cast<size_t>(staging_.buffer_numel) * 4;
  for (const BackendBuffer& b : own_bufs_) n += b.bytes();
  return n;
}

GradBuffer::GradBuffer(const ParamLayout& layout, Backend& be, float* grads, Communicator* dp,
                       Communicator* tp, bool distributed_optimizer, int64_t bucket_size, bool bf16_wire,
                       float* shard, bool tied_embeddings)
    : layout_(layout),
      be_(be),
      grads_(grads),
      dp_(dp && dp->size() > 1 ? dp : nullptr),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      sharded_(distributed_optimizer && dp_ != nullptr),
      bf16_wire_(bf16_wire && dp_ != nullptr),
      shard_(shard) {
  TETRA_CHECK(!shard_ || sharded_ || !dp_, "ZeRO-2 shards the gradient only with the distributed optimizer");
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
    it->compact = owned_numel();
    owned_.push_back(GradRange{it->begin + rank * shard, shard});
  }
  reports_.assign(layout.groups.size(), 0);
  if (shard_ && dp_) {  // the staging buffers, allocated once (memory_plan.h counts them)
    staging_ = staging_plan(layout, bucket_size, tied_embeddings);
    for (int64_t n : staging_.own_numel) own_bufs_.emplace_back(be_, static_cast<size_t>(n) * 4);
    own_free_.assign(own_bufs_.size(), 1);
    for (int64_t i = 0; i < staging_.buffers; ++i) {
      pool_.emplace_back(be_, static_cast<size_t>(staging_.buffer_numel) * 4);
      free_.push_back(pool_.back().as<float>());
    }
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
    // ZeRO-2: one reduction is in flight at a time, so one bucket's bf16 copy; else the whole buffer's.
    const int64_t wire_numel = shard_ ? staging_.largest() : layout.total;
    wire_buf_ = BackendBuffer(be_, static_cast<size_t>(std::max<int64_t>(wire_numel, 1)) * 2);
    wire_ = wire_buf_.as<uint16_t>();
  }
}

GradBuffer::~GradBuffer() {
  for (Bucket& b : buckets_)
    if (b.work) b.work->wait();
  for (InFlight& f : in_flight_) f.work->wait();
}

int64_t GradBuffer::owned_numel() const {
  int64_t n = 0;
  for (const GradRange& r : owned_) n += r.numel;
  return n;
}

void GradBuffer::reduce_sp_partial(int group, float* base, int64_t origin) {
  const std::vector<GradRange>& ranges = sp_partial_[group];
  if (ranges.empty()) return;
  int64_t n = 0;
  for (const GradRange& r : ranges) {
    be_.copy(sp_scratch_ + n, base + (r.offset - origin), static_cast<size_t>(r.numel) * 4);
    n += r.numel;
  }
  tp_->all_reduce(sp_scratch_, n, DType::F32, ReduceOp::SUM);
  n = 0;
  for (const GradRange& r : ranges) {
    be_.copy(base + (r.offset - origin), sp_scratch_ + n, static_cast<size_t>(r.numel) * 4);
    n += r.numel;
  }
}

float* GradBuffer::acquire_staging(int bucket) {
  // buckets_ runs in plan_buckets() order: staging_.own's indices are buckets_'.
  const auto own = std::find(staging_.own.begin(), staging_.own.end(), bucket);
  if (own != staging_.own.end()) {
    const size_t i = static_cast<size_t>(own - staging_.own.begin());
    while (!own_free_[i] && !in_flight_.empty()) complete_oldest();
    TETRA_CHECK(own_free_[i], "gradient bucket {} is opened twice", bucket);
    own_free_[i] = 0;
    return own_bufs_[i].as<float>();
  }
  if (free_.empty() && !in_flight_.empty()) complete_oldest();  // less overlap, the same bytes
  if (free_.empty()) {  // more buckets open at once than the staging plan allows for
    spdlog::warn("ZeRO-2: {} gradient buckets open at once: one more staging buffer of {:.1f} MB beyond the plan",
                 pool_.size() + 1, static_cast<double>(staging_.buffer_numel) * 4 / 1e6);
    pool_.emplace_back(be_, static_cast<size_t>(staging_.buffer_numel) * 4);
    free_.push_back(pool_.back().as<float>());
  }
  float* s = free_.back();
  free_.pop_back();
  return s;
}

float* GradBuffer::at(int64_t offset) {
  TETRA_CHECK(shard_, "GradBuffer::at: the gradient is not sharded (ZeRO-2 only)");
  const int bucket = bucket_of_group_[layout_.group_of(offset)];
  Bucket& b = buckets_[bucket];
  if (!dp_) return shard_ + b.compact + (offset - b.begin);  // nothing to reduce: the shard is all of it
  if (!b.staging) {
    b.staging = acquire_staging(bucket);
    be_.memset_zero(b.staging, static_cast<size_t>(b.end - b.begin) * 4);
  }
  return b.staging + (offset - b.begin);
}

void GradBuffer::launch_staged(int bucket) {
  TETRA_CHECK(reduce_, "ZeRO-2 gradients are always reduced by their buckets");
  if (in_flight_.size() >= static_cast<size_t>(kZero2InFlight)) complete_oldest();
  Bucket& b = buckets_[bucket];
  float* base = b.staging;
  b.staging = nullptr;
  // Sequence parallelism: the norm weights' partial sums over the TP ranks' sequence shards, for
  // every micro-batch this staging buffer holds, in one all-reduce per group.
  if (tp_)
    for (int g = b.first_group; g <= b.last_group; ++g) reduce_sp_partial(g, base, b.begin);
  const int64_t shard = (b.end - b.begin) / dp_->size();
  // bf16_wire: rounded to bf16 and reduced in bf16 (the wire is free: nothing else is in flight).
  const DType type = bf16_wire_ ? DType::BF16 : DType::F32;
  char* wire = bf16_wire_ ? reinterpret_cast<char*>(wire_) : reinterpret_cast<char*>(base);
  if (bf16_wire_) be_.cast(wire_, DType::BF16, base, DType::F32, b.end - b.begin);
  char* mine = wire + static_cast<size_t>(dp_->rank() * shard) * dtype_size(type);
  in_flight_.push_back(InFlight{bucket, base, dp_->reduce_scatter_async(mine, wire, shard, type, ReduceOp::SUM)});
}

void GradBuffer::complete_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  dp_->wait(*f.work, CommOp::REDUCE_SCATTER);
  const Bucket& b = buckets_[f.bucket];
  const int64_t shard = (b.end - b.begin) / dp_->size();
  float* mine = shard_ + b.compact;
  float* reduced = f.staging + dp_->rank() * shard;
  if (bf16_wire_)  // the reduced bf16 shard back into fp32, over the staging buffer's own block
    be_.cast(reduced, DType::F32, wire_ + dp_->rank() * shard, DType::BF16, shard);
  be_.add(mine, mine, reduced, shard, DType::F32);
  const auto own = std::find(staging_.own.begin(), staging_.own.end(), f.bucket);
  if (own != staging_.own.end())
    own_free_[static_cast<size_t>(own - staging_.own.begin())] = 1;
  else
    free_.push_back(f.staging);
}

void GradBuffer::group_done(int group, int micro_batches) {
  TETRA_CHECK(group >= 0 && group < static_cast<int>(bucket_of_group_.size()), "bad group {}", group);
  TETRA_CHECK(micro_batches >= 1 && (shard_ || micro_batches == 1), "group {} reported for {} micro-batches",
              group, micro_batches);
  if (shard_ && !dp_) {  // nothing to reduce (expert-DP of 1): backward wrote into the shard itself
    TETRA_CHECK(sp_partial_[group].empty(), "a partial gradient in an unreduced ZeRO-2 buffer");
    return;
  }
  if (shard_) {
    reports_[group] += micro_batches;
    const int bucket = bucket_of_group_[group];
    Bucket& b = buckets_[bucket];
    int least = reports_[group];
    for (int g = b.first_group; g <= b.last_group; ++g) least = std::min(least, reports_[g]);
    if (least > b.reduced) {  // every group of the bucket is done with what its staging holds
      b.reduced = least;
      if (!b.staging) {  // nothing written since the last reduction (experts no token reached): zeros,
        b.staging = acquire_staging(bucket);  // so that every rank issues the same reductions
        be_.memset_zero(b.staging, static_cast<size_t>(b.end - b.begin) * 4);
      }
      launch_staged(bucket);
    }
    return;
  }
  if (tp_) reduce_sp_partial(group, grads_, 0);
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
  if (shard_ && !dp_) return;
  if (shard_) {
    for (Bucket& b : buckets_) {
      TETRA_CHECK(!b.staging, "gradient bucket of groups {}..{} holds gradients no group report reduced",
                  b.first_group, b.last_group);
      b.reduced = 0;
    }
    while (!in_flight_.empty()) complete_oldest();
    std::fill(reports_.begin(), reports_.end(), 0);
    return;
  }
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

void GradBuffer::gather_bucket(size_t i, const float* compact, float* out) {
  TETRA_CHECK(i < buckets_.size(), "bucket {} of {}", i, buckets_.size());
  // (buckets_ is in backward order, the last of the buffer first; owned_ in buffer order)
  const Bucket& b = buckets_[buckets_.size() - 1 - i];
  const GradRange& mine = owned_[i];
  float* dst = out + (mine.offset - b.begin);
  be_.copy(dst, compact + b.compact, static_cast<size_t>(mine.numel) * 4);
  if (sharded_) dp_->all_gather(out, dst, mine.numel, DType::F32);
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
