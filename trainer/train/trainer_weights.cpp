// The Trainer's weights as files: any parameter-sized buffer of a rank written as the model's
// global tensors (the TP slices, the experts of the EP group and every pipeline stage's tensors
// gathered to the writing rank), and the final weights at the end of a run.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include <spdlog/spdlog.h>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/comm/process_groups.h"
#include "trainer/train/generate.h"
#include "trainer/train/trainer.h"

namespace tetra {

void Trainer::dump_tensors(const std::string& file, const float* buffer, double scale) {
  // Memory: a tensor held whole by this rank is written straight from the buffer (host memory,
  // scale 1) or from one host copy of it (a GPU's, or scaled); only TP/EP-split tensors are
  // assembled, one at a time into storage kept until the write. The writing rank holds at most one
  // model-sized copy beyond the run's own buffers, not two.
  std::vector<float> host_copy;
  const float* host = buffer;
  if (!be_->host_memory() || scale != 1.0) {
    host_copy.resize(static_cast<size_t>(layout_.total));
    be_->copy_to_host(host_copy.data(), buffer, host_copy.size() * 4);
    if (scale != 1.0)
      for (float& x : host_copy) x = static_cast<float>(x * scale);
    host = host_copy.data();
  }
  // Dense tensors: their TP slices over the TP group of the first DP replica. Expert tensors:
  // their ETP slices and the EP group's experts, of the first expert-DP replica (folded experts'
  // groups span TP and DP ranks, rank_grid.h). Every rank may call this; those of neither replica
  // (and the CP ranks past the first, which hold the same weights) take no part.
  const GridCoord& c = groups_.coord;
  const bool dense_part = c.dp == 0 && c.cp == 0, expert_part = c.edp == 0 && c.cp == 0;
  if (!dense_part && !expert_part) return;
  Communicator& tp = *groups_.tp;
  Communicator& etp = cfg_.parallel.expert_tp() < cfg_.parallel.tp ? *groups_.etp : tp;
  Communicator& ep = *groups_.ep;
  const int p = tp.size(), q = ep.size();
  // Every (EP rank, TP rank)'s layout: where its slices sit.
  std::vector<std::vector<ParamLayout>> layouts(q);
  for (int e = 0; e < q; ++e)
    for (int t = 0; t < p; ++t)
      layouts[e].push_back(e == groups_.coord.ep && t == tp.rank() ? layout_ : rank_layout(cfg_, t, groups_.coord.pp, e));
  std::deque<std::vector<float>> assembled;  // storage of the tensors put together here
  std::vector<TensorView> views;
  auto numel_of = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  // The stage's writer: TP rank 0 of the first replica (also ETP, EP and expert-DP rank 0).
  const bool writes = dense_part && tp.rank() == 0;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const ParamSpec& spec = layout_.params[i];
    if (spec.stage_copy) continue;  // the first stage's original is written
    if (!(spec.expert ? expert_part : dense_part)) continue;
    Communicator& slices_of = spec.expert ? etp : tp;
    const int64_t global = numel_of(spec.global_shape);
    const float* whole = host + spec.offset;  // a tensor this rank holds whole
    // Slices held by other ranks: TP slices over the TP group, then experts over the EP group
    // (EP rank e's TP slices at [e p, (e+1) p) when both).
    const int tparts = spec.tp_split ? slices_of.size() : 1, eparts = spec.ep_split ? q : 1;
    if (tparts > 1 || eparts > 1) {
      std::vector<float> slices(static_cast<size_t>(spec.numel) * tparts * eparts);
      if (tparts > 1)
        slices_of.all_gather(slices.data(), host + spec.offset, spec.numel, DType::F32);
      else
        std::memcpy(slices.data(), host + spec.offset, static_cast<size_t>(spec.numel) * 4);
      if (eparts > 1) {
        std::vector<float> mine(slices.begin(), slices.begin() + spec.numel * tparts);
        ep.all_gather(slices.data(), mine.data(), spec.numel * tparts, DType::F32);
      }
      if (!writes) continue;
      std::vector<float>& out = assembled.emplace_back(static_cast<size_t>(global));
      for (int e = 0; e < eparts; ++e)
        for (int t = 0; t < tparts; ++t) {
          // (an expert's ETP rank t: the layout of TP rank t, whose ETP rank is t)
          const ParamSpec& qs =
              layouts[spec.ep_split ? e : c.ep][spec.tp_split ? t : (spec.expert ? c.etp : tp.rank())].params[i];
          const float* src = slices.data() + static_cast<size_t>(e * tparts + t) * spec.numel;
          for (int64_t k = 0; k < qs.held(); ++k) out[static_cast<size_t>(qs.global_index(k))] = src[k];
        }
      whole = out.data();
    }
    if (writes) views.push_back(TensorView{spec.name, DType::F32, spec.global_shape, whole});
  }
  // Pipeline: TP rank 0 of every later stage sends its stage's tensors to the first stage.
  Communicator& pp = *groups_.pp;
  if (pp.size() > 1 && writes) {
    if (pp.rank() > 0) {
      for (const TensorView& v : views) pp.send(v.data, numel_of(v.shape), DType::F32, 0);
    } else {
      for (int s = 1; s < pp.size(); ++s)
        for (const ParamSpec& spec : rank_layout(cfg_, 0, s).params) {
          if (spec.stage_copy) continue;
          const int64_t global = numel_of(spec.global_shape);
          std::vector<float>& out = assembled.emplace_back(static_cast<size_t>(global));
          pp.recv(out.data(), global, DType::F32, s);
          views.push_back(TensorView{spec.name, DType::F32, spec.global_shape, out.data()});
        }
    }
  }
  if (writer_) write_safetensors(file, views);
}


void Trainer::initial_shard_weights(const Config& cfg) {
  float* shard = updater_->master_shard();
  const size_t es = dtype_size(act_);
  constexpr int64_t kPiece = int64_t{1} << 24;  // elements generated on the host at a time (64 MiB)
  std::vector<float> host;
  int64_t at = 0;
  for (const GradRange& o : grad_buffer_->owned()) {
    for (int64_t done = 0; done < o.numel; done += kPiece) {
      const int64_t len = std::min(kPiece, o.numel - done);
      if (be_->host_memory()) {
        init_params_range(layout_, cfg.model, cfg.training.seed, o.offset + done, len, shard + at + done);
      } else {
        host.resize(static_cast<size_t>(len));
        init_params_range(layout_, cfg.model, cfg.training.seed, o.offset + done, len, host.data());
        be_->copy_from_host(shard + at + done, host.data(), static_cast<size_t>(len) * 4);
      }
    }
    if (compute_)  // ZeRO-3: the compact shard; else the whole buffer's owned range
      be_->cast(static_cast<char*>(compute_) + static_cast<size_t>(zero3_ ? at : o.offset) * es, act_, shard + at,
                DType::F32, o.numel);
    at += o.numel;
  }
  if (compute_ && !zero3_) grad_buffer_->gather_params(compute_, act_);
  if (dump_) {
    BackendBuffer whole(*be_, static_cast<size_t>(layout_.total) * 4);
    grad_buffer_->gather_compact(whole.get(), shard, DType::F32);
    dump_->initial_weights(whole.as<float>());
  }
}

void Trainer::save_final_weights() {
  const std::string path = final_weights_path(cfg_);
  if (path.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const float* weights = master_;
  BackendBuffer whole_buf;  // the gathered master weights, when no rank holds them whole
  float* whole = nullptr;
  if (!master_) {
    // bf16 / fp16 with the distributed optimizer: each DP rank's optimizer holds the fp32 master weights
    // of its shards, back to back; every DP rank takes part in gathering them.
    whole_buf = BackendBuffer(*be_, static_cast<size_t>(layout_.total) * 4);
    whole = whole_buf.as<float>();
    grad_buffer_->gather_compact(whole, updater_->master_shard(), DType::F32);
    weights = whole;
  }
  // Global rank 0 writes, gathering the TP slices of its TP group (and the experts of its EP
  // group); the other (expert-)DP replicas hold the same weights and need not gather theirs.
  dump_tensors(path, weights);
  spdlog::info("final weights: {} ({} tensors, fp32 master weights) in {:.1f} s", path, layout_.params.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace tetra
