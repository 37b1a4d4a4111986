// The shared expert's forward and backward (the math and the TP split are in moe_shared.h).
#include "trainer/model/moe_shared.h"

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

MoeSharedExpert::Shape MoeSharedExpert::Shape::of(const ModelConfig& cfg, DType act, int64_t N, int64_t tp_size,
                                                   bool recompute_act) {
  const MoeConfig& m = cfg.moe;
  TETRA_CHECK(m.has_shared_expert() && m.shared_expert_ffn_hidden_size % tp_size == 0,
              "shared expert of width {} over tp {}", m.shared_expert_ffn_hidden_size, tp_size);
  Shape z;
  z.act = act;
  z.N = N;
  z.C = cfg.hidden_size;
  z.swiglu = cfg.activation == Activation::SWIGLU;
  z.FS = m.shared_expert_ffn_hidden_size / tp_size;
  z.FSC = z.swiglu ? 2 * z.FS : z.FS;
  z.gate = m.shared_expert_gate;
  z.recompute_act = recompute_act;
  return z;
}

void MoeSharedExpert::carve_scratch(ArenaCarver& c, const Shape& z, Scratch& x) {
  x.act_again = z.recompute_act ? c.take(z.N * z.FS, z.act) : nullptr;
  x.dact = c.take(z.N * z.FS, z.act);
  x.dfc = c.take(z.N * z.FSC, z.act);
  x.dout_gated = z.gate ? c.take(z.N * z.C, z.act) : nullptr;
  x.logits = z.gate ? c.f32(z.N) : nullptr;
  x.dlogits = z.gate ? c.f32(z.N) : nullptr;
  x.dlogits_act = z.gate && z.act != DType::F32 ? c.take(z.N, z.act) : nullptr;
}

void MoeSharedExpert::carve_saved(ArenaCarver& c, const Shape& z, const Scratch& x, Saved& s) {
  s.fc = c.take(z.N * z.FSC, z.act);
  s.act = z.recompute_act ? x.act_again : c.take(z.N * z.FS, z.act);
  s.out = z.gate ? c.take(z.N * z.C, z.act) : nullptr;
  s.gate = z.gate ? c.f32(z.N) : nullptr;
}

void MoeSharedExpert::activation(void* a, const void* fc) {
  if (z_.swiglu)
    be_.swiglu_forward(a, fc, z_.N, z_.FS, z_.act);
  else
    be_.gelu_forward(a, fc, z_.N * z_.FS, z_.act);
}

void MoeSharedExpert::forward(const Saved& s, const BlockParams& p, const WeightView& weights, const void* h,
                              void* out, bool tp0) {
  const int64_t N = z_.N, C = z_.C, FS = z_.FS, FSC = z_.FSC;
  const DType t = z_.act;
  // u = h W1^T + b1 (N, FSC); a = act(u) (N, FS)
  be_.gemm(false, true, N, FSC, C, 1.0f, h, C, weights(p.shared_fc_w), C, t, 0.0f, s.fc, FSC, t,
           weights(p.shared_fc_b));
  activation(s.act, s.fc);
  const void* b2 = tp0 ? weights(p.shared_proj_b) : nullptr;
  if (!z_.gate) {  // out += a W2^T + b2
    be_.gemm(false, true, N, C, FS, 1.0f, s.act, FS, weights(p.shared_proj_w), FS, t, 1.0f, out, C, t, b2);
    return;
  }
  // s = a W2^T + b2 (N, C); logits = h w_g^T (N) fp32; g = sigmoid(logits); out += g s
  be_.gemm(false, true, N, C, FS, 1.0f, s.act, FS, weights(p.shared_proj_w), FS, t, 0.0f, s.out, C, t, b2);
  be_.gemm(false, true, N, 1, C, 1.0f, h, C, weights(p.shared_gate_w), C, t, 0.0f, x_.logits, 1, DType::F32);
  be_.moe_shared_gate_forward(out, s.gate, x_.logits, s.out, N, C, t);
}

void MoeSharedExpert::backward_output(const Saved& s, const BlockParams& p, const WeightView& weights,
                                      const GradTarget& grads, const void* h, const void* dout, Communicator* tp) {
  const int64_t N = z_.N, C = z_.C, FS = z_.FS, FSC = z_.FSC;
  const DType t = z_.act;
  const void* ds = dout;
  if (z_.gate) {
    // ds = g dout; dlogits = g (1 - g) <dout, s> (a partial sum under TP: summed over the group)
    be_.moe_shared_gate_backward(x_.dout_gated, x_.dlogits, dout, s.out, s.gate, N, C, t);
    if (tp) tp->all_reduce(x_.dlogits, N, DType::F32);
    if (t != DType::F32) be_.cast(x_.dlogits_act, t, x_.dlogits, DType::F32, N);
    // dw_g += dlogits^T h (1, C) on every rank (w_g is replicated, dlogits the whole gradient).
    be_.gemm(true, false, 1, C, N, 1.0f, gate_grad(), 1, h, C, t, 1.0f, grads(p.shared_gate_w), C, DType::F32);
    ds = x_.dout_gated;
  }
  if (z_.recompute_act) activation(s.act, s.fc);  // moe_act: a again, from u
  // dact = ds W2 (N, FS); dW2 += ds^T a (C, FS); db2 += colsum ds (on every TP rank: ds is whole).
  be_.gemm(false, false, N, FS, C, 1.0f, ds, C, weights(p.shared_proj_w), FS, t, 0.0f, x_.dact, FS, t);
  be_.gemm(true, false, C, FS, N, 1.0f, ds, C, s.act, FS, t, 1.0f, grads(p.shared_proj_w), FS, DType::F32);
  if (p.shared_proj_b >= 0) be_.bias_backward(grads(p.shared_proj_b), ds, N, C, t);
  // du = act'(u) dact (N, FSC); dW1 += du^T h (FSC, C); db1 += colsum du.
  if (z_.swiglu)
    be_.swiglu_backward(x_.dfc, s.fc, x_.dact, N, FS, t);
  else
    be_.gelu_backward(x_.dfc, s.fc, x_.dact, N * FS, t);
  be_.gemm(true, false, FSC, C, N, 1.0f, x_.dfc, FSC, h, C, t, 1.0f, grads(p.shared_fc_w), C, DType::F32);
  if (p.shared_fc_b >= 0) be_.bias_backward(grads(p.shared_fc_b), x_.dfc, N, FSC, t);
}

void MoeSharedExpert::backward_input(const BlockParams& p, const WeightView& weights, void* dh, Communicator* tp) {
  const int64_t N = z_.N, C = z_.C, FSC = z_.FSC;
  const DType t = z_.act;
  // dh += dlogits w_g (N, C) on TP rank 0 (dh is a partial sum); dh += du W1 (N, C).
  if (z_.gate && (!tp || tp->rank() == 0))
    be_.gemm(false, false, N, C, 1, 1.0f, gate_grad(), 1, weights(p.shared_gate_w), C, t, 1.0f, dh, C, t);
  be_.gemm(false, false, N, C, FSC, 1.0f, x_.dfc, FSC, weights(p.shared_fc_w), C, t, 1.0f, dh, C, t);
}

}  // namespace tetra
