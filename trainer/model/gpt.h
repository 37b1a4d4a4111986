// The decoder-only Transformer (GPT-2 and Llama styles are both configs of it), forward and
// backward written by hand against the Backend op interface, tensor- and sequence-parallel
// (Megatron-LM) when given a TP communicator.
//
// Per block (pre-norm):            shapes, N = B*T rows
//   h   = norm1(x)                 (N, C)
//   qkv = h W_qkv^T + b            (N, (NH + 2 NKV) HS)      RoPE on q, k if position == rope
//   a   = causal_attention(qkv)    (N, NH HS)
//   x   = x + a W_o^T + b          residual add fused into the GEMM (beta = 1)
//   h   = norm2(x)
//   u   = h W_fc^T + b             (N, F) gelu, or (N, 2F) = [gate | up] swiglu
//   g   = gelu(u) | silu(gate)*up  (N, F)
//   x   = x + g W_p^T + b
// A Mixture-of-Experts block (model.moe) replaces the last three lines by x = x + MoE(h): the
// router, the experts and their expert-parallel exchanges live in moe.{h,cpp} (MoeLayers).
// then logits = norm_f(x) W_out^T (N, V) and a fused softmax-cross-entropy (fp32 math) that writes
// the logits' gradient in place while computing the loss, so the logits are written once.
//
// Tensor parallel over p ranks (param_layout.h says which slice each rank holds): W_qkv and W_fc
// are column-parallel, W_o and W_p row-parallel, the embedding and W_out vocab-parallel. The
// communication around them, the conjugate pairs f and g, the sequence-parallel shards of the
// residual stream and the rank-0 rule for biases and residuals are trainer/parallel/'s
// (tensor_parallel.h, vocab_parallel.h): this file is the single-device block calling them by
// name, and every call is the identity without a TP group.
//
// Pipeline parallelism: a Gpt is one model chunk of a pipeline rank (layers [l0, l0 + L) of the
// model, ParamLayout::stage), with the embedding only on the first stage and the final norm,
// output layer and loss only on the last. A non-first chunk reads its input activation (Ns, C)
// from input(slot), a non-last one leaves its output in output(slot) and takes the gradient of
// it in output_grad() before backward, which writes the gradient of its input to a buffer the
// caller gives. Several micro-batches can be in flight between their forward and backward: each
// has its activation slot (the schedule says how many a chunk needs).
//
// Every activation the backward pass needs is kept in memory laid out at construction (an arena
// of the model's own, or the regions a pipeline rank's chunks share: scratch for what one forward
// or backward uses and leaves, one slot per micro-batch in flight); the step loop allocates nothing. Parameter gradients accumulate (+=) into the fp32 gradient buffer,
// so micro-batches accumulate without extra passes and tied embeddings need no special case.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/model/moe.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"
#include "trainer/params/recompute.h"
#include "trainer/parallel/context_parallel.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/parallel/vocab_parallel.h"

namespace tetra {

class Communicator;
class MoeLayers;

// Sizes of what this rank computes. NH, NKV, F, FC, V, QKV are this rank's slice (the whole model
// when tp = 1); FC = F (gelu) or 2F (swiglu); QKV = (NH + 2 NKV) HS. Its vocabulary slice: the V
// real rows [v0, v0 + V) of the Vl rows it holds (Vl = the padded vocabulary / tp, v0 = tp_rank Vl;
// only the last rank has V < Vl); Vg = model.vocab_size. Ns = rows of the residual stream this
// rank holds (N / tp with sequence parallelism). With context parallelism T is this rank's
// seq_len / cp tokens of each sequence (context_parallel.h).
struct ModelDims {
  int64_t B, T, C, NH, NKV, HS, F, FC, V, L, QKV;
  int64_t Vl = 0, Vg = 0;
  int64_t tp = 1, tp_rank = 0, v0 = 0, Ns = 0, cp = 1;
  bool sp = false;
  int64_t l0 = 0;                   // first layer of this chunk (L is its layer count)
  bool first = true, last = true;   // holds the embedding / the head and loss
  int64_t N() const { return B * T; }
  static ModelDims from(const ModelConfig& m, int64_t micro_batch, int64_t tp = 1,
                        int64_t tp_rank = 0, bool sequence_parallel = false, int64_t cp = 1);
};

// Called during backward when the gradients of a parameter group (ParamSpec::group) are final
// for this micro-batch: the gradient buffer's reduction can start there.
using GroupDoneHook = std::function<void(int group)>;

// RoPE's inverse frequencies under model.rope_theta and model.rope_scaling.
math::RopeFreqs rope_freqs(const ModelConfig& m);

// Which part of the model a Gpt runs, and how many micro-batches it keeps activations for.
struct ChunkShape {
  int64_t l0 = 0, layers = -1;  // -1: every layer
  bool first = true, last = true;
  int64_t slots = 1;
  // Chunk `chunk` of the stage `layout` holds.
  static ChunkShape of(const ParamLayout& layout, int chunk, int64_t slots);
};

class Gpt {
 public:
  // `tp`: the tensor-parallel group (null = no tensor parallelism); the layout must be this
  // rank's slice of the model for that group. `chunk`: which of the layout's model chunks this is
  // (ParamLayout::stage); `slots`: micro-batches in flight between forward and backward. `ep`: the
  // expert-parallel group of a MoE model (null = every expert on this rank); the layout must hold
  // this rank's experts. `rc`: what backward recomputes instead of keeping (recompute.h).
  // `regions`: where the activations live, `slots` slots (activation_sizes_for() bytes of scratch
  // and per slot at least; a pipeline rank's chunks share one set); null: an arena of its own.
  // `etp`, `eshare`: folded experts' ETP and ESHARE groups (moe.h; null: unfolded, split over tp).
  Gpt(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t micro_batch,
      Communicator* tp = nullptr, int chunk = 0, int64_t slots = 1, Communicator* ep = nullptr,
      const Recomputation& rc = {}, int64_t loss_chunk = 0, const ActivationRegions* regions = nullptr,
      Communicator* cp = nullptr, CpComm cp_comm = CpComm::P2P, Communicator* etp = nullptr,
      Communicator* eshare = nullptr, int ep_chunks = 1);
  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  // Bytes of activation memory this model allocated itself (0 when it was given regions).
  size_t activation_bytes() const { return arena_bytes_; }
  // The scratch and one slot of a chunk of `shape` (its slot count aside), MoE state included:
  // what `regions` must hold at least.
  static ActivationSizes activation_sizes_for(const ModelConfig& cfg, DType act, int64_t micro_batch,
                                              int64_t tp = 1, bool sequence_parallel = false,
                                              const ChunkShape& shape = {}, int64_t ep = 1,
                                              const Recomputation& rc = {}, int64_t loss_chunk = 0,
                                              int64_t cp = 1, CpComm cp_comm = CpComm::P2P, int64_t etp = 0);
  // The arena of a chunk of `shape` that allocates its own: scratch + shape.slots slots.
  static size_t activation_bytes_for(const ModelConfig& cfg, DType act, int64_t micro_batch,
                                     int64_t tp = 1, bool sequence_parallel = false,
                                     const ChunkShape& shape = {}, int64_t ep = 1, const Recomputation& rc = {},
                                     int64_t loss_chunk = 0, int64_t cp = 1, CpComm cp_comm = CpComm::P2P,
                                     int64_t etp = 0);

  // tokens, targets: (B, T) int32 in backend memory. weights: the compute copy (type act) of the
  // parameter buffer. Writes per-token losses (N) F32. If `dloss_scale` != 0 the logits' gradient
  // (scaled by it) is kept for backward().
  void forward(const void* weights, const int32_t* tokens, const int32_t* targets, float* losses,
               float dloss_scale) {
    forward(weights, 0, tokens, targets, losses, dloss_scale);
  }
  // Pipeline form: micro-batch activations in `slot`; `tokens` read by the first stage only,
  // `targets` / `losses` by the last only; a non-first stage's input must be in input(slot).
  // With a loss chunk (the constructor's loss_chunk > 0) the last stage's output layer computes its
  // gradients in the forward: `grads` (the fp32 gradient buffer) receives its weight gradient
  // when dloss_scale != 0.
  void forward(const void* weights, int64_t slot, const int32_t* tokens, const int32_t* targets, float* losses,
               float dloss_scale, float* grads = nullptr);
  // Accumulates every parameter's gradient into `grads` (fp32, layout offsets). Requires the
  // immediately preceding forward() to have been run with dloss_scale != 0. `on_group_done`
  // (may be null) is called as each parameter group's gradients become final.
  void backward(const void* weights, float* grads, const int32_t* tokens,
                const GroupDoneHook* on_group_done = nullptr) {
    backward(weights, grads, 0, tokens, on_group_done, nullptr);
  }
  // Pipeline form: the forward of `slot` must have run (with dloss_scale != 0 on the last stage);
  // a non-last stage's output gradient must be in output_grad().
  // A non-first stage writes the gradient of its input (Ns, C) to `input_grad`.
  void backward(const void* weights, float* grads, int64_t slot, const int32_t* tokens,
                const GroupDoneHook* on_group_done, void* input_grad = nullptr);
  // Gradients sharded over data parallelism (ZeRO-2): forward's fused output layer and backward
  // write each gradient where `sink` says (grad_sink.h) instead of at `grads` + offset. Null: `grads`.
  void set_grad_sink(GradSink* sink) { sink_ = sink; }
  // ZeRO-3: the weights are read from `source` (grad_sink.h), told before each phase (the
  // embedding, each block, the final norm and output layer; forward, recomputation, backward)
  // which groups it reads; the `weights` arguments are then unused (null).
  void set_weight_source(WeightSource* source) { weights_ = source; }

  // Stage boundary activations, (Ns, C) of type act(): boundary_numel() elements each.
  int64_t boundary_numel() const { return d_.Ns * d_.C; }
  void* input(int64_t slot);              // where a non-first stage's input goes
  const void* output(int64_t slot) const; // a non-last stage's output after forward
  void* output_grad();                    // where a non-last stage's output gradient goes

  // Inference: the forward pass up to the logits, without loss or gradient. Afterwards logits()
  // holds this rank's vocabulary slice [v0, v0 + V) of every row, (N, V) of type act(), until the
  // next forward. With tensor parallelism every rank of the group calls it (its collectives), and
  // a caller that needs whole rows all-gathers the slices of those rows over the group.
  void forward_logits(const void* weights, const int32_t* tokens);  // needs the whole model
  const void* logits() const;
  DType act() const { return act_; }

  const ModelDims& dims() const { return d_; }
  // The MoE blocks (null for a dense model): routing statistics and aux / z losses.
  bool has_moe() const { return moe_ != nullptr; }
  // The MoE blocks' statistics since the last call, over every activation slot (and reset).
  MoeStepStats take_moe_stats();
  // The MoE blocks' expert biases (MoeLayers::expert_bias), their setting and their per-step
  // update (empty / nothing without model.moe.router_enable_expert_bias).
  std::map<int64_t, std::vector<float>> moe_expert_bias() const;
  void set_moe_expert_bias(const std::map<int64_t, std::vector<float>>& bias);
  void update_moe_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert);

  struct Acts;  // activation pointers into the arena (gpt.cpp)

 private:
  const void* w(const void* weights, int64_t offset) const;
  // Embedding (first stage) and the chunk's blocks, into slot `slot`.
  void forward_blocks(const void* weights, int64_t slot, const int32_t* tokens);
  // Block l of the chunk on slot `slot`'s activations; `recompute`: again in backward (a full
  // recomputation unit's; a MoE block's routing and experts are not rerun).
  void forward_layer(const void* weights, int64_t slot, int64_t l, bool recompute);
  // model.qk_norm: q and k normalised per head in place in the layer's qkv, and its backward in dqkv.
  void qk_norm_forward(const void* weights, const BlockParams& p, int64_t slot, int64_t l);
  void qk_norm_backward(const void* weights, const GradTarget& grads, const BlockParams& p, int64_t slot, int64_t l);
  // Final norm and output layer (last stage): the logits of slot `slot`.
  void forward_head(const void* weights, int64_t slot);
  VocabSlice vocab() const { return {d_.v0, d_.V}; }  // this rank's vocabulary rows

  const ModelConfig& cfg_;
  const ParamLayout& layout_;
  Backend& be_;
  std::unique_ptr<TensorParallel> tp_;  // the TP group's communication (identity without one)
  std::unique_ptr<ContextParallel> cp_;  // ring attention over the CP group (plain attention without one)
  // Causal attention of a layer's qkv: over the CP group's whole sequence with context parallelism.
  void attention_forward(void* att, float* lse, const void* qkv);
  void attention_backward(void* dqkv, const void* datt, const void* qkv, const void* att, const float* lse);
  DType act_;
  ModelDims d_;
  NormKind norm_;
  float eps_;
  bool rope_;    // position == Position::ROPE
  math::RopeFreqs rope_freqs_;
  bool swiglu_;  // activation == Activation::SWIGLU
  Recomputation rc_;
  RecomputeUnits units_;         // of this chunk's layers
  std::vector<bool> moe_layer_;  // per chunk layer: a MoE block
  GradSink* sink_ = nullptr;
  WeightSource* weights_ = nullptr;
  void require(const std::vector<int>& groups) {
    if (weights_) weights_->require(groups);
  }
  std::vector<int> head_groups() const;  // the final norm's and output layer's groups
  std::vector<int> block_groups(int64_t l) const;  // block l's group, and its experts' (MoE)
  int64_t loss_chunk_ = 0;       // rows per chunk of the fused output layer and loss (0: unfused)
  size_t arena_bytes_ = 0;
  BackendBuffer arena_;
  std::unique_ptr<Acts> a_;
  std::unique_ptr<MoeLayers> moe_;  // the MoE blocks (MoE models), their state per activation slot
  bool moe_local_ = false;           // they run on the rank's own rows (moe_local_rows)
  float moe_loss_weight_ = 0.0f;  // forward(): the weight of the micro-batch's mean loss
};

}  // namespace tetra
