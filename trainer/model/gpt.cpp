#include "trainer/model/gpt.h"

#include <vector>

#include "trainer/core/check.h"

namespace tetra {

ModelDims ModelDims::from(const ModelConfig& m, int64_t micro_batch) {
  ModelDims d{};
  d.B = micro_batch;
  d.T = m.seq_len;
  d.C = m.hidden_size;
  d.NH = m.num_heads;
  d.NKV = m.num_kv_heads;
  d.HS = m.head_size();
  d.F = m.ffn_hidden_size;
  d.FC = m.activation == "swiglu" ? 2 * d.F : d.F;
  d.V = m.vocab_size;
  d.L = m.num_layers;
  d.QKV = (d.NH + 2 * d.NKV) * d.HS;
  return d;
}

// Pointers into the arena. `t` marks tensors of the activation type, `f` fp32 ones.
struct Gpt::Acts {
  struct Layer {
    void* res_mid;            // (N, C)  t  residual after the attention branch
    void* ln1;                // (N, C)  t
    float* ln1_mean;          // (N)     f
    float* ln1_rstd;          // (N)     f
    void* qkv;                // (N, QKV) t (after RoPE)
    void* att;                // (N, C)  t
    float* lse;               // (B, NH, T) f
    void* ln2;                // (N, C)  t
    float* ln2_mean;
    float* ln2_rstd;
    void* fc;                 // (N, FC) t
    void* act;                // (N, F)  t
  };
  std::vector<void*> res;     // L+1 of (N, C) t: res[0] embeddings, res[l+1] output of block l
  std::vector<Layer> layers;
  void* lnf;                  // (N, C) t
  float* lnf_mean;
  float* lnf_rstd;
  void* logits;               // (N, V) t; the loss turns it into dlogits in place
  // Backward scratch.
  void* dres;                 // (N, C) t  gradient of the residual stream
  void* dc;                   // (N, C) t
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

static size_t layout_acts(Carver& c, const ModelDims& d, DType act, Gpt::Acts& a) {
  const int64_t N = d.N();
  a.res.resize(d.L + 1);
  for (auto& r : a.res) r = c.take(N * d.C, act);
  a.layers.resize(d.L);
  for (auto& l : a.layers) {
    l.res_mid = c.take(N * d.C, act);
    l.ln1 = c.take(N * d.C, act);
    l.ln1_mean = c.take_f32(N);
    l.ln1_rstd = c.take_f32(N);
    l.qkv = c.take(N * d.QKV, act);
    l.att = c.take(N * d.NH * d.HS, act);
    l.lse = c.take_f32(d.B * d.NH * d.T);
    l.ln2 = c.take(N * d.C, act);
    l.ln2_mean = c.take_f32(N);
    l.ln2_rstd = c.take_f32(N);
    l.fc = c.take(N * d.FC, act);
    l.act = c.take(N * d.F, act);
  }
  a.lnf = c.take(N * d.C, act);
  a.lnf_mean = c.take_f32(N);
  a.lnf_rstd = c.take_f32(N);
  a.logits = c.take(N * d.V, act);
  a.dres = c.take(N * d.C, act);
  a.dc = c.take(N * d.C, act);
  a.dqkv = c.take(N * d.QKV, act);
  a.dfc = c.take(N * d.FC, act);
  a.dact = c.take(N * d.F, act);
  return c.used();
}

size_t Gpt::activation_bytes_for(const ModelConfig& cfg, DType act, int64_t micro_batch) {
  Carver c(nullptr);
  Acts a;
  return layout_acts(c, ModelDims::from(cfg, micro_batch), act, a);
}

Gpt::Gpt(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t micro_batch)
    : cfg_(cfg), layout_(layout), be_(be), act_(act), d_(ModelDims::from(cfg, micro_batch)) {
  norm_ = cfg.norm == "rmsnorm" ? NormKind::RMSNORM : NormKind::LAYERNORM;
  eps_ = static_cast<float>(cfg.norm_eps);
  rope_ = cfg.position == "rope";
  swiglu_ = cfg.activation == "swiglu";
  arena_bytes_ = activation_bytes_for(cfg, act, micro_batch);
  arena_ = be_.alloc(arena_bytes_);
  a_ = std::make_unique<Acts>();
  Carver c(static_cast<char*>(arena_));
  layout_acts(c, d_, act_, *a_);
}

Gpt::~Gpt() {
  if (arena_) be_.free(arena_);
}

const void* Gpt::w(const void* weights, int64_t offset) const {
  if (offset < 0) return nullptr;
  return static_cast<const char*>(weights) + static_cast<size_t>(offset) * dtype_size(act_);
}

void Gpt::forward(const void* weights, const int32_t* tokens, const int32_t* targets, float* losses,
                  float dloss_scale) {
  const ModelDims& d = d_;
  const int64_t N = d.N();
  const DType t = act_;
  Acts& a = *a_;

  be_.embedding_forward(a.res[0], tokens, w(weights, layout_.wte), w(weights, layout_.wpe), d.B,
                        d.T, d.C, t, t);
  for (int64_t l = 0; l < d.L; ++l) {
    const BlockParams& p = layout_.blocks[l];
    Acts::Layer& s = a.layers[l];
    const void* x = a.res[l];
    be_.norm_forward(norm_, s.ln1, s.ln1_mean, s.ln1_rstd, x, w(weights, p.norm1_w),
                     w(weights, p.norm1_b), N, d.C, eps_, t, t);
    // qkv = ln1 W_qkv^T + b                                              (N, QKV)
    be_.gemm(false, true, N, d.QKV, d.C, 1.0f, s.ln1, d.C, w(weights, p.qkv_w), d.C, t, 0.0f,
             s.qkv, d.QKV, t, w(weights, p.qkv_b));
    if (rope_)
      be_.rope_forward(s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    be_.attention_forward(s.att, s.lse, s.qkv, d.B, d.T, d.NH, d.NKV, d.HS, t);
    // res_mid = x + att W_o^T + b                                        (N, C)
    be_.copy(s.res_mid, x, static_cast<size_t>(N * d.C) * dtype_size(t));
    be_.gemm(false, true, N, d.C, d.NH * d.HS, 1.0f, s.att, d.NH * d.HS, w(weights, p.attn_proj_w),
             d.NH * d.HS, t, 1.0f, s.res_mid, d.C, t, w(weights, p.attn_proj_b));
    be_.norm_forward(norm_, s.ln2, s.ln2_mean, s.ln2_rstd, s.res_mid, w(weights, p.norm2_w),
                     w(weights, p.norm2_b), N, d.C, eps_, t, t);
    // fc = ln2 W_fc^T + b                                                (N, FC)
    be_.gemm(false, true, N, d.FC, d.C, 1.0f, s.ln2, d.C, w(weights, p.fc_w), d.C, t, 0.0f, s.fc,
             d.FC, t, w(weights, p.fc_b));
    if (swiglu_)
      be_.swiglu_forward(s.act, s.fc, N, d.F, t);
    else
      be_.gelu_forward(s.act, s.fc, N * d.F, t);
    // res[l+1] = res_mid + act W_p^T + b                                 (N, C)
    be_.copy(a.res[l + 1], s.res_mid, static_cast<size_t>(N * d.C) * dtype_size(t));
    be_.gemm(false, true, N, d.C, d.F, 1.0f, s.act, d.F, w(weights, p.mlp_proj_w), d.F, t, 1.0f,
             a.res[l + 1], d.C, t, w(weights, p.mlp_proj_b));
  }
  be_.norm_forward(norm_, a.lnf, a.lnf_mean, a.lnf_rstd, a.res[d.L], w(weights, layout_.final_norm_w),
                   w(weights, layout_.final_norm_b), N, d.C, eps_, t, t);
  // logits = lnf W_out^T                                                 (N, V)
  // Stored in the activation type (bf16 halves the largest tensor of the step, as in Megatron);
  // the loss's softmax and log-sum-exp are fp32 whatever the storage.
  be_.gemm(false, true, N, d.V, d.C, 1.0f, a.lnf, d.C, w(weights, layout_.output_weight()), d.C, t,
           0.0f, a.logits, d.V, t);
  be_.cross_entropy(losses, dloss_scale != 0.0f ? a.logits : nullptr, t, a.logits, t, targets, N,
                    d.V, dloss_scale);
}

void Gpt::backward(const void* weights, float* grads, const int32_t* tokens) {
  const ModelDims& d = d_;
  const int64_t N = d.N();
  const DType t = act_;
  Acts& a = *a_;
  auto g = [&](int64_t offset) -> float* { return offset < 0 ? nullptr : grads + offset; };
  const size_t c_bytes = static_cast<size_t>(N * d.C) * dtype_size(t);

  // Output projection: dlnf = dlogits W_out (N, C); dW_out += dlogits^T lnf (V, C).
  const void* dlogits = a.logits;  // the loss wrote the gradient over the logits
  be_.gemm(false, false, N, d.C, d.V, 1.0f, dlogits, d.V, w(weights, layout_.output_weight()), d.C,
           t, 0.0f, a.dc, d.C, t);
  be_.gemm(true, false, d.V, d.C, N, 1.0f, dlogits, d.V, a.lnf, d.C, t, 1.0f,
           g(layout_.output_weight()), d.C, DType::F32);
  be_.memset_zero(a.dres, c_bytes);
  be_.norm_backward(norm_, a.dres, g(layout_.final_norm_w), g(layout_.final_norm_b), a.dc, a.res[d.L],
                    w(weights, layout_.final_norm_w), a.lnf_mean, a.lnf_rstd, N, d.C, t, t);

  for (int64_t l = d.L - 1; l >= 0; --l) {
    const BlockParams& p = layout_.blocks[l];
    Acts::Layer& s = a.layers[l];
    // MLP: res[l+1] = res_mid + act W_p^T + b.
    be_.gemm(false, false, N, d.F, d.C, 1.0f, a.dres, d.C, w(weights, p.mlp_proj_w), d.F, t, 0.0f,
             a.dact, d.F, t);
    be_.gemm(true, false, d.C, d.F, N, 1.0f, a.dres, d.C, s.act, d.F, t, 1.0f, g(p.mlp_proj_w), d.F,
             DType::F32);
    if (p.mlp_proj_b >= 0) be_.bias_backward(g(p.mlp_proj_b), a.dres, N, d.C, t);
    if (swiglu_)
      be_.swiglu_backward(a.dfc, s.fc, a.dact, N, d.F, t);
    else
      be_.gelu_backward(a.dfc, s.fc, a.dact, N * d.F, t);
    be_.gemm(false, false, N, d.C, d.FC, 1.0f, a.dfc, d.FC, w(weights, p.fc_w), d.C, t, 0.0f, a.dc,
             d.C, t);
    be_.gemm(true, false, d.FC, d.C, N, 1.0f, a.dfc, d.FC, s.ln2, d.C, t, 1.0f, g(p.fc_w), d.C,
             DType::F32);
    if (p.fc_b >= 0) be_.bias_backward(g(p.fc_b), a.dfc, N, d.FC, t);
    be_.norm_backward(norm_, a.dres, g(p.norm2_w), g(p.norm2_b), a.dc, s.res_mid, w(weights, p.norm2_w),
                      s.ln2_mean, s.ln2_rstd, N, d.C, t, t);

    // Attention: res_mid = res[l] + att W_o^T + b.
    const int64_t A = d.NH * d.HS;
    be_.gemm(false, false, N, A, d.C, 1.0f, a.dres, d.C, w(weights, p.attn_proj_w), A, t, 0.0f, a.dc,
             A, t);
    be_.gemm(true, false, d.C, A, N, 1.0f, a.dres, d.C, s.att, A, t, 1.0f, g(p.attn_proj_w), A,
             DType::F32);
    if (p.attn_proj_b >= 0) be_.bias_backward(g(p.attn_proj_b), a.dres, N, d.C, t);
    be_.attention_backward(a.dqkv, a.dc, s.qkv, s.att, s.lse, d.B, d.T, d.NH, d.NKV, d.HS, t);
    if (rope_)
      be_.rope_backward(a.dqkv, d.B, d.T, d.NH, d.NKV, d.HS, static_cast<float>(cfg_.rope_theta), t);
    be_.gemm(false, false, N, d.C, d.QKV, 1.0f, a.dqkv, d.QKV, w(weights, p.qkv_w), d.C, t, 0.0f,
             a.dc, d.C, t);
    be_.gemm(true, false, d.QKV, d.C, N, 1.0f, a.dqkv, d.QKV, s.ln1, d.C, t, 1.0f, g(p.qkv_w), d.C,
             DType::F32);
    if (p.qkv_b >= 0) be_.bias_backward(g(p.qkv_b), a.dqkv, N, d.QKV, t);
    be_.norm_backward(norm_, a.dres, g(p.norm1_w), g(p.norm1_b), a.dc, a.res[l], w(weights, p.norm1_w),
                      s.ln1_mean, s.ln1_rstd, N, d.C, t, t);
  }
  be_.embedding_backward(g(layout_.wte), g(layout_.wpe), a.dres, tokens, d.B, d.T, d.C, t);
}

}  // namespace tetra
