#include "trainer/train/updater.h"

#include <cmath>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/optim/lr_schedule.h"

namespace tetra {

Updater::Updater(const Config& cfg, const ParamLayout& layout, Backend& be, GradBuffers& grad_buffers,
                 ProcessGroups& groups, DType compute_type, float* master, void* compute, float* grads)
    : cfg_(cfg),
      layout_(layout),
      be_(be),
      grad_buffers_(grad_buffers),
      writer_(groups.rank == 0),
      act_(compute_type),
      master_(master),
      compute_(compute),
      grads_(grads) {
  const bool shard_optimizer = cfg.parallel.distributed_optimizer && cfg.parallel.dp_cp() > 1;
  // ZeRO-3 keeps no whole weights: in fp32 too the master weights are the optimizer's shard, and
  // the model gathers its compute weights from it (weight_units.h).
  zero3_ = shard_optimizer && cfg.parallel.zero_stage == 3;
  const bool optimizer_owns_master = shard_optimizer && (act_ != DType::F32 || zero3_);
  optimizer_ = std::make_unique<AdamW>(cfg.optimizer, layout, be, grad_buffers.owned(), optimizer_owns_master, master,
                                       grad_buffers.shards_gradients());
  optimizer_->set_compact_compute(zero3_);
  grads_numel_ = grad_buffers.shards_gradients() ? grad_buffers.owned_numel() : layout.total;
  if (cfg.parallel.grad_compression == GradCompression::ONEBIT)
    onebit_ = std::make_unique<OnebitAdam>(cfg, layout, be, grad_buffers, *optimizer_, groups);
  if (cfg.parallel.grad_compression == GradCompression::INT8)
    int8_ = std::make_unique<CompressedReduction>(cfg, be, grad_buffers, groups);
  if (act_ == DType::F16) scaler_ = std::make_unique<LossScaler>(cfg.training);
  if (optimizer_owns_master) master_ = nullptr;
}

Updater::~Updater() {
  onebit_.reset();
  int8_.reset();
  optimizer_.reset();
}

StepVolume Updater::begin_step(int64_t s) {
  compressed_ = compresses(s);  // 1-bit Adam past its warm-up
  grad_buffers_.set_reduce(!compressed_ && !int8_);
  return predict_step_volume(cfg_, layout_, compressed_, compressed_ && onebit_->gathers_variance());
}

float Updater::loss_gradient_scale(int64_t tokens) const {
  return scaler_ ? static_cast<float>(scaler_->scale() / static_cast<double>(tokens))
                 : 1.0f / static_cast<float>(tokens);
}

StepUpdate Updater::step(int64_t s, float* scalars, double tokens, StepGuard& guard, int32_t stop_request,
                         const GradientHook& reduced) {
  if (int8_) int8_->reduce(grads_, s);  // the step's gradient reduction, compressed
  grad_buffers_.norm_squares(grads_, scalars + 1);
  float host[3];
  be_.copy_to_host(host, scalars, sizeof(host));  // the loss and the norm's two sums, at once
  const double loss = static_cast<double>(host[0]) / tokens;
  const float squares[2] = {host[1], host[2]};
  // Compressed: the unreduced local gradient's norm, times the group size, as an estimate (onebit_adam.h).
  const double dp = static_cast<double>(cfg_.parallel.dp_cp());
  const double raw_norm = compressed_
                              ? grad_buffers_.norm_from_squares(squares, dp, static_cast<double>(cfg_.parallel.edp_cp()))
                              : grad_buffers_.norm_from_squares(squares);
  // fp16: the gradients carry the loss scale; a non-finite norm is an overflow (loss_scaler.h).
  const double step_scale = scaler_ ? scaler_->scale() : 1.0;
  const double norm = raw_norm / step_scale;
  // A non-finite or spiking loss or norm, or an fp16 overflow: the update is skipped, the
  // gradients dropped.
  const bool overflow_here = scaler_ && !std::isfinite(raw_norm);
  const StepVerdict verdict = guard.check(s + 1, loss, norm, overflow_here, stop_request);
  // A step skipped for an overflow is no update: the LR schedule advances with updates (loss_scaler.h).
  const int64_t updates_before = s - (scaler_ ? scaler_->skipped_steps() : 0);
  const LossScaleUpdate scaling = scaler_ ? scaler_->update(s + 1, verdict.overflow) : LossScaleUpdate{};
  const std::string skip_reason = !verdict.overflow ? verdict.reason
                                  : scaling.describe() + (overflow_here ? "" : " (seen on another rank)");
  if (reduced) reduced(step_scale);

  StepUpdate u;
  u.loss = loss;
  u.stop_request = verdict.request;
  u.lr = learning_rate(cfg_.optimizer, cfg_.training.steps, updates_before);
  u.grad_norm = norm;
  u.clip = verdict.skip || compressed_ ? 1.0f : clip_factor(norm, cfg_.optimizer.grad_clip);
  if (verdict.skip) u.skipped = skip_reason;
  if (scaler_) {
    u.loss_scale = step_scale;
    u.overflow = verdict.overflow;
  }
  void* compute = act_ == DType::F32 ? nullptr : compute_;
  if (verdict.skip) {
    be_.memset_zero(grads_, static_cast<size_t>(grads_numel_) * 4);
    // A guard's skip counts as a step (step_guard.h); an overflow's does not (loss_scaler.h).
    if (!verdict.overflow) optimizer_->set_steps_taken(optimizer_->steps_taken() + 1);
    if (writer_) spdlog::warn("step {}: update skipped: {}", s + 1, skip_reason);
  } else if (compressed_) {
    onebit_->step(master_, grads_, u.lr, compute, act_);
  } else {
    // The loss scale comes off with the clipping factor, in AdamW's one multiply.
    const float grad_scale = scaler_ ? static_cast<float>(u.clip / step_scale) : u.clip;
    optimizer_->step(master_, grads_, u.lr, grad_scale, compute, act_);
  }
  if (grad_buffers_.sharded() && !verdict.skip && !zero3_) {
    // The optimizer zeroed the shards it consumed; the rest of the buffer holds this rank's
    // unreduced gradients (ZeRO-2: there is no rest). Then every rank gets the updated weights of
    // every shard.
    if (!grad_buffers_.shards_gradients()) be_.memset_zero(grads_, static_cast<size_t>(layout_.total) * 4);
    grad_buffers_.gather_params(compute_, act_);
  }  // ZeRO-3: the updated shards are gathered unit by unit when the model next reads them
  return u;
}

void Updater::add_checkpoint_state(CheckpointBuffers& b) {
  b.master_shard = optimizer_->master_shard();
  b.exp_avg = optimizer_->exp_avg();
  b.exp_avg_sq = optimizer_->exp_avg_sq();
  if (onebit_) b.extra = onebit_->checkpoint_state();
  if (int8_) b.extra = int8_->checkpoint_state();
}

std::optional<LossScalerState> Updater::loss_scaler_state() const {
  if (!scaler_) return std::nullopt;
  return scaler_->state();
}

void Updater::resume(const CheckpointState& st, const std::string& from) {
  if (scaler_ && st.loss_scaler) scaler_->restore(*st.loss_scaler);
  if (scaler_ && !st.loss_scaler)
    spdlog::info("{} holds no loss scaler state (saved by a run not in fp16): loss scaling starts afresh at {}",
                 from, scaler_->scale());
  // Steps skipped for an fp16 overflow made no update (loss_scaler.h).
  optimizer_->set_steps_taken(st.step - (scaler_ ? scaler_->skipped_steps() : 0));
}

std::string Updater::describe_loss_scaling() const {
  if (!scaler_) return "";
  const TrainingConfig& tc = cfg_.training;
  return scaler_->dynamic() ? fmt::format("dynamic, scale {} (window {}, hysteresis {}, min {})", scaler_->scale(),
                                          tc.loss_scale_window, tc.hysteresis, tc.min_loss_scale)
                            : fmt::format("static, scale {}", scaler_->scale());
}

}  // namespace tetra
