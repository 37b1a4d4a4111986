// Gradient reduction over data parallelism: the contiguous fp32 gradient buffer split into
// buckets, each reduced over the DP group as soon as backward has produced its last gradient.
//
// Buckets are unions of consecutive parameter groups (param_layout.h: embedding, each block, the
// final norm and output layer), formed from the end of the buffer, the order in which backward
// finishes them, each holding at least `bucket_size` parameters where the model allows. Backward
// reports each finished group (Gpt's GroupDoneHook) during the step's last micro-batch; when
// every group of a bucket is done its reduction is issued asynchronously and runs while backward
// continues on earlier layers; finish() waits for all of them.
//
//   plain data parallelism:   all-reduce of each bucket; every rank then holds the whole
//                             reduced gradient and updates every parameter.
//   distributed optimizer:    reduce-scatter of each bucket (ZeRO-1): rank r of the DP group
//                             receives the r-th of dp equal shards of every bucket and updates
//                             only those parameters; gather_params() all-gathers the updated
//                             weights afterwards. Group boundaries are aligned to 16 dp elements
//                             (TensorSlicing::group_align), so shards are equal and aligned.
//
// With sequence parallelism, the gradients of norm weights and biases are partial sums over each
// TP rank's sequence shard; they are all-reduced over the TP group (coalesced, once per group)
// before the group counts as done.
//
// The gradients are pre-scaled by the loss (1 / global tokens), so the reduced sum is the mean.
//
// ZeRO-2 (parallel.zero_stage 2, `shard` given): the gradient is sharded too. There is no whole
// gradient buffer: backward writes each bucket's gradient into a staging buffer (the GradSink
// at(): taken from a pool and zeroed when the bucket is first written), every micro-batch reports
// its finished groups, and a bucket whose groups have all reported is reduce-scattered at once;
// when that completes this rank's shard is added to `shard` (this rank's owned ranges, back to back
// in buffer order, the layout of the optimizer's state) and the staging buffer goes back to the
// pool. One reduction is in flight at a time (it overlaps the backward of the next bucket); the
// pool (StagingPlan) holds the buckets being
// written and those, and when it runs dry the oldest reduction is waited for. The embedding's
// bucket and the output layer's have staging buffers of their own size where they are larger than
// every other bucket (a vocabulary's rows), so that the pool's buffers are those of the largest
// other bucket, and so does the one that tied embeddings hold open for a whole backward or step
// (pp 1: the output layer writes embedding.wte's gradient first; pp > 1: the two stages' copies
// are summed before they reduce).
// A group reported ahead of the rest of its bucket (interleaved pipeline chunks, tied embeddings
// summed across stages at the end of the step) is fine: a bucket reduces what its staging holds
// when its last group reports, and a later write opens a fresh staging buffer.
//
// `bf16_wire` (parallel.grad_compression: bf16; under ZeRO-2 each reduction's bucket is rounded into
// one bucket-sized bf16 buffer, and this rank's reduced block converted back before it is added): each bucket is rounded to bf16 into a scratch
// buffer and reduced in bf16 (half the bytes on the wire; the communicator sums in fp32 and rounds
// once per combining step), and the reduced result is converted back into the fp32 buffer, where
// the optimizer reads it. set_reduce(false) turns the DP reduction off for a step (1-bit Adam's
// compressed phase and int8 exchange the gradient themselves, compressed_exchange.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"

namespace tetra {

class Communicator;
class Work;

// The buckets for `layout`: ranges of whole groups, in the order backward completes them (from
// the end of the buffer), each of at least `bucket_size` elements except possibly the last.
struct BucketPlan {
  int64_t begin = 0, end = 0;
  int first_group = 0, last_group = 0;
};
std::vector<BucketPlan> plan_buckets(const ParamLayout& layout, int64_t bucket_size);

class GradBuffer final : public GradSink {
 public:
  // dp: the data-parallel group (null or size 1: nothing to reduce); tp: the tensor-parallel
  // group (used for sequence-parallel partial gradients).
  // Bytes of the scratch a tensor-parallel buffer of `layout` keeps for the norm weights'
  // partial gradients under sequence parallelism (the largest group's; 0 when none is partial).
  static size_t sp_scratch_bytes(const ParamLayout& layout);
  // `shard` (ZeRO-2, distributed_optimizer and dp > 1 only): owned_numel() fp32, where this rank's
  // reduced shards accumulate; `grads` is then unused (null).
  GradBuffer(const ParamLayout& layout, Backend& be, float* grads, Communicator* dp, Communicator* tp,
             bool distributed_optimizer, int64_t bucket_size, bool bf16_wire = false, float* shard = nullptr,
             bool tied_embeddings = false);
  ~GradBuffer() override;
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  // Called by backward (last micro-batch of the step; ZeRO-2: every micro-batch) for each finished
  // parameter group; `micro_batches`: how many micro-batches' reports this one stands for (ZeRO-2:
  // a group whose report was deferred to the end of the step reports them all at once).
  void group_done(int group, int micro_batches = 1);
  // ZeRO-2: where backward writes the gradient at `offset` (a staging buffer; grad_sink.h).
  float* at(int64_t offset) override;
  bool shards_gradients() const { return shard_ != nullptr; }
  // ZeRO-2: the staging buffers for `layout`'s buckets (the memory plan's too).
  struct StagingPlan {
    std::vector<int> own;            // plan_buckets() indices of the buckets with a buffer of their own
    std::vector<int64_t> own_numel;  // ... and its elements
    int64_t buffers = 0;             // the pool: the reduction in flight, the bucket being written, and
                                     // one per further interleaved chunk (a bucket straddling two)
    int64_t buffer_numel = 0;        // each of the largest other bucket
    int64_t largest() const {  // elements of the largest buffer
      int64_t n = buffer_numel;
      for (int64_t o : own_numel) n = std::max(n, o);
      return n;
    }
    int64_t bytes() const {
      int64_t n = buffers * buffer_numel;
      for (int64_t o : own_numel) n += o;
      return n * 4;
    }
  };
  static StagingPlan staging_plan(const ParamLayout& layout, int64_t bucket_size, bool tied_embeddings);
  // Bytes of staging held now (the plan's, unless more were ever needed).
  size_t staging_bytes() const;
  // Waits for every bucket's reduction. Every group must have been reported.
  void finish();
  // Whether the next steps' buckets are reduced over DP (default true).
  void set_reduce(bool reduce) { reduce_ = reduce; }
  // Distributed optimizer: all-gather each bucket's updated shards of `params` (count = the
  // layout's total, of `type`) from their owners. No-op otherwise.
  void gather_params(void* params, DType type);
  // Bucket i's elements [begin, end) of the buffer, and its values gathered into `out` (end - begin
  // fp32, backend memory) from every rank's shard of `compact` (this rank's owned ranges back to
  // back, the optimizer's master shard). Collective over dp (a copy when not sharded).
  // (i in buffer order; buckets_ holds them in backward order)
  std::pair<int64_t, int64_t> bucket_range(size_t i) const {
    const Bucket& b = buckets_[buckets_.size() - 1 - i];
    return {b.begin, b.end};
  }
  void gather_bucket(size_t i, const float* compact, float* out);

  // The ranges of the buffer this rank's optimizer updates: one per bucket (its shard under the
  // distributed optimizer, the whole bucket otherwise), in buffer order, non-overlapping.
  const std::vector<GradRange>& owned() const { return owned_; }
  int64_t owned_numel() const;
  bool sharded() const { return sharded_; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // elements
    int first_group = 0, last_group = 0;
    int pending = 0;             // groups not yet done this step
    std::unique_ptr<Work> work;
    // ZeRO-2
    int64_t compact = 0;         // where its shard starts in shard_
    float* staging = nullptr;    // being written; null: none open
    int reduced = 0;             // micro-batches whose reduction has been issued
  };
  struct InFlight {  // ZeRO-2: an issued reduce-scatter and the staging buffer it reads
    int bucket;
    float* staging;
    std::unique_ptr<Work> work;
  };
  void launch(Bucket& b);
  void launch_staged(int bucket);
  void complete_oldest();
  float* acquire_staging(int bucket);
  // The all-reduce over TP of `group`'s partial gradients, at `base` + (layout offset - `origin`).
  void reduce_sp_partial(int group, float* base, int64_t origin);

  const ParamLayout& layout_;
  Backend& be_;
  float* grads_;
  Communicator* dp_;
  Communicator* tp_;
  bool sharded_;
  bool bf16_wire_;
  bool reduce_ = true;
  BackendBuffer wire_buf_, sp_scratch_buf_;  // own wire_ and sp_scratch_
  uint16_t* wire_ = nullptr;  // bf16_wire: the whole buffer in bf16, at the same element offsets
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_group_;
  std::vector<char> group_reported_;  // this step
  std::vector<GradRange> owned_;
  // Sequence parallelism: the partial-gradient parameters of each group, and a scratch buffer
  // that holds one group's of them contiguously for one all-reduce.
  std::vector<std::vector<GradRange>> sp_partial_;
  float* sp_scratch_ = nullptr;
  // ZeRO-2
  float* shard_ = nullptr;
  StagingPlan staging_;
  std::vector<BackendBuffer> own_bufs_;  // staging_.own's buffers
  std::vector<char> own_free_;           // ... not being written or reduced
  std::vector<BackendBuffer> pool_;
  std::vector<float*> free_;
  std::vector<InFlight> in_flight_;  // oldest first
  std::vector<int> reports_;         // per group, this step
};

}  // namespace tetra
