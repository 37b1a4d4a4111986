// Causal attention through cuDNN's fused SDPA engines, built with the cuDNN 9 backend graph API.
//
// cuDNN recognises scaled-dot-product attention as an operation graph of matmuls, pointwise ops
// and reductions (the pattern cudnn-frontend's SDPA nodes lower to) and runs it as one fused
// flash-attention kernel. The graphs themselves, node by node, with the views of qkv / out they
// read and write (no copies), are plain data in sdpa_graph.h (unit-tested against the frontend's
// lowering); this file lowers them into backend descriptors, finds an engine, and executes.
// Stats is exactly our lse (natural log-sum-exp of the scaled scores), written to lse directly;
// the backward's softmax_sum = rowsum(dO * O) is a real fp32 (B, NH, T, 1) tensor backed by the
// caller's (B, NH, T) scratch. The backward carries no dQ accumulator, which selects cuDNN's
// deterministic backward, and engines noted as non-deterministic are skipped.
//
// The io type (bf16 or fp16, the activations') is the type of Q, K, V, O, their gradients, and of
// P and dS before their matmuls; every other tensor of the graph is fp32. The two graphs differ in
// that data type only.
//
// Plans are built once per (direction, io type, B, T, NH, NKV, HS) and cached with the largest
// workspace any of them needs (grown, with a stream sync, only when a new shape needs more; at most
// 2 GiB). A shape no engine accepts, or whose plan fails to execute, is remembered with the reason
// (cuDNN's own message included, from cudnnGetLastErrorString) and the caller falls back to the
// fused kernels (or, with TETRA_ATTENTION=cudnn, fails naming it).
#include <cudnn.h>

#include <array>
#include <limits>
#include <map>
#include <vector>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/sdpa_graph.h"

namespace tetra::cuda::attn {
namespace {

// A failed cuDNN call while building a plan: the shape is not supported (or the API refused it).
struct GraphError {
  std::string what;
};

// cuDNN's own account of its last failure on this thread ("" when it has none).
std::string cudnn_last_error() {
  char buf[2048] = {0};
  cudnnGetLastErrorString(buf, sizeof(buf));
  std::string msg(buf);
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  return msg;
}

std::string failure(const char* what, cudnnStatus_t status) {
  std::string msg = fmt::format("{} failed: {}", what, cudnnGetErrorString(status));
  const std::string detail = cudnn_last_error();
  if (!detail.empty()) msg += " (cuDNN: " + detail + ")";
  return msg;
}

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) throw GraphError{failure(what, status)};
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

// A finalized execution plan and every descriptor it was built from (kept alive with it).
struct Plan {
  std::vector<std::unique_ptr<Desc>> descs;
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
  float scale = 0.0f, mask_value = std::numeric_limits<float>::lowest(), one = 1.0f;  // by value
};

class GraphBuilder {
 public:
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, sdpa::Shape4 dims,
                                  sdpa::Shape4 strides, bool is_virtual, bool by_value) {
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
      if (const cudnnStatus_t st = cudnnBackendFinalize(heur->get()); st != CUDNN_STATUS_SUCCESS) {
        last_failure = failure("engine heuristics finalize", st);
        continue;
      }
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
          last_failure = failure("no engine finalizes: execution plan finalize", st);
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
};

cudnnPointwiseMode_t pointwise_mode(sdpa::Mode m) {
  switch (m) {
    case sdpa::Mode::MUL: return CUDNN_POINTWISE_MUL;
    case sdpa::Mode::SUB: return CUDNN_POINTWISE_SUB;
    case sdpa::Mode::ADD: return CUDNN_POINTWISE_ADD;
    case sdpa::Mode::DIV: return CUDNN_POINTWISE_DIV;
    case sdpa::Mode::EXP: return CUDNN_POINTWISE_EXP;
    case sdpa::Mode::LOG: return CUDNN_POINTWISE_LOG;
    case sdpa::Mode::GEN_INDEX: return CUDNN_POINTWISE_GEN_INDEX;
    case sdpa::Mode::CMP_GE: return CUDNN_POINTWISE_CMP_GE;
    case sdpa::Mode::BINARY_SELECT: return CUDNN_POINTWISE_BINARY_SELECT;
    default: break;
  }
  throw GraphError{fmt::format("no pointwise mode {}", sdpa::mode_name(m))};
}

// The graph of sdpa_graph.h, node for node, as backend descriptors; io is the 16-bit type.
std::unique_ptr<Plan> lower(cudnnHandle_t handle, const sdpa::Graph& graph, cudnnDataType_t io) {
  auto data_type = [io](sdpa::DataType t) {
    switch (t) {
      case sdpa::DataType::IO: return io;
      case sdpa::DataType::INT32: return CUDNN_DATA_INT32;
      case sdpa::DataType::BOOLEAN: return CUDNN_DATA_BOOLEAN;
      case sdpa::DataType::FLOAT: break;
    }
    return CUDNN_DATA_FLOAT;
  };
  GraphBuilder g;
  std::map<int64_t, cudnnBackendDescriptor_t> tensors;
  for (const sdpa::Tensor& t : graph.tensors)
    tensors[t.uid] = g.tensor(t.uid, data_type(t.type), t.dims, t.strides, t.is_virtual, t.by_value);
  auto in = [&](const sdpa::Node& n, size_t i) {
    return i < n.inputs.size() ? tensors.at(n.inputs[i]) : nullptr;
  };
  for (const sdpa::Node& n : graph.nodes) {
    const cudnnBackendDescriptor_t y = tensors.at(n.output);
    switch (n.kind) {
      case sdpa::Kind::MATMUL: g.matmul(in(n, 0), in(n, 1), y); break;
      case sdpa::Kind::RESHAPE: g.reshape(in(n, 0), y); break;
      case sdpa::Kind::REDUCTION:
        g.reduction(n.mode == sdpa::Mode::MAX ? CUDNN_REDUCE_TENSOR_MAX : CUDNN_REDUCE_TENSOR_ADD,
                    in(n, 0), y);
        break;
      case sdpa::Kind::POINTWISE:
        g.pointwise(pointwise_mode(n.mode), in(n, 0), in(n, 1), in(n, 2), y,
                    data_type(n.precision), n.axis);
        break;
    }
  }
  return g.build(handle);
}

sdpa::Shape shape_of(const Dims& d) { return {d.B, d.T, d.NH, d.NKV, d.HS}; }

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

PlanKey plan_key(const Dims& d, DType act, bool backward) {
  const cudnnDataType_t io = act == DType::F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  return {backward ? 1 : 0, static_cast<int64_t>(io), d.B, d.T, d.NH, d.NKV, d.HS};
}

// The cached plan for a shape (building it on first sight), or null with *why set.
Plan* plan_for(CudnnSdpa& s, const PlanKey& key, const Dims& d, DType act, std::string* why) {
  if (auto it = s.plans.find(key); it != s.plans.end()) return it->second.get();
  if (auto it = s.failures.find(key); it != s.failures.end()) {
    *why = it->second;
    return nullptr;
  }
  const bool backward = key[0] == 1;
  const cudnnDataType_t io = act == DType::F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  std::unique_ptr<Plan> plan;
  try {
    const sdpa::Shape shape = shape_of(d);
    plan = lower(s.handle, backward ? sdpa::backward_graph(shape) : sdpa::forward_graph(shape), io);
    plan->scale = d.scale();
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

// Enqueues the plan of `key` on the variant pack; "" when enqueued. A refusal to execute (the
// variant pack, or cudnnBackendExecute itself) enqueues nothing: the shape is then remembered as
// failed with cuDNN's reason, its plan dropped, and the reason returned, so that auto mode runs
// the fused kernels instead (now and for every later call of the shape).
std::string execute(CudnnSdpa& s, const PlanKey& key, Plan& plan,
                    std::initializer_list<std::pair<int64_t, void*>> io) {
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  for (const auto& [uid, ptr] : io) {
    uids.push_back(uid);
    ptrs.push_back(ptr);
  }
  std::string why;
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
    check(cudnnBackendExecute(s.handle, plan.plan->get(), pack.get()), "cudnnBackendExecute");
    return "";
  } catch (const GraphError& e) {
    why = "the plan does not execute: " + e.what;
  }
  // A failed launch inside cuDNN leaves its error for the next launch check: clear it, unless it
  // is sticky (the context is lost, and no fallback can run).
  cudaGetLastError();
  if (const cudaError_t err = cudaPeekAtLastError(); err != cudaSuccess)
    throw Error(fmt::format("cuDNN SDPA: {}; CUDA context error {}", why, cudaGetErrorString(err)));
  s.failures[key] = why;
  s.plans.erase(key);  // `plan` is gone from here on
  return why;
}

}  // namespace

std::string cudnn_sdpa_forward(CudnnSdpa& s, const Dims& d, DType act, void* out, float* lse,
                               const void* qkv) {
  std::string why = eligibility(d, act, {out, lse, qkv});
  if (!why.empty()) return why;
  const PlanKey key = plan_key(d, act, false);
  Plan* plan = plan_for(s, key, d, act, &why);
  if (!plan) return why;
  auto* base = static_cast<uint16_t*>(const_cast<void*>(qkv));  // 16-bit elements
  return execute(s, key, *plan,
                 {{sdpa::kQ, base},
                  {sdpa::kK, base + d.NH * d.HS},
                  {sdpa::kV, base + (d.NH + d.NKV) * d.HS},
                  {sdpa::kO, out},
                  {sdpa::kStats, lse},
                  {sdpa::kScale, &plan->scale},
                  {sdpa::kMaskValue, &plan->mask_value}});
}

std::string cudnn_sdpa_backward(CudnnSdpa& s, const Dims& d, DType act, void* dqkv,
                                const void* dout, const void* qkv, const void* out,
                                const float* lse, float* softmax_sum) {
  std::string why = eligibility(d, act, {dqkv, dout, qkv, out, lse, softmax_sum});
  if (!why.empty()) return why;
  const PlanKey key = plan_key(d, act, true);
  Plan* plan = plan_for(s, key, d, act, &why);
  if (!plan) return why;
  auto* base = static_cast<uint16_t*>(const_cast<void*>(qkv));  // 16-bit elements
  auto* dbase = static_cast<uint16_t*>(dqkv);
  return execute(s, key, *plan,
                 {{sdpa::kQ, base},
                  {sdpa::kK, base + d.NH * d.HS},
                  {sdpa::kV, base + (d.NH + d.NKV) * d.HS},
                  {sdpa::kO, const_cast<void*>(out)},
                  {sdpa::kDO, const_cast<void*>(dout)},
                  {sdpa::kStats, const_cast<float*>(lse)},
                  {sdpa::kDQ, dbase},
                  {sdpa::kDK, dbase + d.NH * d.HS},
                  {sdpa::kDV, dbase + (d.NH + d.NKV) * d.HS},
                  {sdpa::kSoftmaxSum, softmax_sum},
                  {sdpa::kScale, &plan->scale},
                  {sdpa::kMaskValue, &plan->mask_value},
                  {sdpa::kOne, &plan->one}});
}

}  // namespace tetra::cuda::attn
