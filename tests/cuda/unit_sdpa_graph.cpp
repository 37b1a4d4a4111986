// The cuDNN SDPA graphs Tetra builds (kernels/cuda/sdpa_graph.h), node by node, against the graphs
// cudnn-frontend's SDPA nodes lower to: cuDNN's fused engines match those graphs and refuse near
// misses (a virtual softmax_sum, an extra pointwise node), and without a GPU nothing else would
// notice. Runs on any machine (no GPU, no cuDNN call).
//
// The expected lists are cudnn-frontend's own lowering, transcribed from
// include/cudnn_frontend/node/scaled_dot_product_flash_attention.h (SDPANode::expand_node for the
// forward with causal mask and generate_stats, SDPABackwardNode::expand_node for the backward,
// no dropout, no bias, top-left causal mask), with the causal mask as
// utils/attn_score_modifiers.h's causal_mask lowers through node/diagonal_band_mask.h (right
// bound 0: row >= col, then binary_select) and the softmax as node/softmax.h lowers it (Max, sub,
// exp, sum, log, add for Stats, div). Node names are the frontend's.
#define CATCH_CONFIG_CONSOLE_WIDTH 200  // as tests/unit/main.cpp
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/sdpa_graph.h"

namespace tetra::cuda::sdpa {
namespace {

std::string lines_of(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

void require_nodes(const Graph& g, const std::vector<std::string>& expected) {
  const std::vector<std::string> got = describe(g);
  INFO("built:\n" << lines_of(got) << "expected (cudnn-frontend):\n" << lines_of(expected));
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("node " << i);
    REQUIRE(got[i] == expected[i]);
  }
}

// Every uid is defined once, every node's tensors exist, virtual uids are >= kFirstVirtual, and the
// non-virtual tensors are exactly the variant pack's.
void require_well_formed(const Graph& g, const std::set<int64_t>& variant_pack) {
  std::set<int64_t> uids, real;
  for (const Tensor& t : g.tensors) {
    INFO(t.name);
    REQUIRE(uids.insert(t.uid).second);
    REQUIRE(t.is_virtual == (t.uid >= kFirstVirtual));
    if (!t.is_virtual) real.insert(t.uid);
  }
  REQUIRE(real == variant_pack);
  for (const Node& n : g.nodes) {
    INFO(n.name);
    for (int64_t in : n.inputs) REQUIRE(uids.count(in) == 1);
    REQUIRE(uids.count(n.output) == 1);
  }
}

void require_tensor(const Graph& g, const std::string& name, DataType type, Shape4 dims,
                    Shape4 strides, bool is_virtual) {
  INFO(name);
  const Tensor* t = g.find(name);
  REQUIRE(t != nullptr);
  CHECK(t->type == type);
  CHECK(t->dims == dims);
  CHECK(t->strides == strides);
  CHECK(t->is_virtual == is_virtual);
}

const std::vector<std::string> kMask = {
    "gen_row_index: pointwise GEN_INDEX({s}) -> gen_row_index (i32, virtual)",
    "gen_col_index: pointwise GEN_INDEX({s}) -> gen_col_index (i32, virtual)",
    "row>col: pointwise CMP_GE(gen_row_index, gen_col_index) -> row>col (bool, virtual)",
    "binary_select: pointwise BINARY_SELECT({s}, mask_value, row>col) -> binary_select (f32, virtual)",
};

std::vector<std::string> with_mask(std::vector<std::string> head, const std::string& scaled,
                                   const std::vector<std::string>& tail) {
  for (std::string line : kMask) {
    for (size_t at; (at = line.find("{s}")) != std::string::npos;) line.replace(at, 3, scaled);
    head.push_back(line);
  }
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

std::vector<std::string> expected_forward() {
  return with_mask({"bmm1: matmul(Q, K) -> bmm1 (f32, virtual)",
                    "attn_scale: pointwise MUL(bmm1, attn_scale) -> attn_scale (f32, virtual)"},
                   "attn_scale",
                   {"Max: reduction MAX(binary_select) -> Max (f32, virtual)",
                    "sub: pointwise SUB(binary_select, Max) -> sub (f32, virtual)",
                    "exp: pointwise EXP(sub) -> exp (f32, virtual)",
                    "sum: reduction SUM(exp) -> sum (f32, virtual)",
                    "log: pointwise LOG(sum) -> log (f32, virtual)",
                    "add: pointwise ADD(Max, log) -> Stats (f32)",
                    "div: pointwise DIV(exp, sum) -> div (io, virtual)",
                    "bmm2: matmul(div, V) -> O (io)"});
}

std::vector<std::string> expected_backward(bool gqa) {
  std::vector<std::string> tail = {
      "sub_s_m: pointwise SUB(binary_select, Stats) -> sub_s_m (f32, virtual)",
      "exp_s: pointwise EXP(sub_s_m) -> exp_s (f32, virtual)",
      "reshape_p: reshape(exp_s) -> reshape_p (io, virtual)"};
  if (gqa) {
    tail.push_back("matmul_pT_dO: matmul(reshape_p, dO) -> dV_fullhead (io, virtual)");
    tail.push_back("red_dV_head: reduction SUM(dV_fullhead) -> dV (io)");
  } else {
    tail.push_back("matmul_pT_dO: matmul(reshape_p, dO) -> dV (io)");
  }
  // dP goes straight from its matmul into the subtraction (no "dP * 1" node).
  for (const char* l :
       {"matmul_dO_VT: matmul(dO, V) -> matmul_dO_VT (f32, virtual)",
        "sub_dP_softmax_sum: pointwise SUB(matmul_dO_VT, softmax_sum) -> sub_dP_softmax_sum (f32, virtual)",
        "mul_dP_exp_s: pointwise MUL(sub_dP_softmax_sum, exp_s) -> mul_dP_exp_s (f32, virtual)",
        "mul_dS_attn_scale: pointwise MUL(mul_dP_exp_s, attn_scale) -> mul_dS_attn_scale (f32, virtual)",
        "reshape_dS: reshape(mul_dS_attn_scale) -> reshape_dS (io, virtual)"})
    tail.push_back(l);
  if (gqa) {
    tail.push_back("matmul_dST_Q: matmul(reshape_dS, Q) -> dK_fullhead (io, virtual)");
    tail.push_back("red_dK_head: reduction SUM(dK_fullhead) -> dK (io)");
  } else {
    tail.push_back("matmul_dST_Q: matmul(reshape_dS, Q) -> dK (io)");
  }
  tail.push_back("reshape_k: reshape(K) -> reshape_k (io, virtual)");
  tail.push_back("matmul_dS_K: matmul(mul_dS_attn_scale, reshape_k) -> dQ (io)");
  // softmax_sum = rowsum(dO * O) * 1: a real fp32 tensor (the frontend sets it non-virtual).
  return with_mask({"mul_dO_O: pointwise MUL(dO, O) -> mul_dO_O (f32, virtual)",
                    "reduce_dO_o: reduction SUM(mul_dO_O) -> reduce_dO_o (f32, virtual)",
                    "scale_dropout_inv: pointwise MUL(reduce_dO_o, one) -> softmax_sum (f32)",
                    "matmul_Q_KT: matmul(Q, K) -> matmul_Q_KT (f32, virtual)",
                    "mul_s_attn_scale: pointwise MUL(matmul_Q_KT, attn_scale) -> mul_s_attn_scale (f32, virtual)"},
                   "mul_s_attn_scale", tail);
}

// The views into qkv / out of sdpa_graph.h's header comment, for one shape.
void require_views(const Graph& g, const Shape& s, bool backward) {
  const int64_t B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HS = s.HS, row = (NH + 2 * NKV) * HS;
  require_tensor(g, "Q", DataType::IO, {B, NH, T, HS}, {T * row, HS, row, 1}, false);
  require_tensor(g, "K", DataType::IO, {B, NKV, HS, T}, {T * row, HS, 1, row}, false);
  if (backward)
    require_tensor(g, "V", DataType::IO, {B, NKV, HS, T}, {T * row, HS, 1, row}, false);
  else
    require_tensor(g, "V", DataType::IO, {B, NKV, T, HS}, {T * row, HS, row, 1}, false);
  require_tensor(g, "O", DataType::IO, {B, NH, T, HS}, {T * NH * HS, HS, NH * HS, 1}, false);
  require_tensor(g, "Stats", DataType::FLOAT, {B, NH, T, 1}, {NH * T, T, 1, 1}, false);
  const Shape4 scalar = {1, 1, 1, 1};
  for (const char* name : {"attn_scale", "mask_value"}) {
    INFO(name);
    const Tensor* t = g.find(name);
    REQUIRE(t != nullptr);
    CHECK(t->by_value);
    CHECK(t->dims == scalar);
  }
}

}  // namespace

TEST_CASE("cuDNN SDPA forward graph: cudnn-frontend's lowering, causal, MHA and GQA", "[cuda][sdpa]") {
  for (const Shape s : {Shape{2, 128, 4, 4, 64}, Shape{1, 257, 8, 2, 128}, Shape{3, 64, 8, 1, 32}}) {
    INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " NKV=" << s.NKV << " HS=" << s.HS);
    const Graph g = forward_graph(s);
    require_nodes(g, expected_forward());
    require_well_formed(g, {kQ, kK, kV, kO, kStats, kScale, kMaskValue});
    require_views(g, s, false);
    const int64_t B = s.B, T = s.T, NH = s.NH;
    require_tensor(g, "bmm1", DataType::FLOAT, {B, NH, T, T}, {NH * T * T, T * T, T, 1}, true);
    require_tensor(g, "Max", DataType::FLOAT, {B, NH, T, 1}, {NH * T, T, 1, 1}, true);
    require_tensor(g, "div", DataType::IO, {B, NH, T, T}, {NH * T * T, T * T, T, 1}, true);
    const Node* row = g.node("gen_row_index");
    const Node* col = g.node("gen_col_index");
    REQUIRE(row != nullptr);
    REQUIRE(col != nullptr);
    CHECK(row->axis == 2);
    CHECK(col->axis == 3);
  }
}

TEST_CASE("cuDNN SDPA backward graph: cudnn-frontend's lowering, causal, MHA and GQA", "[cuda][sdpa]") {
  for (const Shape s : {Shape{2, 128, 4, 4, 64}, Shape{1, 257, 8, 2, 128}, Shape{3, 64, 8, 1, 32}}) {
    const bool gqa = s.NH != s.NKV;
    INFO("B=" << s.B << " T=" << s.T << " NH=" << s.NH << " NKV=" << s.NKV << " HS=" << s.HS);
    const Graph g = backward_graph(s);
    require_nodes(g, expected_backward(gqa));
    require_well_formed(g, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kMaskValue, kOne,
                            kSoftmaxSum});
    require_views(g, s, true);
    const int64_t B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HS = s.HS, row = (NH + 2 * NKV) * HS;
    // softmax_sum: real, fp32, (B, NH, T, 1) with strides (NH T, T, 1, 1), as the frontend sizes it.
    require_tensor(g, "softmax_sum", DataType::FLOAT, {B, NH, T, 1}, {NH * T, T, 1, 1}, false);
    require_tensor(g, "dO", DataType::IO, {B, NH, T, HS}, {T * NH * HS, HS, NH * HS, 1}, false);
    require_tensor(g, "dQ", DataType::IO, {B, NH, T, HS}, {T * row, HS, row, 1}, false);
    require_tensor(g, "dK", DataType::IO, {B, NKV, T, HS}, {T * row, HS, row, 1}, false);
    require_tensor(g, "dV", DataType::IO, {B, NKV, T, HS}, {T * row, HS, row, 1}, false);
    // P^T and dS^T: (B, NH, s_kv, s_q) views with strides (NH T T, T T, 1, T), in the io type.
    for (const char* name : {"reshape_p", "reshape_dS"})
      require_tensor(g, name, DataType::IO, {B, NH, T, T}, {NH * T * T, T * T, 1, T}, true);
    // K again as (B, NKV, s_kv, d): K^T's dims and strides with the last two swapped.
    require_tensor(g, "reshape_k", DataType::IO, {B, NKV, T, HS}, {T * row, HS, row, 1}, true);
    if (gqa)
      for (const char* name : {"dV_fullhead", "dK_fullhead"})
        require_tensor(g, name, DataType::IO, {B, NH, T, HS}, {NH * T * HS, T * HS, HS, 1}, true);
    const Tensor* one = g.find("one");
    REQUIRE(one != nullptr);
    CHECK(one->by_value);
  }
}

}  // namespace tetra::cuda::sdpa
