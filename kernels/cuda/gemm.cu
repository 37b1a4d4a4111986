// CudaBackend::gemm through cuBLASLt, and the state it keeps (handle, workspace, cached plans).
//
//   C(M,N) = alpha * op(A)(M,K) · op(B)(K,N) + beta * C + bias(N)   (row-major, fp32 accumulate)
//
// cuBLASLt is column-major. A row-major (R, S) matrix with leading dimension ld is, byte for
// byte, the column-major (S, R) matrix with the same ld: its transpose. So the row-major product
// is computed as the column-major product C^T (N, M) = op(B)^T op(A)^T, operands swapped, no data
// moved:
//   cuBLASLt A = our B: column-major (N, K), ld ldb, op N   (B stored (K, N))
//                       column-major (K, N), ld ldb, op T   (trans_b: B stored (N, K))
//   cuBLASLt B = our A: column-major (K, M), ld lda, op N   (A stored (M, K))
//                       column-major (M, K), ld lda, op T   (trans_a: A stored (K, M))
//   C = D = our C:      column-major (N, M), ld ldc, in place
// The bias epilogue adds one element per row of the column-major D, which is one per column n of
// our row-major C: bias[n] on every row, as the contract says.
//
// Numerics. Both input types use CUBLAS_COMPUTE_32F with fp32 scale: fp32 inputs get exact fp32
// arithmetic (never TF32: this is the reference path), bf16 and fp16 inputs fp32 accumulation of
// exact products. Split-K algorithms are allowed only with fp32 partials reduced in a separate
// fixed-order step: reduction in the output type would round every partial to bf16, and the
// in-place scheme's order is not ours to fix. beta == 0 never reads C (cuBLASLt's convention).
//
// Bias. cuBLASLt's epilogue bias has the output's type. fp32/fp32, bf16/bf16 and fp16/fp16 pass
// the bias as it is; for 16-bit inputs with an fp32 C the 16-bit bias is first widened into the
// backend's scratch area (N floats, a tiny pass) so the epilogue applies. The epilogue is used only when
// alpha == 1, where alpha * A·B + beta * C + bias has no ordering question; otherwise, or when
// cuBLASLt offers no algorithm with the epilogue, a bias kernel adds it after the product.
// A 16-bit C of another type than the inputs (fp32 x fp32 -> bf16 or fp16, bf16 -> fp16, fp16 ->
// bf16) is no cuBLASLt type combination: the product runs into an fp32 C in a fixed staging
// buffer, tile by tile, and a rounding pass adds bias and beta * C and stores C's type (the CPU
// backend's order).
//
// Plans. A matmul descriptor, the three layouts and the heuristic's algorithm are built once per
// key (shape, leading dimensions, transposes, types, epilogue, and the alignment of each pointer,
// which the heuristic needs since an algorithm may require 16-byte aligned operands) and reused:
// the first call for a key queries cublasLtMatmulAlgoGetHeuristic once, later calls only enqueue.
// M and K enter the key bucketed (bucket_dim: exact up to 64, then 8 buckets per octave, so
// every multiple of 64 up to 512, of 512 up to 4096, ... is its own bucket): the MoE expert GEMMs,
// whose row count (M, or K for the weight gradient) changes with the routing every step, then
// reuse a bucket's plan instead of asking the heuristic per row count. A plan describes the dims
// it last ran; another M or K of its bucket retargets its layouts and checks the cached algorithm
// with cublasLtMatmulAlgoCheck (host-only), asking the heuristic again only where the check
// fails. The cache is bounded (kMaxPlans: past it, it starts again empty; cuBLASLt reads the
// descriptors when a matmul is enqueued, so dropping them with work in flight is safe).
//
// GELU epilogues (gemm_gelu / gemm_dgelu, the two GEMMs of a GELU MLP): forward
// CUBLASLT_EPILOGUE_GELU_AUX_BIAS (or GELU_AUX without a bias) writes gelu(A·B + bias) to D and
// the pre-activation A·B + bias to the auxiliary matrix; backward CUBLASLT_EPILOGUE_DGELU reads
// the pre-activation as its auxiliary input and writes (A·B) * gelu'(pre). The auxiliary matrix
// has D's layout (column-major (N, M), ld N), which cuBLASLt wants divisible by 8; the aux
// pointer is set per call like the bias pointer. Each saves a full read and write of the (M, N)
// activation against a separate GELU kernel. cuBLASLt's GELU is the tanh approximation, applied to
// the fp32 accumulator before the one rounding to the output type; its tanh is not documented to
// fp32 accuracy, so the epilogues serve bf16 and fp16 activations only, where the output rounding
// (2^-8) dominates, and fp32 (the reference precision) keeps the exact GELU kernels. Where a
// shape has no such algorithm (or N % 8 != 0) the plain product and the GELU kernels run
// instead, the order the CPU backend uses.
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "kernels/common/gemm_groups.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/pack.cuh"
#include "kernels/cuda/scratch.cuh"

#define TETRA_LT_ENTRIES(X) X(Create) X(Destroy) X(GetStatusName) X(GetStatusString) X(Matmul) X(MatmulAlgoCheck) X(MatmulAlgoGetHeuristic) X(MatmulDescCreate) X(MatmulDescDestroy) X(MatmulDescSetAttribute) X(MatmulPreferenceCreate) X(MatmulPreferenceDestroy) X(MatmulPreferenceSetAttribute) X(MatrixLayoutCreate) X(MatrixLayoutDestroy) X(MatrixLayoutSetAttribute)

namespace tetra {
namespace cuda::lt_gemm {

// cuBLASLt's entry points, from the library opened at the first use (dlopen) rather than linked:
// loading and relocating its ~500 MB costs every start of the binary about 0.35 s, CPU runs and
// `tetra ckpt` included, where no GEMM ever runs on a GPU.
struct LtApi {
#define TETRA_LT_ENTRY(name) decltype(&::cublasLt##name) name = nullptr;
  TETRA_LT_ENTRIES(TETRA_LT_ENTRY)
#undef TETRA_LT_ENTRY
};

const LtApi& lt() {
  static const LtApi api = [] {
    // The library this build was compiled against (its major version), by soname, then by the path
    // CMake found it at.
    const std::string soname = fmt::format("libcublasLt.so.{}", CUBLAS_VER_MAJOR);
    void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen(TETRA_CUBLASLT_PATH, RTLD_NOW | RTLD_LOCAL);
    if (!h)
      throw Error(fmt::format("cannot open cuBLASLt ({} or {}): {}; the CUDA Toolkit's lib64 must be on the "
                              "library path (LD_LIBRARY_PATH) of every rank", soname, TETRA_CUBLASLT_PATH,
                              dlerror()));
    LtApi a;
#define TETRA_LT_ENTRY(name)                                                                         \
  a.name = reinterpret_cast<decltype(a.name)>(dlsym(h, "cublasLt" #name));                        \
  if (!a.name) throw Error(fmt::format("{} has no cublasLt{}: another cuBLASLt than the one this build " \
                                       "was compiled against ({})", soname, #name, CUBLAS_VERSION));
    TETRA_LT_ENTRIES(TETRA_LT_ENTRY)
#undef TETRA_LT_ENTRY
    return a;
  }();
  return api;
}


inline void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(fmt::format("{}:{}: cuBLASLt error in {}: {} ({})", file, line, what,
                            lt().GetStatusName(status), lt().GetStatusString(status)));
}
#define TETRA_CUBLAS_CHECK(call) \
  ::tetra::cuda::lt_gemm::check_cublas((call), #call, __FILE__, __LINE__)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLASLt's workspace (split-K partials)
constexpr size_t kMaxPlans = 1024;                     // cached plans at most (see "Plans")
constexpr int64_t kStagingFloats = int64_t{4} << 20;  // 16 MiB: fp32 tiles of a staged GEMM

enum class LtEpilogue : uint8_t { NONE, BIAS, GELU_AUX, GELU_AUX_BIAS, DGELU };

bool has_bias(LtEpilogue e) { return e == LtEpilogue::BIAS || e == LtEpilogue::GELU_AUX_BIAS; }
bool has_aux(LtEpilogue e) { return e == LtEpilogue::GELU_AUX || e == LtEpilogue::GELU_AUX_BIAS || e == LtEpilogue::DGELU; }

struct LtKey {
  bool trans_a, trans_b;
  LtEpilogue epilogue;
  DType ab_type, c_type;
  int64_t M, N, K, lda, ldb, ldc;
  uint16_t align_a, align_b, align_c, align_bias;  // bytes, powers of two up to 256
  uint16_t align_aux = 0;

  bool operator==(const LtKey& o) const {
    return trans_a == o.trans_a && trans_b == o.trans_b && epilogue == o.epilogue &&
           ab_type == o.ab_type && c_type == o.c_type && M == o.M && N == o.N && K == o.K &&
           lda == o.lda && ldb == o.ldb && ldc == o.ldc && align_a == o.align_a &&
           align_b == o.align_b && align_c == o.align_c && align_bias == o.align_bias &&
           align_aux == o.align_aux;
  }
};

struct LtKeyHash {
  size_t operator()(const LtKey& k) const {
    uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.epilogue) << 2 |
        uint64_t(k.ab_type) << 8 | uint64_t(k.c_type) << 16);
    for (int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc}) mix(static_cast<uint64_t>(v));
    mix(uint64_t(k.align_a) | uint64_t(k.align_b) << 16 | uint64_t(k.align_c) << 32 |
        uint64_t(k.align_bias) << 48);
    mix(k.align_aux);
    return static_cast<size_t>(h);
  }
};

// One cached matmul: descriptor, layouts of cuBLASLt's A (our B), B (our A) and C = D, the
// chosen algorithm, and which epilogue it has (`usable` false: a GELU plan cuBLASLt has no
// algorithm for, remembered so the heuristic is not asked again).
// The dims of the plan-cache key for a row count or inner dimension: exact up to 64, above it
// rounded up to a multiple of 1/8 of its power-of-two octave (64..512 in steps of 8, 512..1024 of
// 64, ..., 4096..8192 of 512): at most ~12% apart within a bucket, common model sizes exact.
inline int64_t bucket_dim(int64_t x) {
  if (x <= 64) return x;
  int64_t octave = 64;
  while (octave * 2 <= x) octave *= 2;
  const int64_t step = octave / 8;
  return (x + step - 1) / step * step;
}

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  int64_t M = 0, K = 0;  // the dims the layouts describe now (a bucket's key holds bucket_dim)
  bool bias_epilogue = false;
  bool aux_epilogue = false;
  bool usable = true;

  void destroy() {
    if (desc) lt().MatmulDescDestroy(desc);
    if (a) lt().MatrixLayoutDestroy(a);
    if (b) lt().MatrixLayoutDestroy(b);
    if (c) lt().MatrixLayoutDestroy(c);
    desc = nullptr;
    a = b = c = nullptr;
    bias_epilogue = aux_epilogue = false;
  }
};

}  // namespace cuda::lt_gemm

using cuda::lt_gemm::lt;

struct CudaGemmState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // kWorkspaceBytes
  float* staging = nullptr;   // kStagingFloats, allocated at the first staged GEMM
  bool gelu_fused = false, gelu_unfused = false;  // which GELU paths gemm_gelu / gemm_dgelu took
  std::unordered_map<cuda::lt_gemm::LtKey, cuda::lt_gemm::LtPlan, cuda::lt_gemm::LtKeyHash> plans;
  // How often a plan was built (heuristic asked), retargeted within its bucket, and re-asked
  // because the cached algorithm failed its check; for tests and the kernel report.
  int64_t plans_built = 0, plans_retargeted = 0, plans_reheuristic = 0, cache_resets = 0;
};

void CudaGemmStateDeleter::operator()(CudaGemmState* s) const {
  for (auto& entry : s->plans) entry.second.destroy();
  if (s->staging) cudaFree(s->staging);
  if (s->workspace) cudaFree(s->workspace);
  if (s->handle) lt().Destroy(s->handle);
  delete s;
}

CudaGemmState& CudaBackend::gemm_state() {
  if (!gemm_) {
    std::unique_ptr<CudaGemmState, CudaGemmStateDeleter> s(new CudaGemmState);
    TETRA_CUBLAS_CHECK(lt().Create(&s->handle));
    TETRA_CUDA_CHECK(cudaMalloc(&s->workspace, cuda::lt_gemm::kWorkspaceBytes));
    gemm_ = std::move(s);
  }
  return *gemm_;
}

namespace cuda::lt_gemm {
namespace {

cudaDataType_t lt_type(DType t) {
  return t == DType::BF16 ? CUDA_R_16BF : t == DType::F16 ? CUDA_R_16F : CUDA_R_32F;
}

// The largest power of two dividing the address, capped at 256 (cuBLASLt's default assumption).
uint16_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  const uintptr_t low = a & (~a + 1);
  return static_cast<uint16_t>(std::min<uintptr_t>(low, 256));
}

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TETRA_CUBLAS_CHECK(lt().MatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}
template <typename T>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value) {
  TETRA_CUBLAS_CHECK(lt().MatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
}

// Asks the heuristic for the best algorithm for the plan's descriptor and layouts (the
// alignments of `k`); false, with its status, where cuBLASLt offers none.
bool choose_algo(cublasLtHandle_t handle, const LtKey& k, LtPlan& plan,
                 cublasStatus_t& heuristic_status) {
  cublasLtMatmulPreference_t pref = nullptr;
  try {
    TETRA_CUBLAS_CHECK(lt().MatmulPreferenceCreate(&pref));
    set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{kWorkspaceBytes});
    // Split-K only with fp32 partials in the workspace, reduced in a separate fixed-order step
    // (no reduction in the output type; no in-place reduction, whose order is the GPU's).
    set_pref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
             uint32_t{CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE});
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t{k.align_b});
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t{k.align_a});
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t{k.align_c});
    set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t{k.align_c});
  } catch (...) {
    if (pref) lt().MatmulPreferenceDestroy(pref);
    throw;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = lt().MatmulAlgoGetHeuristic(
      handle, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  lt().MatmulPreferenceDestroy(pref);
  heuristic_status = status != CUBLAS_STATUS_SUCCESS ? status : result.state;
  if (status != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
    return false;
  plan.algo = result.algo;
  return true;
}

// The column-major layouts of cuBLASLt's A (our B), B (our A) and C = D for the dims M, K
// (N and the leading dimensions are the key's).
void set_layout_dims(cublasLtMatrixLayout_t l, int64_t rows, int64_t cols) {
  const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
  TETRA_CUBLAS_CHECK(lt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof(r)));
  TETRA_CUBLAS_CHECK(lt().MatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof(c)));
}

// Builds the descriptor and layouts for `k` at the dims M, K (the key holds their buckets) and
// asks the heuristic for its best algorithm. `bias` and `aux` (for an epilogue plan) are the
// pointers the heuristic reads the alignment from. Returns false, with nothing left allocated
// and the heuristic's status, when cuBLASLt offers no algorithm (a refused epilogue may show as
// NOT_SUPPORTED or INVALID_VALUE, or as no result).
bool make_plan(cublasLtHandle_t handle, const LtKey& k, int64_t M, int64_t K, const void* bias,
               const void* aux, LtPlan& plan, cublasStatus_t& heuristic_status) {
  plan = LtPlan{};
  plan.M = M;
  plan.K = K;
  try {
    TETRA_CUBLAS_CHECK(lt().MatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt A = our B
    const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt B = our A
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    const cudaDataType_t ab = lt_type(k.ab_type), c = lt_type(k.c_type);
    TETRA_CUBLAS_CHECK(lt().MatrixLayoutCreate(&plan.a, ab, k.trans_b ? K : k.N,
                                                  k.trans_b ? k.N : K, k.ldb));
    TETRA_CUBLAS_CHECK(lt().MatrixLayoutCreate(&plan.b, ab, k.trans_a ? M : K,
                                                  k.trans_a ? K : M, k.lda));
    TETRA_CUBLAS_CHECK(lt().MatrixLayoutCreate(&plan.c, c, k.N, M, k.ldc));
    if (k.epilogue != LtEpilogue::NONE) {
      uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      if (k.epilogue == LtEpilogue::GELU_AUX) epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
      if (k.epilogue == LtEpilogue::GELU_AUX_BIAS) epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
      if (k.epilogue == LtEpilogue::DGELU) epilogue = CUBLASLT_EPILOGUE_DGELU;
      set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    }
    if (has_bias(k.epilogue)) {
      set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(c));
      set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
      plan.bias_epilogue = true;
    }
    if (has_aux(k.epilogue)) {  // the auxiliary matrix: D's layout, C's type
      set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
      set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{k.ldc});
      plan.aux_epilogue = true;
    }
    if (!choose_algo(handle, k, plan, heuristic_status)) {
      plan.destroy();
      return false;
    }
    return true;
  } catch (...) {
    plan.destroy();
    throw;
  }
}

// The cached plan of `k`'s bucket, describing the dims M, K. A new bucket is planned at these
// dims; a plan that last ran other dims of its bucket is retargeted (layouts set, the cached
// algorithm checked, the heuristic asked again only where the check fails). A key asking for the
// bias epilogue where cuBLASLt has no algorithm with it gets a plan without it (bias_epilogue
// false: the caller adds the bias); a GELU key without an algorithm gets an unusable plan (the
// caller runs the product and the GELU apart).
LtPlan& find_plan(CudaGemmState& st, LtKey k, int64_t M, int64_t K, const void* bias,
                  const void* aux) {
  auto it = st.plans.find(k);
  if (it != st.plans.end()) {
    LtPlan& plan = it->second;
    if (!plan.usable || (plan.M == M && plan.K == K)) return plan;
    set_layout_dims(plan.a, k.trans_b ? K : k.N, k.trans_b ? k.N : K);
    set_layout_dims(plan.b, k.trans_a ? M : K, k.trans_a ? K : M);
    set_layout_dims(plan.c, k.N, M);
    plan.M = M;
    plan.K = K;
    ++st.plans_retargeted;
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t status = lt().MatmulAlgoCheck(st.handle, plan.desc, plan.a, plan.b,
                                                          plan.c, plan.c, &plan.algo, &check);
    if (status == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= kWorkspaceBytes) return plan;
    ++st.plans_reheuristic;
    cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS;
    TETRA_CHECK(choose_algo(st.handle, k, plan, heuristic),
                "gemm: cuBLASLt has no algorithm for trans_a={} trans_b={} M={} N={} K={} lda={} "
                "ldb={} ldc={} {} -> {}: {}",
                k.trans_a, k.trans_b, M, k.N, K, k.lda, k.ldb, k.ldc, dtype_name(k.ab_type),
                dtype_name(k.c_type), lt().GetStatusName(heuristic));
    return plan;
  }
  if (st.plans.size() >= kMaxPlans) {
    for (auto& entry : st.plans) entry.second.destroy();
    st.plans.clear();
    ++st.cache_resets;
  }
  ++st.plans_built;
  LtPlan plan;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  bool ok = make_plan(st.handle, k, M, K, bias, aux, plan, status);
  if (!ok && has_aux(k.epilogue)) {
    plan = LtPlan{};
    plan.usable = false;
    return st.plans.emplace(k, plan).first->second;
  }
  if (!ok && k.epilogue == LtEpilogue::BIAS) {
    LtKey plain = k;
    plain.epilogue = LtEpilogue::NONE;
    ok = make_plan(st.handle, plain, M, K, nullptr, nullptr, plan, status);
  }
  TETRA_CHECK(ok,
              "gemm: cuBLASLt has no algorithm for trans_a={} trans_b={} M={} N={} K={} lda={} "
              "ldb={} ldc={} {} x {} -> {} (pointer alignments A {} B {} C {}): {}",
              k.trans_a, k.trans_b, M, k.N, K, k.lda, k.ldb, k.ldc, dtype_name(k.ab_type),
              dtype_name(k.ab_type), dtype_name(k.c_type), k.align_a, k.align_b, k.align_c,
              lt().GetStatusName(status));
  return st.plans.emplace(k, plan).first->second;
}

// Enqueues C = alpha op(A) op(B) + beta C (+ bias through the epilogue when `epilogue_bias` is
// non-null and the plan has it). Returns whether the bias was applied.
bool lt_matmul(CudaGemmState& st, cudaStream_t stream, bool trans_a, bool trans_b, int64_t M,
               int64_t N, int64_t K, float alpha, const void* A, int64_t lda, const void* B,
               int64_t ldb, DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
               const void* epilogue_bias) {
  const LtKey key{trans_a, trans_b, epilogue_bias ? LtEpilogue::BIAS : LtEpilogue::NONE,
                  ab_type, c_type, bucket_dim(M), N, bucket_dim(K), lda, ldb, ldc,
                  alignment_of(A), alignment_of(B), alignment_of(C),
                  epilogue_bias ? alignment_of(epilogue_bias) : uint16_t{0}};
  LtPlan& plan = find_plan(st, key, M, K, epilogue_bias, nullptr);
  if (plan.bias_epilogue) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue_bias);
  TETRA_CUBLAS_CHECK(lt().Matmul(st.handle, plan.desc, &alpha, B, plan.a, A, plan.b, &beta, C,
                                    plan.c, C, plan.c, &plan.algo, st.workspace, kWorkspaceBytes,
                                    stream));
  return plan.bias_epilogue;
}

// Enqueues a GELU-epilogue product (GELU_AUX[_BIAS] or DGELU: `epilogue`) of contiguous (M, N)
// outputs: D = C, aux = the pre-activation (written forward, read backward). Returns false,
// having enqueued nothing, where cuBLASLt has no algorithm for it.
bool lt_matmul_gelu(CudaGemmState& st, cudaStream_t stream, LtEpilogue epilogue, bool trans_a,
                    bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                    const void* B, int64_t ldb, DType type, void* C, const void* bias,
                    const void* aux) {
  const LtKey key{trans_a, trans_b, epilogue, type, type, bucket_dim(M), N, bucket_dim(K), lda,
                  ldb, N, alignment_of(A), alignment_of(B), alignment_of(C),
                  bias ? alignment_of(bias) : uint16_t{0}, alignment_of(aux)};
  LtPlan& plan = find_plan(st, key, M, K, bias, aux);
  if (!plan.usable) return false;
  if (plan.bias_epilogue) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
  const float alpha = 1.0f, beta = 0.0f;
  TETRA_CUBLAS_CHECK(lt().Matmul(st.handle, plan.desc, &alpha, B, plan.a, A, plan.b, &beta, C,
                                    plan.c, C, plan.c, &plan.algo, st.workspace, kWorkspaceBytes,
                                    stream));
  return true;
}

// ---- small kernels around the product ---------------------------------------------------------

constexpr int kThreads = 256;

// dst[n] = bias[n] as fp32 (the epilogue bias of a 16-bit x 16-bit -> f32 product).
template <typename TB>
__global__ void widen_kernel(float* dst, const TB* bias, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = ld(bias + i);
}

// C[m, n] += bias[n] over the (M, N) block of C (row stride ldc), in fp32, rounded once.
template <typename TC, typename TB>
__global__ void add_bias_kernel(TC* C, int64_t ldc, const TB* bias, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = i / N, n = i - m * N;
    TC* c = C + m * ldc + n;
    st(c, ld(c) + ld(bias + n));
  }
}

// One tile of a staged product: C[m, n] = TC((stage[m, n] + bias[n]) + beta C[m, n]) for the
// (rows, cols) tile, stage packed with row stride cols. beta == 0 does not read C.
template <typename TC, typename TB>
__global__ void round_tile_kernel(TC* C, int64_t ldc, const float* stage, const TB* bias,
                                  float beta, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = i / cols, n = i - m * cols;
    float v = stage[i];
    if (bias) v += ld(bias + n);
    TC* c = C + m * ldc + n;
    if (beta != 0.0f) v += beta * ld(c);
    st(c, v);
  }
}

// ---- bias_backward: dbias[j] += sum_i dout[i, j] --------------------------------------------
//
// Deterministic without atomics. Pass 1: block (x, y) sums the rows of chunk y for a tile of
// 32 * VEC columns; thread (tx, ty) walks rows ty, ty + 8, ... of the chunk over its VEC columns
// (one 16-byte load per row where aligned), and the 8 row-partials of a column are added in ty
// order. The chunk sums go to row y of the scratch area (chunks, OC), and pass 2 adds them in
// chunk order into dbias. With one chunk, pass 1 adds into dbias directly. The chunking depends
// on N and OC only, so the result is the same bits on every run and every GPU.
constexpr int kBiasCols = 32, kBiasRows = 8;

template <typename T, int VEC>
__global__ void __launch_bounds__(kBiasCols * kBiasRows)
bias_partial_kernel(float* dst, bool add_into_dst, const T* dout, int64_t N, int64_t OC,
                    int64_t rows_per_chunk) {
  __shared__ float partial[kBiasRows][VEC][kBiasCols];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j0 = (blockIdx.x * int64_t{kBiasCols} + tx) * VEC;
  const int64_t r_begin = blockIdx.y * rows_per_chunk;
  const int64_t r_end = r_begin + rows_per_chunk < N ? r_begin + rows_per_chunk : N;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
  if (j0 < OC) {  // VEC > 1 only where OC % VEC == 0: the whole pack is inside the row
    for (int64_t r = r_begin + ty; r < r_end; r += kBiasRows) {
      const T* row = dout + r * OC + j0;
      if constexpr (VEC == 1) {
        acc[0] += ld(row);
      } else {
        const Pack<T, VEC> p = load_pack<T, VEC>(row);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] += to_float(p.v[v]);
      }
    }
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) partial[ty][v][tx] = acc[v];
  __syncthreads();
  if (ty == 0 && j0 < OC) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      float s = partial[0][v][tx];
      for (int y = 1; y < kBiasRows; ++y) s += partial[y][v][tx];
      float* d = dst + blockIdx.y * OC + j0 + v;  // chunk y's row of the partials (y = 0: dbias)
      *d = add_into_dst ? *d + s : s;
    }
  }
}

// dbias[j] += sum over chunks c (in order) of partials[c * OC + j].
__global__ void bias_finish_kernel(float* dbias, const float* partials, int64_t chunks,
                                   int64_t OC) {
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < OC;
       j += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) s += partials[c * OC + j];
    dbias[j] += s;
  }
}

template <typename T, int VEC>
void launch_bias_backward(float* dbias, const T* dout, int64_t N, int64_t OC, float* scratch,
                          size_t scratch_floats, cudaStream_t stream) {
  const int64_t tiles = (OC + int64_t{kBiasCols} * VEC - 1) / (int64_t{kBiasCols} * VEC);
  // About 1024 blocks in all, each chunk at least 64 rows; no more chunks than the scratch holds.
  constexpr int64_t kTargetBlocks = 1024, kMinRows = 64;
  int64_t chunks = std::max<int64_t>(1, kTargetBlocks / std::max<int64_t>(1, tiles));
  chunks = std::min(chunks, (N + kMinRows - 1) / kMinRows);
  chunks = std::min<int64_t>(chunks, static_cast<int64_t>(scratch_floats) / OC);
  chunks = std::clamp<int64_t>(chunks, 1, 65535);
  const int64_t rows_per_chunk = (N + chunks - 1) / chunks;
  chunks = (N + rows_per_chunk - 1) / rows_per_chunk;
  TETRA_CHECK(tiles <= 0x7fffffff, "bias_backward: OC ({}) too large", OC);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks));
  const dim3 block(kBiasCols, kBiasRows);
  if (chunks == 1) {
    bias_partial_kernel<T, VEC><<<grid, block, 0, stream>>>(dbias, true, dout, N, OC,
                                                           rows_per_chunk);
    TETRA_CUDA_LAUNCHED();
    return;
  }
  bias_partial_kernel<T, VEC><<<grid, block, 0, stream>>>(scratch, false, dout, N, OC,
                                                         rows_per_chunk);
  TETRA_CUDA_LAUNCHED();
  bias_finish_kernel<<<grid_for(OC, kThreads), kThreads, 0, stream>>>(dbias, scratch, chunks, OC);
  TETRA_CUDA_LAUNCHED();
}

}  // namespace
}  // namespace cuda::lt_gemm

void CudaBackend::gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                       float beta, void* C, int64_t ldc, DType c_type, const void* bias) {
  using namespace cuda::lt_gemm;
  auto gemm_type = [](DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; };
  TETRA_CHECK(gemm_type(ab_type), "gemm: A/B type must be F32, BF16 or F16, got {}", dtype_name(ab_type));
  TETRA_CHECK(gemm_type(c_type), "gemm: C type must be F32, BF16 or F16, got {} (A/B are {})",
              dtype_name(c_type), dtype_name(ab_type));
  TETRA_CHECK(M >= 0 && N >= 0 && K > 0, "gemm: need M, N >= 0 and K > 0, got M={} N={} K={}",
              M, N, K);
  if (M == 0 || N == 0) return;
  TETRA_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
              "gemm: leading dimensions too small: trans_a={} trans_b={} M={} N={} K={} lda={} "
              "ldb={} ldc={}",
              trans_a, trans_b, M, N, K, lda, ldb, ldc);
  CudaGemmState& st = gemm_state();
  const cudaStream_t stream = cuda::as_stream(stream_);

  if (c_type != DType::F32 && c_type != ab_type) {
    // No cuBLASLt matmul into this C type: fp32 tiles of C in the staging buffer, then rounded.
    if (!st.staging)
      TETRA_CUDA_CHECK(
          cudaMalloc(&st.staging, static_cast<size_t>(kStagingFloats) * sizeof(float)));
    const int64_t tile_n = std::min(N, kStagingFloats);
    const int64_t tile_m = std::min(M, std::max<int64_t>(1, kStagingFloats / tile_n));
    const size_t es = dtype_size(ab_type);
    const auto* a = static_cast<const char*>(A);
    const auto* b = static_cast<const char*>(B);
    for (int64_t m0 = 0; m0 < M; m0 += tile_m) {
      for (int64_t n0 = 0; n0 < N; n0 += tile_n) {
        const int64_t rows = std::min(tile_m, M - m0), cols = std::min(tile_n, N - n0);
        const char* a_tile = a + static_cast<size_t>(trans_a ? m0 : m0 * lda) * es;
        const char* b_tile = b + static_cast<size_t>(trans_b ? n0 * ldb : n0) * es;
        lt_matmul(st, stream, trans_a, trans_b, rows, cols, K, alpha, a_tile, lda, b_tile, ldb,
                  ab_type, 0.0f, st.staging, cols, DType::F32, nullptr);
        cuda::with_float_type(c_type, "gemm", "C type", [&](auto c_tag) {
          using TC = decltype(c_tag);
          cuda::with_float_type(ab_type, "gemm", "bias type", [&](auto b_tag) {
            using TB = decltype(b_tag);
            const TB* bias_tile = bias ? static_cast<const TB*>(bias) + n0 : nullptr;
            round_tile_kernel<TC, TB>
                <<<cuda::grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(
                    static_cast<TC*>(C) + m0 * ldc + n0, ldc, st.staging, bias_tile, beta, rows,
                    cols);
            TETRA_CUDA_LAUNCHED();
          });
        });
      }
    }
    return;
  }

  // The epilogue bias has C's type: a 16-bit bias for an fp32 C is widened into the scratch area.
  const void* epilogue_bias = (bias && alpha == 1.0f) ? bias : nullptr;
  if (epilogue_bias && ab_type != c_type) {
    CudaScratch& sc = scratch();
    float* widened = sc.data;
    if (static_cast<size_t>(N) <= sc.floats) {
      cuda::with_float_type(ab_type, "gemm", "bias type", [&](auto b_tag) {
        using TB = decltype(b_tag);
        widen_kernel<<<cuda::grid_for(N, kThreads), kThreads, 0, stream>>>(
            widened, static_cast<const TB*>(bias), N);
        TETRA_CUDA_LAUNCHED();
      });
      epilogue_bias = widened;
    } else {
      epilogue_bias = nullptr;
    }
  }
  const bool bias_done = lt_matmul(st, stream, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb,
                                   ab_type, beta, C, ldc, c_type, epilogue_bias);
  if (bias && !bias_done) {
    cuda::with_float_type(c_type, "gemm", "C type", [&](auto c_tag) {
      using TC = decltype(c_tag);
      cuda::with_float_type(ab_type, "gemm", "bias type", [&](auto b_tag) {
        using TB = decltype(b_tag);
        add_bias_kernel<<<cuda::grid_for(M * N, kThreads), kThreads, 0, stream>>>(
            static_cast<TC*>(C), ldc, static_cast<const TB*>(bias), M, N);
        TETRA_CUDA_LAUNCHED();
      });
    });
  }
}

// Grouped GEMMs: the groups' products enqueued one after another on the backend's stream, each
// through gemm above (its plans, its bias epilogue), so a group's result is exactly that of its
// gemm call. cuBLASLt as shipped with CUDA 13.1 has no grouped matmul layout, and cuBLAS's
// cublasGemmGroupedBatchedEx has no bias epilogue and reads its pointer arrays from device memory;
// the row counts are host values here, so the loop costs no synchronisation, only G launches.
void CudaBackend::gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K,
                               float alpha, const void* A, int64_t lda, const void* const* B, int64_t ldb,
                               DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
                               const void* const* bias) {
  TETRA_CHECK(G >= 0 && (G == 0 || rows != nullptr), "gemm_grouped: {} groups without row counts", G);
  for (int64_t g = 0; g < G; ++g) TETRA_CHECK(rows[g] >= 0, "gemm_grouped: group {} has {} rows", g, rows[g]);
  for_gemm_groups(trans_a, G, rows, N, K, A, lda, B, dtype_size(ab_type), C, ldc, dtype_size(c_type), bias,
                  [&](const GemmProblem& p) {
                    gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc,
                         c_type, p.bias);
                  });
}

void CudaBackend::gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N,
                                 float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                                 float beta, void* const* C, int64_t ldc, DType c_type) {
  TETRA_CHECK(G >= 0 && (G == 0 || rows != nullptr), "gemm_grouped_k: {} groups without row counts", G);
  for (int64_t g = 0; g < G; ++g) TETRA_CHECK(rows[g] >= 0, "gemm_grouped_k: group {} has {} rows", g, rows[g]);
  for_gemm_groups_k(trans_a, trans_b, G, rows, M, N, A, lda, B, ldb, dtype_size(ab_type), C,
                    [&](const GemmProblem& p) {
                      gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc,
                           c_type, nullptr);
                    });
}

void CudaBackend::bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) {
  using namespace cuda::lt_gemm;
  TETRA_CHECK(N >= 0 && OC >= 0, "bias_backward: N ({}) and OC ({}) must be >= 0", N, OC);
  if (N == 0 || OC == 0) return;
  CudaScratch& sc = scratch();
  const cudaStream_t stream = cuda::as_stream(stream_);
  cuda::with_float_type(act, "bias_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    const T* d = static_cast<const T*>(dout);
    if (OC % kVec == 0 && cuda::aligned_to(d, 16))
      launch_bias_backward<T, kVec>(dbias, d, N, OC, sc.data, sc.floats, stream);
    else
      launch_bias_backward<T, 1>(dbias, d, N, OC, sc.data, sc.floats, stream);
  });
}

}  // namespace tetra

namespace tetra {

void CudaBackend::gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            const void* A, int64_t lda, const void* B, int64_t ldb,
                            const void* bias, void* pre, void* out, DType act) {
  using namespace cuda::lt_gemm;
  TETRA_CHECK(pre != out, "gemm_gelu: pre and out must be different buffers (backward reads pre)");
  TETRA_CHECK(M >= 0 && N >= 0 && K > 0, "gemm_gelu: need M, N >= 0 and K > 0, got M={} N={} K={}",
              M, N, K);
  if (M == 0 || N == 0) return;
  if ((act == DType::BF16 || act == DType::F16) && N % 8 == 0 &&
      lt_matmul_gelu(gemm_state(), cuda::as_stream(stream_),
                     bias ? LtEpilogue::GELU_AUX_BIAS : LtEpilogue::GELU_AUX, trans_a, trans_b, M,
                     N, K, A, lda, B, ldb, act, out, bias, pre)) {
    gemm_state().gelu_fused = true;
    return;
  }
  gemm_state().gelu_unfused = true;
  gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, act, 0.0f, pre, N, act, bias);
  gelu_forward(out, pre, M * N, act);
}

void CudaBackend::gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             const void* A, int64_t lda, const void* B, int64_t ldb,
                             const void* pre, void* dpre, DType act) {
  using namespace cuda::lt_gemm;
  TETRA_CHECK(pre != dpre, "gemm_dgelu: dpre must not alias pre");
  TETRA_CHECK(M >= 0 && N >= 0 && K > 0, "gemm_dgelu: need M, N >= 0 and K > 0, got M={} N={} K={}",
              M, N, K);
  if (M == 0 || N == 0) return;
  if ((act == DType::BF16 || act == DType::F16) && N % 8 == 0 &&
      lt_matmul_gelu(gemm_state(), cuda::as_stream(stream_), LtEpilogue::DGELU, trans_a, trans_b,
                     M, N, K, A, lda, B, ldb, act, dpre, nullptr, pre)) {
    gemm_state().gelu_fused = true;
    return;
  }
  gemm_state().gelu_unfused = true;
  gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, act, 0.0f, dpre, N, act, nullptr);
  gelu_backward(dpre, pre, dpre, M * N, act);
}

CudaBackend::GemmPlanStats CudaBackend::gemm_plan_stats() const {
  GemmPlanStats s;
  if (!gemm_) return s;
  s.cached = static_cast<int64_t>(gemm_->plans.size());
  s.built = gemm_->plans_built;
  s.retargeted = gemm_->plans_retargeted;
  s.reheuristic = gemm_->plans_reheuristic;
  s.resets = gemm_->cache_resets;
  return s;
}

std::string CudaBackend::gemm_report() const {
  if (!gemm_ || (!gemm_->gelu_fused && !gemm_->gelu_unfused)) return "";
  if (gemm_->gelu_fused && gemm_->gelu_unfused) return "MLP GELU in cuBLASLt's epilogue and (some shapes) in GELU kernels";
  return gemm_->gelu_fused ? "MLP GELU in cuBLASLt's epilogue" : "MLP GELU in GELU kernels";
}

}  // namespace tetra
