#include "trainer/model/gpt.h"

#include <vector>

#include "kernels/common/check.h"
#include "trainer/core/arena.h"
#include "trainer/comm/communicator.h"
#include "trainer/model/moe.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/parallel/vocab_parallel.h"

namespace tetra {

ModelDims ModelDims::from(const ModelConfig& m, int64_t micro_batch, int64_t tp, int64_t tp_rank,
                          bool sequence_parallel) {
  ModelDims d{};
  d.B = micro_batch;
  d.T = m.seq_len;
  d.C = m.hidden_size;
  d.HS = m.head_size();
  d.NH = m.num_heads / tp;
  d.NKV = m.num_kv_heads / tp;
  d.F = m.ffn_hidden_size / tp;
  d.FC = m.activation == Activation::SWIGLU ? 2 * d.F : d.F;
  d.V = m.vocab_size / tp;
  d.L = m.num_layers;
  d.QKV = (d.NH + 2 * d.NKV) * d.HS;
  d.tp = tp;
  d.tp_rank = tp_rank;
  d.v0 = tp_rank * d.V;
  d.sp = sequence_parallel && tp > 1;
  d.Ns = d.sp ? d.N() / tp : d.N();
  return d;
}

// Pointers into the arena. `t` marks tensors of the activation type, `f` fp32 ones. Ns rows are
// this rank's part of the residual stream (all N rows without sequence parallelism).
struct Gpt::Acts {
  struct Layer {
    void* res_mid;            // (Ns, C) t  residual after the attention branch
    void* ln1;                // (N, C)  t  (gathered from the shards with sequence parallelism)
    float* ln1_mean;          // (Ns)    f
    float* ln1_rstd;          // (Ns)    f
    void* qkv;                // (N, QKV) t (after RoPE)
    void* att;                // (N, NH HS) t
    float* lse;               // (B, NH, T) f
    void* ln2;                // (N, C)  t
    float* ln2_mean;
    float* ln2_rstd;
    void* fc;                 // (N, FC) t
    void* act;                // (N, F)  t
  };
  // What one micro-batch keeps from its forward to its backward.
  struct Slot {
    std::vector<void*> res;   // L+1 of (Ns, C) t: res[0] the chunk's input (the embeddings on the
                              // first stage), res[l+1] output of block l; backward leaves the
                              // input's gradient in res[0]
    std::vector<Layer> layers;
    void* lnf = nullptr;      // (N, C) t      last stage only
    float* lnf_mean = nullptr;  // (Ns) f
    float* lnf_rstd = nullptr;
    void* logits = nullptr;   // (N, V) t; the loss turns it into dlogits in place
  };
  std::vector<Slot> slots;
  float* ce_max;              // (N) f       vocab-parallel loss statistics (tp > 1)
  float* ce_sums;             // (2, N) f    [sum exp | target logit]
  // Backward scratch.
  void* dres;                 // (Ns, C) t  gradient of the residual stream
  void* dc;                   // (Ns, C) t
  void* dfull;                // (N, C) t   partial products and gathered gradients (tp > 1)
  void* datt;                 // (N, NH HS) t  (== dc without sequence parallelism)
  void* dqkv;                 // (N, QKV) t
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

static void layout_slot(ArenaCarver& c, const ModelDims& d, DType act, Gpt::Acts::Slot& a) {
  const int64_t N = d.N(), Ns = d.Ns;
  a.res.resize(d.L + 1);
  for (auto& r : a.res) r = c.take(Ns * d.C, act);
  a.layers.resize(d.L);
  for (auto& l : a.layers) {
    l.res_mid = c.take(Ns * d.C, act);
    l.ln1 = c.take(N * d.C, act);
    l.ln1_mean = c.f32(Ns);
    l.ln1_rstd = c.f32(Ns);
    l.qkv = c.take(N * d.QKV, act);
    l.att = c.take(N * d.NH * d.HS, act);
    l.lse = c.f32(d.B * d.NH * d.T);
    l.ln2 = c.take(N * d.C, act);
    l.ln2_mean = c.f32(Ns);
    l.ln2_rstd = c.f32(Ns);
    l.fc = c.take(N * d.FC, act);
    l.act = c.take(N * d.F, act);
  }
  if (d.last) {
    a.lnf = c.take(N * d.C, act);
    a.lnf_mean = c.f32(Ns);
    a.lnf_rstd = c.f32(Ns);
    a.logits = c.take(N * d.V, act);
  }
}

// `slots` copies of a Slot, then the scratch; returns the bytes.
static size_t layout_acts(ArenaCarver& c, const ModelDims& d, DType act, int64_t slots, Gpt::Acts& a) {
  const int64_t N = d.N(), Ns = d.Ns;
  a.slots.resize(static_cast<size_t>(slots));
  for (Gpt::Acts::Slot& s : a.slots) layout_slot(c, d, act, s);
  a.ce_max = d.tp > 1 ? c.f32(N) : nullptr;
  a.ce_sums = d.tp > 1 ? c.f32(2 * N) : nullptr;
  a.dres = c.take(Ns * d.C, act);
  a.dc = c.take(Ns * d.C, act);
  a.dfull = d.tp > 1 ? c.take(N * d.C, act) : nullptr;
  // Without sequence parallelism dc is (N, C) and holds the attention output's gradient
  // (N, NH HS), NH HS <= C; with it dc is a shard and this needs its own buffer.
  a.datt = d.sp ? c.take(N * d.NH * d.HS, act) : a.dc;
  a.dqkv = c.take(N * d.QKV, act);
  a.dfc = c.take(N * d.FC, act);
  a.dact = c.take(N * d.F, act);
  return c.used();
}

static void apply_shape(ModelDims& d, const ChunkShape& shape) {
  d.l0 = shape.l0;
  if (shape.layers >= 0) d.L = shape.layers;
  d.first = shape.first;
  d.last = shape.last;
}

size_t Gpt::activation_bytes_for(const ModelConfig& cfg, DType act, int64_t micro_batch, int64_t tp,
                                 bool sequence_parallel, const ChunkShape& shape, int64_t ep) {
  ArenaCarver c(nullptr);
  Acts a;
  ModelDims d = ModelDims::from(cfg, micro_batch, tp, 0, sequence_parallel);
  apply_shape(d, shape);
  // MoE blocks: each slot's routing and expert activations (every block of the model counted: an
  // upper bound for a pipeline stage).
  return layout_acts(c, d, act, shape.slots, a) +
         static_cast<size_t>(shape.slots) * MoeLayers::activation_bytes_for(cfg, act, micro_batch * cfg.seq_len, ep, tp);
}

Gpt::Gpt(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t micro_batch,
         Communicator* tp, int chunk, int64_t slots, Communicator* ep)
    : cfg_(cfg), layout_(layout), be_(be), act_(act) {
  if (tp && tp->size() <= 1) tp = nullptr;
  const int64_t tp_size = tp ? tp->size() : 1, tp_rank = tp ? tp->rank() : 0;
  TETRA_CHECK(layout.slicing.tp == tp_size && layout.slicing.tp_rank == tp_rank,
              "the parameter layout is for TP rank {} of {}, the model for rank {} of {}",
              layout.slicing.tp_rank, layout.slicing.tp, tp_rank, tp_size);
  d_ = ModelDims::from(cfg, micro_batch, tp_size, tp_rank, layout.slicing.sequence_parallel);
  const ChunkShape shape = ChunkShape::of(layout, chunk, slots);
  TETRA_CHECK(slots >= 1, "a model chunk needs at least one activation slot, not {}", slots);
  apply_shape(d_, shape);
  tp_ = std::make_unique<TensorParallel>(tp, layout.slicing.sequence_parallel, be, act, d_.N(), d_.C);
  norm_ = cfg.norm == Norm::RMSNORM ? NormKind::RMSNORM : NormKind::LAYERNORM;
  eps_ = static_cast<float>(cfg.norm_eps);
  rope_ = cfg.position == Position::ROPE;
  swiglu_ = cfg.activation == Activation::SWIGLU;
  {
    ArenaCarver measure(nullptr);
    Acts unused;
    arena_bytes_ = layout_acts(measure, d_, act_, slots, unused);
  }
  arena_ = BackendBuffer(be_, arena_bytes_);
  a_ = std::make_unique<Acts>();
  ArenaCarver c(arena_.as<char>());
  layout_acts(c, d_, act_, slots, *a_);
  if (cfg.moe.enabled()) {
    // Each in-flight micro-batch keeps its own routing and expert activations.
    for (int64_t s = 0; s < slots; ++s) {
      moe_.push_back(std::make_unique<MoeLayers>(cfg, layout, be, act, d_.N(), ep, tp));
      arena_bytes_ += moe_.back()->activation_bytes();
    }
  }
}

Gpt::~Gpt() = default;

const void* Gpt::w(const void* weights, int64_t offset) const {
  if (offset < 0) return nullptr;
  return static_cast<const char*>(weights) + static_cast<size_t>(offset) * dtype_size(act_);
}

void Gpt::forward(const void* weights, int64_t slot, const int32_t* tokens, const int32_t* targets,
                  float* losses, float dloss_scale) {
  moe_loss_weight_ = dloss_scale * static_cast<float>(d_.N());
  forward_blocks(weights, slot, tokens);
  moe_loss_weight_ = 0.0f;
  if (!d_.last) return;
  forward_head(weights, slot);
  vocab_parallel_cross_entropy(*tp_, be_, vocab(), losses, a_->slots[static_cast<size_t>(slot)].logits, targets,
                               dloss_scale, a_->ce_max, a_->ce_sums);
}

const void* Gpt::logits() const { return a_->slots[0].logits; }

void* Gpt::input(int64_t slot) { return a_->slots.at(static_cast<size_t>(slot)).res[0]; }
const void* Gpt::output(int64_t slot) const { return a_->slots.at(static_cast<size_t>(slot)).res[d_.L]; }
void* Gpt::output_grad() { return a_->dres; }

MoeStepStats Gpt::take_moe_stats() {
  MoeStepStats all;
  for (auto& m : moe_) all.merge(m->take_stats());
  return all;
}

void Gpt::forward_logits(const void* weights, const int32_t* tokens) {
  TETRA_CHECK(d_.first && d_.last, "forward_logits() needs the whole model, not layers {} .. {} of a pipeline stage",
              d_.l0, d_.l0 + d_.L - 1);
  forward_blocks(weights, 0, tokens);
  forward_head(weights, 0);
}

void Gpt::forward_blocks(const void* weights, int64_t slot, const int32_t* tokens) {
  const ModelDims& d = d_;
  const int64_t Ns = d.Ns;
  const DType t = act_;
  TensorParallel& tp = *tp_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  auto lin = [&](int64_t wo, int64_t bo) { return LinearWeights{w(weights, wo), w(weights, bo)}; };

  if (d.first)  // x = wte[tokens] + wpe                vocab-parallel          (Ns, C)
    vocab_parallel_embedding_forward(tp, be_, vocab(), tokens, d.B, d.T, w(weights, layout_.wte),
                                     w(weights, layout_.wpe), sl.res[0], a.dfull);
  for (int64_t l = 0; l < d.L; ++l) {
    const BlockParams& p = layout_.blocks[static_cast<size_t>(d.l0 + l)];
    Acts::Layer& s = sl.layers[l];
    const void* x = sl.res[l];
    // ln1 = norm1(x) on this rank's rows, then f                                 (N, C)
    be_.norm_forward(norm_, tp.shard_of(s.ln1), s.ln1_mean, s.ln1_rstd, x, w(weights, p.norm1_w),
                     w(weights, p.norm1_b), Ns, d.C, eps_, t, t);
    tp.copy_to_region(s.ln1);
    // qkv = ln1 W_qkv^T + b        column-parallel: this rank's heads          (N, QKV)
    column_parallel_linear_forward(tp, be_, s.ln1, d.C, lin(p.qkv_w, p.qkv_b), s.qkv, d.QKV);
    if (rope_)
      be_.rope_forward(s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    be_.attention_forward(s.att, s.lse, s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, t);
    // res_mid = x + att W_o^T + b  row-parallel, then g                          (Ns, C)
    row_parallel_linear_forward(tp, be_, s.att, d.NH * d.HS, lin(p.attn_proj_w, p.attn_proj_b), x, s.res_mid,
                                a.dfull);
    // ln2 = norm2(res_mid), then f                                              (N, C)
    be_.norm_forward(norm_, tp.shard_of(s.ln2), s.ln2_mean, s.ln2_rstd, s.res_mid, w(weights, p.norm2_w),
                     w(weights, p.norm2_b), Ns, d.C, eps_, t, t);
    tp.copy_to_region(s.ln2);
    if (p.moe) {  // res[l+1] = res_mid + MoE(ln2); the experts' TP slices reduced like a row-parallel output
      void* y = tp.product_target(sl.res[l + 1], a.dfull);
      moe_[static_cast<size_t>(slot)]->forward(d.l0 + l, weights, s.ln2, tp.residual_in_product() ? s.res_mid : nullptr,
                                               y, moe_loss_weight_);
      tp.reduce_from_region(sl.res[l + 1], y, s.res_mid);
      continue;
    }
    // fc = ln2 W_fc^T + b          column-parallel                              (N, FC)
    // act = swiglu(fc) (N, F), or gelu(fc) with the GELU in the GEMM's epilogue where it can be
    column_parallel_linear_forward(tp, be_, s.ln2, d.C, lin(p.fc_w, p.fc_b), s.fc, d.FC, swiglu_ ? nullptr : s.act);
    if (swiglu_) be_.swiglu_forward(s.act, s.fc, d.N(), d.F, t);
    // res[l+1] = res_mid + act W_p^T + b   row-parallel, then g                 (Ns, C)
    row_parallel_linear_forward(tp, be_, s.act, d.F, lin(p.mlp_proj_w, p.mlp_proj_b), s.res_mid, sl.res[l + 1],
                                a.dfull);
  }
}

void Gpt::forward_head(const void* weights, int64_t slot) {
  const ModelDims& d = d_;
  const DType t = act_;
  TensorParallel& tp = *tp_;
  Acts::Slot& sl = a_->slots.at(static_cast<size_t>(slot));
  be_.norm_forward(norm_, tp.shard_of(sl.lnf), sl.lnf_mean, sl.lnf_rstd, sl.res[d.L], w(weights, layout_.final_norm_w),
                   w(weights, layout_.final_norm_b), d.Ns, d.C, eps_, t, t);
  tp.copy_to_region(sl.lnf);
  // logits = lnf W_out^T           column-parallel over the vocabulary          (N, V)
  // Stored in the activation type (bf16 halves the largest tensor of the step, as in Megatron);
  // the loss's softmax and log-sum-exp are fp32 whatever the storage.
  column_parallel_linear_forward(tp, be_, sl.lnf, d.C, LinearWeights{w(weights, layout_.output_weight()), nullptr},
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
  auto g = [&](int64_t offset) -> float* { return offset < 0 ? nullptr : grads + offset; };
  auto lin = [&](int64_t wo, int64_t bo) { return LinearWeights{w(weights, wo), w(weights, bo)}; };
  auto grad = [&](int64_t wo, int64_t bo) { return LinearGrads{g(wo), g(bo)}; };
  auto done = [&](int group) {
    if (on_group_done) (*on_group_done)(group);
  };
  // The partial input gradients of column-parallel layers (N, C); f's backward sums them into a.dc.
  void* dx = d.sp ? a.dfull : a.dc;

  if (d.last) {
    // Output layer: dlnf = dlogits W_out (N, C); dW_out += dlogits^T lnf (V, C).
    const void* dlogits = sl.logits;  // the loss wrote the gradient over the logits
    column_parallel_linear_backward(tp, be_, dlogits, d.V, sl.lnf, d.C,
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
    // MLP: res[l+1] = res_mid + act W_p^T + b; g's backward gives every row's gradient.
    const void* dout = tp.reduce_from_region_backward(a.dfull, a.dres);
    if (p.moe) {
      moe_[static_cast<size_t>(slot)]->backward(d.l0 + l, weights, grads, s.ln2, dout, dx);
      done(p.expert_group);
      tp.copy_to_region_backward(a.dc, dx);
    } else {
      // dact = dout W_p (swiglu: then through the swiglu), or dfc = gelu'(fc) * (dout W_p) in one GEMM
      row_parallel_linear_backward(tp, be_, dout, s.act, d.F, lin(p.mlp_proj_w, p.mlp_proj_b),
                                   grad(p.mlp_proj_w, p.mlp_proj_b), swiglu_ ? a.dact : a.dfc,
                                   swiglu_ ? nullptr : s.fc);
      if (swiglu_) be_.swiglu_backward(a.dfc, s.fc, a.dact, d.N(), d.F, t);
      column_parallel_linear_backward(tp, be_, a.dfc, d.FC, s.ln2, d.C, lin(p.fc_w, p.fc_b), grad(p.fc_w, p.fc_b),
                                      dx, a.dc);
    }
    be_.norm_backward(norm_, a.dres, g(p.norm2_w), g(p.norm2_b), a.dc, s.res_mid, w(weights, p.norm2_w),
                      s.ln2_mean, s.ln2_rstd, Ns, d.C, t, t);

    // Attention: res_mid = res[l] + att W_o^T + b.
    const int64_t A = d.NH * d.HS;
    dout = tp.reduce_from_region_backward(a.dfull, a.dres);
    row_parallel_linear_backward(tp, be_, dout, s.att, A, lin(p.attn_proj_w, p.attn_proj_b),
                                 grad(p.attn_proj_w, p.attn_proj_b), a.datt);
    be_.attention_backward(a.dqkv, a.datt, s.qkv, s.att, s.lse, d.B, d.T, d.NH, d.NKV, d.HS, t);
    if (rope_)
      be_.rope_backward(a.dqkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    column_parallel_linear_backward(tp, be_, a.dqkv, d.QKV, s.ln1, d.C, lin(p.qkv_w, p.qkv_b), grad(p.qkv_w, p.qkv_b),
                                    dx, a.dc);
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
                                    g(layout_.wpe));
  done(layout_.embedding_group);
}

}  // namespace tetra
