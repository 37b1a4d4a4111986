// Where every parameter of the model lives in the one contiguous parameter buffer of a rank.
//
// Parameters are laid out back to back (each padded to 16 elements, 64 bytes in fp32) in a fixed
// order derived from the config alone. The same offsets index the fp32 master weights, the
// compute copy, the fp32 gradients and both Adam moments, which is what lets the optimizer and the
// gradient norm run over single contiguous buffers. Names follow the PyTorch state-dict style
// ("layers.3.attn.qkv.weight") and are the keys of exported weights and checkpoints.
//
// Tensor parallelism (Megatron-LM): with tp > 1 a rank's buffer holds its slice of each
// parameter, and each ParamSpec says which part of the global tensor that slice is:
//   column-parallel (Y = X A, A = [A_1 ... A_p], A stored as (out, in) so split by rows):
//     qkv.weight/bias   rows of this rank's query heads, then of its key heads, then of its
//                       value heads (three row blocks of the global (NH + 2 NKV) HS rows)
//     fc.weight/bias    rows [r F/p, (r+1) F/p) (gelu); swiglu: that block of the gate rows and of
//                       the up rows, so the local tensor is again [gate | up]
//     wte, lm_head      vocabulary rows [r Vl, (r+1) Vl), Vl = the padded vocabulary / p
//                       (vocab-parallel embedding and loss); the last rank's rows from
//                       model.vocab_size on are padding: local rows past its row block, part of
//                       no global tensor (ParamSpec::pad_rows)
//   row-parallel (Y = X A, A = [A_1; ...; A_p], split by columns of the (out, in) storage):
//     attn.proj.weight, mlp.proj.weight
//   replicated: norms, position embeddings, the biases of row-parallel layers.
//
// Parameters are grouped (embedding, each block, the final norm + output layer) and each group
// starts at a multiple of `group_align` elements: gradient buckets are unions of groups, so with
// group_align = 16 dp every bucket splits into dp equal, aligned shards (distributed optimizer).
//
// Pipeline parallelism: a rank's buffer holds only its stage's parameters (StageSlice): the
// blocks of its model chunks, the embedding on the first stage, the final norm and output layer
// on the last. Groups are numbered in buffer order over what the rank holds. With tied
// embeddings and more than one stage, the last stage holds its own copy of embedding.wte for the
// output layer (Megatron's word_embeddings_for_head): initialised like the original, its gradient
// summed with the first stage's over the embedding group, so the two stay identical; checkpoints
// and gradient norms count only the first stage's (ParamSpec::stage_copy).
// Mixture of Experts (model.moe): a MoE block holds a router (layers.l.mlp.router.weight, (E, C),
// replicated, in the block's group) instead of the dense MLP, and its experts as global 3-D
// tensors layers.l.mlp.experts.fc.weight (E, FC, C), .fc.bias (E, FC), .proj.weight (E, C, F),
// .proj.bias (E, C). A shared expert (model.moe.shared_expert_ffn_hidden_size) is a dense MLP of the
// block's group, named and split over TP as the dense MLP is (layers.l.mlp.shared_expert.fc.weight,
// .fc.bias, .proj.weight, .proj.bias), with its gate layers.l.mlp.shared_expert_gate.weight (1, C)
// replicated like the router. Expert parallelism over ep ranks: rank r holds experts [r E/ep, (r+1) E/ep),
// i.e. row blocks of the tensors' 2-D views (every dim but the last flattened into rows); with
// tp > 1 each expert is split like the dense MLP (fc: row blocks of each expert's gate and up
// rows; fc.bias a column range, with swiglu two per expert, of its gate and of its up columns, so
// the local row is again [gate | up]; proj.weight a column range; proj.bias replicated). All
// expert tensors come after every dense group, one group per MoE layer (groups L + 2, ...), so
// [expert_begin, total) is one contiguous range whose gradients reduce over the expert-DP group
// while [0, expert_begin) reduces over DP.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

enum class ParamInit : uint8_t { NORMAL, NORMAL_SCALED, ZEROS, ONES };

// A run of elements of the parameter buffer (or of the grad buffer, which has the same layout):
// a bucket, a parameter, or the part of the buffer one rank's optimizer owns.
struct GradRange {
  int64_t offset = 0, numel = 0;  // elements of the parameter buffer
};

// Rows [global_start, global_start + rows) of the global tensor's 2-D view; with cols > 0 only
// its columns [col0, col0 + cols) (else the spec's col_start and local columns). A block with a
// column range of its own is a rectangle stored row-major after the blocks before it: what lets a
// local row be made of two global column ranges (a swiglu expert's fc bias under TP, [gate | up]).
struct RowBlock {
  int64_t global_start = 0, rows = 0;
  int64_t col0 = 0, cols = 0;
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;         // this rank's slice
  std::vector<int64_t> global_shape;  // the whole tensor
  // The slice, in the 2-D view (rows = product of every dim but the last, cols = the last; a 1-D
  // tensor is n x 1): the concatenation of `row_blocks` of the global rows (all rows when empty),
  // restricted to columns [col_start, col_start + local cols) (col_start 0 for 1-D tensors), or
  // to a block's own column range (RowBlock::cols > 0).
  std::vector<RowBlock> row_blocks;
  int64_t col_start = 0;
  // Local rows after the row blocks that are no part of the global tensor: the vocabulary's
  // padding (ModelConfig::padded_vocab_size), zero, never read by the model, never saved. Local
  // elements [held(), numel) are these.
  int64_t pad_rows = 0;
  int64_t offset = 0;  // in elements, into every parameter-sized buffer
  int64_t numel = 0;
  int group = 0;       // 0 embedding, 1 + l block l, L + 1 final norm and output layer,
                       // L + 2 + j the experts of the j-th MoE block
  ParamInit init = ParamInit::NORMAL;
  bool weight_decay = false;  // 2-D weights except position embeddings
  bool matmul = false;        // counted in the 6N FLOPs of a training step
  bool tp_split = false;      // each TP rank holds a different slice, or the tensor padded (else a
                              // replica); of an expert tensor: each expert-TP (ETP) rank
  bool expert = false;        // an expert tensor (MoE): reduced over expert-DP, split over EP
  bool ep_split = false;      // each EP rank holds different experts
  bool sp_partial = false;    // each TP rank's gradient is a partial sum, all-reduced over TP: of
                              // its sequence shard (norm weights and biases, with sequence
                              // parallelism), or of its heads (the q/k norms, whenever tp > 1)
  bool stage_copy = false;    // the last pipeline stage's copy of a tied embedding

  // Local elements that are elements of the global tensor (all but the padding), [0, held()).
  int64_t held() const;
  // Flat index into the global tensor of local element `i` < held() (row-major in both).
  int64_t global_index(int64_t i) const;
  // The local tensor as rectangles of the global 2-D view, in local order, each row-major: the
  // row blocks with their column ranges resolved (cols > 0), or the whole local tensor's rows.
  std::vector<RowBlock> blocks() const;
};

// Offsets of one transformer block's parameters (-1 where the config has no such parameter).
struct BlockParams {
  int64_t norm1_w = -1, norm1_b = -1;
  int64_t qkv_w = -1, qkv_b = -1;
  int64_t q_norm_w = -1, k_norm_w = -1;  // model.qk_norm: (HS) each, shared by the heads
  int64_t attn_proj_w = -1, attn_proj_b = -1;
  int64_t norm2_w = -1, norm2_b = -1;
  int64_t fc_w = -1, fc_b = -1;
  int64_t mlp_proj_w = -1, mlp_proj_b = -1;
  // MoE blocks (moe == true; fc_w .. mlp_proj_b are then -1): the router (E, C) and this rank's
  // experts, local tensors (El, FC, C), (El, FC), (El, C, F), (El, C).
  bool moe = false;
  int64_t router_w = -1;
  int64_t experts_fc_w = -1, experts_fc_b = -1, experts_proj_w = -1, experts_proj_b = -1;
  // The shared expert (model.moe.shared_expert_ffn_hidden_size > 0), this rank's TP slices as the
  // dense MLP's: fc (FSC_l, C), (FSC_l), proj (C, FS_l), (C); its gate (1, C) replicated.
  int64_t shared_fc_w = -1, shared_fc_b = -1, shared_proj_w = -1, shared_proj_b = -1;
  int64_t shared_gate_w = -1;
  int expert_group = -1;  // the group of the block's experts
};

struct TensorSlicing {
  int64_t tp = 1, tp_rank = 0;
  bool sequence_parallel = false;
  int64_t group_align = 16;  // elements; a multiple of 16
  int64_t ep = 1, ep_rank = 0;  // expert parallelism (MoE models only)
  // The experts' tensor parallelism (a divisor of tp; 0: tp) and this rank's place in it.
  int64_t etp = 0, etp_rank = -1;  // etp_rank -1: tp_rank % etp
  int64_t expert_tp() const { return etp > 0 ? etp : tp; }
  int64_t expert_tp_rank() const { return etp_rank >= 0 ? etp_rank : tp_rank % expert_tp(); }
};

// The layers a pipeline rank holds: one [begin, end) range per model chunk, in chunk order
// (empty: every layer, one chunk); `first` / `last`: it holds the embedding / the final norm and
// output layer.
struct StageSlice {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  bool first = true, last = true;
};

struct ParamLayout {
  std::vector<ParamSpec> params;
  int64_t total = 0;  // elements, including padding
  int64_t wte = -1, wpe = -1, final_norm_w = -1, final_norm_b = -1, lm_head = -1;
  std::vector<BlockParams> blocks;  // every layer of the model; offsets -1 where not held
  // Element range [begin, end) of each group this rank holds, in buffer order, multiples of
  // group_align; and which group holds the embedding, each layer, the head (-1: not held).
  std::vector<std::pair<int64_t, int64_t>> groups;
  int embedding_group = -1, head_group = -1;
  std::vector<int> layer_group;
  TensorSlicing slicing;
  StageSlice stage;
  // MoE: [expert_begin, total) holds every expert tensor (== total for a dense model), and the
  // groups from dense_groups on are expert groups (dense_groups == groups.size() when dense).
  int64_t expert_begin = 0;
  int dense_groups = 0;

  static ParamLayout build(const ModelConfig& m, const TensorSlicing& slicing = {}, const StageSlice& stage = {});
  int64_t count() const;          // parameters (without any padding) in this rank's buffer
  // The group holding element `offset` of the buffer (an offset in none is a bug: TETRA_CHECK).
  int group_of(int64_t offset) const;
  int64_t matmul_count() const;   // parameters of matrix multiplies, lm_head / tied wte included
  // Matmul parameters one token goes through: experts count top_k / num_experts of theirs.
  double active_matmul_count(const ModelConfig& m) const;
  double active_count(const ModelConfig& m) const;  // all parameters, experts weighted alike
  // Offset of the output projection (lm_head, or wte when embeddings are tied).
  int64_t output_weight() const { return lm_head >= 0 ? lm_head : wte; }
  const ParamSpec* find(const std::string& name) const;
};

// Fills `master` (fp32, layout.total elements, host memory) with this rank's initial weights.
// Element n of a global parameter is a pure function of (seed, parameter name, n), and a rank
// generates exactly the elements of its slice: every parallel layout starts from the same model.
void init_params(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, float* master);
// The same values for the elements [first, first + count) of the layout's buffer only, into
// out[0, count) (host memory): a shard's initial weights, bit for bit the whole buffer's there.
void init_params_range(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, int64_t first, int64_t count,
                       float* out);

}  // namespace tetra
