// The Trainer's weights as files: any parameter-sized buffer of a rank written as the model's
// global tensors (the TP slices, the experts of the EP group and every pipeline stage's tensors
// gathered to the writing rank), and the final weights at the end of a run.
#include <chrono>
#include <cstring>

#include <spdlog/spdlog.h>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/dist/process_groups.h"
#include "trainer/train/generate.h"
#include "trainer/train/trainer.h"

namespace tetra {

void Trainer::dump_tensors(const std::string& file, const float* buffer, double scale) {
  std::vector<float> host(static_cast<size_t>(layout_.total));
  be_->copy_to_host(host.data(), buffer, host.size() * 4);
  if (scale != 1.0)
    for (float& x : host) x = static_cast<float>(x * scale);
  Communicator& tp = *groups_.tp;
  Communicator& ep = *groups_.ep;
  const int p = tp.size(), q = ep.size();
  // Every (EP rank, TP rank)'s layout: where its slices sit.
  std::vector<std::vector<ParamLayout>> layouts(q);
  for (int e = 0; e < q; ++e)
    for (int t = 0; t < p; ++t)
      layouts[e].push_back(e == groups_.coord.ep && t == tp.rank() ? layout_ : rank_layout(cfg_, t, groups_.coord.pp, e));
  std::vector<TensorRecord> records;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const ParamSpec& spec = layout_.params[i];
    if (spec.stage_copy) continue;  // the first stage's original is written
    int64_t global = 1;
    for (int64_t d : spec.global_shape) global *= d;
    // Slices held by other ranks: TP slices over the TP group, then experts over the EP group
    // (EP rank e's TP slices at [e p, (e+1) p) when both).
    const int tparts = spec.tp_split ? p : 1, eparts = spec.ep_split ? q : 1;
    std::vector<float> slices(static_cast<size_t>(spec.numel) * tparts * eparts);
    if (tparts > 1)
      tp.all_gather(slices.data(), host.data() + spec.offset, spec.numel, DType::F32);
    else
      std::memcpy(slices.data(), host.data() + spec.offset, static_cast<size_t>(spec.numel) * 4);
    if (eparts > 1) {
      std::vector<float> mine(slices.begin(), slices.begin() + spec.numel * tparts);
      ep.all_gather(slices.data(), mine.data(), spec.numel * tparts, DType::F32);
    }
    if (tp.rank() != 0 || groups_.coord.ep != 0) continue;
    TensorRecord r;
    r.name = spec.name;
    r.dtype = DType::F32;
    r.shape = spec.global_shape;
    r.data.resize(static_cast<size_t>(global) * 4);
    float* out = reinterpret_cast<float*>(r.data.data());
    for (int e = 0; e < eparts; ++e)
      for (int t = 0; t < tparts; ++t) {
        const ParamSpec& qs = layouts[spec.ep_split ? e : groups_.coord.ep][spec.tp_split ? t : tp.rank()].params[i];
        const float* src = slices.data() + static_cast<size_t>(e * tparts + t) * spec.numel;
        for (int64_t k = 0; k < qs.numel; ++k) out[qs.global_index(k)] = src[k];
      }
    records.push_back(std::move(r));
  }
  // Pipeline: TP rank 0 of every later stage sends its stage's tensors to the first stage.
  Communicator& pp = *groups_.pp;
  if (pp.size() > 1 && tp.rank() == 0 && groups_.coord.ep == 0) {
    if (pp.rank() > 0) {
      for (const TensorRecord& r : records)
        pp.send(r.data.data(), static_cast<int64_t>(r.data.size() / 4), DType::F32, 0);
    } else {
      for (int s = 1; s < pp.size(); ++s)
        for (const ParamSpec& spec : rank_layout(cfg_, 0, s).params) {
          if (spec.stage_copy) continue;
          TensorRecord r;
          r.name = spec.name;
          r.dtype = DType::F32;
          r.shape = spec.global_shape;
          int64_t global = 1;
          for (int64_t d : spec.global_shape) global *= d;
          r.data.resize(static_cast<size_t>(global) * 4);
          pp.recv(r.data.data(), global, DType::F32, s);
          records.push_back(std::move(r));
        }
    }
  }
  if (writer_) write_safetensors(file, records);
}

void Trainer::save_final_weights() {
  const std::string path = final_weights_path(cfg_);
  if (path.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const float* weights = master_;
  float* whole = nullptr;
  if (!master_) {
    // bf16 / fp16 with the distributed optimizer: each DP rank's optimizer holds the fp32 master weights
    // of its shards, back to back; every DP rank takes part in gathering them.
    whole = static_cast<float*>(be_->alloc(static_cast<size_t>(layout_.total) * 4));
    const float* shard = optimizer_->master_shard();
    int64_t at = 0;
    for (const GradRange& o : grad_buffer_->owned()) {
      be_->copy(whole + o.offset, shard + at, static_cast<size_t>(o.numel) * 4);
      at += o.numel;
    }
    grad_buffer_->gather_params(whole, DType::F32);
    weights = whole;
  }
  // Global rank 0 writes, gathering the TP slices of its TP group (and the experts of its EP
  // group); the other (expert-)DP replicas hold the same weights and need not gather theirs.
  if (groups_.coord.edp == 0) dump_tensors(path, weights);
  if (whole) be_->free(whole);
  spdlog::info("final weights: {} ({} tensors, fp32 master weights) in {:.1f} s", path, layout_.params.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace tetra
