// The operation graphs Tetra asks cuDNN's fused SDPA engines for, as plain data: which tensors
// (uid, data type, dims, strides, virtual or not) and which nodes (matmul, pointwise, reduction,
// reshape), in order. attention_cudnn.cu lowers them one to one into cuDNN backend descriptors;
// tests/cuda/unit_sdpa_graph.cpp checks them, without a GPU, against the graphs cudnn-frontend's
// SDPA nodes lower to (scaled_dot_product_flash_attention.h: SDPANode and SDPABackwardNode, with
// the causal mask of attn_score_modifiers.h / diagonal_band_mask.h and softmax.h), since cuDNN's
// engines recognise those graphs and refuse near misses.
//
// Layout (kernels/backend.h): qkv (B, T, (NH + 2 NKV) HS) holds per token NH query heads, then
// NKV key heads, then NKV value heads; out / dout (B, T, NH HS); lse (B, NH, T). With
// row = (NH + 2 NKV) HS the views are, as (dims) strides:
//   Q   (B, NH, T, HS)   (T row, HS, row, 1)        from qkv
//   K^T (B, NKV, HS, T)  (T row, HS, 1, row)        from qkv + NH HS (V^T the same from + (NH+NKV) HS)
//   V   (B, NKV, T, HS)  (T row, HS, row, 1)        dQ, dK, dV the same views into dqkv
//   O   (B, NH, T, HS)   (T NH HS, HS, NH HS, 1)    dO the same
//   Stats, softmax_sum (B, NH, T, 1) (NH T, T, 1, 1)
//
// Forward (frontend node names):  S = bmm1(Q, K^T) * attn_scale; causal mask (gen_row_index,
//   gen_col_index, row>col: row >= col, binary_select: keep ? S : mask_value); softmax: Max,
//   sub, exp, sum, log, add (Stats = max + log sum), div (P in the io type); O = bmm2(P, V).
// Backward: softmax_sum = rowsum(dO * O) * 1 (mul_dO_O, reduce_dO_o, scale_dropout_inv), a real
//   fp32 tensor (the frontend marks it non-virtual and backs it with workspace; the backend backs
//   it with its (B, NH, T) scratch); S as forward; P = exp(S - Stats); dV = P^T dO (summed over
//   a kv head's query heads with GQA); dP = dO V^T; dS = (dP - softmax_sum) * P * attn_scale;
//   dK = dS^T Q (GQA: summed likewise); dQ = dS K, written directly (no fp32 dQ accumulator:
//   the deterministic dP-workspace backward).
//
// Every tensor is fp32 except Q, K, V, O, dO, dQ, dK, dV, P before bmm2 / its transpose before
// matmul_pT_dO and dS^T, and the per-head dK / dV of GQA before their reduction, which have the
// io type (bf16 or fp16); the index tensors are int32 and the mask boolean.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace tetra::cuda::sdpa {

using Shape4 = std::array<int64_t, 4>;

enum class DataType : uint8_t { IO, FLOAT, INT32, BOOLEAN };  // IO: bf16 or fp16, chosen at lowering
enum class Kind : uint8_t { MATMUL, POINTWISE, REDUCTION, RESHAPE };
enum class Mode : uint8_t { NONE, MUL, SUB, ADD, DIV, EXP, LOG, GEN_INDEX, CMP_GE, BINARY_SELECT, SUM, MAX };

// The uids of the variant pack (the non-virtual tensors); virtual tensors count up from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kMaskValue, kDO, kDQ, kDK, kDV, kOne, kSoftmaxSum,
  kFirstVirtual = 100
};

struct Tensor {
  std::string name;
  int64_t uid = 0;
  DataType type = DataType::FLOAT;
  Shape4 dims{}, strides{};
  bool is_virtual = false;
  bool by_value = false;  // a host scalar in the variant pack (attn_scale, mask_value, one)
};

struct Node {
  std::string name;  // cudnn-frontend's name for the node
  Kind kind = Kind::POINTWISE;
  Mode mode = Mode::NONE;
  std::vector<int64_t> inputs;  // uids: x, b, t for pointwise; a, b for matmul; x otherwise
  int64_t output = 0;
  DataType precision = DataType::FLOAT;  // pointwise math precision
  int64_t axis = -1;                     // GEN_INDEX only
};

struct Graph {
  std::vector<Tensor> tensors;
  std::vector<Node> nodes;

  const Tensor& tensor(int64_t uid) const {
    for (const Tensor& t : tensors)
      if (t.uid == uid) return t;
    static const Tensor none{"?"};
    return none;
  }
  const Tensor* find(const std::string& name) const {
    for (const Tensor& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  const Node* node(const std::string& name) const {
    for (const Node& n : nodes)
      if (n.name == name) return &n;
    return nullptr;
  }
};

struct Shape {
  int64_t B, T, NH, NKV, HS;
};

inline const char* mode_name(Mode m) {
  switch (m) {
    case Mode::NONE: return "";
    case Mode::MUL: return "MUL";
    case Mode::SUB: return "SUB";
    case Mode::ADD: return "ADD";
    case Mode::DIV: return "DIV";
    case Mode::EXP: return "EXP";
    case Mode::LOG: return "LOG";
    case Mode::GEN_INDEX: return "GEN_INDEX";
    case Mode::CMP_GE: return "CMP_GE";
    case Mode::BINARY_SELECT: return "BINARY_SELECT";
    case Mode::SUM: return "SUM";
    case Mode::MAX: return "MAX";
  }
  return "?";
}
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::MATMUL: return "matmul";
    case Kind::POINTWISE: return "pointwise";
    case Kind::REDUCTION: return "reduction";
    case Kind::RESHAPE: return "reshape";
  }
  return "?";
}
inline const char* type_name(DataType t) {
  switch (t) {
    case DataType::IO: return "io";
    case DataType::FLOAT: return "f32";
    case DataType::INT32: return "i32";
    case DataType::BOOLEAN: return "bool";
  }
  return "?";
}

// One line per node, in graph order: "name: kind MODE(in, ...) -> out (type[, virtual])".
inline std::vector<std::string> describe(const Graph& g) {
  std::vector<std::string> lines;
  for (const Node& n : g.nodes) {
    std::string s = n.name + ": " + kind_name(n.kind);
    if (n.mode != Mode::NONE) s += std::string(" ") + mode_name(n.mode);
    s += "(";
    for (size_t i = 0; i < n.inputs.size(); ++i) s += (i ? ", " : "") + g.tensor(n.inputs[i]).name;
    const Tensor& out = g.tensor(n.output);
    s += ") -> " + out.name + " (" + type_name(out.type) + (out.is_virtual ? ", virtual" : "") + ")";
    lines.push_back(s);
  }
  return lines;
}

namespace detail {

class Builder {
 public:
  explicit Builder(const Shape& s) : s_(s) {
    const int64_t B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, HS = s.HS;
    const int64_t row = (NH + 2 * NKV) * HS;
    q_dims = {B, NH, T, HS};
    kv_dims = {B, NKV, T, HS};
    kt_dims = {B, NKV, HS, T};
    s_dims = {B, NH, T, T};
    r_dims = {B, NH, T, 1};
    qkv_strides = {T * row, HS, row, 1};
    kt_strides = {T * row, HS, 1, row};
    o_strides = {T * NH * HS, HS, NH * HS, 1};
    s_strides = {NH * T * T, T * T, T, 1};
    st_strides = {NH * T * T, T * T, 1, T};  // the (T, T) matrices transposed
    r_strides = {NH * T, T, 1, 1};
    packed = {NH * T * HS, T * HS, HS, 1};  // (B, NH, T, HS) per-head dK / dV
  }

  int64_t real(const std::string& name, int64_t uid, DataType type, Shape4 dims, Shape4 strides) {
    g.tensors.push_back({name, uid, type, dims, strides, false, false});
    return uid;
  }
  int64_t scalar(const std::string& name, int64_t uid) {
    g.tensors.push_back({name, uid, DataType::FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true});
    return uid;
  }
  int64_t virt(const std::string& name, DataType type, Shape4 dims, Shape4 strides) {
    const int64_t uid = next_virtual_++;
    g.tensors.push_back({name, uid, type, dims, strides, true, false});
    return uid;
  }

  // Each op names its node; a new virtual output takes the node's name.
  int64_t pointwise(const std::string& name, Mode mode, std::vector<int64_t> in, int64_t out,
                    DataType precision = DataType::FLOAT, int64_t axis = -1) {
    g.nodes.push_back({name, Kind::POINTWISE, mode, std::move(in), out, precision, axis});
    return out;
  }
  int64_t pointwise(const std::string& name, Mode mode, std::vector<int64_t> in, DataType type,
                    Shape4 dims, Shape4 strides, DataType precision = DataType::FLOAT,
                    int64_t axis = -1) {
    return pointwise(name, mode, std::move(in), virt(name, type, dims, strides), precision, axis);
  }
  int64_t reduction(const std::string& name, Mode mode, int64_t x, int64_t out) {
    g.nodes.push_back({name, Kind::REDUCTION, mode, {x}, out});
    return out;
  }
  int64_t matmul(const std::string& name, int64_t a, int64_t b, int64_t out) {
    g.nodes.push_back({name, Kind::MATMUL, Mode::NONE, {a, b}, out});
    return out;
  }
  int64_t reshape(const std::string& name, int64_t x, int64_t out) {
    g.nodes.push_back({name, Kind::RESHAPE, Mode::NONE, {x}, out});
    return out;
  }

  // S = Q K^T * attn_scale, causally masked (the frontend's bmm1 / matmul_Q_KT, then its
  // diagonal band mask with right bound 0: keep row >= col).
  int64_t masked_scores(const char* matmul_name, const char* scale_name, int64_t q, int64_t kt,
                        int64_t attn_scale, int64_t mask_value) {
    const auto F = DataType::FLOAT;
    int64_t s = matmul(matmul_name, q, kt, virt(matmul_name, F, s_dims, s_strides));
    s = pointwise(scale_name, Mode::MUL, {s, attn_scale}, F, s_dims, s_strides);
    const int64_t row = pointwise("gen_row_index", Mode::GEN_INDEX, {s}, DataType::INT32, s_dims,
                                  s_strides, DataType::INT32, 2);
    const int64_t col = pointwise("gen_col_index", Mode::GEN_INDEX, {s}, DataType::INT32, s_dims,
                                  s_strides, DataType::INT32, 3);
    const int64_t keep = pointwise("row>col", Mode::CMP_GE, {row, col}, DataType::BOOLEAN, s_dims,
                                   s_strides, DataType::BOOLEAN);
    return pointwise("binary_select", Mode::BINARY_SELECT, {s, mask_value, keep}, F, s_dims,
                     s_strides);
  }

  Graph g;
  Shape4 q_dims, kv_dims, kt_dims, s_dims, r_dims;
  Shape4 qkv_strides, kt_strides, o_strides, s_strides, st_strides, r_strides, packed;

 private:
  Shape s_;
  int64_t next_virtual_ = kFirstVirtual;
};

}  // namespace detail

inline Graph forward_graph(const Shape& s) {
  detail::Builder b(s);
  const auto IO = DataType::IO, F = DataType::FLOAT;
  const int64_t q = b.real("Q", kQ, IO, b.q_dims, b.qkv_strides);
  const int64_t kt = b.real("K", kK, IO, b.kt_dims, b.kt_strides);
  const int64_t v = b.real("V", kV, IO, b.kv_dims, b.qkv_strides);
  const int64_t o = b.real("O", kO, IO, b.q_dims, b.o_strides);
  const int64_t stats = b.real("Stats", kStats, F, b.r_dims, b.r_strides);
  const int64_t attn_scale = b.scalar("attn_scale", kScale);
  const int64_t mask_value = b.scalar("mask_value", kMaskValue);

  const int64_t sc = b.masked_scores("bmm1", "attn_scale", q, kt, attn_scale, mask_value);
  const int64_t mx = b.reduction("Max", Mode::MAX, sc, b.virt("Max", F, b.r_dims, b.r_strides));
  const int64_t centred = b.pointwise("sub", Mode::SUB, {sc, mx}, F, b.s_dims, b.s_strides);
  const int64_t e = b.pointwise("exp", Mode::EXP, {centred}, F, b.s_dims, b.s_strides);
  const int64_t z = b.reduction("sum", Mode::SUM, e, b.virt("sum", F, b.r_dims, b.r_strides));
  const int64_t log_z = b.pointwise("log", Mode::LOG, {z}, F, b.r_dims, b.r_strides);
  b.pointwise("add", Mode::ADD, {mx, log_z}, stats);
  const int64_t p = b.pointwise("div", Mode::DIV, {e, z}, IO, b.s_dims, b.s_strides);
  b.matmul("bmm2", p, v, o);
  return std::move(b.g);
}

inline Graph backward_graph(const Shape& s) {
  detail::Builder b(s);
  const auto IO = DataType::IO, F = DataType::FLOAT;
  const bool gqa = s.NH != s.NKV;
  const int64_t q = b.real("Q", kQ, IO, b.q_dims, b.qkv_strides);
  const int64_t kt = b.real("K", kK, IO, b.kt_dims, b.kt_strides);
  const int64_t vt = b.real("V", kV, IO, b.kt_dims, b.kt_strides);
  const int64_t o = b.real("O", kO, IO, b.q_dims, b.o_strides);
  const int64_t d_o = b.real("dO", kDO, IO, b.q_dims, b.o_strides);
  const int64_t stats = b.real("Stats", kStats, F, b.r_dims, b.r_strides);
  const int64_t dq = b.real("dQ", kDQ, IO, b.q_dims, b.qkv_strides);
  const int64_t dk = b.real("dK", kDK, IO, b.kv_dims, b.qkv_strides);
  const int64_t dv = b.real("dV", kDV, IO, b.kv_dims, b.qkv_strides);
  const int64_t attn_scale = b.scalar("attn_scale", kScale);
  const int64_t mask_value = b.scalar("mask_value", kMaskValue);
  const int64_t one = b.scalar("one", kOne);
  const int64_t softmax_sum = b.real("softmax_sum", kSoftmaxSum, F, b.r_dims, b.r_strides);

  // softmax_sum = rowsum(dO * O) * 1
  int64_t d = b.pointwise("mul_dO_O", Mode::MUL, {d_o, o}, F, b.q_dims, b.o_strides);
  d = b.reduction("reduce_dO_o", Mode::SUM, d, b.virt("reduce_dO_o", F, b.r_dims, b.r_strides));
  b.pointwise("scale_dropout_inv", Mode::MUL, {d, one}, softmax_sum);

  // P = exp(S - Stats); dV = P^T dO
  const int64_t sc = b.masked_scores("matmul_Q_KT", "mul_s_attn_scale", q, kt, attn_scale, mask_value);
  const int64_t centred = b.pointwise("sub_s_m", Mode::SUB, {sc, stats}, F, b.s_dims, b.s_strides);
  const int64_t p = b.pointwise("exp_s", Mode::EXP, {centred}, F, b.s_dims, b.s_strides);
  const int64_t pt = b.reshape("reshape_p", p, b.virt("reshape_p", IO, b.s_dims, b.st_strides));
  if (gqa) {
    const int64_t heads = b.matmul("matmul_pT_dO", pt, d_o, b.virt("dV_fullhead", IO, b.q_dims, b.packed));
    b.reduction("red_dV_head", Mode::SUM, heads, dv);
  } else {
    b.matmul("matmul_pT_dO", pt, d_o, dv);
  }

  // dS = (dO V^T - softmax_sum) * P * attn_scale; dK = dS^T Q; dQ = dS K
  int64_t ds = b.matmul("matmul_dO_VT", d_o, vt, b.virt("matmul_dO_VT", F, b.s_dims, b.s_strides));
  ds = b.pointwise("sub_dP_softmax_sum", Mode::SUB, {ds, softmax_sum}, F, b.s_dims, b.s_strides);
  ds = b.pointwise("mul_dP_exp_s", Mode::MUL, {ds, p}, F, b.s_dims, b.s_strides);
  ds = b.pointwise("mul_dS_attn_scale", Mode::MUL, {ds, attn_scale}, F, b.s_dims, b.s_strides);
  const int64_t dst = b.reshape("reshape_dS", ds, b.virt("reshape_dS", IO, b.s_dims, b.st_strides));
  if (gqa) {
    const int64_t heads = b.matmul("matmul_dST_Q", dst, q, b.virt("dK_fullhead", IO, b.q_dims, b.packed));
    b.reduction("red_dK_head", Mode::SUM, heads, dk);
  } else {
    b.matmul("matmul_dST_Q", dst, q, dk);
  }
  const int64_t k = b.reshape("reshape_k", kt, b.virt("reshape_k", IO, b.kv_dims, b.qkv_strides));
  b.matmul("matmul_dS_K", ds, k, dq);
  return std::move(b.g);
}

}  // namespace tetra::cuda::sdpa
