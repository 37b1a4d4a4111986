#include "trainer/parallel/comm_volume.h"

#include <fmt/format.h>

#include "trainer/optim/compression.h"
#include "trainer/optim/grad_buffer.h"
#include "trainer/optim/onebit_adam.h"

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

StepVolume predict_step_volume(const Config& cfg, const ParamLayout& layout, bool onebit_compressed,
                               bool onebit_gather_variance) {
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
    v.tp.add(CommOp::ALL_REDUCE, accum, N * 4);      // loss: row maxima
    v.tp.add(CommOp::ALL_REDUCE, accum, 2 * N * 4);  // loss: sum of exponentials, target logits
    v.tp.add(CommOp::ALL_REDUCE, 1, 4);              // gradient norm
  }
  if (par.dp > 1) {
    const int64_t buckets = static_cast<int64_t>(plan_buckets(layout, par.bucket_size).size());
    const int64_t grad_bytes = layout.total * (par.grad_compression == "bf16" ? 2 : 4);
    const CommOp reduce = par.distributed_optimizer ? CommOp::REDUCE_SCATTER : CommOp::ALL_REDUCE;
    if (onebit_compressed) {
      const int64_t message_bytes = par.dp * plan_chunks(layout, par.bucket_size, par.dp).words * 2;
      v.dp.add(CommOp::ALL_TO_ALL, 1, message_bytes);
      if (!par.distributed_optimizer) v.dp.add(CommOp::ALL_GATHER, 1, message_bytes);
      int64_t replicated = 0;  // replicated parameters: averaged exactly (onebit_adam.h)
      for (const GradRange& r : onebit_exact_ranges(cfg, layout)) replicated += r.numel;
      if (replicated > 0) v.dp.add(CommOp::ALL_REDUCE, 1, replicated * 4);
      if (onebit_gather_variance) {  // GradBuffer::gather_params of the fp32 variance
        v.dp.add(CommOp::ALL_GATHER, buckets, 0);
        v.dp.payload_bytes[static_cast<int>(CommOp::ALL_GATHER)] += layout.total * 4;
      }
    } else {
      v.dp.add(reduce, buckets, 0);
      v.dp.payload_bytes[static_cast<int>(reduce)] += grad_bytes;
    }
    if (par.distributed_optimizer) {
      v.dp.add(CommOp::ALL_GATHER, buckets, 0);
      v.dp.payload_bytes[static_cast<int>(CommOp::ALL_GATHER)] += layout.total * act_bytes;
      v.dp.add(CommOp::ALL_REDUCE, 1, 4);  // gradient norm over the shards
    }
    v.dp.add(CommOp::ALL_REDUCE, 1, 4);  // the step's loss
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
