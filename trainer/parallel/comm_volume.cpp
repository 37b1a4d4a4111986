#include "trainer/parallel/comm_volume.h"

#include <algorithm>

#include <fmt/format.h>

#include "trainer/params/recompute.h"
#include "trainer/optim/compression.h"
#include "trainer/optim/grad_buffer.h"
#include "trainer/optim/grad_buffers.h"
#include "trainer/optim/compressed_exchange.h"
#include "trainer/optim/weight_units.h"
#include "trainer/parallel/pipeline_schedule.h"

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

std::vector<std::vector<int>> zero3_step_phases(const Config& cfg, const ParamLayout& layout) {
  const ParallelConfig& par = cfg.parallel;
  const PipelineSchedule& schedule = PipelineSchedule::build(par.schedule, static_cast<int>(par.pp),
                                                            static_cast<int>(par.virtual_stages),
                                                            static_cast<int>(cfg.grad_accum_steps()));
  const Recomputation rc = Recomputation::from(cfg.training);
  std::vector<int> head{layout.head_group};  // Gpt::head_groups()
  if (layout.output_weight() == layout.wte && layout.embedding_group >= 0 && layout.embedding_group != layout.head_group)
    head.push_back(layout.embedding_group);
  // This rank's pipeline rank: the one whose stages (chunk c of rank r is stage c pp + r) are the
  // layout's chunks, and which is first / last as the layout is.
  const std::vector<int64_t> stage_layers = cfg.pipeline_stage_layers();
  std::vector<int64_t> start(stage_layers.size() + 1, 0);
  for (size_t s = 0; s < stage_layers.size(); ++s) start[s + 1] = start[s] + stage_layers[s];
  size_t pp_rank = 0;
  for (; pp_rank < static_cast<size_t>(par.pp); ++pp_rank) {
    bool same = layout.stage.first == (pp_rank == 0) && layout.stage.last == (pp_rank + 1 == static_cast<size_t>(par.pp));
    for (size_t c = 0; same && c < layout.stage.chunks.size(); ++c) {
      const size_t s = c * static_cast<size_t>(par.pp) + pp_rank;
      same = s + 1 < start.size() && layout.stage.chunks[c] == std::make_pair(start[s], start[s + 1]);
    }
    if (same) break;
  }
  TETRA_CHECK(pp_rank < static_cast<size_t>(par.pp), "the layout's chunks are no pipeline rank's");
  std::vector<std::vector<int>> phases;
  for (const PipeAction& a : schedule.ranks[pp_rank]) {
    const auto& [begin, end] = layout.stage.chunks[static_cast<size_t>(a.chunk)];
    const bool chunk_first = layout.stage.first && a.chunk == 0;
    const bool chunk_last = layout.stage.last && a.chunk + 1 == static_cast<int>(layout.stage.chunks.size());
    const std::vector<bool> moe(static_cast<size_t>(end - begin), false);
    const RecomputeUnits units = plan_recompute_units(rc, end - begin, moe);
    const auto block = [&](int64_t l) {  // Gpt::block_groups()
      const BlockParams& p = layout.blocks[static_cast<size_t>(begin + l)];
      std::vector<int> g{layout.layer_group[static_cast<size_t>(begin + l)]};
      if (p.moe && p.expert_group >= 0) g.push_back(p.expert_group);
      return g;
    };
    if (a.forward) {  // Gpt::forward: the embedding, each block, the head
      if (chunk_first) phases.push_back({layout.embedding_group});
      for (int64_t l = 0; l < end - begin; ++l) phases.push_back(block(l));
      if (chunk_last) phases.push_back(head);
    } else {  // Gpt::backward: the head, then each block (a recomputed unit's forwards first)
      if (chunk_last) phases.push_back(head);
      for (int64_t l = end - begin - 1; l >= 0; --l) {
        if (units.ends_unit(l)) {
          const auto& [ub, ue] = units.units[static_cast<size_t>(units.unit_of[static_cast<size_t>(l)])];
          for (int64_t j = ub; j < ue; ++j) phases.push_back(block(j));
        }
        phases.push_back(block(l));
      }
    }
  }
  return phases;
}

StepVolume predict_step_volume(const Config& cfg, const ParamLayout& layout, bool onebit_compressed,
                               bool onebit_gather_variance) {
  StepVolume v;
  const ParallelConfig& par = cfg.parallel;
  const int64_t act_bytes = static_cast<int64_t>(dtype_size(precision_dtype(cfg.training.precision)));
  const int64_t N = cfg.training.micro_batch_size * cfg.model.seq_len / par.cp, C = cfg.model.hidden_size;
  const int64_t accum = cfg.grad_accum_steps();
  const int64_t rows = N * C * act_bytes;
  const bool first = layout.stage.first, last = layout.stage.last;
  // Folded experts (rank_grid.h): this rank's share of the TP group's rows.
  const bool folded = cfg.model.moe.enabled() && par.expert_shares() > 1;
  const int64_t coord_share = layout.slicing.tp_rank / par.expert_tp();
  // ZeRO-2 (grad_buffer.h): every bucket is reduced once per micro-batch, but a bucket holding a
  // group deferred to the end of the step (tied embeddings summed across pipeline stages first:
  // the first stage's embedding, the last stage's output layer) once per step.
  const bool zero2 = par.zero_stage >= 2 && par.dp_cp() > 1;
  const bool deferring = zero2 && cfg.model.tie_embeddings && par.pp > 1;
  auto reductions_of = [&](const BucketPlan& b, const ParamLayout& part) -> int64_t {
    if (!zero2) return 1;
    if (deferring && part.dense_groups > 0)
      for (int g = b.first_group; g <= b.last_group; ++g)
        if ((first && g == layout.embedding_group) || (last && g == layout.head_group)) return 1;
    return accum;
  };
  int64_t L = 0;  // layers this rank holds
  int64_t moe_blocks = 0;  // MoE blocks among them
  // Block forwards that full recomputation runs again in backward (recompute.h): each repeats its
  // f and g exchanges, two in a dense block, one (the attention's) in a MoE block.
  int64_t recomputed_exchanges = 0;
  int64_t attention_forwards = 0;  // per micro-batch, over this rank's layers
  const Recomputation rc = Recomputation::from(cfg.training);
  for (const auto& [begin, end] : layout.stage.chunks) {
    L += end - begin;
    std::vector<bool> moe;
    for (int64_t l = begin; l < end; ++l) {
      moe.push_back(cfg.model.moe.enabled() && cfg.model.moe.is_moe_layer(l));
      moe_blocks += moe.back() ? 1 : 0;
    }
    const RecomputeUnits units = plan_recompute_units(rc, end - begin, moe);
    for (int64_t l = 0; l < end - begin; ++l) {
      if (units.full(l)) recomputed_exchanges += moe[static_cast<size_t>(l)] ? 1 : 2;
      // The attention forwards: the forward's, and again in backward under full recomputation
      // (the unit's forward) or selective core_attn.
      attention_forwards += 1 + (units.full(l) || rc.core_attn ? 1 : 0);
    }
  }
  if (par.cp > 1) {
    // Context parallelism (context_parallel.h), per micro-batch and layer: p2p passes the local
    // K/V block (B, Tl, 2 NKV HS) cp - 1 hops in each attention forward and in the backward, and
    // the fp32 gradient of a block cp hops in the backward; all_gather gathers the blocks in each
    // forward and in the backward and reduce-scatters the fp32 gradients.
    const int64_t kv = N * 2 * (cfg.model.num_kv_heads / par.tp) * cfg.model.head_size();
    if (par.cp_comm == CpComm::P2P) {
      const int64_t hops = (attention_forwards + L) * (par.cp - 1) * accum, grads = L * par.cp * accum;
      for (CommOp op : {CommOp::SEND, CommOp::RECV}) {
        v.cp.add(op, hops, kv * act_bytes);
        v.cp.add(op, grads, kv * 4);
      }
    } else {
      v.cp.add(CommOp::ALL_GATHER, (attention_forwards + L) * accum, par.cp * kv * act_bytes);
      v.cp.add(CommOp::REDUCE_SCATTER, L * accum, par.cp * kv * 4);
    }
    // MoE blocks: the sequence's routing statistics (E counts, E probability sums) per forward, and
    // with a capacity factor the assignments of each of the B sequences' 2 cp chunks to each expert.
    if (moe_blocks > 0) v.cp.add(CommOp::ALL_REDUCE, 2 * moe_blocks * accum, cfg.model.moe.num_experts * 4);
    if (moe_blocks > 0 && cfg.model.moe.capacity_factor)
      v.cp.add(CommOp::ALL_REDUCE, moe_blocks * accum,
               cfg.training.micro_batch_size * 2 * par.cp * cfg.model.moe.num_experts * 4);
  }

  if (par.tp > 1) {
    // (N, C) exchanges per micro-batch: forward after the embedding and each row-parallel layer,
    // backward for each column-parallel input (the output layer's included); with sequence
    // parallelism also the gathers before each column-parallel layer (the output layer's
    // included), before each row-parallel backward (the embedding's included) and of each norm
    // output again in backward (kept on its shard; not the final norm's under the fused loss, whose
    // weight gradient is done in the forward); and the recomputed forwards' own.
    const int64_t fwd = 2 * L + (first ? 1 : 0) + recomputed_exchanges, bwd = 2 * L + (last ? 1 : 0);
    if (!par.sequence_parallel) {
      v.tp.add(CommOp::ALL_REDUCE, (fwd + bwd) * accum, rows);
    } else {
      // MoE blocks on their local rows (whole folded experts: moe_local_rows, config.h) skip the
      // MLP's exchanges: its reduce-scatter forward and backward, its gather forward, and backward
      // the gather of the output gradient and the norm output's again.
      const int64_t local = moe_local_rows(cfg.model, par.tp, par.expert_tp(), true) ? moe_blocks : 0;
      v.tp.add(CommOp::REDUCE_SCATTER, (fwd + bwd - 2 * local) * accum, rows);
      const bool fused_loss = cfg.training.loss_chunk_rows > 0;
      const int64_t gathers = (2 * L + (last ? 1 : 0) + recomputed_exchanges) + (2 * L + (first ? 1 : 0)) +
                              (2 * L + (last && !fused_loss ? 1 : 0)) - 3 * local;
      v.tp.add(CommOp::ALL_GATHER, gathers * accum, rows);
    }
    // Gradients that are partial sums per TP rank (norms under sequence parallelism, q/k norms),
    // once per step per group that has any (ZeRO-2: once per reduction of its bucket).
    std::vector<int64_t> per_group(layout.groups.size(), 0);
    for (const ParamSpec& p : layout.params)
      if (p.sp_partial) per_group[p.group] += p.numel;
    std::vector<int64_t> times(layout.groups.size(), 1);
    if (zero2) {
      const ParamLayout dense = layout_part(layout, false);
      for (const BucketPlan& b : plan_buckets(dense, par.gradient_bucket_size()))
        for (int g = b.first_group; g <= b.last_group; ++g) times[static_cast<size_t>(g)] = reductions_of(b, dense);
    }
    for (size_t g = 0; g < per_group.size(); ++g)
      if (per_group[g] > 0) v.tp.add(CommOp::ALL_REDUCE, times[g], per_group[g] * 4);
    if (cfg.model.moe.enabled() && !folded)  // the gates' gradient (partial sums over the experts' TP slices)
      v.tp.add(CommOp::ALL_REDUCE, moe_blocks * accum, N * cfg.model.moe.top_k * 4);
    if (cfg.model.moe.enabled() && cfg.model.moe.shared_expert_gate)  // the shared expert gate's logits' gradient
      v.tp.add(CommOp::ALL_REDUCE, moe_blocks * accum, N * 4);
    if (last) {  // per chunk of the fused loss (training.loss_chunk_rows; 0: one of every row)
      const int64_t chunk = cfg.training.loss_chunk_rows > 0 ? std::min(cfg.training.loss_chunk_rows, N) : N;
      const int64_t full = N / chunk, rest = N % chunk;
      v.tp.add(CommOp::ALL_REDUCE, accum * full, chunk * 4);      // loss: row maxima
      v.tp.add(CommOp::ALL_REDUCE, accum * full, 2 * chunk * 4);  // loss: sum of exponentials, target logits
      if (rest > 0) {
        v.tp.add(CommOp::ALL_REDUCE, accum, rest * 4);
        v.tp.add(CommOp::ALL_REDUCE, accum, 2 * rest * 4);
      }
    }
    v.tp.add(CommOp::ALL_REDUCE, 1, 4);              // gradient norm
    if (moe_blocks > 0 && !folded) v.tp.add(CommOp::ALL_REDUCE, 1, 4);  // and its expert part
  }
  if (folded && moe_blocks > 0) {
    // The share's rows: the g-th ceil(N / shares) (moe.h).
    const int64_t S = par.expert_shares(), share_rows = (N + S - 1) / S;
    const int64_t share = coord_share, rows_here = std::max<int64_t>(0, std::min(N, (share + 1) * share_rows) - share * share_rows);
    if (par.expert_tp() > 1) {
      v.etp.add(CommOp::ALL_REDUCE, moe_blocks * accum, rows_here * cfg.model.moe.top_k * 4);  // the gates' gradient
      v.etp.add(CommOp::ALL_REDUCE, 1, 4);  // the experts' gradient norm
    }
    v.eshare.add(CommOp::ALL_REDUCE, 2 * moe_blocks * accum, cfg.model.moe.num_experts * 4);
    if (cfg.model.moe.capacity_factor)
      v.eshare.add(CommOp::ALL_REDUCE, moe_blocks * accum, S * cfg.model.moe.num_experts * 4);
  }
  if (par.pp > 1) {
    const int64_t boundary = (par.sequence_parallel && par.tp > 1 ? N / par.tp : N) * C * act_bytes;
    const int64_t chunks = static_cast<int64_t>(layout.stage.chunks.size());
    // Chunk c of this rank is stage c pp + r: every chunk but the model's last sends forward, and
    // every chunk but the model's first sends its input gradient back; receives mirror them.
    const int64_t sends_fwd = chunks - (last ? 1 : 0), sends_bwd = chunks - (first ? 1 : 0);
    v.pp.add(CommOp::SEND, (sends_fwd + sends_bwd) * accum, boundary);
    v.pp.add(CommOp::RECV, (sends_fwd + sends_bwd) * accum, boundary);
    v.pp.add(CommOp::ALL_REDUCE, 1, 4);  // the loss (from the last stage)
    v.pp.add(CommOp::ALL_REDUCE, 1, 8);  // the gradient norm's dense and expert sums of squares
    if (cfg.model.tie_embeddings && (first || last)) {
      const ParamSpec* wte = layout.find("embedding.wte");
      if (wte) v.embedding.add(CommOp::ALL_REDUCE, 1, wte->numel * 4);
    }
  }
  // The reduction of a part of the gradient buffer over a group of `size` ranks; `bf16`: its
  // buckets reduce in bf16 (the dense part); 1-bit Adam's compressed steps and int8 exchange both parts.
  auto reduction = [&](GroupVolume& g, const ParamLayout& part, int64_t size, GroupVolume& norm_group, bool bf16) {
    if (size <= 1 || part.groups.empty()) return;
    const std::vector<BucketPlan> plan = plan_buckets(part, par.gradient_bucket_size());
    const int64_t buckets = static_cast<int64_t>(plan.size());
    const int64_t numel = part.groups.back().second - part.groups.front().first;
    int64_t reduce_calls = 0, reduce_numel = 0;  // ZeRO-2 reduces buckets per micro-batch
    for (const BucketPlan& b : plan) {
      reduce_calls += reductions_of(b, part);
      reduce_numel += reductions_of(b, part) * (b.end - b.begin);
    }
    const CommOp reduce = par.distributed_optimizer ? CommOp::REDUCE_SCATTER : CommOp::ALL_REDUCE;
    if (onebit_compressed || par.grad_compression == GradCompression::INT8) {
      const ExchangePlan plan = plan_exchange(cfg, part, size);
      const int64_t message_bytes = size * plan.chunks.words * 2;
      g.add(CommOp::ALL_TO_ALL, 1, message_bytes);
      if (!par.distributed_optimizer)
        g.add(CommOp::ALL_GATHER, 1, message_bytes);
      else if (plan.tied_offset >= 0)  // the tied piece's server stage
        g.add(CommOp::ALL_GATHER, 1, size * plan.tied_words * 2);
      if (plan.exact_numel > 0) g.add(CommOp::ALL_REDUCE, 1, plan.exact_numel * 4);  // TP replicas, exact
      if (onebit_gather_variance) {  // GradBuffer::gather_params of the fp32 variance
        g.add(CommOp::ALL_GATHER, buckets, 0);
        g.payload_bytes[static_cast<int>(CommOp::ALL_GATHER)] += numel * 4;
      }
    } else {
      g.add(reduce, reduce_calls, 0);
      g.payload_bytes[static_cast<int>(reduce)] += reduce_numel * (bf16 ? 2 : 4);
    }
    if (par.distributed_optimizer) {
      if (par.zero_stage < 3) {  // the updated weights (ZeRO-3 gathers them per unit instead)
        g.add(CommOp::ALL_GATHER, buckets, 0);
        g.payload_bytes[static_cast<int>(CommOp::ALL_GATHER)] += numel * act_bytes;
      }
      norm_group.add(CommOp::ALL_REDUCE, 1, 4);  // gradient norm over the shards
    }
  };
  reduction(v.dp, layout_part(layout, false), par.dp_cp(), v.dp, par.grad_compression == GradCompression::BF16);
  if (par.zero_stage == 3 && par.dp_cp() > 1) {
    // ZeRO-3 (weight_units.h): one all-gather of a unit's weights per gather this rank's phases
    // take from empty buffers, prefetch included.
    const std::vector<std::vector<int>> phases = zero3_step_phases(cfg, layout);
    std::vector<int64_t> gathers(layout.groups.size(), 0);
    WeightUnits::count_gathers(phases, gathers, /*keep=*/!par.reshards_after_forward());
    const int64_t edp = par.edp_cp();  // a MoE model's experts gather over expert-DP (none at 1)
    for (size_t g = 0; g < gathers.size(); ++g) {
      const bool expert = static_cast<int>(g) >= layout.dense_groups;
      if (gathers[g] > 0 && (!expert || edp > 1))
        (expert ? v.edp : v.dp)
            .add(CommOp::ALL_GATHER, gathers[g], (layout.groups[g].second - layout.groups[g].first) * act_bytes);
    }
  }
  if (par.dp_cp() > 1) v.dp.add(CommOp::ALL_REDUCE, 1, 4);  // the step's loss
  const MoeConfig& moe = cfg.model.moe;
  if (moe.enabled()) {
    // (the sharded experts' norm: over dp unfolded, where dp x cp holds ep x edp; folded, over edp)
    reduction(v.edp, layout_part(layout, true), par.edp_cp(), folded ? v.edp : v.dp, false);
    if (par.ep > 1) {
      // the counts, then each exchange (dispatch, combine, their gradients) in its chunks
      v.ep.add(CommOp::ALL_TO_ALL, (1 + 4 * par.ep_overlap_chunks) * moe_blocks * accum, 0);
      const bool sharded = par.distributed_optimizer && par.edp_cp() > 1;
      // the experts' gradient norm (folded: over ep always; its sharded part over edp, above)
      if ((!sharded || folded) && moe_blocks > 0) v.ep.add(CommOp::ALL_REDUCE, 1, 4);
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
