// CpuBackend::gemm through oneDNN's matmul primitive, plus the backend's constructor/destructor
// (they own the primitive cache, whose type is complete only here). bf16 operands go to our own
// AMX kernel instead where the CPU has AMX (gemm_amx.cpp); everything below is the rest.
//
//   C(M,N) = alpha * op(A)(M,K) · op(B)(K,N) + beta * C + bias(N)   (row-major, fp32 accumulate)
//
// Row-major storage with leading dimensions and transposes is expressed through memory
// descriptor strides, so operands are used in place (two exceptions below):
//   op(A) (M,K): strides {lda, 1}, or {1, lda} when A is stored (K,M)  (trans_a)
//   op(B) (K,N): strides {ldb, 1}, or {1, ldb} when B is stored (N,K)  (trans_b)
//   C     (M,N): strides {ldc, 1}
// alpha is an output scale and beta a sum post-op. beta == 0 adds no sum post-op at all, so C is
// never read (it may hold garbage, NaN included). The bias is oneDNN's native matmul bias when
// alpha == 1; oneDNN applies output scales after its bias (dst = alpha * (A·B + bias)), so with
// alpha != 1 the bias becomes a binary-add post-op placed after the sum, which keeps the contract's
// order: alpha * A·B + beta * C + bias.
//
// oneDNN 2.6's fp32 brgemm matmul packs a non-transposed B (K, N) into its blocked layout on
// every call, reading down columns; when B's rows lie a multiple of 1 KiB apart those reads
// collide in the same L1 sets and the whole product runs up to 2.5x slower (1024x768 · 768x3072
// on one core: 70 ms with ldb = 3072, 27 ms with ldb = 3088). Such a B is first copied to rows
// padded by one cache line: O(K N) of copying against O(M K N) of arithmetic, done only for
// M >= 64, and at most kMaxPaddedRows rows of K at a time (a taller B is multiplied in slices of K
// that accumulate into C). The bf16 (AMX / AVX512-BF16) kernels pack B differently and gain nothing
// from it.
//
// oneDNN 2.6 has no f32 x f32 -> bf16 (or -> f16) matmul: such a combination (any 16-bit C whose
// type is not A's and B's) runs the primitive into an fp32 staging buffer (sized on first sight of
// a shape, then reused), and a rounding pass adds beta * C and stores the 16-bit type.
//
// fp16 inputs: oneDNN 2.6 has no f16 matmul on CPUs without AVX512-FP16 / AMX-FP16 kernels (none
// is implemented for the CPUs this runs on: creating the primitive fails). So op(A), op(B) and the
// bias are widened to fp32 (exact: every fp16 value is an fp32 value) into planned scratch buffers
// (grown on first sight of a shape, then reused) and the fp32 primitive runs on them. Products of
// fp16 values are exact in fp32 and the sums are fp32, so this is the reference fp16 GEMM: the same
// arithmetic as a tensor-core f16 x f16 -> fp32 product, up to the order of the fp32 additions.
//
// Creating a primitive costs far more than running a small one, so primitives are cached per
// shape key (every field that changes the primitive). A training loop sees a fixed set of shapes:
// each is created on its first call and reused ever after; per call we only swap data handles.
// Shapes that vary (an MoE expert's row count changes every step) would create one each time: a
// row count or inner dimension above 64 that is not a multiple of 64 runs as the multiple and
// power-of-two pieces of the rest (rows of C apart; along K accumulated into an fp32 C), so an expert
// GEMM family needs (largest rows / 64) + 6 primitives rather than one per row count seen.
// The cache is not thread-safe: one backend is driven by one host thread (oneDNN parallelises
// inside each call with OpenMP).
//
// Compiled with oneDNN only; gemm_loops.cpp defines these members in a build without it.
#if defined(TETRA_HAVE_DNNL)
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/gemm_loops.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/common/check.h"

namespace tetra {

namespace {

struct GemmKey {
  bool trans_a, trans_b, has_bias;
  DType ab_type, c_type;
  int64_t M, N, K, lda, ldb, ldc;
  uint32_t alpha_bits, beta_bits;  // compared bitwise: every distinct value is its own primitive
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    size_t h = 0;
    auto mix = [&h](uint64_t v) {
      h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix((uint64_t(k.trans_a) << 0) | (uint64_t(k.trans_b) << 1) | (uint64_t(k.has_bias) << 2) |
        (uint64_t(k.ab_type) << 8) | (uint64_t(k.c_type) << 16));
    for (int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc}) mix(static_cast<uint64_t>(v));
    mix((uint64_t(k.alpha_bits) << 32) | k.beta_bits);
    return h;
  }
};

// One cached matmul and the memory objects it runs on; only their data handles change per call.
struct GemmPlan {
  dnnl::matmul prim;
  dnnl::memory a, b, c, bias;
  dnnl::memory scratch;  // user-managed scratchpad, bound to the cache's shared buffer per call
  size_t scratch_bytes = 0;
  std::unordered_map<int, dnnl::memory> args;  // execution arguments, bound to the memories above
};

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::F32: return dnnl::memory::data_type::f32;
    case DType::BF16: return dnnl::memory::data_type::bf16;
    case DType::F16: return dnnl::memory::data_type::f16;
    default: break;
  }
  TETRA_CHECK(false, "gemm: no oneDNN type for {}", dtype_name(t));
  return dnnl::memory::data_type::undef;
}

}  // namespace

struct CpuBackend::GemmCache {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans;
  cpu::Buffer<float> staging;   // (M, N) fp32 result of a product into a 16-bit C of another type
  cpu::Buffer<char> b_staging;  // B (K, N) copied to padded rows
  cpu::Buffer<float> a_wide, b_wide, bias_wide;  // fp16 operands widened to fp32
  // One scratchpad for every plan (they run one at a time), grown to the largest plan's need the
  // first time that plan runs. oneDNN's default would allocate it inside every execution.
  cpu::Buffer<char> scratch;
  // Per grouped-GEMM problem shape: whether one thread computes it bit for bit as the team does
  // (gemm_problems).
  std::unordered_map<GemmKey, bool, GemmKeyHash> alone_exact;
  std::vector<char> probe[8], probe_c[8];  // the probes' operands and C, per DType (probe_values)
};

CpuBackend::CpuBackend(int threads)
    : threads_(threads > 0 ? threads : omp_get_max_threads()),
      gemm_cache_(std::make_unique<GemmCache>()), scratch_(threads_) {
  omp_set_num_threads(threads_);
}

CpuBackend::~CpuBackend() = default;

namespace {

GemmPlan make_gemm_plan(const dnnl::engine& engine, const GemmKey& k, float alpha, float beta) {
  using dims = dnnl::memory::dims;
  using dt = dnnl::memory::data_type;
  dt ab = dnnl_type(k.ab_type), c = dnnl_type(k.c_type);
  dnnl::memory::desc a_md(dims{k.M, k.K}, ab, k.trans_a ? dims{1, k.lda} : dims{k.lda, 1});
  dnnl::memory::desc b_md(dims{k.K, k.N}, ab, k.trans_b ? dims{1, k.ldb} : dims{k.ldb, 1});
  dnnl::memory::desc c_md(dims{k.M, k.N}, c, dims{k.ldc, 1});
  dnnl::memory::desc bias_md(dims{1, k.N}, ab, dims{k.N, 1});

  bool bias_as_post_op = k.has_bias && alpha != 1.0f;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  dnnl::post_ops ops;
  if (beta != 0.0f) ops.append_sum(beta);
  if (bias_as_post_op) ops.append_binary(dnnl::algorithm::binary_add, bias_md);
  attr.set_post_ops(ops);

  GemmPlan plan;
  bool native_bias = k.has_bias && !bias_as_post_op;
  auto desc = native_bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                          : dnnl::matmul::desc(a_md, b_md, c_md);
  dnnl::matmul::primitive_desc pd(desc, attr, engine);
  plan.prim = dnnl::matmul(pd);
  plan.scratch_bytes = pd.scratchpad_desc().get_size();
  plan.scratch = dnnl::memory(pd.scratchpad_desc(), engine, nullptr);
  plan.a = dnnl::memory(a_md, engine, nullptr);
  plan.b = dnnl::memory(b_md, engine, nullptr);
  plan.c = dnnl::memory(c_md, engine, nullptr);
  plan.args = {{DNNL_ARG_SRC, plan.a}, {DNNL_ARG_WEIGHTS, plan.b}, {DNNL_ARG_DST, plan.c},
               {DNNL_ARG_SCRATCHPAD, plan.scratch}};
  if (k.has_bias) {
    plan.bias = dnnl::memory(bias_md, engine, nullptr);
    // The binary post-op is the last one: index 1 after a sum, else 0.
    int slot = bias_as_post_op
                   ? (DNNL_ARG_ATTR_MULTIPLE_POST_OP(beta != 0.0f ? 1 : 0) | DNNL_ARG_SRC_1)
                   : DNNL_ARG_BIAS;
    plan.args.emplace(slot, plan.bias);
  }
  return plan;
}

}  // namespace

namespace {

// The (rows, cols) fp16 matrix at src (leading dimension ld) widened into dst with leading dimension
// `out_ld`.
void widen_f16(cpu::Buffer<float>& dst, const void* src, int64_t rows, int64_t cols, int64_t ld,
               int64_t out_ld, int threads) {
  const f16* s = static_cast<const f16*>(src);
  float* d = cpu::grow(dst, rows * out_ld);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) d[r * out_ld + c] = to_f32(s[r * ld + c]);
}

// The padded copy of B (see the header) holds at most this many rows of K: 8192 x (N + 16) floats,
// 26 MB at N = 768, where the whole output layer's weight would be 158 MB.
constexpr int64_t kMaxPaddedRows = 8192;

// Rows (leading dimension) of a widened operand: one cache line more when the plain width would put
// rows a multiple of 1 KiB apart (the fp32 kernels' set conflicts, see the header).
int64_t widened_ld(int64_t cols) { return (cols * 4) % 1024 == 0 ? cols + 16 : cols; }

// A dimension above kShapeQuantum that is not a multiple of it, as (offset, size) pieces: the
// largest multiple of kShapeQuantum, then the rest's powers of two, largest first.
constexpr int64_t kShapeQuantum = 64;
// A grouped GEMM deals its problems out to the threads unless the most loaded thread would then
// have this many times its share of the work (gemm_problems).
constexpr double kMaxGroupImbalance = 1.2;
std::vector<std::pair<int64_t, int64_t>> shape_pieces(int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  const int64_t head = n - n % kShapeQuantum;
  pieces.emplace_back(0, head);
  for (int64_t bit = kShapeQuantum / 2, at = head; bit > 0; bit /= 2)
    if ((n % kShapeQuantum) & bit) pieces.emplace_back(at, bit), at += bit;
  return pieces;
}

}  // namespace

void CpuBackend::gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                      const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                      float beta, void* C, int64_t ldc, DType c_type, const void* bias) {
  cpu::check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc, ab_type, c_type);
  if (M == 0 || N == 0) return;

  if (gemm_amx(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type,
               bias))
    return;
  gemm_dnnl(*gemm_cache_, threads_, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type,
            bias);
}

void CpuBackend::gemm_dnnl(GemmCache& cache, int threads, bool trans_a, bool trans_b, int64_t M, int64_t N,
                           int64_t K, float alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
                           DType ab_type, float beta, void* C, int64_t ldc, DType c_type, const void* bias) {
  // The pieces below are gemm calls again: through gemm (and its AMX path) on the backend's own
  // cache, on this cache otherwise (a grouped GEMM's thread, which never meets an AMX case).
  auto sub = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, float al, const void* a, int64_t la,
                 const void* b, int64_t lb, DType abt, float be, void* c, int64_t lc, DType ct, const void* bi) {
    if (&cache == gemm_cache_.get())
      gemm(ta, tb, m, n, k, al, a, la, b, lb, abt, be, c, lc, ct, bi);
    else
      gemm_dnnl(cache, threads, ta, tb, m, n, k, al, a, la, b, lb, abt, be, c, lc, ct, bi);
  };
  // oneDNN runs on the calling thread's OpenMP team size; make it this call's.
  omp_set_num_threads(threads);

  if (ab_type == DType::F16) {
    // A stored (M, K) or, transposed, (K, M); B stored (K, N) or (N, K): widened as stored.
    const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
    const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
    const int64_t la = widened_ld(a_cols), lb = widened_ld(b_cols);
    widen_f16(cache.a_wide, A, a_rows, a_cols, lda, la, threads);
    widen_f16(cache.b_wide, B, b_rows, b_cols, ldb, lb, threads);
    const float* wide_bias = nullptr;
    if (bias) {
      widen_f16(cache.bias_wide, bias, 1, N, N, N, threads);
      wide_bias = cache.bias_wide.data();
    }
    sub(trans_a, trans_b, M, N, K, alpha, cache.a_wide.data(), la, cache.b_wide.data(), lb,
         DType::F32, beta, C, ldc, c_type, wide_bias);
    return;
  }

  if (c_type != DType::F32 && c_type != ab_type) {
    float* staging = cpu::grow(cache.staging, M * N);
    sub(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, 0.0f, staging, N,
         DType::F32, bias);
    const float* src = staging;
    cpu::with_float_type(c_type, "gemm", "C type", [&](auto tag) {
      using TC = decltype(tag);
      TC* c = static_cast<TC*>(C);
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t m = 0; m < M; ++m) {
        TC* cr = c + m * ldc;
        const float* sr = src + m * N;
        if (beta == 0.0f) {
          for (int64_t n = 0; n < N; ++n) cr[n] = from_f32<TC>(sr[n]);
        } else {
          for (int64_t n = 0; n < N; ++n) cr[n] = from_f32<TC>(sr[n] + beta * to_f32(cr[n]));
        }
      }
    });
    return;
  }

  if (ab_type == DType::F32 && !trans_b && (ldb * 4) % 1024 == 0 && M >= 64) {
    const int64_t es = 4, ldp = N + 16;  // one cache line more per row
    if (K > kMaxPaddedRows) {
      // A B this tall (the tied output layer's weight, K = vocabulary) is padded and multiplied
      // kMaxPaddedRows rows of K at a time, accumulating into C, so the staging stays small.
      for (int64_t k0 = 0; k0 < K; k0 += kMaxPaddedRows) {
        const int64_t kc = std::min(kMaxPaddedRows, K - k0);
        const float* a = static_cast<const float*>(A) + (trans_a ? k0 * lda : k0);
        sub(trans_a, false, M, N, kc, alpha, a, lda, static_cast<const float*>(B) + k0 * ldb, ldb,
             ab_type, k0 == 0 ? beta : 1.0f, C, ldc, c_type, k0 == 0 ? bias : nullptr);
      }
      return;
    }
    const char* src = static_cast<const char*>(B);
    char* dst = cpu::grow(cache.b_staging, K * ldp * es);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * ldp * es, src + k * ldb * es, N * es);
    B = dst;
    ldb = ldp;
  }

  // Row counts (M) and inner dimensions (K) that vary from call to call (an MoE expert's tokens)
  // would each create a primitive: above 64 and not a multiple of it, they run as a multiple of 64
  // and the rest in power-of-two pieces, so the primitives of one family stay a few dozen.
  if (M > kShapeQuantum && M % kShapeQuantum != 0) {
    const size_t ea = dtype_size(ab_type), ec = dtype_size(c_type);
    for (const auto& [m0, mc] : shape_pieces(M)) {
      const char* a = static_cast<const char*>(A) + (trans_a ? m0 * ea : m0 * lda * ea);
      sub(trans_a, trans_b, mc, N, K, alpha, a, lda, B, ldb, ab_type, beta, static_cast<char*>(C) + m0 * ldc * ec,
           ldc, c_type, bias);
    }
    return;
  }
  // Along K the pieces accumulate into C: only into fp32 (a 16-bit C would be rounded between them).
  if (K > kShapeQuantum && K % kShapeQuantum != 0 && c_type == DType::F32) {
    const size_t ea = dtype_size(ab_type);
    for (const auto& [k0, kc] : shape_pieces(K)) {
      const char* a = static_cast<const char*>(A) + (trans_a ? k0 * lda * ea : k0 * ea);
      const char* b = static_cast<const char*>(B) + (trans_b ? k0 * ea : k0 * ldb * ea);
      sub(trans_a, trans_b, M, N, kc, alpha, a, lda, b, ldb, ab_type, k0 == 0 ? beta : 1.0f, C, ldc, c_type,
           k0 == 0 ? bias : nullptr);
    }
    return;
  }

  const GemmKey key{trans_a, trans_b, bias != nullptr, ab_type, c_type, M, N, K, lda, ldb, ldc,
                    math::f32_bits(alpha), math::f32_bits(beta)};
  auto it = cache.plans.find(key);
  if (it == cache.plans.end()) {
    it = cache.plans.emplace(key, make_gemm_plan(cache.engine, key, alpha, beta))
             .first;
  }
  GemmPlan& plan = it->second;
  plan.a.set_data_handle(const_cast<void*>(A));
  plan.b.set_data_handle(const_cast<void*>(B));
  plan.c.set_data_handle(C);
  if (bias != nullptr) plan.bias.set_data_handle(const_cast<void*>(bias));
  plan.scratch.set_data_handle(
      cpu::grow(cache.scratch, static_cast<int64_t>(plan.scratch_bytes)));
  plan.prim.execute(cache.stream, plan.args);
  cache.stream.wait();
}

// A grouped GEMM's problems (gemm_grouped.cpp): in turn on the team, the gemm loop, unless
// set_grouped_threads (cpu_backend.h) turned on what follows. The experts of a MoE layer are many small GEMMs
// (64-256 fine-grained experts get a few dozen rows each): split over the team, each is too small
// to keep both threads busy (oneDNN's per-call synchronisation and B packing dominate). So the
// problems are dealt out whole to the threads, the largest first onto the least-loaded thread,
// and each thread runs its own on one thread, with a primitive cache of its own (the backend's is
// not thread-safe, and a oneDNN primitive is built for the thread count it is created under, so
// these are created with 1). A problem's result does not depend on the thread that runs it, but
// may depend on the thread count: oneDNN's jit GEMM (and its brgemm for some shapes) splits the K
// sum over the threads when M N is small, which changes the rounding. So each problem shape
// (every field of the primitive key, M and K included) is first run once both ways on fixed
// pseudo-random operands (alone_exact, remembered per shape); a shape whose bits differ runs on
// the team, as gemm would run it. The grouped result is then that of the gemm loop bit for bit
// (tests/unit/test_kernels_gemm_grouped.cpp checks it on real operands). The team also runs the
// problems one after another where dealing them out would leave a thread idle for long (a few
// large groups of unequal size), and wherever bf16 operands may reach the AMX kernels
// (gemm_amx.cpp: they use the backend's per-thread scratch).
namespace {

// The first n values of a fixed pseudo-random sequence, stored as `type` in `pool` (grown, never
// regenerated). Their exponents spread over 2^-10 .. 2^10, so that sums of their products are
// inexact in fp32 whatever the input type (bf16 products of values of one binade would add up
// exactly in any order).
const char* probe_values(std::vector<char>& pool, int64_t n, DType type) {
  const size_t es = dtype_size(type);
  const int64_t have = static_cast<int64_t>(pool.size() / es);
  if (have >= n) return pool.data();
  pool.resize(static_cast<size_t>(n) * es);
  for (int64_t i = have; i < n; ++i) {
    uint64_t x = static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 31, x *= 0xbf58476d1ce4e5b9ull, x ^= x >> 29;
    const float f = std::ldexp(1.0f + static_cast<float>(x >> 41) * (1.0f / 8388608.0f),
                               static_cast<int>((x >> 8) % 21) - 10);
    const float value = (x & 1u) ? -f : f;
    if (type == DType::F32)
      std::memcpy(pool.data() + i * 4, &value, 4);
    else if (type == DType::BF16)
      reinterpret_cast<bf16*>(pool.data())[i] = bf16(value);
    else
      reinterpret_cast<f16*>(pool.data())[i] = f16(value);
  }
  return pool.data();
}

}  // namespace

bool CpuBackend::alone_exact(const GemmProblem& p, bool trans_a, bool trans_b, float alpha, int64_t lda, int64_t ldb,
                             DType ab_type, float beta, int64_t ldc, DType c_type) {
  const GemmKey key{trans_a, trans_b, p.bias != nullptr, ab_type, c_type, p.M, p.N, p.K, lda, ldb, ldc,
                    math::f32_bits(alpha), math::f32_bits(beta)};
  auto it = gemm_cache_->alone_exact.find(key);
  if (it != gemm_cache_->alone_exact.end()) return it->second;
  // The shape on fixed pseudo-random operands (probe_values), by the team and by one thread on
  // thread 0's cache.
  const int64_t a_n = (trans_a ? p.K : p.M) * lda, b_n = (trans_b ? p.N : p.K) * ldb, c_n = p.M * ldc;
  const char* pool =
      probe_values(gemm_cache_->probe[static_cast<int>(ab_type)], std::max({a_n, b_n + 7, p.N + 11}), ab_type);
  const char* cpool = probe_values(gemm_cache_->probe_c[static_cast<int>(c_type)], c_n + 3, c_type);
  const char* a = pool;
  const char* b = pool + 7 * dtype_size(ab_type);  // other values than A's
  const std::vector<char> c(cpool + 3 * dtype_size(c_type), cpool + (3 + c_n) * dtype_size(c_type));
  std::vector<char> team = c, alone = c;
  const void* bi = p.bias ? pool + 11 * dtype_size(ab_type) : nullptr;
  gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, a, lda, b, ldb, ab_type, beta, team.data(), ldc, c_type, bi);
  if (thread_caches_.empty())
    for (int t = 0; t < threads_; ++t) thread_caches_.push_back(std::make_unique<GemmCache>());
  gemm_dnnl(*thread_caches_[0], 1, trans_a, trans_b, p.M, p.N, p.K, alpha, a, lda, b, ldb, ab_type, beta, alone.data(),
            ldc, c_type, bi);
  omp_set_num_threads(threads_);
  const bool same = team == alone;
  gemm_cache_->alone_exact.emplace(key, same);
  return same;
}

void CpuBackend::gemm_problems(bool trans_a, bool trans_b, float alpha, int64_t lda, int64_t ldb, DType ab_type,
                               float beta, int64_t ldc, DType c_type) {
  const int64_t n = static_cast<int64_t>(grouped_.size());
  auto in_turn = [&] {
    for (const GemmProblem& p : grouped_)
      gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc, c_type, p.bias);
  };
  const bool amx = ab_type == DType::BF16 && amx_gemm_ && cpu::amx_available();
  if (!grouped_threads_ || threads_ == 1 || n < 2 || amx) return in_turn();

  // The team's turn first, for the problems one thread would not compute bit for bit as it does;
  // then the rest dealt out: longest processing time first, each problem (largest M N K first,
  // ties by index) to the thread with the least work so far.
  std::vector<int64_t> order;
  std::vector<int> owner(static_cast<size_t>(n), -1);
  for (int64_t i = 0; i < n; ++i) {
    const GemmProblem& p = grouped_[static_cast<size_t>(i)];
    if (alone_exact(p, trans_a, trans_b, alpha, lda, ldb, ab_type, beta, ldc, c_type))
      order.push_back(i);
    else
      gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc, c_type, p.bias);
  }
  if (order.empty()) return;
  auto work = [&](int64_t i) {
    const GemmProblem& p = grouped_[static_cast<size_t>(i)];
    return static_cast<double>(p.M) * static_cast<double>(p.N) * static_cast<double>(p.K);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  std::vector<double> load(static_cast<size_t>(threads_), 0.0);
  double total = 0.0;
  for (int64_t i : order) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    load[static_cast<size_t>(t)] += work(i);
    owner[static_cast<size_t>(i)] = static_cast<int>(t);
    total += work(i);
  }
  // Dealt out, the step takes the most loaded thread's time; in turn, each problem runs on the
  // whole team at (for large problems) close to full speed.
  const double imbalance = *std::max_element(load.begin(), load.end()) / (total / threads_);
  if (imbalance > kMaxGroupImbalance) {
    for (int64_t i : order) {
      const GemmProblem& p = grouped_[static_cast<size_t>(i)];
      gemm(trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda, p.B, ldb, ab_type, beta, p.C, ldc, c_type, p.bias);
    }
    return;
  }

  if (ab_type == DType::BF16 && (c_type == DType::F32 || c_type == DType::BF16)) bf16_gemm_kernel_ = "onednn";
  std::exception_ptr error;
#pragma omp parallel num_threads(threads_)
  {
    const int t = omp_get_thread_num();
    omp_set_num_threads(1);  // this thread's primitives are made for one thread
    try {
      for (int64_t i = 0; i < n; ++i)
        if (owner[static_cast<size_t>(i)] == t) {
          const GemmProblem& p = grouped_[static_cast<size_t>(i)];
          gemm_dnnl(*thread_caches_[static_cast<size_t>(t)], 1, trans_a, trans_b, p.M, p.N, p.K, alpha, p.A, lda,
                    p.B, ldb, ab_type, beta, p.C, ldc, c_type, p.bias);
        }
    } catch (...) {
#pragma omp critical(tetra_gemm_grouped_error)
      if (!error) error = std::current_exception();
    }
  }
  omp_set_num_threads(threads_);
  if (error) std::rethrow_exception(error);
}

}  // namespace tetra

#endif  // TETRA_HAVE_DNNL
