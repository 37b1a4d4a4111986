#include "trainer/parallel/comm_volume.h"

#include <fmt/format.h>

#include "trainer/optim/grad_buffer.h"
#include "trainer/optim/grad_buffers.h"

namespace tetra {

void GroupVolume::add(CommOp op, int64_t n, int64_t bytes_each) {
  calls[static_cast<int>(op)] += n;
  payload_bytes[static_cast<int>(op)] += n * bytes_each;
}

int64_t GroupVolume::total_payload() const {
  int64_t t = 0;
  for (int64_t b : payload_bytes) t += b;
  return t;
}

std::string GroupVolume::describe() const {
  std::string out;
  for (int i = 0; i < kCommOps; ++i) {
    if (calls[i] == 0) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {} x = {:.3f} MB", comm_op_name(static_cast<CommOp>(i)), calls[i],
                       static_cast<double>(payload_bytes[i]) / 1e6);
  }
  return out.empty() ? "none" : out;
}

StepVolume predict_step_volume(const Config& cfg, const ParamLayout& layout) {
  StepVolume v;
  const ParallelConfig& par = cfg.parallel;
  const int64_t act_bytes = cfg.training.precision == "bf16" ? 2 : 4;
  const int64_t N = cfg.training.micro_batch_size * cfg.model.seq_len, C = cfg.model.hidden_size;
  const int64_t L = cfg.model.num_layers, accum = cfg.grad_accum_steps();
  const int64_t rows = N * C * act_bytes;

  if (par.tp > 1) {
    const int64_t per_micro = 2 * L + 1;  // (N, C) exchanges in each direction
    if (!par.sequence_parallel) {
      v.tp.add(CommOp::ALL_REDUCE, 2 * per_micro * accum, rows);
    } else {
      v.tp.add(CommOp::REDUCE_SCATTER, 2 * per_micro * accum, rows);
      v.tp.add(CommOp::ALL_GATHER, 2 * per_micro * accum, rows);
      // Norm gradients (partial over sequence shards), once per step per group that has any.
      std::vector<int64_t> per_group(layout.groups.size(), 0);
      for (const ParamSpec& p : layout.params)
        if (p.sp_partial) per_group[p.group] += p.numel;
      for (int64_t n : per_group)
        if (n > 0) v.tp.add(CommOp::ALL_REDUCE, 1, n * 4);
    }
    if (cfg.model.moe.enabled()) {  // the gates' gradient (partial sums over the experts' TP slices)
      int64_t blocks = 0;
      for (int64_t l = 0; l < L; ++l) blocks += cfg.model.moe.is_moe_layer(l) ? 1 : 0;
      v.tp.add(CommOp::ALL_REDUCE, blocks * accum, N * cfg.model.moe.top_k * 4);
    }
    v.tp.add(CommOp::ALL_REDUCE, accum, N * 4);      // loss: row maxima
    v.tp.add(CommOp::ALL_REDUCE, accum, 2 * N * 4);  // loss: sum of exponentials, target logits
    v.tp.add(CommOp::ALL_REDUCE, 1, 4);              // gradient norm
    if (cfg.model.moe.enabled()) v.tp.add(CommOp::ALL_REDUCE, 1, 4);  // and its expert part
  }
  // The reduction of a part of the gradient buffer over a group of `size` ranks.
  auto reduction = [&](GroupVolume& g, const ParamLayout& part, int64_t size, GroupVolume& norm_group) {
    if (size <= 1 || part.groups.empty()) return;
    const int64_t buckets = static_cast<int64_t>(plan_buckets(part, par.bucket_size).size());
    const int64_t numel = part.groups.back().second - part.groups.front().first;
    if (par.distributed_optimizer) {
      g.add(CommOp::REDUCE_SCATTER, buckets, 0);
      g.payload_bytes[static_cast<int>(CommOp::REDUCE_SCATTER)] += numel * 4;
      g.add(CommOp::ALL_GATHER, buckets, 0);
      g.payload_bytes[static_cast<int>(CommOp::ALL_GATHER)] += numel * act_bytes;
      norm_group.add(CommOp::ALL_REDUCE, 1, 4);  // gradient norm over the shards
    } else {
      g.add(CommOp::ALL_REDUCE, buckets, 0);
      g.payload_bytes[static_cast<int>(CommOp::ALL_REDUCE)] += numel * 4;
    }
  };
  reduction(v.dp, layout_part(layout, false), par.dp, v.dp);
  if (par.dp > 1) v.dp.add(CommOp::ALL_REDUCE, 1, 4);  // the step's loss
  const MoeConfig& moe = cfg.model.moe;
  if (moe.enabled()) {
    reduction(v.edp, layout_part(layout, true), par.dp / par.ep, v.dp);
    if (par.ep > 1) {
      int64_t blocks = 0;
      for (int64_t l = 0; l < L; ++l) blocks += moe.is_moe_layer(l) ? 1 : 0;
      v.ep.add(CommOp::ALL_TO_ALL, 5 * blocks * accum, 0);
      const bool sharded = par.distributed_optimizer && par.dp / par.ep > 1;
      if (!sharded) v.ep.add(CommOp::ALL_REDUCE, 1, 4);  // the experts' gradient norm
    }
  }
  return v;
}

GroupVolume measured_volume(const CommStats& after, const CommStats& before) {
  GroupVolume v;
  for (int i = 0; i < kCommOps; ++i) {
    v.calls[i] = after.calls[i] - before.calls[i];
    v.payload_bytes[i] = after.payload_bytes[i] - before.payload_bytes[i];
  }
  return v;
}

}  // namespace tetra
