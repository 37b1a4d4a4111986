// Causal attention through cuDNN's fused SDPA engines, built with the cuDNN 9 backend graph API.
//
// cuDNN recognises scaled-dot-product attention as an operation graph of matmuls, pointwise ops
// and reductions (the pattern cudnn-frontend's SDPA nodes lower to) and runs it as one fused
// flash-attention kernel. Forward, per (b, h):
//   S = Q K^T * scale;  S = row >= col ? S : lowest      (GEN_INDEX x 2, CMP_GE, BINARY_SELECT)
//   M = rowmax S;  E = exp(S - M);  Z = rowsum E;  Stats = M + log Z;  O = (E / Z in io) V
// Stats is exactly our lse (natural log-sum-exp of the scaled scores), written to lse directly.
// Backward recomputes P = exp(S - Stats) and forms dV = P^T dO, dP = dO V^T,
// dS = P (dP - rowsum(dO * O)) * scale, dK = dS^T Q, dQ = dS K; with GQA (NH > NKV) the per query
// head dK / dV are reduced over the group into the kv head. The graph carries no dQ accumulator,
// which selects cuDNN's deterministic backward, and engines noted as non-deterministic are skipped.
//
// Q, K, V, dQ, dK, dV are described in place inside qkv / dqkv by strides (no copies): with
// row = (NH + 2 NKV) HS, Q (B, NH, T, HS) has strides (T row, HS, row, 1) from qkv, K^T
// (B, NKV, HS, T) strides (T row, HS, 1, row) from qkv + NH HS, V the same as Q from
// qkv + (NH + NKV) HS; O / dO (B, NH, T, HS) strides (T NH HS, HS, NH HS, 1); Stats (B, NH, T, 1).
//
// The io type (bf16 or fp16, the activations') is the type of Q, K, V, O, their gradients, and of
// P and dS before their matmuls; every other tensor of the graph is fp32. The two graphs differ in
// that data type only.
//
// Plans are built once per (direction, io type, B, T, NH, NKV, HS) and cached with the largest
// workspace any of them needs (grown, with a stream sync, only when a new shape needs more; at most
// 2 GiB). A shape no engine accepts is remembered with the reason and the caller falls back to the
// fused kernels.
#include <cudnn.h>

#include <array>
#include <limits>
#include <map>
#include <vector>

#include "kernels/cuda/attention.cuh"

namespace tetra::cuda::attn {
namespace {

// A failed cuDNN call while building a plan: the shape is not supported (or the API refused it).
struct GraphError {
  std::string what;
};

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw GraphError{fmt::format("{} failed: {}", what, cudnnGetErrorString(status))};
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &desc_), "cudnnBackendCreateDescriptor");
  }
  ~Desc() {
    if (desc_) cudnnBackendDestroyDescriptor(desc_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return desc_; }
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values, const char* what) {
    check(cudnnBackendSetAttribute(desc_, name, type, count, values), what);
  }
  void set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t d, const char* what) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d, what);
  }
  void finalize(const char* what) { check(cudnnBackendFinalize(desc_), what); }

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
};

using Shape4 = std::array<int64_t, 4>;

// The tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kLowest, kDO, kDQ, kDK, kDV, kOne, kFirstVirtual = 100
};

// A finalized execution plan and every descriptor it was built from (kept alive with it).
struct Plan {
  std::vector<std::unique_ptr<Desc>> descs;
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
  float scale = 0.0f, lowest = std::numeric_limits<float>::lowest(), one = 1.0f;  // by value
};

class GraphBuilder {
 public:
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, Shape4 dims, Shape4 strides,
                                  bool is_virtual = false, bool by_value = false) {
    Desc& t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dimensions");
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    if (is_virtual) {
      const bool yes = true;
      t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes, "tensor is_virtual");
    }
    if (by_value) {
      const bool yes = true;
      t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes, "tensor is_by_value");
    }
    t.finalize("tensor finalize");
    return t.get();
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, Shape4 dims, Shape4 strides) {
    return tensor(next_virtual_++, type, dims, strides, true);
  }

  // y = mode(x, b, t); GEN_INDEX takes an axis, comparisons and selects a math precision.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc& pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    pw.finalize("pointwise finalize");
    Desc& op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get(), "pointwise op descriptor");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b");
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
    op.finalize("pointwise op finalize");
    ops_.push_back(op.get());
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    Desc& red = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    red.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode,
            "reduction operator");
    red.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction precision");
    red.finalize("reduction finalize");
    Desc& op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red.get(), "reduction descriptor");
    op.finalize("reduction op finalize");
    ops_.push_back(op.get());
  }
  // c (..., M, N) = a (..., M, K) b (..., K, N), batched over the leading dims (broadcasting a
  // kv head over its group of query heads).
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc& mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul precision");
    mm.finalize("matmul finalize");
    Desc& op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a");
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul b");
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul c");
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get(), "matmul descriptor");
    op.finalize("matmul op finalize");
    ops_.push_back(op.get());
  }
  // A view of x with other dims / strides (the transposes of P, dS and K^T).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc& op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x");
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y");
    op.finalize("reshape op finalize");
    ops_.push_back(op.get());
  }

  // The operation graph, the heuristics' engine configurations in order, and the first one that
  // finalizes into an execution plan (skipping non-deterministic engines).
  std::unique_ptr<Plan> build(cudnnHandle_t handle) {
    Desc& graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "graph handle");
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
              static_cast<int64_t>(ops_.size()), ops_.data(), "graph ops");
    graph.finalize("operation graph finalize (cuDNN has no fused SDPA for this graph)");
    std::string last_failure = "the heuristics returned no engine";
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      auto heur = std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      heur->set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get(), "heuristics graph");
      heur->set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
      if (cudnnBackendFinalize(heur->get()) != CUDNN_STATUS_SUCCESS) continue;
      int64_t count = 0;
      if (cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr) !=
              CUDNN_STATUS_SUCCESS ||
          count <= 0)
        continue;
      std::vector<std::unique_ptr<Desc>> configs;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (int64_t i = 0; i < count; ++i) {
        configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
        raw.push_back(configs.back()->get());
      }
      int64_t returned = 0;
      check(cudnnBackendGetAttribute(heur->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, raw.data()),
            "heuristics results");
      for (int64_t i = 0; i < returned; ++i) {
        if (nondeterministic(raw[static_cast<size_t>(i)])) {
          last_failure = "the only engines are non-deterministic";
          continue;
        }
        auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan handle");
        plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[static_cast<size_t>(i)],
                       "plan engine config");
        const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
        if (st != CUDNN_STATUS_SUCCESS) {
          last_failure = fmt::format("no engine finalizes ({})", cudnnGetErrorString(st));
          continue;
        }
        auto result = std::make_unique<Plan>();
        int64_t n = 0;
        check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                       CUDNN_TYPE_INT64, 1, &n, &result->workspace),
              "plan workspace size");
        result->plan = std::move(plan);
        result->descs = std::move(owned_);
        result->descs.push_back(std::move(heur));
        for (auto& cfg : configs) result->descs.push_back(std::move(cfg));
        return result;
      }
    }
    throw GraphError{last_failure};
  }

 private:
  Desc& make(cudnnBackendDescriptorType_t type) {
    owned_.push_back(std::make_unique<Desc>(type));
    return *owned_.back();
  }
  static bool nondeterministic(cudnnBackendDescriptor_t config) {
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    cudnnBackendDescriptor_t e = engine.get();
    int64_t n = 0;
    if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 1, &n, &e) != CUDNN_STATUS_SUCCESS)
      return false;  // no notes to read: judged by the graph (no dQ accumulator) alone
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int64_t count = 0;
    if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                 CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes) !=
        CUDNN_STATUS_SUCCESS)
      return false;
    for (int64_t i = 0; i < count; ++i)
      if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return true;
    return false;
  }

  std::vector<std::unique_ptr<Desc>> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// Strides of the views into qkv / out (see the header comment).
struct Views {
  Shape4 q_dims, kv_dims, kt_dims, s_dims, r_dims;
  Shape4 qkv_strides, kt_strides, o_strides, s_strides, st_strides, r_strides;
};

Views views_of(const Dims& d) {
  const int64_t B = d.B, T = d.T, NH = d.NH, NKV = d.NKV, HS = d.HS, row = d.row();
  Views v;
  v.q_dims = {B, NH, T, HS};
  v.kv_dims = {B, NKV, T, HS};
  v.kt_dims = {B, NKV, HS, T};
  v.s_dims = {B, NH, T, T};
  v.r_dims = {B, NH, T, 1};
  v.qkv_strides = {T * row, HS, row, 1};
  v.kt_strides = {T * row, HS, 1, row};
  v.o_strides = {T * NH * HS, HS, NH * HS, 1};
  v.s_strides = {NH * T * T, T * T, T, 1};
  v.st_strides = {NH * T * T, T * T, 1, T};  // the (T, T) matrices transposed
  v.r_strides = {NH * T, T, 1, 1};
  return v;
}

// S = Q K^T * scale with the causal mask applied (shared by forward and backward).
cudnnBackendDescriptor_t masked_scores(GraphBuilder& g, const Views& v,
                                       cudnnBackendDescriptor_t q, cudnnBackendDescriptor_t kt,
                                       cudnnBackendDescriptor_t scale,
                                       cudnnBackendDescriptor_t lowest) {
  auto s0 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.matmul(q, kt, s0);
  auto s1 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, s0, scale, nullptr, s1);
  auto row = g.virt(CUDNN_DATA_INT32, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s1, nullptr, nullptr, row, CUDNN_DATA_INT32, 2);
  auto col = g.virt(CUDNN_DATA_INT32, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s1, nullptr, nullptr, col, CUDNN_DATA_INT32, 3);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  auto s2 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s1, lowest, keep, s2);  // keep ? s1 : lowest
  return s2;
}

std::unique_ptr<Plan> build_forward(cudnnHandle_t handle, const Dims& d, cudnnDataType_t io) {
  const Views v = views_of(d);
  GraphBuilder g;
  auto q = g.tensor(kQ, io, v.q_dims, v.qkv_strides);
  auto kt = g.tensor(kK, io, v.kt_dims, v.kt_strides);
  auto val = g.tensor(kV, io, v.kv_dims, v.qkv_strides);
  auto o = g.tensor(kO, io, v.q_dims, v.o_strides);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  auto scale = g.scalar(kScale);
  auto lowest = g.scalar(kLowest);

  auto s = masked_scores(g, v, q, kt, scale, lowest);
  auto mx = g.virt(CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, mx);
  auto centred = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, s, mx, nullptr, centred);
  auto e = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_EXP, centred, nullptr, nullptr, e);
  auto z = g.virt(CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  auto log_z = g.virt(CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  g.pointwise(CUDNN_POINTWISE_LOG, z, nullptr, nullptr, log_z);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, log_z, nullptr, stats);
  auto p = g.virt(io, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_DIV, e, z, nullptr, p);
  g.matmul(p, val, o);
  auto plan = g.build(handle);
  plan->scale = d.scale();
  return plan;
}

std::unique_ptr<Plan> build_backward(cudnnHandle_t handle, const Dims& d, cudnnDataType_t io) {
  const Views v = views_of(d);
  const bool gqa = d.NH != d.NKV;
  const Shape4 packed = {d.NH * d.T * d.HS, d.T * d.HS, d.HS, 1};  // (B, NH, T, HS) scratch
  GraphBuilder g;
  auto q = g.tensor(kQ, io, v.q_dims, v.qkv_strides);
  auto kt = g.tensor(kK, io, v.kt_dims, v.kt_strides);
  auto vt = g.tensor(kV, io, v.kt_dims, v.kt_strides);
  auto o = g.tensor(kO, io, v.q_dims, v.o_strides);
  auto d_o = g.tensor(kDO, io, v.q_dims, v.o_strides);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  auto dq = g.tensor(kDQ, io, v.q_dims, v.qkv_strides);
  auto dk = g.tensor(kDK, io, v.kv_dims, v.qkv_strides);
  auto dv = g.tensor(kDV, io, v.kv_dims, v.qkv_strides);
  auto scale = g.scalar(kScale);
  auto lowest = g.scalar(kLowest);
  auto one = g.scalar(kOne);

  // D = rowsum(dO * O)
  auto dd = g.virt(CUDNN_DATA_FLOAT, v.q_dims, v.o_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, nullptr, dd);
  auto d_sum = g.virt(CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dd, d_sum);
  auto d_row = g.virt(CUDNN_DATA_FLOAT, v.r_dims, v.r_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, d_sum, one, nullptr, d_row);

  // P = exp(S - Stats); dV = P^T dO
  auto s = masked_scores(g, v, q, kt, scale, lowest);
  auto centred = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, s, stats, nullptr, centred);
  auto p = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_EXP, centred, nullptr, nullptr, p);
  auto pt = g.virt(io, v.s_dims, v.st_strides);
  g.reshape(p, pt);
  if (gqa) {
    auto dv_heads = g.virt(io, v.q_dims, packed);
    g.matmul(pt, d_o, dv_heads);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv);
  } else {
    g.matmul(pt, d_o, dv);
  }

  // dS = P (dO V^T - D) scale; dK = dS^T Q; dQ = dS K
  auto dp = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.matmul(d_o, vt, dp);
  auto dp1 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dp, one, nullptr, dp1);
  auto dp2 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_SUB, dp1, d_row, nullptr, dp2);
  auto dp3 = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dp2, p, nullptr, dp3);
  auto ds = g.virt(CUDNN_DATA_FLOAT, v.s_dims, v.s_strides);
  g.pointwise(CUDNN_POINTWISE_MUL, dp3, scale, nullptr, ds);
  auto dst = g.virt(io, v.s_dims, v.st_strides);
  g.reshape(ds, dst);
  if (gqa) {
    auto dk_heads = g.virt(io, v.q_dims, packed);
    g.matmul(dst, q, dk_heads);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk);
  } else {
    g.matmul(dst, q, dk);
  }
  auto k = g.virt(io, v.kv_dims, v.qkv_strides);
  g.reshape(kt, k);
  g.matmul(ds, k, dq);
  auto plan = g.build(handle);
  plan->scale = d.scale();
  return plan;
}

using PlanKey = std::array<int64_t, 7>;  // direction, io type, B, T, NH, NKV, HS

// The deterministic backward keeps dP in the workspace (B NH T^2 16-bit values); past this size the fused
// kernels, which need none, take the shape instead.
constexpr int64_t kMaxWorkspaceBytes = int64_t{2} << 30;

}  // namespace

struct CudnnSdpa {
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<PlanKey, std::string> failures;  // shapes without a plan, and why
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

void CudnnSdpaDeleter::operator()(CudnnSdpa* s) const {
  s->plans.clear();
  if (s->workspace) cudaFree(s->workspace);
  if (s->handle) cudnnDestroy(s->handle);
  delete s;
}

std::unique_ptr<CudnnSdpa, CudnnSdpaDeleter> cudnn_sdpa_create(cudaStream_t stream) {
  std::unique_ptr<CudnnSdpa, CudnnSdpaDeleter> s(new CudnnSdpa);
  s->stream = stream;
  cudnnStatus_t st = cudnnCreate(&s->handle);
  if (st == CUDNN_STATUS_SUCCESS) st = cudnnSetStream(s->handle, stream);
  if (st != CUDNN_STATUS_SUCCESS)
    throw Error(fmt::format("cuDNN handle: {}", cudnnGetErrorString(st)));
  return s;
}

std::string cudnn_sdpa_eligible(const Dims& d, DType act) {
  if (act != DType::BF16 && act != DType::F16)
    return "cuDNN's fused SDPA is used for BF16 and F16 activations only";
  if (d.HS % 8 != 0 || d.HS > 128) return "cuDNN's fused SDPA needs HS a multiple of 8, <= 128";
  return "";
}

namespace {

// The cached plan for a shape (building it on first sight), or null with *why set.
Plan* plan_for(CudnnSdpa& s, const Dims& d, DType act, bool backward, std::string* why) {
  const cudnnDataType_t io = act == DType::F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  const PlanKey key = {backward ? 1 : 0, static_cast<int64_t>(io), d.B, d.T, d.NH, d.NKV, d.HS};
  if (auto it = s.plans.find(key); it != s.plans.end()) return it->second.get();
  if (auto it = s.failures.find(key); it != s.failures.end()) {
    *why = it->second;
    return nullptr;
  }
  std::unique_ptr<Plan> plan;
  try {
    plan = backward ? build_backward(s.handle, d, io) : build_forward(s.handle, d, io);
    if (plan->workspace > kMaxWorkspaceBytes)
      throw GraphError{fmt::format("its workspace of {} bytes is above the {} allowed",
                                   plan->workspace, kMaxWorkspaceBytes)};
  } catch (const GraphError& e) {
    s.failures[key] = e.what;
    *why = e.what;
    return nullptr;
  }
  const size_t need = static_cast<size_t>(plan->workspace);
  if (need > s.workspace_bytes) {
    // Work already enqueued may still use the old buffer.
    TETRA_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    if (s.workspace) TETRA_CUDA_CHECK(cudaFree(s.workspace));
    s.workspace = nullptr;
    s.workspace_bytes = 0;
    TETRA_CUDA_CHECK(cudaMalloc(&s.workspace, need));
    s.workspace_bytes = need;
  }
  return (s.plans[key] = std::move(plan)).get();
}

std::string eligibility(const Dims& d, DType act, std::initializer_list<const void*> ptrs) {
  std::string why = cudnn_sdpa_eligible(d, act);
  if (!why.empty()) return why;
  for (const void* p : ptrs)
    if (!aligned16(p)) return "a tensor is not 16-byte aligned";
  return "";
}

std::string execute(CudnnSdpa& s, Plan& plan, std::initializer_list<std::pair<int64_t, void*>> io) {
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  for (const auto& [uid, ptr] : io) {
    uids.push_back(uid);
    ptrs.push_back(ptr);
  }
  try {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    void* ws = s.workspace;
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
             static_cast<int64_t>(uids.size()), uids.data(), "variant pack uids");
    pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
             static_cast<int64_t>(ptrs.size()), ptrs.data(), "variant pack pointers");
    pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws,
             "variant pack workspace");
    pack.finalize("variant pack finalize");
    const cudnnStatus_t st = cudnnBackendExecute(s.handle, plan.plan->get(), pack.get());
    if (st != CUDNN_STATUS_SUCCESS)
      throw Error(fmt::format("cudnnBackendExecute (SDPA): {}", cudnnGetErrorString(st)));
  } catch (const GraphError& e) {
    throw Error(fmt::format("cuDNN SDPA execution: {}", e.what));
  }
  return "";
}

}  // namespace

std::string cudnn_sdpa_forward(CudnnSdpa& s, const Dims& d, DType act, void* out, float* lse,
                               const void* qkv) {
  std::string why = eligibility(d, act, {out, lse, qkv});
  if (!why.empty()) return why;
  Plan* plan = plan_for(s, d, act, false, &why);
  if (!plan) return why;
  auto* base = static_cast<uint16_t*>(const_cast<void*>(qkv));  // 16-bit elements
  return execute(s, *plan,
                 {{kQ, base},
                  {kK, base + d.NH * d.HS},
                  {kV, base + (d.NH + d.NKV) * d.HS},
                  {kO, out},
                  {kStats, lse},
                  {kScale, &plan->scale},
                  {kLowest, &plan->lowest}});
}

std::string cudnn_sdpa_backward(CudnnSdpa& s, const Dims& d, DType act, void* dqkv,
                                const void* dout, const void* qkv, const void* out,
                                const float* lse) {
  std::string why = eligibility(d, act, {dqkv, dout, qkv, out, lse});
  if (!why.empty()) return why;
  Plan* plan = plan_for(s, d, act, true, &why);
  if (!plan) return why;
  auto* base = static_cast<uint16_t*>(const_cast<void*>(qkv));  // 16-bit elements
  auto* dbase = static_cast<uint16_t*>(dqkv);
  return execute(s, *plan,
                 {{kQ, base},
                  {kK, base + d.NH * d.HS},
                  {kV, base + (d.NH + d.NKV) * d.HS},
                  {kO, const_cast<void*>(out)},
                  {kDO, const_cast<void*>(dout)},
                  {kStats, const_cast<float*>(lse)},
                  {kDQ, dbase},
                  {kDK, dbase + d.NH * d.HS},
                  {kDV, dbase + (d.NH + d.NKV) * d.HS},
                  {kScale, &plan->scale},
                  {kLowest, &plan->lowest},
                  {kOne, &plan->one}});
}

}  // namespace tetra::cuda::attn
