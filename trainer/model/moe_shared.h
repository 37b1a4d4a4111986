// The shared expert of a MoE block (Qwen2-MoE's shared_expert, DeepSeek's shared experts,
// Megatron-Core's moe_shared_expert_*): a dense MLP beside the routed experts that every token
// goes through, forward and backward. MoeLayers (moe.h) runs it after the routed experts' combine.
//
// For the block's rows h (N, C):
//   u = h W1^T + b1      (N, FSC)   FSC = 2 FS with SwiGLU ([gate | up]), else FS
//   a = gelu(u) | swiglu(u)   (N, FS)
//   s = a W2^T + b2      (N, C)
//   out += g_i s_i,  g_i = sigmoid(h_i . w_g)   (model.moe.shared_expert_gate; else g = 1)
// Backward, given dout (N, C):
//   ds = g dout;  dlogit_i = g_i (1 - g_i) <dout_i, s_i>;  dw_g += dlogit^T h;  dh += dlogit w_g
//   then the MLP's: dW2 += ds^T a, db2 += colsum ds, du = act'(u, ds W2), dW1 += du^T h,
//   db1 += colsum du, dh += du W1.
//
// Tensor parallelism: W1 is split by rows (column-parallel) and W2 by columns (row-parallel), as
// the dense MLP; s is this rank's partial sum, which the caller reduces over TP with the routed
// experts' (b2 added on TP rank 0 only). The gate is replicated: every TP rank computes the same g;
// dlogit is linear in s, so each rank's is a partial sum, all-reduced over TP (N floats) before it
// reaches w_g and h. dh is a partial sum (the gate's share on TP rank 0), reduced by the caller.
//
// Kept per activation slot: u, a (unless training.recompute_modules has moe_act: then computed
// again from u), and with the gate s and g.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/core/arena.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"

namespace tetra {

class Communicator;

class MoeSharedExpert {
 public:
  // The sizes (this rank's share of the hidden units).
  struct Shape {
    DType act = DType::F32;
    int64_t N = 0, C = 0, FS = 0, FSC = 0;  // rows, width, hidden units (FSC: fc's, 2 FS with SwiGLU)
    bool swiglu = false, gate = false, recompute_act = false;
    // N rows; `tp_size` ranks split the hidden units; `recompute_act`: a is not kept (moe_act).
    static Shape of(const ModelConfig& cfg, DType act, int64_t N, int64_t tp_size, bool recompute_act);
  };
  // What one block keeps from its forward for its backward (in an activation slot).
  struct Saved {
    void* fc = nullptr;     // (N, FSC)
    void* act = nullptr;    // (N, FS); the scratch's when recomputed
    void* out = nullptr;    // (N, C) s, with the gate
    float* gate = nullptr;  // (N) g, with the gate
  };
  // Shared by every block and slot: what one forward or backward uses and leaves.
  struct Scratch {
    void* act_again = nullptr;    // (N, FS) a computed again (moe_act)
    void* dact = nullptr;         // (N, FS)
    void* dfc = nullptr;          // (N, FSC)
    void* dout_gated = nullptr;   // (N, C) g dout (gate)
    float* logits = nullptr;      // (N) the gate's logits, forward (gate)
    float* dlogits = nullptr;     // (N) (gate)
    void* dlogits_act = nullptr;  // (N) in act for the GEMMs (gate, 16-bit act)
  };
  // Carve (or, with a measuring carver, size) the scratch, then each block's saved state.
  static void carve_scratch(ArenaCarver& c, const Shape& z, Scratch& x);
  static void carve_saved(ArenaCarver& c, const Shape& z, const Scratch& x, Saved& s);

  MoeSharedExpert(Backend& be, const Shape& shape, const Scratch& scratch) : be_(be), z_(shape), x_(scratch) {}

  // out (N, C) += g s (this rank's partial sum when tp > 1); `tp0`: this rank adds the proj bias.
  void forward(const Saved& s, const BlockParams& p, const WeightView& weights, const void* h, void* out, bool tp0);
  // Backward in two parts, so that the caller's input gradient may overwrite dout in between (with
  // sequence parallelism dh and dout are one buffer): backward_output reads dout and h, and
  // accumulates the parameter gradients into `grads`, keeping du and dlogits in the scratch;
  // backward_input then adds the gradient of g s w.r.t. h into dh (N, C) (a partial sum when
  // tp > 1). `tp`: the TP group (null: none).
  void backward_output(const Saved& s, const BlockParams& p, const WeightView& weights, const GradTarget& grads,
                       const void* h, const void* dout, Communicator* tp);
  void backward_input(const BlockParams& p, const WeightView& weights, void* dh, Communicator* tp);

 private:
  void activation(void* a, const void* fc);
  // dlogits in the GEMMs' type.
  const void* gate_grad() const { return z_.act == DType::F32 ? static_cast<const void*>(x_.dlogits) : x_.dlogits_act; }

  Backend& be_;
  Shape z_;
  Scratch x_;
};

}  // namespace tetra
