#include "trainer/model/gpt.h"

#include <algorithm>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/core/arena.h"
#include "trainer/comm/communicator.h"
#include "trainer/model/moe.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/parallel/vocab_parallel.h"

namespace tetra {

ModelDims ModelDims::from(const ModelConfig& m, int64_t micro_batch, int64_t tp, int64_t tp_rank,
                          bool sequence_parallel, int64_t cp) {
  ModelDims d{};
  d.B = micro_batch;
  d.cp = cp;
  d.T = m.seq_len / cp;
  d.C = m.hidden_size;
  d.HS = m.head_size();
  d.NH = m.num_heads / tp;
  d.NKV = m.num_kv_heads / tp;
  d.F = m.ffn_hidden_size / tp;
  d.FC = m.activation == Activation::SWIGLU ? 2 * d.F : d.F;
  d.Vl = m.padded_vocab_size(tp) / tp;
  d.V = m.vocab_rows(tp, tp_rank);
  d.Vg = m.vocab_size;
  d.L = m.num_layers;
  d.QKV = (d.NH + 2 * d.NKV) * d.HS;
  d.tp = tp;
  d.tp_rank = tp_rank;
  d.v0 = tp_rank * d.Vl;
  d.sp = sequence_parallel && tp > 1;
  d.Ns = d.sp ? d.N() / tp : d.N();
  return d;
}

// Pointers into the arena. `t` marks tensors of the activation type, `f` fp32 ones. Ns rows are
// this rank's part of the residual stream (all N rows without sequence parallelism). Norm outputs
// are kept on the rank's rows too: with sequence parallelism they are all-gathered into `lnfull`
// before each column-parallel GEMM, in forward and again in backward.
//
// Bytes kept per layer per micro-batch in flight (s = T, b = B, h = C, t = tp; 2-byte activations;
// a dense SwiGLU/GQA block with F = ffn / t, QKV = (NH + 2 NKV) HS / t; q = QKV / h, f = F / h):
//   none       res, res_mid, ln1, ln2: 4 x 2 s b h / t (sequence-parallel shards; 2 s b h each
//              without SP: res and res_mid are shards only with it), qkv 2 s b h q, att
//              2 s b h / t (NH HS = h), fc 2 s b h 2f (gelu: f), act 2 s b h f; plus fp32 lse
//              (4 b NH s / t) and norm statistics (4 x 4 s b / t)
//                Llama-3 70B (q = 1.25 / t, f = 3.5 / t):  33.5 s b h / t
//   selective  minus the listed modules' outputs: norm 2 x 2 s b h / t, act 2 s b h f,
//              core_attn 2 s b h / t and the lse
//   full       per unit its input, 2 s b h / t; the unit being recomputed is scratch
// MoE blocks keep res, res_mid, ln1, ln2, qkv, att and their routing and expert state (moe.h).
// Scratch beside the slots: the backward's gradients (dres, dc, dfull, datt, dqkv, dfc, dact),
// lnfull, one set of a selective recomputation's tensors, one unit's tensors for full.
struct Gpt::Acts {
  struct Layer {
    void* res_mid = nullptr;    // (Ns, C) t  residual after the attention branch
    void* ln1 = nullptr;        // (Ns, C) t  this rank's rows of norm1's output
    float* ln1_mean = nullptr;  // (Ns)    f
    float* ln1_rstd = nullptr;  // (Ns)    f
    void* qkv = nullptr;        // (N, QKV) t (after the q/k norm and RoPE)
    void* qk = nullptr;         // (N (NH + NKV), HS) t  q/k norm: q heads, then k heads, before it
    float* qk_rstd = nullptr;   // (N (NH + NKV))     f  their statistics
    void* att = nullptr;        // (N, NH HS) t
    float* lse = nullptr;       // (B, NH, T) f
    void* ln2 = nullptr;        // (Ns, C) t
    float* ln2_mean = nullptr;
    float* ln2_rstd = nullptr;
    void* fc = nullptr;         // (N, FC) t  (dense blocks)
    void* act = nullptr;        // (N, F)  t
  };
  // What one micro-batch keeps from its forward to its backward.
  struct Slot {
    std::vector<void*> res;   // L+1 of (Ns, C) t: res[0] the chunk's input (the embeddings on the
                              // first stage), res[l+1] output of block l; backward leaves the
                              // input's gradient in res[0]
    std::vector<Layer> layers;
    void* lnf = nullptr;      // (Ns, C) t     last stage only
    float* lnf_mean = nullptr;  // (Ns) f
    float* lnf_rstd = nullptr;
    void* logits = nullptr;   // (N, V) t; the loss turns it into dlogits in place (unfused loss)
    void* dlnf = nullptr;     // (N, C) t  the output layer's input gradient (fused loss)
  };
  std::vector<Slot> slots;
  // Recomputation scratch, shared by the slots: unit[i] the tensors of the i-th layer of the unit
  // being recomputed and unit_res[i] its output (full); `selective` the selective modules' outputs.
  std::vector<Layer> unit;
  std::vector<void*> unit_res;
  Layer selective;
  void* lnfull = nullptr;     // (N, C) t   a gathered norm output (sequence parallelism)
  void* lnf = nullptr;        // (Ns, C) t  the final norm's output (fused loss: not kept)
  void* logits = nullptr;     // (chunk, V) t  one chunk's logits (fused loss)
  float* ce_max;              // (N) f       vocab-parallel loss statistics (tp > 1)
  float* ce_sums;             // (2, N) f    [sum exp | target logit]
  ContextParallelBuffers cp;  // ring attention's (context parallelism)
  // Backward scratch.
  void* dres;                 // (Ns, C) t  gradient of the residual stream
  void* dc;                   // (Ns, C) t
  void* dfull;                // (N, C) t   partial products and gathered gradients (tp > 1)
  void* datt;                 // (N, NH HS) t  (== dc without sequence parallelism)
  void* dqkv;                 // (N, QKV) t
  void* qk_y;                 // (N (NH + NKV), HS) t  q/k norm: its output, then its output's gradient
  void* qk_dx;                // (N (NH + NKV), HS) t  q/k norm: its input's gradient
  void* dfc;                  // (N, FC) t
  void* dact;                 // (N, F) t
};

ChunkShape ChunkShape::of(const ParamLayout& layout, int chunk, int64_t slots) {
  const auto& chunks = layout.stage.chunks;
  TETRA_CHECK(chunk >= 0 && chunk < static_cast<int>(chunks.size()), "model chunk {} of a stage with {}", chunk,
              chunks.size());
  ChunkShape s;
  s.l0 = chunks[static_cast<size_t>(chunk)].first;
  s.layers = chunks[static_cast<size_t>(chunk)].second - s.l0;
  s.first = layout.stage.first && chunk == 0;
  s.last = layout.stage.last && chunk + 1 == static_cast<int>(chunks.size());
  s.slots = slots;
  return s;
}

namespace {

// What a chunk's arena is carved by: its dimensions, the recomputation and its units, and which
// of its layers are MoE blocks.
struct ArenaShape {
  const ModelDims& d;
  DType act;
  const Recomputation& rc;
  const RecomputeUnits& units;
  const std::vector<bool>& moe;
  int64_t loss_chunk;  // rows per chunk of the fused output layer and loss; 0: unfused
  bool qk_norm;        // model.qk_norm
  CpComm cp_comm = CpComm::P2P;  // with d.cp > 1
};

Gpt::Acts::Layer carve_layer(ArenaCarver& c, const ArenaShape& z, bool moe) {
  const ModelDims& d = z.d;
  const int64_t N = d.N(), Ns = d.Ns;
  Gpt::Acts::Layer l;
  l.res_mid = c.take(Ns * d.C, z.act);
  l.ln1 = c.take(Ns * d.C, z.act);
  l.ln1_mean = c.f32(Ns);
  l.ln1_rstd = c.f32(Ns);
  l.qkv = c.take(N * d.QKV, z.act);
  if (z.qk_norm) {
    l.qk = c.take(N * (d.NH + d.NKV) * d.HS, z.act);
    l.qk_rstd = c.f32(N * (d.NH + d.NKV));
  }
  l.att = c.take(N * d.NH * d.HS, z.act);
  l.lse = c.f32(d.B * d.NH * d.T);
  l.ln2 = c.take(Ns * d.C, z.act);
  l.ln2_mean = c.f32(Ns);
  l.ln2_rstd = c.f32(Ns);
  if (!moe) {
    l.fc = c.take(N * d.FC, z.act);
    l.act = c.take(N * d.F, z.act);
  }
  return l;
}

void layout_slot(ArenaCarver& c, const ArenaShape& z, Gpt::Acts& a, Gpt::Acts::Slot& s) {
  const ModelDims& d = z.d;
  const int64_t N = d.N(), Ns = d.Ns;
  const DType act = z.act;
  const RecomputeUnits& u = z.units;
  auto pos = [&](int64_t l) { return l - u.units[static_cast<size_t>(u.unit_of[static_cast<size_t>(l)])].first; };
  s.res.resize(d.L + 1);
  s.res[0] = c.take(Ns * d.C, act);
  for (int64_t l = 0; l < d.L; ++l)  // inside a unit the outputs are recomputed
    s.res[l + 1] = u.full(l) && !u.ends_unit(l) ? a.unit_res[static_cast<size_t>(pos(l))] : c.take(Ns * d.C, act);
  s.layers.resize(d.L);
  for (int64_t l = 0; l < d.L; ++l) {
    Gpt::Acts::Layer& x = s.layers[l];
    const bool moe = z.moe[static_cast<size_t>(l)];
    if (u.full(l)) {
      x = a.unit[static_cast<size_t>(pos(l))];
      continue;
    }
    const Gpt::Acts::Layer& sel = a.selective;
    x.res_mid = c.take(Ns * d.C, act);
    x.ln1 = z.rc.norm ? sel.ln1 : c.take(Ns * d.C, act);
    x.ln1_mean = c.f32(Ns);
    x.ln1_rstd = c.f32(Ns);
    x.qkv = c.take(N * d.QKV, act);
    if (z.qk_norm) {
      x.qk = c.take(N * (d.NH + d.NKV) * d.HS, act);
      x.qk_rstd = c.f32(N * (d.NH + d.NKV));
    }
    x.att = z.rc.core_attn ? sel.att : c.take(N * d.NH * d.HS, act);
    x.lse = z.rc.core_attn ? sel.lse : c.f32(d.B * d.NH * d.T);
    x.ln2 = z.rc.norm ? sel.ln2 : c.take(Ns * d.C, act);
    x.ln2_mean = c.f32(Ns);
    x.ln2_rstd = c.f32(Ns);
    if (!moe) {
      x.fc = c.take(N * d.FC, act);
      x.act = z.rc.act ? sel.act : c.take(N * d.F, act);
    }
  }
  if (d.last) {
    s.lnf_mean = c.f32(Ns);
    s.lnf_rstd = c.f32(Ns);
    if (z.loss_chunk > 0) {
      s.lnf = a.lnf;
      s.dlnf = c.take(N * d.C, act);
    } else {
      s.lnf = c.take(Ns * d.C, act);
      s.logits = c.take(N * d.V, act);
    }
  }
}

// The scratch: recomputation's, the fused loss's, the gathers' and the backward's; returns the
// bytes. The slots (layout_slot) point into it for what they recompute.
size_t layout_scratch(ArenaCarver& c, const ArenaShape& z, Gpt::Acts& a) {
  const ModelDims& d = z.d;
  const int64_t N = d.N(), Ns = d.Ns;
  const DType act = z.act;
  const bool fused = d.last && z.loss_chunk > 0;
  // Live while the fused output layer and loss run, at the end of the forward.
  a.lnf = fused ? c.take(Ns * d.C, act) : nullptr;
  a.lnfull = d.sp ? c.take(N * d.C, act) : nullptr;
  a.cp = ContextParallel::carve(c, static_cast<int>(d.cp), z.cp_comm, act, d.B, d.T, d.NH, d.NKV, d.HS);
  const int64_t loss_rows = fused ? z.loss_chunk : N;  // rows the loss sees at once
  a.ce_max = d.tp > 1 ? c.f32(loss_rows) : nullptr;
  a.ce_sums = d.tp > 1 ? c.f32(2 * loss_rows) : nullptr;
  // Not live then: what a layer recomputes (used inside a layer's forward and in the backward) and
  // the backward's gradients. The fused loss's chunk of logits overlays them.
  const size_t free_at_loss = c.used();
  const int64_t longest = z.units.longest();
  bool unit_dense = false;  // a unit holds a dense block (it needs fc and act)
  for (int64_t l = 0; l < d.L; ++l) unit_dense = unit_dense || (z.units.full(l) && !z.moe[static_cast<size_t>(l)]);
  a.unit.clear();
  a.unit_res.clear();
  for (int64_t i = 0; i < longest; ++i) a.unit.push_back(carve_layer(c, z, !unit_dense));
  for (int64_t i = 0; i + 1 < longest; ++i) a.unit_res.push_back(c.take(Ns * d.C, act));
  a.selective = Gpt::Acts::Layer{};
  if (z.rc.norm) a.selective.ln1 = a.selective.ln2 = c.take(Ns * d.C, act);  // ln2 is consumed before ln1
  if (z.rc.core_attn) {
    a.selective.att = c.take(N * d.NH * d.HS, act);
    a.selective.lse = c.f32(d.B * d.NH * d.T);
  }
  bool dense = false;
  for (int64_t l = 0; l < d.L; ++l) dense = dense || !z.moe[static_cast<size_t>(l)];
  if (z.rc.act && dense) a.selective.act = c.take(N * d.F, act);
  a.dres = c.take(Ns * d.C, act);
  a.dc = c.take(Ns * d.C, act);
  a.dfull = d.tp > 1 ? c.take(N * d.C, act) : nullptr;
  // Without sequence parallelism dc is (N, C) and holds the attention output's gradient
  // (N, NH HS) where NH HS <= C; with it dc is a shard, and a head_dim above hidden / heads
  // widens the attention output: those need a buffer of its own.
  a.datt = d.sp || d.NH * d.HS > d.C ? c.take(N * d.NH * d.HS, act) : a.dc;
  a.dqkv = c.take(N * d.QKV, act);
  a.qk_y = z.qk_norm ? c.take(N * (d.NH + d.NKV) * d.HS, act) : nullptr;
  a.qk_dx = z.qk_norm ? c.take(N * (d.NH + d.NKV) * d.HS, act) : nullptr;
  a.dfc = dense ? c.take(N * d.FC, act) : nullptr;
  a.dact = dense && d.FC != d.F ? c.take(N * d.F, act) : nullptr;  // SwiGLU (GELU's is fused into dfc)
  a.logits = fused ? c.overlay(free_at_loss, z.loss_chunk * d.V, act) : nullptr;
  return c.used();
}

// The scratch and one slot of a chunk's dense part (MoE state: MoeLayers::sizes_for).
ActivationSizes dense_sizes(const ArenaShape& z) {
  Gpt::Acts a;
  ArenaCarver scratch(nullptr), slot(nullptr);
  ActivationSizes out;
  out.scratch = layout_scratch(scratch, z, a);
  Gpt::Acts::Slot s;
  layout_slot(slot, z, a, s);
  out.slot = slot.used();
  return out;
}

std::vector<bool> moe_blocks_of(const ModelConfig& cfg, const ModelDims& d) {
  std::vector<bool> moe(static_cast<size_t>(d.L));
  for (int64_t l = 0; l < d.L; ++l) moe[static_cast<size_t>(l)] = cfg.moe.enabled() && cfg.moe.is_moe_layer(d.l0 + l);
  return moe;
}

}  // namespace

math::RopeFreqs rope_freqs(const ModelConfig& m) {
  math::RopeFreqs f(static_cast<float>(m.rope_theta));
  const RopeScalingConfig& s = m.rope_scaling;
  f.kind = s.type == RopeScaling::LINEAR   ? math::RopeFreqs::LINEAR
           : s.type == RopeScaling::LLAMA3 ? math::RopeFreqs::LLAMA3
                                           : math::RopeFreqs::DEFAULT;
  if (s.type != RopeScaling::NONE) f.factor = static_cast<float>(s.factor);
  if (s.type == RopeScaling::LLAMA3) {
    f.low_freq_factor = static_cast<float>(s.low_freq_factor);
    f.high_freq_factor = static_cast<float>(s.high_freq_factor);
    f.original_max_position = static_cast<float>(s.original_max_position_embeddings);
  }
  return f;
}

static void apply_shape(ModelDims& d, const ChunkShape& shape) {
  d.l0 = shape.l0;
  if (shape.layers >= 0) d.L = shape.layers;
  d.first = shape.first;
  d.last = shape.last;
}

ActivationSizes Gpt::activation_sizes_for(const ModelConfig& cfg, DType act, int64_t micro_batch, int64_t tp,
                                          bool sequence_parallel, const ChunkShape& shape, int64_t ep,
                                          const Recomputation& rc, int64_t loss_chunk, int64_t cp,
                                          CpComm cp_comm, int64_t etp) {
  ModelDims d = ModelDims::from(cfg, micro_batch, tp, 0, sequence_parallel, cp);
  apply_shape(d, shape);
  const std::vector<bool> moe = moe_blocks_of(cfg, d);
  const RecomputeUnits units = plan_recompute_units(rc, d.L, moe);
  const int64_t chunk = loss_chunk > 0 ? std::min(loss_chunk, d.N()) : 0;
  ActivationSizes size = dense_sizes(ArenaShape{d, act, rc, units, moe, chunk, cfg.qk_norm, cp_comm});
  // MoE blocks: their routing and expert state in each slot, their scratch beside the dense one.
  // (whole folded experts under SP run on the rank's own rows: moe_local_rows)
  const bool local = moe_local_rows(cfg, tp, etp > 0 ? etp : tp, sequence_parallel && tp > 1);
  size += MoeLayers::sizes_for(cfg, act, local ? d.Ns : d.N(), ep, local ? 1 : tp, d.l0, d.L, rc.moe_act, cp, etp);
  return size;
}

size_t Gpt::activation_bytes_for(const ModelConfig& cfg, DType act, int64_t micro_batch, int64_t tp,
                                 bool sequence_parallel, const ChunkShape& shape, int64_t ep,
                                 const Recomputation& rc, int64_t loss_chunk, int64_t cp, CpComm cp_comm,
                                 int64_t etp) {
  const ActivationSizes s =
      activation_sizes_for(cfg, act, micro_batch, tp, sequence_parallel, shape, ep, rc, loss_chunk, cp, cp_comm, etp);
  return s.scratch + static_cast<size_t>(shape.slots) * s.slot;
}

Gpt::Gpt(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t micro_batch,
         Communicator* tp, int chunk, int64_t slots, Communicator* ep, const Recomputation& rc,
         int64_t loss_chunk, const ActivationRegions* regions, Communicator* cp, CpComm cp_comm,
         Communicator* etp, Communicator* eshare, int ep_chunks)
    : cfg_(cfg), layout_(layout), be_(be), act_(act), rc_(rc) {
  if (eshare && eshare->size() <= 1) eshare = etp = nullptr;  // unfolded
  if (tp && tp->size() <= 1) tp = nullptr;
  if (cp && cp->size() <= 1) cp = nullptr;
  const int64_t tp_size = tp ? tp->size() : 1, tp_rank = tp ? tp->rank() : 0;
  const int64_t ep_size = ep && ep->size() > 1 ? ep->size() : 1;
  TETRA_CHECK(layout.slicing.tp == tp_size && layout.slicing.tp_rank == tp_rank,
              "the parameter layout is for TP rank {} of {}, the model for rank {} of {}",
              layout.slicing.tp_rank, layout.slicing.tp, tp_rank, tp_size);
  d_ = ModelDims::from(cfg, micro_batch, tp_size, tp_rank, layout.slicing.sequence_parallel, cp ? cp->size() : 1);
  const ChunkShape shape = ChunkShape::of(layout, chunk, slots);
  TETRA_CHECK(slots >= 1, "a model chunk needs at least one activation slot, not {}", slots);
  apply_shape(d_, shape);
  tp_ = std::make_unique<TensorParallel>(tp, layout.slicing.sequence_parallel, be, act, d_.N(), d_.C);
  norm_ = cfg.norm == Norm::RMSNORM ? NormKind::RMSNORM : NormKind::LAYERNORM;
  eps_ = static_cast<float>(cfg.norm_eps);
  rope_ = cfg.position == Position::ROPE;
  rope_freqs_ = rope_freqs(cfg);
  swiglu_ = cfg.activation == Activation::SWIGLU;
  moe_layer_ = moe_blocks_of(cfg, d_);
  units_ = plan_recompute_units(rc_, d_.L, moe_layer_);
  loss_chunk_ = loss_chunk > 0 ? std::min(loss_chunk, d_.N()) : 0;
  const ArenaShape z{d_, act_, rc_, units_, moe_layer_, loss_chunk_, cfg.qk_norm, cp_comm};
  cp_ = std::make_unique<ContextParallel>(cp, cp_comm, be, act, d_.B, cfg.seq_len, d_.NH, d_.NKV, d_.HS);
  const ActivationSizes dense = dense_sizes(z);
  ActivationSizes size = dense;
  const int64_t etp_size = eshare ? (etp ? etp->size() : 1) : tp_size;
  moe_local_ = moe_local_rows(cfg, tp_size, etp_size, d_.sp);
  size += MoeLayers::sizes_for(cfg, act, moe_local_ ? d_.Ns : d_.N(), ep_size, moe_local_ ? 1 : tp_size, d_.l0, d_.L,
                               rc_.moe_act, d_.cp, etp_size);
  ActivationRegions r;
  if (regions) {  // shared with the rank's other chunks
    TETRA_CHECK(regions->count == slots && regions->slot_stride >= size.slot && regions->scratch_bytes >= size.scratch,
                "activation regions of {} slot(s) of {} bytes and {} bytes of scratch for a chunk that needs {} of {} "
                "and {}", regions->count, regions->slot_stride, regions->scratch_bytes, slots, size.slot, size.scratch);
    r = *regions;
  } else {
    arena_bytes_ = size.scratch + static_cast<size_t>(slots) * size.slot;
    arena_ = BackendBuffer(be_, arena_bytes_);
    r = ActivationRegions{arena_.as<char>(), size.scratch, arena_.as<char>() + size.scratch, size.slot, slots};
  }
  a_ = std::make_unique<Acts>();
  ArenaCarver c(r.scratch);
  layout_scratch(c, z, *a_);
  cp_->set_buffers(a_->cp);
  a_->slots.resize(static_cast<size_t>(slots));
  for (int64_t i = 0; i < slots; ++i) {
    ArenaCarver cs(r.slot(i));
    layout_slot(cs, z, *a_, a_->slots[static_cast<size_t>(i)]);
  }
  if (cfg.moe.enabled()) {  // the MoE state after the dense part, in the scratch and in each slot
    const ActivationRegions m{r.scratch + dense.scratch, r.scratch_bytes - dense.scratch, r.slots + dense.slot,
                              r.slot_stride, slots};
    moe_ = std::make_unique<MoeLayers>(cfg, layout, be, act, moe_local_ ? d_.Ns : d_.N(), ep, tp, d_.l0, d_.L,
                                       rc_.moe_act, slots, &m, cp, etp, eshare, ep_chunks, moe_local_);
  }
}

Gpt::~Gpt() = default;

const void* Gpt::w(const void* weights, int64_t offset) const {
  if (offset < 0) return nullptr;
  if (weights_ != nullptr) return weights_->at(offset);
  return static_cast<const char*>(weights) + static_cast<size_t>(offset) * dtype_size(act_);
}

void Gpt::forward(const void* weights, int64_t slot, const int32_t* tokens, const int32_t* targets,
                  float* losses, float dloss_scale, float* grads) {
  moe_loss_weight_ = dloss_scale * static_cast<float>(d_.N());
  forward_blocks(weights, slot, tokens);
  moe_loss_weight_ = 0.0f;
  if (!d_.last) return;
  if (loss_chunk_ > 0) {  // the output layer and the loss fused, chunk by chunk; its gradients now
    require(head_groups());
    const GradTarget g{grads, sink_};
    TETRA_CHECK(g.present() || dloss_scale == 0.0f, "a training forward with the fused loss needs the gradient buffer");
    Acts::Slot& sl = a_->slots[static_cast<size_t>(slot)];
    be_.norm_forward(norm_, sl.lnf, sl.lnf_mean, sl.lnf_rstd, sl.res[d_.L], w(weights, layout_.final_norm_w),
                     w(weights, layout_.final_norm_b), d_.Ns, d_.C, eps_, act_, act_);
    const void* h = tp_->copy_to_region(a_->lnfull, sl.lnf);
    const int64_t out = layout_.output_weight();
    vocab_parallel_linear_cross_entropy(*tp_, be_, vocab(), h, d_.C, w(weights, out),
                                        dloss_scale != 0.0f ? g(out) : nullptr, targets, losses, dloss_scale,
                                        loss_chunk_, a_->logits, a_->ce_max, a_->ce_sums, sl.dlnf);
    return;
  }
  forward_head(weights, slot);
  vocab_parallel_cross_entropy(*tp_, be_, vocab(), losses, a_->slots[static_cast<size_t>(slot)].logits, targets,
                               dloss_scale, a_->ce_max, a_->ce_sums);
}

const void* Gpt::logits() const { return a_->slots[0].logits; }

void* Gpt::input(int64_t slot) { return a_->slots.at(static_cast<size_t>(slot)).res[0]; }
const void* Gpt::output(int64_t slot) const { return a_->slots.at(static_cast<size_t>(slot)).res[d_.L]; }
void* Gpt::output_grad() { return a_->dres; }

MoeStepStats Gpt::take_moe_stats() { return moe_ ? moe_->take_stats() : MoeStepStats{}; }

std::map<int64_t, std::vector<float>> Gpt::moe_expert_bias() const {
  return moe_ ? moe_->expert_bias() : std::map<int64_t, std::vector<float>>{};
}

void Gpt::set_moe_expert_bias(const std::map<int64_t, std::vector<float>>& bias) {
  if (moe_) moe_->set_expert_bias(bias);
}

void Gpt::update_moe_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert) {
  if (moe_) moe_->update_expert_bias(tokens_per_expert);
}

void Gpt::forward_logits(const void* weights, const int32_t* tokens) {
  TETRA_CHECK(d_.first && d_.last, "forward_logits() needs the whole model, not layers {} .. {} of a pipeline stage",
              d_.l0, d_.l0 + d_.L - 1);
  forward_blocks(weights, 0, tokens);
  forward_head(weights, 0);
}

void Gpt::forward_blocks(const void* weights, int64_t slot, const int32_t* tokens) {
  const ModelDims& d = d_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  if (d.first) require({layout_.embedding_group});
  if (d.first)  // x = wte[tokens] + wpe                vocab-parallel          (Ns, C)
    vocab_parallel_embedding_forward(*tp_, be_, vocab(), tokens, d.B, d.T, w(weights, layout_.wte),
                                     w(weights, layout_.wpe), sl.res[0], a.dfull, cp_->positions());
  for (int64_t l = 0; l < d.L; ++l) forward_layer(weights, slot, l, /*recompute=*/false);
}

// model.qk_norm (Qwen3): every head's q and k RMS-normalised over its HS values, q heads with
// q_norm's weight and k heads with k_norm's, in place in qkv before RoPE. The q heads of a row are
// one run of NH HS values of qkv, its k heads the next NKV HS: each run is copied out to a compact
// (N NH, HS) or (N NKV, HS) view (s.qk, kept for the backward), normalised by the norm kernels into
// scratch, and copied back.
void Gpt::qk_norm_forward(const void* weights, const BlockParams& p, int64_t slot, int64_t l) {
  const ModelDims& d = d_;
  Acts::Layer& s = a_->slots.at(static_cast<size_t>(slot)).layers[static_cast<size_t>(l)];
  const size_t es = dtype_size(act_), row = static_cast<size_t>(d.QKV) * es;
  const int64_t N = d.N(), Q = d.NH * d.HS, K = d.NKV * d.HS;
  char* qkv = static_cast<char*>(s.qkv);
  char* xq = static_cast<char*>(s.qk);
  char* xk = xq + static_cast<size_t>(N * Q) * es;
  char* yq = static_cast<char*>(a_->qk_y);
  char* yk = yq + static_cast<size_t>(N * Q) * es;
  be_.copy_2d(xq, Q * es, qkv, row, Q * es, N);
  be_.copy_2d(xk, K * es, qkv + Q * es, row, K * es, N);
  be_.norm_forward(NormKind::RMSNORM, yq, nullptr, s.qk_rstd, xq, w(weights, p.q_norm_w), nullptr, N * d.NH, d.HS,
                   eps_, act_, act_);
  be_.norm_forward(NormKind::RMSNORM, yk, nullptr, s.qk_rstd + N * d.NH, xk, w(weights, p.k_norm_w), nullptr,
                   N * d.NKV, d.HS, eps_, act_, act_);
  be_.copy_2d(qkv, row, yq, Q * es, Q * es, N);
  be_.copy_2d(qkv + Q * es, row, yk, K * es, K * es, N);
}

// Its backward, in place in dqkv (the gradient of the normalised q and k, after RoPE's backward):
// the same views, the norm kernels' backward (q_norm's and k_norm's gradients accumulate), the
// input gradients copied back.
void Gpt::qk_norm_backward(const void* weights, const GradTarget& grads, const BlockParams& p, int64_t slot, int64_t l) {
  const ModelDims& d = d_;
  Acts::Layer& s = a_->slots.at(static_cast<size_t>(slot)).layers[static_cast<size_t>(l)];
  const size_t es = dtype_size(act_), row = static_cast<size_t>(d.QKV) * es;
  const int64_t N = d.N(), Q = d.NH * d.HS, K = d.NKV * d.HS;
  char* dqkv = static_cast<char*>(a_->dqkv);
  const char* xq = static_cast<const char*>(s.qk);
  const char* xk = xq + static_cast<size_t>(N * Q) * es;
  char* dyq = static_cast<char*>(a_->qk_y);
  char* dyk = dyq + static_cast<size_t>(N * Q) * es;
  char* dxq = static_cast<char*>(a_->qk_dx);
  char* dxk = dxq + static_cast<size_t>(N * Q) * es;
  be_.copy_2d(dyq, Q * es, dqkv, row, Q * es, N);
  be_.copy_2d(dyk, K * es, dqkv + Q * es, row, K * es, N);
  be_.memset_zero(dxq, static_cast<size_t>(N * (Q + K)) * es);  // norm_backward adds to dx
  be_.norm_backward(NormKind::RMSNORM, dxq, grads(p.q_norm_w), nullptr, dyq, xq, w(weights, p.q_norm_w), nullptr,
                    s.qk_rstd, N * d.NH, d.HS, act_, act_);
  be_.norm_backward(NormKind::RMSNORM, dxk, grads(p.k_norm_w), nullptr, dyk, xk, w(weights, p.k_norm_w), nullptr,
                    s.qk_rstd + N * d.NH, N * d.NKV, d.HS, act_, act_);
  be_.copy_2d(dqkv, row, dxq, Q * es, Q * es, N);
  be_.copy_2d(dqkv + Q * es, row, dxk, K * es, K * es, N);
}

void Gpt::attention_forward(void* att, float* lse, const void* qkv) {
  if (cp_->enabled())
    cp_->forward(att, lse, qkv);
  else
    be_.attention_forward(att, lse, qkv, d_.B, d_.T, d_.NH, d_.NKV, d_.HS, act_);
}

void Gpt::attention_backward(void* dqkv, const void* datt, const void* qkv, const void* att, const float* lse) {
  if (cp_->enabled())
    cp_->backward(dqkv, datt, qkv, att, lse);
  else
    be_.attention_backward(dqkv, datt, qkv, att, lse, d_.B, d_.T, d_.NH, d_.NKV, d_.HS, act_);
}

std::vector<int> Gpt::block_groups(int64_t l) const {
  const BlockParams& p = layout_.blocks[static_cast<size_t>(d_.l0 + l)];
  std::vector<int> g{layout_.layer_group[static_cast<size_t>(d_.l0 + l)]};
  if (p.moe && p.expert_group >= 0) g.push_back(p.expert_group);
  return g;
}

std::vector<int> Gpt::head_groups() const {
  std::vector<int> g{layout_.head_group};
  const int out = layout_.output_weight() == layout_.wte ? layout_.embedding_group : -1;  // tied
  if (out >= 0 && out != layout_.head_group) g.push_back(out);
  return g;
}

void Gpt::forward_layer(const void* weights, int64_t slot, int64_t l, bool recompute) {
  require(block_groups(l));
  const ModelDims& d = d_;
  const int64_t Ns = d.Ns;
  const DType t = act_;
  TensorParallel& tp = *tp_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  auto lin = [&](int64_t wo, int64_t bo) { return LinearWeights{w(weights, wo), w(weights, bo)}; };
  const BlockParams& p = layout_.blocks[static_cast<size_t>(d.l0 + l)];
  Acts::Layer& s = sl.layers[l];
  const void* x = sl.res[l];
  // ln1 = norm1(x) on this rank's rows, then f                                 (N, C)
  be_.norm_forward(norm_, s.ln1, s.ln1_mean, s.ln1_rstd, x, w(weights, p.norm1_w), w(weights, p.norm1_b), Ns, d.C,
                   eps_, t, t);
  const void* h1 = tp.copy_to_region(a.lnfull, s.ln1);
  // qkv = ln1 W_qkv^T + b        column-parallel: this rank's heads          (N, QKV)
  column_parallel_linear_forward(tp, be_, h1, d.C, lin(p.qkv_w, p.qkv_b), s.qkv, d.QKV);
  if (cfg_.qk_norm) qk_norm_forward(weights, p, slot, l);
  if (rope_) be_.rope_forward(s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, rope_freqs_, t, cp_->positions());
  attention_forward(s.att, s.lse, s.qkv);
  // res_mid = x + att W_o^T + b  row-parallel, then g                          (Ns, C)
  row_parallel_linear_forward(tp, be_, s.att, d.NH * d.HS, lin(p.attn_proj_w, p.attn_proj_b), x, s.res_mid, a.dfull);
  // ln2 = norm2(res_mid), then f                                              (N, C)
  be_.norm_forward(norm_, s.ln2, s.ln2_mean, s.ln2_rstd, s.res_mid, w(weights, p.norm2_w), w(weights, p.norm2_b), Ns,
                   d.C, eps_, t, t);
  if (p.moe) {  // res[l+1] = res_mid + MoE(ln2); the experts' TP slices reduced like a row-parallel output
    // A recomputed unit ends at its MoE block, whose state and output were kept: nothing to redo.
    if (recompute) return;
    if (moe_local_) {  // the rank's own rows, whole values: no TP exchange (moe_local_rows)
      moe_->forward(d.l0 + l, WeightView(weights, weights_, dtype_size(act_)), s.ln2, s.res_mid, sl.res[l + 1],
                    moe_loss_weight_, slot);
      return;
    }
    const void* h2 = tp.copy_to_region(a.lnfull, s.ln2);
    void* y = tp.product_target(sl.res[l + 1], a.dfull);
    moe_->forward(d.l0 + l, WeightView(weights, weights_, dtype_size(act_)), h2, tp.residual_in_product() ? s.res_mid : nullptr, y, moe_loss_weight_, slot);
    tp.reduce_from_region(sl.res[l + 1], y, s.res_mid);
    return;
  }
  const void* h2 = tp.copy_to_region(a.lnfull, s.ln2);
  // fc = ln2 W_fc^T + b          column-parallel                              (N, FC)
  // act = swiglu(fc) (N, F), or gelu(fc) with the GELU in the GEMM's epilogue where it can be (not
  // where backward recomputes act with gelu_forward: the epilogue may round differently)
  const bool epilogue = !swiglu_ && !(rc_.act && !units_.full(l));
  column_parallel_linear_forward(tp, be_, h2, d.C, lin(p.fc_w, p.fc_b), s.fc, d.FC, epilogue ? s.act : nullptr);
  if (swiglu_)
    be_.swiglu_forward(s.act, s.fc, d.N(), d.F, t);
  else if (!epilogue)
    be_.gelu_forward(s.act, s.fc, d.N() * d.F, t);
  // res[l+1] = res_mid + act W_p^T + b   row-parallel, then g                 (Ns, C)
  row_parallel_linear_forward(tp, be_, s.act, d.F, lin(p.mlp_proj_w, p.mlp_proj_b), s.res_mid, sl.res[l + 1], a.dfull);
}

void Gpt::forward_head(const void* weights, int64_t slot) {
  require(head_groups());
  const ModelDims& d = d_;
  const DType t = act_;
  TensorParallel& tp = *tp_;
  Acts::Slot& sl = a_->slots.at(static_cast<size_t>(slot));
  be_.norm_forward(norm_, sl.lnf, sl.lnf_mean, sl.lnf_rstd, sl.res[d.L], w(weights, layout_.final_norm_w),
                   w(weights, layout_.final_norm_b), d.Ns, d.C, eps_, t, t);
  const void* h = tp.copy_to_region(a_->lnfull, sl.lnf);
  // logits = lnf W_out^T           column-parallel over the vocabulary          (N, V)
  // Stored in the activation type (bf16 halves the largest tensor of the step, as in Megatron);
  // the loss's softmax and log-sum-exp are fp32 whatever the storage.
  column_parallel_linear_forward(tp, be_, h, d.C, LinearWeights{w(weights, layout_.output_weight()), nullptr},
                                 sl.logits, d.V);
}

void Gpt::backward(const void* weights, float* grads, int64_t slot, const int32_t* tokens,
                   const GroupDoneHook* on_group_done, void* input_grad) {
  const ModelDims& d = d_;
  const int64_t Ns = d.Ns;
  const DType t = act_;
  TensorParallel& tp = *tp_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  const GradTarget g{grads, sink_};
  auto lin = [&](int64_t wo, int64_t bo) { return LinearWeights{w(weights, wo), w(weights, bo)}; };
  auto grad = [&](int64_t wo, int64_t bo) { return LinearGrads{g(wo), g(bo)}; };
  auto done = [&](int group) {
    if (on_group_done) (*on_group_done)(group);
  };
  // The partial input gradients of column-parallel layers (N, C); f's backward sums them into a.dc.
  void* dx = d.sp ? a.dfull : a.dc;

  if (d.last) require(head_groups());
  if (d.last && loss_chunk_ > 0) {
    // The fused loss left the output layer's input gradient, this rank's share, in dlnf (N, C)
    // and its weight gradient in grads; f's backward sums the shares.
    void* din = d.sp ? a.dc : sl.dlnf;
    tp.copy_to_region_backward(din, sl.dlnf);
    be_.memset_zero(a.dres, static_cast<size_t>(Ns * d.C) * dtype_size(t));
    be_.norm_backward(norm_, a.dres, g(layout_.final_norm_w), g(layout_.final_norm_b), din, sl.res[d.L],
                      w(weights, layout_.final_norm_w), sl.lnf_mean, sl.lnf_rstd, Ns, d.C, t, t);
    done(layout_.head_group);
  } else if (d.last) {
    // Output layer: dlnf = dlogits W_out (N, C); dW_out += dlogits^T lnf (V, C).
    const void* dlogits = sl.logits;  // the loss wrote the gradient over the logits
    const void* h = tp.copy_to_region(a.lnfull, sl.lnf);
    column_parallel_linear_backward(tp, be_, dlogits, d.V, h, d.C,
                                    LinearWeights{w(weights, layout_.output_weight()), nullptr},
                                    LinearGrads{g(layout_.output_weight()), nullptr}, dx, a.dc);
    be_.memset_zero(a.dres, static_cast<size_t>(Ns * d.C) * dtype_size(t));
    be_.norm_backward(norm_, a.dres, g(layout_.final_norm_w), g(layout_.final_norm_b), a.dc, sl.res[d.L],
                      w(weights, layout_.final_norm_w), sl.lnf_mean, sl.lnf_rstd, Ns, d.C, t, t);
    done(layout_.head_group);
  }  // else the next stage's gradient of this chunk's output is in a.dres (output_grad())

  for (int64_t l = d.L - 1; l >= 0; --l) {
    const BlockParams& p = layout_.blocks[static_cast<size_t>(d.l0 + l)];
    Acts::Layer& s = sl.layers[l];
    if (units_.ends_unit(l)) {  // full recomputation: the unit's forward again, from its kept input
      const auto& [begin, end] = units_.units[static_cast<size_t>(units_.unit_of[static_cast<size_t>(l)])];
      for (int64_t j = begin; j < end; ++j) forward_layer(weights, slot, j, /*recompute=*/true);
    }
    require(block_groups(l));
    // Selective recomputation, just before each output is read (a fully recomputed layer has them all).
    const bool full = units_.full(l);
    const bool re_norm = rc_.norm && !full, re_act = rc_.act && !full, re_attn = rc_.core_attn && !full;
    auto norm2_input = [&]() -> const void* {  // ln2 over every row (gathered with SP)
      if (re_norm)
        be_.norm_forward(norm_, s.ln2, s.ln2_mean, s.ln2_rstd, s.res_mid, w(weights, p.norm2_w), w(weights, p.norm2_b),
                         Ns, d.C, eps_, t, t);
      return p.moe && moe_local_ ? s.ln2 : tp.copy_to_region(a.lnfull, s.ln2);
    };
    // MLP: res[l+1] = res_mid + act W_p^T + b; g's backward gives every row's gradient (a MoE block
    // on its local rows: the rank's own, dres itself, and its input gradient whole into dc).
    const void* dout = p.moe && moe_local_ ? a.dres : tp.reduce_from_region_backward(a.dfull, a.dres);
    if (p.moe && moe_local_) {
      moe_->backward(d.l0 + l, WeightView(weights, weights_, dtype_size(act_)), g, norm2_input(), dout, a.dc, slot);
      done(p.expert_group);
    } else if (p.moe) {
      moe_->backward(d.l0 + l, WeightView(weights, weights_, dtype_size(act_)), g, norm2_input(), dout, dx, slot);
      done(p.expert_group);
      tp.copy_to_region_backward(a.dc, dx);
    } else {
      if (re_act) {
        if (swiglu_)
          be_.swiglu_forward(s.act, s.fc, d.N(), d.F, t);
        else
          be_.gelu_forward(s.act, s.fc, d.N() * d.F, t);
      }
      // dact = dout W_p (swiglu: then through the swiglu), or dfc = gelu'(fc) * (dout W_p) in one GEMM
      row_parallel_linear_backward(tp, be_, dout, s.act, d.F, lin(p.mlp_proj_w, p.mlp_proj_b),
                                   grad(p.mlp_proj_w, p.mlp_proj_b), swiglu_ ? a.dact : a.dfc,
                                   swiglu_ ? nullptr : s.fc);
      if (swiglu_) be_.swiglu_backward(a.dfc, s.fc, a.dact, d.N(), d.F, t);
      column_parallel_linear_backward(tp, be_, a.dfc, d.FC, norm2_input(), d.C, lin(p.fc_w, p.fc_b),
                                      grad(p.fc_w, p.fc_b), dx, a.dc);
    }
    be_.norm_backward(norm_, a.dres, g(p.norm2_w), g(p.norm2_b), a.dc, s.res_mid, w(weights, p.norm2_w),
                      s.ln2_mean, s.ln2_rstd, Ns, d.C, t, t);

    // Attention: res_mid = res[l] + att W_o^T + b.
    const int64_t A = d.NH * d.HS;
    dout = tp.reduce_from_region_backward(a.dfull, a.dres);
    if (re_attn) attention_forward(s.att, s.lse, s.qkv);
    row_parallel_linear_backward(tp, be_, dout, s.att, A, lin(p.attn_proj_w, p.attn_proj_b),
                                 grad(p.attn_proj_w, p.attn_proj_b), a.datt);
    attention_backward(a.dqkv, a.datt, s.qkv, s.att, s.lse);
    if (rope_)
      be_.rope_backward(a.dqkv, d.B, d.T, d.NH, d.NKV, d.HS, rope_freqs_, t, cp_->positions());
    if (cfg_.qk_norm) qk_norm_backward(weights, g, p, slot, l);
    if (re_norm)
      be_.norm_forward(norm_, s.ln1, s.ln1_mean, s.ln1_rstd, sl.res[l], w(weights, p.norm1_w), w(weights, p.norm1_b),
                       Ns, d.C, eps_, t, t);
    column_parallel_linear_backward(tp, be_, a.dqkv, d.QKV, tp.copy_to_region(a.lnfull, s.ln1), d.C,
                                    lin(p.qkv_w, p.qkv_b), grad(p.qkv_w, p.qkv_b), dx, a.dc);
    be_.norm_backward(norm_, a.dres, g(p.norm1_w), g(p.norm1_b), a.dc, sl.res[l], w(weights, p.norm1_w),
                      s.ln1_mean, s.ln1_rstd, Ns, d.C, t, t);
    done(layout_.layer_group[static_cast<size_t>(d.l0 + l)]);
  }
  if (!d.first) {  // the gradient of this chunk's input, for the previous stage
    TETRA_CHECK(input_grad, "backward of a non-first pipeline stage needs a buffer for its input gradient");
    be_.copy(input_grad, a.dres, static_cast<size_t>(Ns * d.C) * dtype_size(t));
    return;
  }
  vocab_parallel_embedding_backward(tp, be_, vocab(), tokens, d.B, d.T, a.dres, a.dfull, g(layout_.wte),
                                    g(layout_.wpe), cp_->positions());
  done(layout_.embedding_group);
}

}  // namespace tetra
