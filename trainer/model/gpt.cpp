#include "trainer/model/gpt.h"

#include <vector>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"
#include "trainer/model/moe.h"

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
  d.FC = m.activation == "swiglu" ? 2 * d.F : d.F;
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

namespace {

// Carves the arena; run once with base == nullptr to measure it.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  void* take(int64_t numel, DType t) {
    size_t bytes = (static_cast<size_t>(numel) * dtype_size(t) + 63) / 64 * 64;
    void* p = base_ ? base_ + used_ : nullptr;
    used_ += bytes;
    return p;
  }
  float* take_f32(int64_t numel) { return static_cast<float*>(take(numel, DType::F32)); }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace

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

static void layout_slot(Carver& c, const ModelDims& d, DType act, Gpt::Acts::Slot& a) {
  const int64_t N = d.N(), Ns = d.Ns;
  a.res.resize(d.L + 1);
  for (auto& r : a.res) r = c.take(Ns * d.C, act);
  a.layers.resize(d.L);
  for (auto& l : a.layers) {
    l.res_mid = c.take(Ns * d.C, act);
    l.ln1 = c.take(N * d.C, act);
    l.ln1_mean = c.take_f32(Ns);
    l.ln1_rstd = c.take_f32(Ns);
    l.qkv = c.take(N * d.QKV, act);
    l.att = c.take(N * d.NH * d.HS, act);
    l.lse = c.take_f32(d.B * d.NH * d.T);
    l.ln2 = c.take(N * d.C, act);
    l.ln2_mean = c.take_f32(Ns);
    l.ln2_rstd = c.take_f32(Ns);
    l.fc = c.take(N * d.FC, act);
    l.act = c.take(N * d.F, act);
  }
  if (d.last) {
    a.lnf = c.take(N * d.C, act);
    a.lnf_mean = c.take_f32(Ns);
    a.lnf_rstd = c.take_f32(Ns);
    a.logits = c.take(N * d.V, act);
  }
}

// `slots` copies of a Slot, then the scratch; returns the bytes.
static size_t layout_acts(Carver& c, const ModelDims& d, DType act, int64_t slots, Gpt::Acts& a) {
  const int64_t N = d.N(), Ns = d.Ns;
  a.slots.resize(static_cast<size_t>(slots));
  for (Gpt::Acts::Slot& s : a.slots) layout_slot(c, d, act, s);
  a.ce_max = d.tp > 1 ? c.take_f32(N) : nullptr;
  a.ce_sums = d.tp > 1 ? c.take_f32(2 * N) : nullptr;
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
  Carver c(nullptr);
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
    : cfg_(cfg), layout_(layout), be_(be), tp_(tp && tp->size() > 1 ? tp : nullptr), act_(act) {
  const int64_t tp_size = tp_ ? tp_->size() : 1, tp_rank = tp_ ? tp_->rank() : 0;
  TETRA_CHECK(layout.slicing.tp == tp_size && layout.slicing.tp_rank == tp_rank,
              "the parameter layout is for TP rank {} of {}, the model for rank {} of {}",
              layout.slicing.tp_rank, layout.slicing.tp, tp_rank, tp_size);
  d_ = ModelDims::from(cfg, micro_batch, tp_size, tp_rank, layout.slicing.sequence_parallel);
  const ChunkShape shape = ChunkShape::of(layout, chunk, slots);
  TETRA_CHECK(slots >= 1, "a model chunk needs at least one activation slot, not {}", slots);
  apply_shape(d_, shape);
  TETRA_CHECK(!d_.sp || d_.N() % tp_size == 0, "sequence parallelism needs B*T ({}) divisible by tp ({})",
              d_.N(), tp_size);
  norm_ = cfg.norm == "rmsnorm" ? NormKind::RMSNORM : NormKind::LAYERNORM;
  eps_ = static_cast<float>(cfg.norm_eps);
  rope_ = cfg.position == "rope";
  swiglu_ = cfg.activation == "swiglu";
  {
    Carver measure(nullptr);
    Acts unused;
    arena_bytes_ = layout_acts(measure, d_, act_, slots, unused);
  }
  arena_ = be_.alloc(arena_bytes_);
  a_ = std::make_unique<Acts>();
  Carver c(static_cast<char*>(arena_));
  layout_acts(c, d_, act_, slots, *a_);
  if (cfg.moe.enabled()) {
    // Each in-flight micro-batch keeps its own routing and expert activations.
    for (int64_t s = 0; s < slots; ++s) {
      moe_.push_back(std::make_unique<MoeLayers>(cfg, layout, be, act, d_.N(), ep, tp_));
      arena_bytes_ += moe_.back()->activation_bytes();
    }
  }
}

Gpt::~Gpt() {
  if (arena_) be_.free(arena_);
}

const void* Gpt::w(const void* weights, int64_t offset) const {
  if (offset < 0) return nullptr;
  return static_cast<const char*>(weights) + static_cast<size_t>(offset) * dtype_size(act_);
}

void Gpt::row_parallel_output(void* out, void* y, const void* residual) {
  const int64_t C = d_.C;
  if (!tp_) return;  // y == out, residual and bias already added
  if (!d_.sp) {
    tp_->all_reduce(out, d_.N() * C, act_);  // g: all-reduce forward
    return;
  }
  tp_->reduce_scatter(out, y, d_.Ns * C, act_);  // g: reduce-scatter to the sequence shards
  if (residual) be_.add(out, out, residual, d_.Ns * C, act_);
}

void Gpt::column_parallel_input_grad(void* dx_partial) {
  if (!tp_) return;                                                  // dx_partial == a_->dc
  if (!d_.sp)
    tp_->all_reduce(dx_partial, d_.N() * d_.C, act_);               // f backward: all-reduce
  else
    tp_->reduce_scatter(a_->dc, dx_partial, d_.Ns * d_.C, act_);    // all-gather's conjugate
}

void Gpt::vocab_parallel_loss(float* losses, void* logits, const int32_t* targets, float dloss_scale) {
  const ModelDims& d = d_;
  const int64_t N = d.N();
  Acts& a = *a_;
  void* dlogits = dloss_scale != 0.0f ? logits : nullptr;
  if (!tp_) {
    be_.cross_entropy(losses, dlogits, act_, logits, act_, targets, N, d.V, dloss_scale);
    return;
  }
  be_.vocab_ce_max(a.ce_max, logits, act_, N, d.V);
  tp_->all_reduce(a.ce_max, N, DType::F32, ReduceOp::MAX);
  be_.vocab_ce_sums(a.ce_sums, a.ce_sums + N, logits, act_, a.ce_max, targets, d.v0, N, d.V);
  tp_->all_reduce(a.ce_sums, 2 * N, DType::F32, ReduceOp::SUM);
  be_.vocab_ce_finish(losses, dlogits, act_, logits, act_, a.ce_max, a.ce_sums, a.ce_sums + N,
                      targets, d.v0, N, d.V, dloss_scale);
}

void Gpt::forward(const void* weights, int64_t slot, const int32_t* tokens, const int32_t* targets,
                  float* losses, float dloss_scale) {
  moe_loss_weight_ = dloss_scale * static_cast<float>(d_.N());
  forward_blocks(weights, slot, tokens);
  moe_loss_weight_ = 0.0f;
  if (!d_.last) return;
  forward_head(weights, slot);
  vocab_parallel_loss(losses, a_->slots[static_cast<size_t>(slot)].logits, targets, dloss_scale);
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
  const int64_t N = d.N(), Ns = d.Ns;
  const DType t = act_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  const bool rank0 = d.tp_rank == 0;
  const size_t shard_bytes = static_cast<size_t>(Ns * d.C) * dtype_size(t);
  // With sequence parallelism a norm writes its rows of the gathered (N, C) buffer in place.
  auto shard_of = [&](void* full) -> void* {
    return d.sp ? static_cast<char*>(full) + static_cast<size_t>(d.tp_rank) * shard_bytes : full;
  };
  auto gather = [&](void* full) {  // f: identity, or all-gather of the sequence shards
    if (d.sp) tp_->all_gather(full, shard_of(full), Ns * d.C, t);
  };
  // Row-parallel GEMM target: the output itself, or the (N, C) partial product to reduce-scatter.
  auto row_target = [&](void* out) -> void* { return d.sp ? a.dfull : out; };

  // Vocab-parallel embedding: each rank looks up its vocabulary rows (zero elsewhere); TP rank 0
  // adds the position embedding; g sums the ranks' rows.
  if (d.first) {
    void* emb = row_target(sl.res[0]);
    be_.embedding_forward(emb, tokens, w(weights, layout_.wte), rank0 ? w(weights, layout_.wpe) : nullptr,
                          d.B, d.T, d.C, d.v0, d.V, t, t);
    row_parallel_output(sl.res[0], emb, /*residual=*/nullptr);
  }
  for (int64_t l = 0; l < d.L; ++l) {
    const BlockParams& p = layout_.blocks[static_cast<size_t>(d.l0 + l)];
    Acts::Layer& s = sl.layers[l];
    const void* x = sl.res[l];
    be_.norm_forward(norm_, shard_of(s.ln1), s.ln1_mean, s.ln1_rstd, x, w(weights, p.norm1_w),
                     w(weights, p.norm1_b), Ns, d.C, eps_, t, t);
    gather(s.ln1);
    // qkv = ln1 W_qkv^T + b        column-parallel: this rank's heads          (N, QKV)
    be_.gemm(false, true, N, d.QKV, d.C, 1.0f, s.ln1, d.C, w(weights, p.qkv_w), d.C, t, 0.0f,
             s.qkv, d.QKV, t, w(weights, p.qkv_b));
    if (rope_)
      be_.rope_forward(s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    be_.attention_forward(s.att, s.lse, s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, t);
    // res_mid = x + att W_o^T + b  row-parallel                                 (Ns, C)
    const int64_t A = d.NH * d.HS;
    void* y = row_target(s.res_mid);
    const bool fused_residual = !d.sp && rank0;
    if (fused_residual) be_.copy(y, x, shard_bytes);
    be_.gemm(false, true, N, d.C, A, 1.0f, s.att, A, w(weights, p.attn_proj_w), A, t,
             fused_residual ? 1.0f : 0.0f, y, d.C, t, rank0 ? w(weights, p.attn_proj_b) : nullptr);
    row_parallel_output(s.res_mid, y, x);
    be_.norm_forward(norm_, shard_of(s.ln2), s.ln2_mean, s.ln2_rstd, s.res_mid, w(weights, p.norm2_w),
                     w(weights, p.norm2_b), Ns, d.C, eps_, t, t);
    gather(s.ln2);
    if (p.moe) {  // res[l+1] = res_mid + MoE(ln2); the experts' TP slices reduced like a row-parallel output
      y = row_target(sl.res[l + 1]);
      moe_[static_cast<size_t>(slot)]->forward(d.l0 + l, weights, s.ln2, fused_residual ? s.res_mid : nullptr, y,
                                               moe_loss_weight_);
      row_parallel_output(sl.res[l + 1], y, s.res_mid);
      continue;
    }
    // fc = ln2 W_fc^T + b          column-parallel                              (N, FC)
    // act = swiglu(fc) (N, F), or gelu(fc) with the GELU in the GEMM's epilogue where it can be
    if (swiglu_) {
      be_.gemm(false, true, N, d.FC, d.C, 1.0f, s.ln2, d.C, w(weights, p.fc_w), d.C, t, 0.0f, s.fc,
               d.FC, t, w(weights, p.fc_b));
      be_.swiglu_forward(s.act, s.fc, N, d.F, t);
    } else {
      be_.gemm_gelu(false, true, N, d.FC, d.C, s.ln2, d.C, w(weights, p.fc_w), d.C, w(weights, p.fc_b),
                    s.fc, s.act, t);
    }
    // res[l+1] = res_mid + act W_p^T + b   row-parallel                        (Ns, C)
    y = row_target(sl.res[l + 1]);
    if (fused_residual) be_.copy(y, s.res_mid, shard_bytes);
    be_.gemm(false, true, N, d.C, d.F, 1.0f, s.act, d.F, w(weights, p.mlp_proj_w), d.F, t,
             fused_residual ? 1.0f : 0.0f, y, d.C, t, rank0 ? w(weights, p.mlp_proj_b) : nullptr);
    row_parallel_output(sl.res[l + 1], y, s.res_mid);
  }
}

void Gpt::forward_head(const void* weights, int64_t slot) {
  const ModelDims& d = d_;
  const int64_t N = d.N(), Ns = d.Ns;
  const DType t = act_;
  Acts::Slot& sl = a_->slots.at(static_cast<size_t>(slot));
  const size_t shard_bytes = static_cast<size_t>(Ns * d.C) * dtype_size(t);
  void* lnf_shard = d.sp ? static_cast<char*>(sl.lnf) + static_cast<size_t>(d.tp_rank) * shard_bytes : sl.lnf;
  be_.norm_forward(norm_, lnf_shard, sl.lnf_mean, sl.lnf_rstd, sl.res[d.L], w(weights, layout_.final_norm_w),
                   w(weights, layout_.final_norm_b), Ns, d.C, eps_, t, t);
  if (d.sp) tp_->all_gather(sl.lnf, lnf_shard, Ns * d.C, t);
  // logits = lnf W_out^T                                                 (N, V)
  // Stored in the activation type (bf16 halves the largest tensor of the step, as in Megatron);
  // the loss's softmax and log-sum-exp are fp32 whatever the storage.
  be_.gemm(false, true, N, d.V, d.C, 1.0f, sl.lnf, d.C, w(weights, layout_.output_weight()), d.C, t,
           0.0f, sl.logits, d.V, t);
}

void Gpt::backward(const void* weights, float* grads, int64_t slot, const int32_t* tokens,
                   const GroupDoneHook* on_group_done, void* input_grad) {
  const ModelDims& d = d_;
  const int64_t N = d.N(), Ns = d.Ns;
  const DType t = act_;
  Acts& a = *a_;
  Acts::Slot& sl = a.slots.at(static_cast<size_t>(slot));
  auto g = [&](int64_t offset) -> float* { return offset < 0 ? nullptr : grads + offset; };
  auto done = [&](int group) {
    if (on_group_done) (*on_group_done)(group);
  };
  // Input gradients of column-parallel GEMMs go here, then column_parallel_input_grad sums them.
  void* dx = d.sp ? a.dfull : a.dc;
  // The full-row gradient of a row-parallel output: all-gathered from the shards (sequence
  // parallelism), else the residual gradient itself (identical on every TP rank).
  auto full_dres = [&]() -> const void* {
    if (!d.sp) return a.dres;
    tp_->all_gather(a.dfull, a.dres, Ns * d.C, t);
    return a.dfull;
  };

  if (d.last) {
    // Output projection: dlnf = dlogits W_out (N, C); dW_out += dlogits^T lnf (V, C).
    const void* dlogits = sl.logits;  // the loss wrote the gradient over the logits
    be_.gemm(false, false, N, d.C, d.V, 1.0f, dlogits, d.V, w(weights, layout_.output_weight()), d.C,
             t, 0.0f, dx, d.C, t);
    be_.gemm(true, false, d.V, d.C, N, 1.0f, dlogits, d.V, sl.lnf, d.C, t, 1.0f,
             g(layout_.output_weight()), d.C, DType::F32);
    column_parallel_input_grad(dx);
    be_.memset_zero(a.dres, static_cast<size_t>(Ns * d.C) * dtype_size(t));
    be_.norm_backward(norm_, a.dres, g(layout_.final_norm_w), g(layout_.final_norm_b), a.dc, sl.res[d.L],
                      w(weights, layout_.final_norm_w), sl.lnf_mean, sl.lnf_rstd, Ns, d.C, t, t);
    done(layout_.head_group);
  }  // else the next stage's gradient of this chunk's output is in a.dres (output_grad())

  for (int64_t l = d.L - 1; l >= 0; --l) {
    const BlockParams& p = layout_.blocks[static_cast<size_t>(d.l0 + l)];
    Acts::Layer& s = sl.layers[l];
    // MLP: res[l+1] = res_mid + act W_p^T + b.
    const void* dout = full_dres();
    if (p.moe) {
      moe_[static_cast<size_t>(slot)]->backward(d.l0 + l, weights, grads, s.ln2, dout, dx);
      done(p.expert_group);
    } else {
      // dfc = swiglu'(dout W_p) through dact, or gelu'(fc) * (dout W_p) in the GEMM's epilogue
      if (swiglu_) {
        be_.gemm(false, false, N, d.F, d.C, 1.0f, dout, d.C, w(weights, p.mlp_proj_w), d.F, t, 0.0f,
                 a.dact, d.F, t);
        be_.swiglu_backward(a.dfc, s.fc, a.dact, N, d.F, t);
      } else {
        be_.gemm_dgelu(false, false, N, d.F, d.C, dout, d.C, w(weights, p.mlp_proj_w), d.F, s.fc, a.dfc, t);
      }
      be_.gemm(true, false, d.C, d.F, N, 1.0f, dout, d.C, s.act, d.F, t, 1.0f, g(p.mlp_proj_w), d.F,
               DType::F32);
      if (p.mlp_proj_b >= 0) be_.bias_backward(g(p.mlp_proj_b), dout, N, d.C, t);
      be_.gemm(false, false, N, d.C, d.FC, 1.0f, a.dfc, d.FC, w(weights, p.fc_w), d.C, t, 0.0f, dx,
               d.C, t);
      be_.gemm(true, false, d.FC, d.C, N, 1.0f, a.dfc, d.FC, s.ln2, d.C, t, 1.0f, g(p.fc_w), d.C,
               DType::F32);
      if (p.fc_b >= 0) be_.bias_backward(g(p.fc_b), a.dfc, N, d.FC, t);
    }
    column_parallel_input_grad(dx);
    be_.norm_backward(norm_, a.dres, g(p.norm2_w), g(p.norm2_b), a.dc, s.res_mid, w(weights, p.norm2_w),
                      s.ln2_mean, s.ln2_rstd, Ns, d.C, t, t);

    // Attention: res_mid = res[l] + att W_o^T + b.
    const int64_t A = d.NH * d.HS;
    dout = full_dres();
    void* datt = a.datt;
    be_.gemm(false, false, N, A, d.C, 1.0f, dout, d.C, w(weights, p.attn_proj_w), A, t, 0.0f, datt,
             A, t);
    be_.gemm(true, false, d.C, A, N, 1.0f, dout, d.C, s.att, A, t, 1.0f, g(p.attn_proj_w), A,
             DType::F32);
    if (p.attn_proj_b >= 0) be_.bias_backward(g(p.attn_proj_b), dout, N, d.C, t);
    void* dqkv = a.dqkv;
    be_.attention_backward(dqkv, datt, s.qkv, s.att, s.lse, d.B, d.T, d.NH, d.NKV, d.HS, t);
    if (rope_)
      be_.rope_backward(dqkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    be_.gemm(false, false, N, d.C, d.QKV, 1.0f, dqkv, d.QKV, w(weights, p.qkv_w), d.C, t, 0.0f, dx,
             d.C, t);
    be_.gemm(true, false, d.QKV, d.C, N, 1.0f, dqkv, d.QKV, s.ln1, d.C, t, 1.0f, g(p.qkv_w), d.C,
             DType::F32);
    if (p.qkv_b >= 0) be_.bias_backward(g(p.qkv_b), dqkv, N, d.QKV, t);
    column_parallel_input_grad(dx);
    be_.norm_backward(norm_, a.dres, g(p.norm1_w), g(p.norm1_b), a.dc, sl.res[l], w(weights, p.norm1_w),
                      s.ln1_mean, s.ln1_rstd, Ns, d.C, t, t);
    done(layout_.layer_group[static_cast<size_t>(d.l0 + l)]);
  }
  if (!d.first) {  // the gradient of this chunk's input, for the previous stage
    TETRA_CHECK(input_grad, "backward of a non-first pipeline stage needs a buffer for its input gradient");
    be_.copy(input_grad, a.dres, static_cast<size_t>(Ns * d.C) * dtype_size(t));
    return;
  }
  const void* demb = full_dres();
  be_.embedding_backward(g(layout_.wte), g(layout_.wpe), demb, tokens, d.B, d.T, d.C, d.v0, d.V, t);
  done(layout_.embedding_group);
}

}  // namespace tetra
