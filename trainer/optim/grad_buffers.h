// The gradient buffers of a model: one GradBuffer over the dense parameters, reduced over DP, and
// for a Mixture-of-Experts model a second one over the expert parameters, reduced over expert-DP
// (experts are replicated over dp / ep ranks only, DESIGN.md). The layout puts every expert
// tensor after the dense ones (param_layout.h), so each buffer covers one contiguous range of the
// one gradient buffer and the GradBuffer itself needs no notion of experts.
//
// Backward's group reports are routed by group number (the expert groups come last); the owned
// ranges the optimizer updates are the two buffers' ranges, dense first (buffer order); the global
// gradient norm is sqrt(dense^2 + experts^2), the expert part summed over the EP group (each EP
// rank holds different experts) or, with the distributed optimizer, over the DP group (each rank
// holds its expert-DP shard of its EP rank's experts).
//
// ZeRO-2 (`shard_gradients`, with the distributed optimizer over dp > 1): the two buffers' reduced
// shards live in one compact fp32 buffer, shard(), the owned ranges back to back (dense first), as
// the optimizer's state is laid out; backward writes through this object's at() (grad_sink.h).
#pragma once

#include <memory>
#include <vector>

#include "trainer/optim/adamw.h"
#include "trainer/optim/grad_buffer.h"

namespace tetra {

class Communicator;
struct ProcessGroups;

class GradBuffers final : public GradSink {
 public:
  // `bf16_wire`: the dense buckets reduce in bf16 (parallel.grad_compression "bf16").
  // `grads`: the whole fp32 gradient buffer; null with `shard_gradients`.
  GradBuffers(const ParamLayout& layout, Backend& be, float* grads, ProcessGroups& groups,
              bool distributed_optimizer, int64_t bucket_size, bool bf16_wire = false,
              bool shard_gradients = false, bool tied_embeddings = false);
  ~GradBuffers() override;

  // ZeRO-2: whether the gradient is sharded; the compact shard buffer (owned_numel() fp32), and
  // where backward writes.
  bool shards_gradients() const { return dense_->shards_gradients(); }
  float* shard() { return shard_; }
  int64_t owned_numel() const;
  float* at(int64_t offset) override;
  // ZeRO-2: bytes of staging buffers held now (their peak so far).
  size_t staging_bytes() const;

  void group_done(int group, int micro_batches = 1);
  // 1-bit Adam's compressed steps and int8 exchange the gradients themselves (grad_buffer.h).
  void set_reduce(bool reduce) {
    dense_->set_reduce(reduce);
    if (experts_) experts_->set_reduce(reduce);
  }
  GradBuffer& dense() { return *dense_; }
  GradBuffer* experts() { return experts_.get(); }  // null for a dense model
  void finish();
  void gather_params(void* params, DType type);
  // The whole buffer `whole` (layout.total of `type`) from this rank's `compact` values (the owned
  // ranges back to back, the optimizer state's layout) and every other rank's: each owned range
  // copied to its offsets, then gather_params.
  void gather_compact(void* whole, const void* compact, DType type);
  // Every bucket, the dense part's then the experts', in buffer order: its [begin, end) and its
  // fp32 values gathered from `compact` (the optimizer's master shard) into `out` (GradBuffer::
  // gather_bucket; collective over dp or expert-DP).
  size_t buckets() const;
  std::pair<int64_t, int64_t> bucket_range(size_t i) const;
  void gather_bucket(size_t i, const float* compact, float* out);
  const std::vector<GradRange>& owned() const { return owned_; }
  bool sharded() const { return dense_->sharded(); }
  // The global gradient norm in two halves, so that it is read back with the step's other scalars:
  // the dense and the expert sums of squares, reduced over every group, into `out` (2 floats of
  // backend memory; nothing read back), then the norm from those two values on the host, the
  // dense and expert parts' norms first multiplied by the scales (1-bit Adam's compressed phase
  // estimates the reduced norm from local gradients).
  void norm_squares(const float* grads, float* out);
  double norm_from_squares(const float squares[2], double dense_scale = 1.0, double expert_scale = 1.0) const;
  size_t num_buckets() const { return dense_->num_buckets() + (experts_ ? experts_->num_buckets() : 0); }

  // The parts of the layout each buffer covers (offsets those of the whole buffer).
  const ParamLayout& dense_layout() const { return dense_layout_; }
  const ParamLayout& expert_layout() const { return expert_layout_; }

 private:
  ParamLayout dense_layout_, expert_layout_;
  int dense_groups_;
  std::unique_ptr<GradBuffer> dense_, experts_;
  std::unique_ptr<GradNorm> dense_norm_, expert_norm_;
  std::vector<GradRange> owned_;
  Communicator* pp_ = nullptr;  // pipeline group (size > 1), for the norm
  Backend* be_;
  BackendBuffer shard_buf_;   // ZeRO-2: owns shard_
  float* shard_ = nullptr;
  int64_t expert_begin_ = 0;  // the first expert offset (at()'s routing)
};

// The dense part of `layout` (groups [0, dense_groups)) or its experts (the later groups,
// renumbered from 0); parameter offsets and group ranges stay those of the whole buffer.
ParamLayout layout_part(const ParamLayout& layout, bool experts);

}  // namespace tetra
