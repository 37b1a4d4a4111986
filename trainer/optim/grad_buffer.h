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
// `bf16_wire` (parallel.grad_compression: bf16): each bucket is rounded to bf16 into a scratch
// buffer and reduced in bf16 (half the bytes on the wire; the communicator sums in fp32 and rounds
// once per combining step), and the reduced result is converted back into the fp32 buffer, where
// the optimizer reads it. set_reduce(false) turns the DP reduction off for a step (1-bit Adam's
// compressed phase and int8 exchange the gradient themselves, compressed_exchange.h).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
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

class GradBuffer {
 public:
  // dp: the data-parallel group (null or size 1: nothing to reduce); tp: the tensor-parallel
  // group (used for sequence-parallel partial gradients).
  // Bytes of the scratch a tensor-parallel buffer of `layout` keeps for the norm weights'
  // partial gradients under sequence parallelism (the largest group's; 0 when none is partial).
  static size_t sp_scratch_bytes(const ParamLayout& layout);
  GradBuffer(const ParamLayout& layout, Backend& be, float* grads, Communicator* dp, Communicator* tp,
             bool distributed_optimizer, int64_t bucket_size, bool bf16_wire = false);
  ~GradBuffer();
  GradBuffer(const GradBuffer&) = delete;
  GradBuffer& operator=(const GradBuffer&) = delete;

  // Called by backward (last micro-batch of the step) for each finished parameter group.
  void group_done(int group);
  // Waits for every bucket's reduction. Every group must have been reported.
  void finish();
  // Whether the next steps' buckets are reduced over DP (default true).
  void set_reduce(bool reduce) { reduce_ = reduce; }
  // Distributed optimizer: all-gather each bucket's updated shards of `params` (count = the
  // layout's total, of `type`) from their owners. No-op otherwise.
  void gather_params(void* params, DType type);

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
  };
  void launch(Bucket& b);
  void reduce_sp_partial(int group);

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
};

}  // namespace tetra
