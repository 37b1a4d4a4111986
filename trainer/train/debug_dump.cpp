#include "trainer/train/debug_dump.h"

#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/checkpoint/safetensors.h"

namespace tetra {

namespace {
constexpr int64_t kMaxDumpedSteps = 100;
}  // namespace

DebugDump::DebugDump(const Config& cfg, std::string dir, bool writer, WriteTensors write)
    : cfg_(cfg), dir_(std::move(dir)), writer_(writer), write_(std::move(write)) {
  if (writer_) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    TETRA_INPUT_CHECK(!ec, "--dump-dir: cannot create {}: {}", dir_, ec.message());
  }
}

void DebugDump::initial_weights(const float* master) { write_(dir_ + "/params_init.safetensors", master, 1.0); }

void DebugDump::add_batch(int64_t s, const std::vector<int32_t>& batch) {
  if (s < kMaxDumpedSteps && cfg_.parallel.dp == 1) batches_.insert(batches_.end(), batch.begin(), batch.end());
}

void DebugDump::gradients(Backend& be, GradBuffers& grad_buffers, const float* grads, int64_t total,
                          double loss_scale) {
  const std::string file = dir_ + "/grads_step0.safetensors";
  if (grad_buffers.sharded()) {  // each DP rank holds its shards of the reduced gradient: gather them
    BackendBuffer whole_buf(be, static_cast<size_t>(total) * 4);
    float* whole = whole_buf.as<float>();
    if (grad_buffers.shards_gradients()) {  // ZeRO-2: `grads` is the compact shard, the owned ranges back to back
      be.memset_zero(whole, static_cast<size_t>(total) * 4);
      grad_buffers.gather_compact(whole, grads, DType::F32);
    } else {
      be.copy(whole, grads, static_cast<size_t>(total) * 4);
      grad_buffers.gather_params(whole, DType::F32);
    }
    write_(file, whole, 1.0 / loss_scale);
  } else {
    write_(file, grads, 1.0 / loss_scale);
  }
}

void DebugDump::batches(int64_t start_step) {
  if (!writer_ || cfg_.parallel.dp != 1) return;
  // The steps run here (from start_step; a stop may end the run before training.steps).
  const TrainingConfig& tc = cfg_.training;
  std::vector<TensorRecord> records;
  const size_t per_step = static_cast<size_t>(tc.global_batch_size * (cfg_.model.seq_len + 1));
  const int64_t dumped = static_cast<int64_t>(batches_.size() / per_step);
  for (int64_t s = 0; s < dumped; ++s) {
    TensorRecord r;
    r.name = fmt::format("step_{}", start_step + s);
    r.dtype = DType::I32;
    r.shape = {tc.global_batch_size, cfg_.model.seq_len + 1};
    r.data.resize(per_step * 4);
    std::memcpy(r.data.data(), batches_.data() + s * per_step, per_step * 4);
    records.push_back(std::move(r));
  }
  write_safetensors(dir_ + "/batches.safetensors", records);
}

}  // namespace tetra
