// The Trainer's weights as files: any parameter-sized buffer of a rank written as the model's
// global tensors (the TP slices, the experts of the EP group and every pipeline stage's tensors
// gathered to the writing rank), and the final weights at the end of a run.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>

#include <spdlog/spdlog.h>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/comm/process_groups.h"
#include "trainer/train/generate.h"
#include "trainer/train/trainer.h"

namespace tetra {

void Trainer::dump_tensors(const std::string& file, const float* buffer, double scale) {
  // A tensor this rank holds whole is read straight from the buffer (host memory, scale 1) or
  // through one host copy of that tensor (a GPU's, or scaled).
  std::vector<float> host;
  write_global_tensors(
      file,
      [&](size_t i) -> const float* {
        const ParamSpec& p = layout_.params[i];
        if (be_->host_memory() && scale == 1.0) return buffer + p.offset;
        host.resize(static_cast<size_t>(p.numel));
        be_->copy_to_host(host.data(), buffer + p.offset, host.size() * 4);
        if (scale != 1.0)
          for (float& x : host) x = static_cast<float>(x * scale);
        return host.data();
      },
      /*collective=*/false);
}

void Trainer::write_global_tensors(const std::string& file, const std::function<const float*(size_t)>& local,
                                   bool collective) {
  // Memory: one global tensor at a time. A tensor this rank holds whole is written from `local`;
  // TP / EP-split ones are assembled into one tensor's storage; the file is written a tensor at a
  // time (SafetensorsWriter), later pipeline stages' tensors received one by one.
  //
  // Dense tensors: their TP slices over the TP group of the first DP replica. Expert tensors:
  // their ETP slices and the EP group's experts, of the first expert-DP replica (folded experts'
  // groups span TP and DP ranks, rank_grid.h). The CP ranks past the first hold the same weights.
  // Without a collective source, the ranks of neither replica take no part.
  const GridCoord& c = groups_.coord;
  const bool dense_part = c.dp == 0 && c.cp == 0, expert_part = c.edp == 0 && c.cp == 0;
  if (!collective && !dense_part && !expert_part) return;
  Communicator& tp = *groups_.tp;
  Communicator& etp = cfg_.parallel.expert_tp() < cfg_.parallel.tp ? *groups_.etp : tp;
  Communicator& ep = *groups_.ep;
  Communicator& pp = *groups_.pp;
  const int p = tp.size(), q = ep.size();
  // Every (EP rank, TP rank)'s layout: where its slices sit.
  std::vector<std::vector<ParamLayout>> layouts(q);
  for (int e = 0; e < q; ++e)
    for (int t = 0; t < p; ++t)
      layouts[e].push_back(e == c.ep && t == tp.rank() ? layout_ : rank_layout(cfg_, t, c.pp, e));
  auto numel_of = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  // The stage's writer: TP rank 0 of the first replica (also ETP, EP and expert-DP rank 0); the
  // first stage's is the file's.
  const bool writes = dense_part && tp.rank() == 0;
  std::unique_ptr<SafetensorsWriter> out;
  if (writes && pp.rank() == 0 && writer_) {
    std::vector<SafetensorsWriter::TensorEntry> entries;
    for (int s = 0; s < pp.size(); ++s)
      for (const ParamSpec& spec : (s == pp.rank() ? layout_ : rank_layout(cfg_, 0, s)).params)
        if (!spec.stage_copy) entries.push_back({spec.name, DType::F32, spec.global_shape});
    out = std::make_unique<SafetensorsWriter>(file, entries);
  }
  std::vector<float> assembled, slices;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const ParamSpec& spec = layout_.params[i];
    if (!collective && !(spec.expert ? expert_part : dense_part)) continue;
    const float* mine = local(i);  // (a collective source: every rank, every parameter)
    if (spec.stage_copy) continue;  // the first stage's original is written
    if (!(spec.expert ? expert_part : dense_part)) continue;
    const int64_t global = numel_of(spec.global_shape);
    const float* whole = mine;  // a tensor this rank holds whole
    // Slices held by other ranks: TP (experts: ETP) slices, then experts over the EP group (EP
    // rank e's slices at [e p, (e+1) p) when both).
    Communicator& slices_of = spec.expert ? etp : tp;
    const int tparts = spec.tp_split ? slices_of.size() : 1, eparts = spec.ep_split ? q : 1;
    if (tparts > 1 || eparts > 1) {
      slices.resize(static_cast<size_t>(spec.numel) * tparts * eparts);
      if (tparts > 1)
        slices_of.all_gather(slices.data(), mine, spec.numel, DType::F32);
      else
        std::memcpy(slices.data(), mine, static_cast<size_t>(spec.numel) * 4);
      if (eparts > 1) {
        std::vector<float> part(slices.begin(), slices.begin() + spec.numel * tparts);
        ep.all_gather(slices.data(), part.data(), spec.numel * tparts, DType::F32);
      }
      if (!writes) continue;
      assembled.assign(static_cast<size_t>(global), 0.0f);
      for (int e = 0; e < eparts; ++e)
        for (int t = 0; t < tparts; ++t) {
          // (an expert's ETP rank t: the layout of TP rank t, whose ETP rank is t)
          const ParamSpec& qs =
              layouts[spec.ep_split ? e : c.ep][spec.tp_split ? t : (spec.expert ? c.etp : tp.rank())].params[i];
          const float* src = slices.data() + static_cast<size_t>(e * tparts + t) * spec.numel;
          for (int64_t k = 0; k < qs.held(); ++k) assembled[static_cast<size_t>(qs.global_index(k))] = src[k];
        }
      whole = assembled.data();
    }
    if (!writes) continue;
    if (out)
      out->append(whole);
    else if (pp.rank() > 0)  // a later stage's writer: to the first stage's, tensor by tensor
      pp.send(whole, global, DType::F32, 0);
  }
  if (out) {
    for (int s = 1; s < pp.size(); ++s)
      for (const ParamSpec& spec : rank_layout(cfg_, 0, s).params) {
        if (spec.stage_copy) continue;
        assembled.resize(static_cast<size_t>(numel_of(spec.global_shape)));
        pp.recv(assembled.data(), static_cast<int64_t>(assembled.size()), DType::F32, s);
        out->append(assembled.data());
      }
    out->finish();
  }
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
  if (master_) {
    // Global rank 0 writes, gathering the TP slices of its TP group (and the experts of its EP
    // group); the other (expert-)DP replicas hold the same weights and take no part.
    dump_tensors(path, master_);
  } else {
    // The optimizer's shards only (bf16 / fp16 with the distributed optimizer, or ZeRO-3): bucket by
    // bucket, every DP (expert-DP) rank all-gathers the bucket's fp32 master weights from the
    // shards, and its tensors go to the writers as the whole buffer's would. The buffer: the largest
    // bucket (ZeRO-3: the largest parameter group), not the whole weights.
    const float* shard = updater_->master_shard();
    int64_t largest = 0;
    for (size_t b = 0; b < grad_buffer_->buckets(); ++b) {
      const auto [lo, hi] = grad_buffer_->bucket_range(b);
      largest = std::max(largest, hi - lo);
    }
    BackendBuffer bucket(*be_, static_cast<size_t>(std::max<int64_t>(largest, 1)) * 4);
    std::vector<float> host;
    size_t current = 0;
    bool gathered = false;
    write_global_tensors(
        path,
        [&](size_t i) -> const float* {
          const ParamSpec& p = layout_.params[i];
          while (!gathered || p.offset >= grad_buffer_->bucket_range(current).second) {
            if (gathered) ++current;
            TETRA_CHECK(current < grad_buffer_->buckets(), "parameter {} beyond the last bucket", p.name);
            grad_buffer_->gather_bucket(current, shard, bucket.as<float>());
            gathered = true;
          }
          const float* at = bucket.as<float>() + (p.offset - grad_buffer_->bucket_range(current).first);
          if (be_->host_memory()) return at;
          host.resize(static_cast<size_t>(p.numel));
          be_->copy_to_host(host.data(), at, host.size() * 4);
          return host.data();
        },
        /*collective=*/true);
  }
  spdlog::info("final weights: {} ({} tensors, fp32 master weights) in {:.1f} s", path, layout_.params.size(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace tetra
