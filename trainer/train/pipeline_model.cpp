#include "trainer/train/pipeline_model.h"

#include <algorithm>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"
#include "trainer/comm/process_groups.h"

namespace tetra {

StageSlice stage_slice(const Config& cfg, int64_t pp_rank) {
  const int64_t pp = cfg.parallel.pp, vp = cfg.parallel.virtual_stages;
  const std::vector<int64_t> layers = cfg.pipeline_stage_layers();
  TETRA_CHECK(static_cast<int64_t>(layers.size()) == pp * vp, "{} stage layer counts for {} stages", layers.size(),
              pp * vp);
  std::vector<int64_t> start(layers.size() + 1, 0);
  for (size_t s = 0; s < layers.size(); ++s) start[s + 1] = start[s] + layers[s];
  TETRA_CHECK(start.back() == cfg.model.num_layers, "stages hold {} layers, the model has {}", start.back(),
              cfg.model.num_layers);
  StageSlice slice;
  for (int64_t c = 0; c < vp; ++c) {
    const size_t s = static_cast<size_t>(c * pp + pp_rank);
    slice.chunks.emplace_back(start[s], start[s + 1]);
  }
  slice.first = pp_rank == 0;
  slice.last = pp_rank == pp - 1;
  return slice;
}

const PipelineSchedule& make_schedule(const Config& cfg, int64_t micro_batches) {
  return PipelineSchedule::build(cfg.parallel.schedule, static_cast<int>(cfg.parallel.pp),
                                 static_cast<int>(cfg.parallel.virtual_stages), static_cast<int>(micro_batches));
}

// One model chunk as the runner sees it.
class PipelineModel::Chunk final : public PipelineChunk {
 public:
  Chunk(PipelineModel& owner, std::unique_ptr<Gpt> model, int64_t rows, const int32_t* tokens,
        const int32_t* targets, float* losses, Backend& be, int64_t grad_buffers)
      : owner_(owner), model_(std::move(model)), be_(be), rows_(rows), tokens_(tokens),
        targets_(targets), losses_(losses) {
    if (!model_->dims().first) {  // input gradients for the previous stage
      const size_t bytes = static_cast<size_t>(model_->boundary_numel()) * dtype_size(model_->act());
      for (int64_t i = 0; i < grad_buffers; ++i) {
        grad_buffer_mem_.emplace_back(be_, bytes);
        grad_buffers_.push_back(grad_buffer_mem_.back().get());
      }
    }
  }

  void forward(int64_t slot, int m) override {
    model_->forward(owner_.weights_, slot, tokens_ + m * rows_, targets_ + m * rows_, losses_ + m * rows_,
                    owner_.dloss_scale_, owner_.grads_);
  }
  void backward(int64_t slot, int m, bool last, int64_t grad_buffer) override {
    // Group reports: from the step's last micro-batch, whose backward finalises the gradients,
    // or under ZeRO-2 from every micro-batch, each reduced as it finishes.
    const bool report = last || owner_.sink_ != nullptr;
    model_->backward(owner_.weights_, owner_.grads_, slot, tokens_ + m * rows_, report ? &owner_.hook_ : nullptr,
                     grad_buffers_.empty() ? nullptr : grad_buffers_.at(static_cast<size_t>(grad_buffer)));
  }
  void* input(int64_t slot) override { return model_->input(slot); }
  const void* output(int64_t slot) override { return model_->output(slot); }
  void* output_grad() override { return model_->output_grad(); }
  const void* input_grad(int64_t grad_buffer) override { return grad_buffers_.at(static_cast<size_t>(grad_buffer)); }
  Gpt& model() { return *model_; }

 private:
  PipelineModel& owner_;
  std::unique_ptr<Gpt> model_;
  Backend& be_;
  std::vector<BackendBuffer> grad_buffer_mem_;  // owns grad_buffers_
  std::vector<void*> grad_buffers_;  // schedule.grad_buffers of (Ns, C), non-first stages
  int64_t rows_;
  const int32_t* tokens_;
  const int32_t* targets_;
  float* losses_;
};

PipelineModel::PipelineModel(const Config& cfg, const ParamLayout& layout, Backend& be, DType act,
                             ProcessGroups& groups, int64_t micro_batches, const int32_t* tokens,
                             const int32_t* targets, float* losses)
    : cfg_(cfg), layout_(layout), be_(be), groups_(groups), schedule_(make_schedule(cfg, micro_batches)) {
  const int pp_rank = groups.coord.pp;
  TETRA_CHECK(groups.pp->size() == schedule_.pp, "pipeline group of {} ranks, parallel.pp {}", groups.pp->size(),
              schedule_.pp);
  const int64_t rows = cfg.training.micro_batch_size * cfg.model.seq_len / cfg.parallel.cp;
  // Every chunk over one scratch and one set of slots (pipeline_runner.h).
  const SharedActivations shared = shared_activations(cfg, layout, schedule_, pp_rank);
  scratch_mem_ = BackendBuffer(be, shared.scratch);
  slot_mem_ = BackendBuffer(be, static_cast<size_t>(shared.slots) * shared.stride);
  const ActivationRegions regions{scratch_mem_.as<char>(), shared.scratch, slot_mem_.as<char>(), shared.stride,
                                  shared.slots};
  for (int c = 0; c < schedule_.vp; ++c) {
    auto model = std::make_unique<Gpt>(cfg.model, layout, be, act, cfg.training.micro_batch_size,
                                       &groups.backend(GroupKind::TP), c, shared.slots, &groups.backend(GroupKind::EP),
                                       Recomputation::from(cfg.training), cfg.training.loss_chunk_rows, &regions,
                                       &groups.backend(GroupKind::CP), cfg.parallel.cp_comm,
                                       &groups.backend(GroupKind::ETP), &groups.backend(GroupKind::ESHARE),
                                       static_cast<int>(cfg.parallel.ep_overlap_chunks));
    chunks_.push_back(std::make_unique<Chunk>(*this, std::move(model), rows, tokens, targets, losses, be,
                                              schedule_.grad_buffers));
  }
  runner_ = std::make_unique<PipelineRunner>(schedule_, groups.backend(GroupKind::PP),
                                             chunks_.front()->model().boundary_numel(), act, shared.slots);
  last_ = layout.stage.last;
  tied_across_stages_ = cfg.model.tie_embeddings && cfg.parallel.pp > 1;
  sum_before_reduction_ = tied_across_stages_ && cfg.parallel.distributed_optimizer && cfg.parallel.dp_cp() > 1;
  if (tied_across_stages_ && (layout.stage.first || layout.stage.last)) {
    for (const ParamSpec& p : layout.params)
      if (p.name == "embedding.wte") wte_numel_ = p.numel;
    TETRA_CHECK(wte_numel_ > 0, "pipeline rank {} holds no embedding.wte for the tied output layer", pp_rank);
  }
}

PipelineModel::~PipelineModel() = default;

void PipelineModel::set_weight_source(WeightSource* source) {
  for (auto& c : chunks_) c->model().set_weight_source(source);
}

void PipelineModel::set_grad_sink(GradSink* sink) {
  sink_ = sink;
  for (auto& c : chunks_) c->model().set_grad_sink(sink);
}

bool PipelineModel::has_moe() const { return chunks_.front()->model().has_moe(); }

MoeStepStats PipelineModel::take_moe_stats() {
  MoeStepStats all;
  for (auto& c : chunks_) all.merge(c->model().take_moe_stats());
  return all;
}

std::map<int64_t, std::vector<float>> PipelineModel::moe_expert_bias() const {
  std::map<int64_t, std::vector<float>> all;
  for (const auto& c : chunks_)
    for (auto& [l, b] : c->model().moe_expert_bias()) all[l] = b;
  return all;
}

void PipelineModel::set_moe_expert_bias(const std::map<int64_t, std::vector<float>>& bias) {
  for (auto& c : chunks_) c->model().set_moe_expert_bias(bias);
}

void PipelineModel::update_moe_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert) {
  for (auto& c : chunks_) c->model().update_moe_expert_bias(tokens_per_expert);
}

size_t PipelineModel::activation_bytes() const { return scratch_mem_.bytes() + slot_mem_.bytes(); }

PipelineModel::SharedActivations PipelineModel::shared_activations(const Config& cfg, const ParamLayout& layout,
                                                                   const PipelineSchedule& s, int pp_rank) {
  SharedActivations out;
  for (int c = 0; c < s.vp; ++c) {
    const ActivationSizes a = Gpt::activation_sizes_for(
        cfg.model, precision_dtype(cfg.training.precision), cfg.training.micro_batch_size, cfg.parallel.tp,
        cfg.parallel.sequence_parallel, ChunkShape::of(layout, c, 1), cfg.parallel.ep,
        Recomputation::from(cfg.training), cfg.training.loss_chunk_rows, cfg.parallel.cp, cfg.parallel.cp_comm,
        cfg.parallel.expert_tp());
    out.scratch = std::max(out.scratch, a.scratch);
    out.stride = std::max(out.stride, a.slot);
  }
  out.slots = PipelineRunner::slots_needed(s, pp_rank);
  return out;
}

ActivationSplit PipelineModel::activation_split(const Config& cfg, int64_t pp_rank) {
  const PipelineSchedule& s = make_schedule(cfg, cfg.grad_accum_steps());
  TensorSlicing slicing;  // the activations do not depend on which TP / EP slice
  slicing.ep = cfg.parallel.ep;
  const ParamLayout layout = ParamLayout::build(cfg.model, slicing, stage_slice(cfg, pp_rank));
  const SharedActivations shared = shared_activations(cfg, layout, s, static_cast<int>(pp_rank));
  ActivationSplit split;
  split.kept = static_cast<size_t>(shared.slots) * shared.stride;
  split.slots = shared.slots;
  split.scratch = shared.scratch;
  return split;
}

size_t PipelineModel::activation_bytes_for(const Config& cfg, int64_t pp_rank) {
  const ActivationSplit split = activation_split(cfg, pp_rank);
  return split.kept + split.scratch;
}

size_t PipelineModel::input_grad_bytes_for(const Config& cfg, int64_t pp_rank) {
  const PipelineSchedule& s = make_schedule(cfg, cfg.grad_accum_steps());
  const StageSlice stage = stage_slice(cfg, pp_rank);
  const int64_t Ns = cfg.training.micro_batch_size * cfg.model.seq_len / cfg.parallel.cp /
                     (cfg.parallel.sequence_parallel && cfg.parallel.tp > 1 ? cfg.parallel.tp : 1);
  const size_t boundary = static_cast<size_t>(Ns * cfg.model.hidden_size) * dtype_size(precision_dtype(cfg.training.precision));
  const int64_t chunks = s.vp - (stage.first ? 1 : 0);  // every chunk but the model's first
  return static_cast<size_t>(chunks * s.grad_buffers) * boundary;
}

PipelineStepStats PipelineModel::run(bool forward_only) {
  std::vector<PipelineChunk*> chunks;
  for (const auto& c : chunks_) chunks.push_back(c.get());
  return runner_->run(chunks, forward_only);
}

PipelineStepStats PipelineModel::train(const void* weights, float* grads, float dloss_scale,
                                       const GroupReport& done) {
  weights_ = weights;
  grads_ = grads;
  dloss_scale_ = dloss_scale;
  deferred_.clear();
  hook_ = [&](int group) {
    if (sum_before_reduction_ && (group == layout_.embedding_group || group == layout_.head_group))
      deferred_.push_back(group);
    else
      done(group, 1);
  };
  PipelineStepStats st = run(false);
  if (sum_before_reduction_ && wte_numel_ > 0) {
    // Sum of the first stage's and the last stage's embedding.wte gradients, on both (ZeRO-2: in
    // the staging buffer that has held them the whole step, its bucket's reports being deferred).
    float* wte = sink_ ? sink_->at(layout_.wte) : grads + layout_.wte;
    groups_.backend(GroupKind::EMBEDDING).all_reduce(wte, wte_numel_, DType::F32, ReduceOp::SUM);
  }
  // Each deferred group once, for all its micro-batches (ZeRO-2 reports every micro-batch's).
  std::vector<int> order;
  for (int g : deferred_)
    if (std::find(order.begin(), order.end(), g) == order.end()) order.push_back(g);
  for (int g : order)
    done(g, static_cast<int>(std::count(deferred_.begin(), deferred_.end(), g)));
  hook_ = nullptr;
  return st;
}

void PipelineModel::finish_tied_embedding(float* grads) {
  if (sum_before_reduction_ || wte_numel_ == 0) return;
  groups_.backend(GroupKind::EMBEDDING).all_reduce(grads + layout_.wte, wte_numel_, DType::F32, ReduceOp::SUM);
}

PipelineStepStats PipelineModel::forward(const void* weights) {
  weights_ = weights;
  grads_ = nullptr;
  dloss_scale_ = 0.0f;
  return run(true);
}

}  // namespace tetra
