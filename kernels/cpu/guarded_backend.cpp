// The guarded-memory backend (see guarded_backend.h): mmap'd allocations kept PROT_NONE, opened
// for the duration of each op that names them.
#include "kernels/cpu/guarded_backend.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra {

namespace {

struct Region {
  char* map = nullptr;   // the mapping: guard page, the allocation's pages, guard page
  size_t mapped = 0;
  char* base = nullptr;  // what alloc() returned (map + one page)
  size_t bytes = 0;      // as asked
  size_t span = 0;       // the allocation's pages
};

// A pointer argument of an op, named for error messages.
struct Arg {
  const void* p;
  const char* what;
};

class GuardedBackend;
std::atomic<GuardedBackend*> g_active{nullptr};  // for the SIGSEGV report
// The report is installed while any guarded backend lives, over whatever handler was there.
std::mutex g_segv_mutex;
int g_segv_users = 0;
struct sigaction g_previous_segv {};

class GuardedBackend final : public Backend {
 public:
  explicit GuardedBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    TETRA_CHECK(inner_ && inner_->host_memory(), "the guarded backend wraps a backend whose memory is host memory, "
                "not {}", inner_ ? inner_->name() : std::string("null"));
    install_segv_report();
    g_active.store(this);
  }
  ~GuardedBackend() override {
    g_active.store(nullptr);
    uninstall_segv_report();
    for (auto& [key, r] : regions_) munmap(r.map, r.mapped);
  }

  std::string name() const override { return "cpu-guarded"; }
  std::string kernel_report() const override { return inner_->kernel_report(); }
  bool host_memory() const override { return false; }

  // ---- memory ------------------------------------------------------------------------------
  void* alloc(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Region r;
    r.bytes = bytes;
    r.span = std::max<size_t>(1, math::ceil_div(bytes, page_)) * page_;
    r.mapped = r.span + 2 * page_;
    void* map = mmap(nullptr, r.mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TETRA_CHECK(map != MAP_FAILED, "cpu-guarded alloc of {} bytes: mmap failed: {}", bytes, std::strerror(errno));
    r.map = static_cast<char*>(map);
    r.base = r.map + page_;
    // Filled with 0xFF: memory nothing wrote reads as NaN, not as zeros.
    protect(r, PROT_READ | PROT_WRITE);
    std::memset(r.base, 0xFF, r.span);
    protect(r, PROT_NONE);
    regions_[reinterpret_cast<uintptr_t>(r.base)] = r;
    tally_.on_alloc(r.base, bytes);
    return r.base;
  }
  MemoryStats memory_stats() const override { return tally_.stats(); }

  void free(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = regions_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == regions_.end()) {
      // Called from destructors: report and stop rather than throw through them.
      std::fprintf(stderr, "cpu-guarded: free(%p): not an allocation of this backend\n", ptr);
      std::abort();
    }
    munmap(it->second.map, it->second.mapped);
    regions_.erase(it);
    tally_.on_free(ptr);
  }

  void memset_zero(void* ptr, size_t bytes) override {
    Open o(*this, "memset_zero", {{ptr, "ptr"}});
    o.check_extent(ptr, bytes, "ptr");
    inner_->memset_zero(ptr, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Open o(*this, "copy_to_host", {{src, "src"}});
    o.check_extent(src, bytes, "src");
    o.check_host(host_dst, bytes, "host_dst");
    inner_->copy_to_host(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    if (bytes == 0) return;
    Open o(*this, "copy_from_host", {{dst, "dst"}});
    o.check_extent(dst, bytes, "dst");
    o.check_host(host_src, bytes, "host_src");
    inner_->copy_from_host(dst, host_src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    Open o(*this, "copy", {{dst, "dst"}, {src, "src"}});
    o.check_extent(dst, bytes, "dst");
    o.check_extent(src, bytes, "src");
    inner_->copy(dst, src, bytes);
  }
  void synchronize() override { inner_->synchronize(); }

  // ---- ops: open their pointer arguments, run the CPU op -----------------------------------
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
            const void* B, int64_t ldb, DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
            const void* bias) override {
    Open o(*this, "gemm", {{A, "A"}, {B, "B"}, {C, "C"}, {bias, "bias"}});
    inner_->gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type, bias);
  }
  void gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K, float alpha,
                    const void* A, int64_t lda, const void* const* B, int64_t ldb, DType ab_type, float beta,
                    void* C, int64_t ldc, DType c_type, const void* const* bias) override {
    std::vector<Arg> args{{A, "A"}, {C, "C"}};
    for (int64_t g = 0; g < G; ++g) {
      args.push_back({B[g], "B[g]"});
      if (bias) args.push_back({bias[g], "bias[g]"});
    }
    Open o(*this, "gemm_grouped", args);
    inner_->gemm_grouped(trans_a, trans_b, G, rows, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type, bias);
  }
  void gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N, float alpha,
                      const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta,
                      void* const* C, int64_t ldc, DType c_type) override {
    std::vector<Arg> args{{A, "A"}, {B, "B"}};
    for (int64_t g = 0; g < G; ++g) args.push_back({C[g], "C[g]"});
    Open o(*this, "gemm_grouped_k", args);
    inner_->gemm_grouped_k(trans_a, trans_b, G, rows, M, N, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type);
  }
  void bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) override {
    Open o(*this, "bias_backward", {{dbias, "dbias"}, {dout, "dout"}});
    inner_->bias_backward(dbias, dout, N, OC, act);
  }
  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int64_t B, int64_t T,
                         int64_t C, int64_t v0, int64_t Vl, DType act, DType w,
                         const int32_t* positions = nullptr) override {
    Open o(*this, "embedding_forward",
           {{out, "out"}, {tokens, "tokens"}, {wte, "wte"}, {wpe, "wpe"}, {positions, "positions"}});
    inner_->embedding_forward(out, tokens, wte, wpe, B, T, C, v0, Vl, act, w, positions);
  }
  void embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C, int64_t v0, int64_t Vl, DType act, const int32_t* positions = nullptr) override {
    Open o(*this, "embedding_backward",
           {{dwte, "dwte"}, {dwpe, "dwpe"}, {dout, "dout"}, {tokens, "tokens"}, {positions, "positions"}});
    inner_->embedding_backward(dwte, dwpe, dout, tokens, B, T, C, v0, Vl, act, positions);
  }
  void norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x, const void* weight,
                    const void* bias, int64_t N, int64_t C, float eps, DType act, DType w) override {
    Open o(*this, "norm_forward",
           {{out, "out"}, {mean, "mean"}, {rstd, "rstd"}, {x, "x"}, {weight, "weight"}, {bias, "bias"}});
    inner_->norm_forward(kind, out, mean, rstd, x, weight, bias, N, C, eps, act, w);
  }
  void norm_backward(NormKind kind, void* dx, float* dweight, float* dbias, const void* dout, const void* x,
                     const void* weight, const float* mean, const float* rstd, int64_t N, int64_t C, DType act,
                     DType w) override {
    Open o(*this, "norm_backward",
           {{dx, "dx"}, {dweight, "dweight"}, {dbias, "dbias"}, {dout, "dout"}, {x, "x"}, {weight, "weight"},
            {mean, "mean"}, {rstd, "rstd"}});
    inner_->norm_backward(kind, dx, dweight, dbias, dout, x, weight, mean, rstd, N, C, act, w);
  }
  void add(void* out, const void* a, const void* b, int64_t n, DType act) override {
    Open o(*this, "add", {{out, "out"}, {a, "a"}, {b, "b"}});
    inner_->add(out, a, b, n, act);
  }
  void gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                 const void* B, int64_t ldb, const void* bias, void* pre, void* out, DType act) override {
    Open o(*this, "gemm_gelu", {{A, "A"}, {B, "B"}, {bias, "bias"}, {pre, "pre"}, {out, "out"}});
    inner_->gemm_gelu(trans_a, trans_b, M, N, K, A, lda, B, ldb, bias, pre, out, act);
  }
  void gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                  const void* B, int64_t ldb, const void* pre, void* dpre, DType act) override {
    Open o(*this, "gemm_dgelu", {{A, "A"}, {B, "B"}, {pre, "pre"}, {dpre, "dpre"}});
    inner_->gemm_dgelu(trans_a, trans_b, M, N, K, A, lda, B, ldb, pre, dpre, act);
  }
  void gelu_forward(void* y, const void* x, int64_t n, DType act) override {
    Open o(*this, "gelu_forward", {{y, "y"}, {x, "x"}});
    inner_->gelu_forward(y, x, n, act);
  }
  void gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) override {
    Open o(*this, "gelu_backward", {{dx, "dx"}, {x, "x"}, {dy, "dy"}});
    inner_->gelu_backward(dx, x, dy, n, act);
  }
  void swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) override {
    Open o(*this, "swiglu_forward", {{y, "y"}, {x, "x"}});
    inner_->swiglu_forward(y, x, N, F, act);
  }
  void swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F, DType act) override {
    Open o(*this, "swiglu_backward", {{dx, "dx"}, {x, "x"}, {dy, "dy"}});
    inner_->swiglu_backward(dx, x, dy, N, F, act);
  }
  void rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const math::RopeFreqs& freqs,
                    DType act, const int32_t* positions = nullptr) override {
    Open o(*this, "rope_forward", {{qkv, "qkv"}, {positions, "positions"}});
    inner_->rope_forward(qkv, B, T, NH, NKV, HS, freqs, act, positions);
  }
  void rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const math::RopeFreqs& freqs,
                     DType act, const int32_t* positions = nullptr) override {
    Open o(*this, "rope_backward", {{dqkv, "dqkv"}, {positions, "positions"}});
    inner_->rope_backward(dqkv, B, T, NH, NKV, HS, freqs, act, positions);
  }
  void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                         int64_t HS, DType act) override {
    Open o(*this, "attention_forward", {{out, "out"}, {lse, "lse"}, {qkv, "qkv"}});
    inner_->attention_forward(out, lse, qkv, B, T, NH, NKV, HS, act);
  }
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, DType act) override {
    Open o(*this, "attention_backward", {{dqkv, "dqkv"}, {dout, "dout"}, {qkv, "qkv"}, {out, "out"}, {lse, "lse"}});
    inner_->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS, act);
  }
  void attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) override {
    Open g(*this, "attention_block_forward",
           {{blk.q.p, "q"}, {blk.k.p, "k"}, {blk.v.p, "v"}, {blk.lse, "lse"}, {o.p, "o"}});
    inner_->attention_block_forward(blk, o, first, act);
  }
  void attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq, AttnView dk,
                                AttnView dv, DType act) override {
    Open g(*this, "attention_block_backward",
           {{blk.q.p, "q"}, {blk.k.p, "k"}, {blk.v.p, "v"}, {blk.lse, "lse"}, {dout.p, "dout"}, {out.p, "out"},
            {dq.p, "dq"}, {dk.p, "dk"}, {dv.p, "dv"}});
    inner_->attention_block_backward(blk, dout, out, dq, dk, dv, act);
  }
  void cross_entropy(float* losses, void* dlogits, DType dlogits_type, const void* logits, DType logits_type,
                     const int32_t* targets, int64_t N, int64_t V, float dloss_scale) override {
    Open o(*this, "cross_entropy", {{losses, "losses"}, {dlogits, "dlogits"}, {logits, "logits"}, {targets, "targets"}});
    inner_->cross_entropy(losses, dlogits, dlogits_type, logits, logits_type, targets, N, V, dloss_scale);
  }
  void vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N, int64_t Vl) override {
    Open o(*this, "vocab_ce_max", {{row_max, "row_max"}, {logits, "logits"}});
    inner_->vocab_ce_max(row_max, logits, logits_type, N, Vl);
  }
  void vocab_ce_sums(float* sumexp, float* target_logit, const void* logits, DType logits_type, const float* row_max,
                     const int32_t* targets, int64_t v0, int64_t N, int64_t Vl) override {
    Open o(*this, "vocab_ce_sums",
           {{sumexp, "sumexp"}, {target_logit, "target_logit"}, {logits, "logits"}, {row_max, "row_max"},
            {targets, "targets"}});
    inner_->vocab_ce_sums(sumexp, target_logit, logits, logits_type, row_max, targets, v0, N, Vl);
  }
  void vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type, const void* logits, DType logits_type,
                       const float* row_max, const float* sumexp, const float* target_logit, const int32_t* targets,
                       int64_t v0, int64_t N, int64_t Vl, float dloss_scale) override {
    Open o(*this, "vocab_ce_finish",
           {{losses, "losses"}, {dlogits, "dlogits"}, {logits, "logits"}, {row_max, "row_max"}, {sumexp, "sumexp"},
            {target_logit, "target_logit"}, {targets, "targets"}});
    inner_->vocab_ce_finish(losses, dlogits, dlogits_type, logits, logits_type, row_max, sumexp, target_logit,
                            targets, v0, N, Vl, dloss_scale);
  }
  void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob, const float* logits,
                          int64_t N, int64_t E, int64_t K, MoeScore score, const float* select_bias) override {
    Open o(*this, "moe_router_forward",
           {{probs, "probs"}, {lse, "lse"}, {topk_idx, "topk_idx"}, {topk_prob, "topk_prob"}, {logits, "logits"},
            {select_bias, "select_bias"}});
    inner_->moe_router_forward(probs, lse, topk_idx, topk_prob, logits, N, E, K, score, select_bias);
  }
  void moe_router_backward(float* dlogits, const float* probs, const float* lse, const int32_t* topk_idx,
                           const float* dtopk_prob, const float* expert_grad, float z_scale, int64_t N, int64_t E,
                           int64_t K, MoeScore score) override {
    Open o(*this, "moe_router_backward",
           {{dlogits, "dlogits"}, {probs, "probs"}, {lse, "lse"}, {topk_idx, "topk_idx"}, {dtopk_prob, "dtopk_prob"},
            {expert_grad, "expert_grad"}});
    inner_->moe_router_backward(dlogits, probs, lse, topk_idx, dtopk_prob, expert_grad, z_scale, N, E, K, score);
  }
  void moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                         float scale) override {
    Open o(*this, "moe_gates_forward", {{gates, "gates"}, {topk_prob, "topk_prob"}});
    inner_->moe_gates_forward(gates, topk_prob, N, K, normalize, scale);
  }
  void moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N, int64_t K,
                          bool normalize, float scale) override {
    Open o(*this, "moe_gates_backward", {{dtopk_prob, "dtopk_prob"}, {dgates, "dgates"}, {topk_prob, "topk_prob"}});
    inner_->moe_gates_backward(dtopk_prob, dgates, topk_prob, N, K, normalize, scale);
  }
  void moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N, int64_t C,
                               DType act) override {
    Open o(*this, "moe_shared_gate_forward", {{out, "out"}, {gate, "gate"}, {logits, "logits"}, {y, "y"}});
    inner_->moe_shared_gate_forward(out, gate, logits, y, N, C, act);
  }
  void moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y, const float* gate,
                                int64_t N, int64_t C, DType act) override {
    Open o(*this, "moe_shared_gate_backward",
           {{dy, "dy"}, {dlogits, "dlogits"}, {dout, "dout"}, {y, "y"}, {gate, "gate"}});
    inner_->moe_shared_gate_backward(dy, dlogits, dout, y, gate, N, C, act);
  }
  void moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t C, DType act) override {
    Open o(*this, "moe_gather_rows", {{dst, "dst"}, {src, "src"}, {rows, "rows"}});
    inner_->moe_gather_rows(dst, src, rows, M, C, act);
  }
  void moe_combine(void* out, const void* y, const int32_t* pos, const float* weights, int64_t N, int64_t K,
                   int64_t C, bool accumulate, DType act) override {
    Open o(*this, "moe_combine", {{out, "out"}, {y, "y"}, {pos, "pos"}, {weights, "weights"}});
    inner_->moe_combine(out, y, pos, weights, N, K, C, accumulate, act);
  }
  void moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y, const int32_t* pos,
                            const float* weights, int64_t N, int64_t K, int64_t C, DType act) override {
    Open o(*this, "moe_combine_backward",
           {{dy, "dy"}, {dweights, "dweights"}, {dout, "dout"}, {y, "y"}, {pos, "pos"}, {weights, "weights"}});
    inner_->moe_combine_backward(dy, dweights, dout, y, pos, weights, N, K, C, act);
  }
  void sum_squares(float* out, const float* x, int64_t n) override {
    Open o(*this, "sum_squares", {{out, "out"}, {x, "x"}});
    inner_->sum_squares(out, x, n);
  }
  void sum(float* out, const float* x, int64_t n) override {
    Open o(*this, "sum", {{out, "out"}, {x, "x"}});
    inner_->sum(out, x, n);
  }
  void adamw(float* params, float* grads, float* m, float* v, int64_t n, const math::AdamParams& hp,
             void* compute_copy, DType compute_type) override {
    Open o(*this, "adamw",
           {{params, "params"}, {grads, "grads"}, {m, "m"}, {v, "v"}, {compute_copy, "compute_copy"}});
    inner_->adamw(params, grads, m, v, n, hp, compute_copy, compute_type);
  }
  void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) override {
    Open o(*this, "cast", {{dst, "dst"}, {src, "src"}});
    inner_->cast(dst, dst_type, src, src_type, n);
  }

  // The allocation `p` lies in (its first byte up to one past its last), or null. Callers hold
  // mutex_, or are the SIGSEGV report, which reads in a dying process.
  const Region* find(const void* p) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = regions_.upper_bound(a);
    if (it == regions_.begin()) return nullptr;
    --it;
    return a <= it->first + it->second.bytes ? &it->second : nullptr;
  }
  // The mapping (guard pages included) `p` lies in, or null.
  const Region* find_mapping(const void* p) const {
    const char* a = static_cast<const char*>(p);
    for (const auto& [key, r] : regions_)
      if (a >= r.map && a < r.map + r.mapped) return &r;
    return nullptr;
  }

 private:
  // Opens the allocations of an op's pointer arguments (null ones skipped) while it lives.
  class Open {
   public:
    Open(GuardedBackend& g, const char* op, std::initializer_list<Arg> args) : Open(g, op, args.begin(), args.end()) {}
    // A grouped GEMM's arguments: one per group (its B, bias or C).
    Open(GuardedBackend& g, const char* op, const std::vector<Arg>& args)
        : Open(g, op, args.data(), args.data() + args.size()) {}
    Open(GuardedBackend& g, const char* op, const Arg* first, const Arg* last) : g_(g), op_(op), lock_(g.mutex_) {
      for (const Arg* a = first; a != last; ++a) {
        if (a->p == nullptr) continue;
        const Region* r = g_.find(a->p);
        if (r == nullptr)
          throw Error(fmt::format("cpu-guarded: {}: argument {} ({}) is not backend memory (host memory passed "
                                  "to a backend op?)", op, a->what, a->p));
        bool seen = false;
        for (int i = 0; i < n_; ++i) seen = seen || open_[static_cast<size_t>(i)] == r;
        if (seen) continue;
        TETRA_CHECK(n_ < static_cast<int>(open_.size()), "cpu-guarded: {} names more than {} allocations", op,
                    open_.size());
        open_[static_cast<size_t>(n_++)] = r;
      }
      for (int i = 0; i < n_; ++i) g_.protect(*open_[static_cast<size_t>(i)], PROT_READ | PROT_WRITE);
    }
    ~Open() {
      for (int i = 0; i < n_; ++i) g_.protect(*open_[static_cast<size_t>(i)], PROT_NONE);
    }
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;

    // [p, p + bytes) must lie within p's allocation.
    void check_extent(const void* p, size_t bytes, const char* what) const {
      const Region* r = g_.find(p);
      const size_t at = static_cast<size_t>(static_cast<const char*>(p) - r->base);
      if (at + bytes > r->bytes)
        throw Error(fmt::format("cpu-guarded: {}: {} bytes at {} (byte {} of an allocation of {}) run past its end",
                                op_, bytes, what, at, r->bytes));
    }
    // The host side of a copy must not be backend memory.
    void check_host(const void* p, size_t bytes, const char* what) const {
      if (g_.find(p) != nullptr || g_.find(static_cast<const char*>(p) + bytes - 1) != nullptr)
        throw Error(fmt::format("cpu-guarded: {}: {} ({}) is backend memory, not host memory", op_, what, p));
    }

   private:
    GuardedBackend& g_;
    const char* op_;
    std::unique_lock<std::mutex> lock_;
    std::array<const Region*, 12> open_{};
    int n_ = 0;
  };

  void protect(const Region& r, int prot) const {
    if (mprotect(r.base, r.span, prot) != 0) {
      std::fprintf(stderr, "cpu-guarded: mprotect(%p, %zu) failed: %s\n", static_cast<void*>(r.base), r.span,
                   std::strerror(errno));
      std::abort();
    }
  }

  static void install_segv_report();
  static void uninstall_segv_report();

  std::unique_ptr<Backend> inner_;
  size_t page_;
  std::map<uintptr_t, Region> regions_;  // by base address
  std::mutex mutex_;
  AllocationTally tally_;  // what alloc() holds
};

// SIGSEGV: name the backend allocation the address falls in, print a backtrace, then let the
// previous handler (MPI's, or the default: a core dump) have the signal.
void segv_report(int sig, siginfo_t* info, void* context) {
  char line[256];
  const GuardedBackend* g = g_active.load();
  const Region* r = g ? g->find_mapping(info->si_addr) : nullptr;
  int n;
  if (r && static_cast<char*>(info->si_addr) >= r->base && static_cast<char*>(info->si_addr) < r->base + r->span)
    n = std::snprintf(line, sizeof(line),
                      "cpu-guarded: host access to backend memory at %p: byte %zu of an allocation of %zu bytes at "
                      "%p (use Backend::copy_to_host / copy_from_host, or a backend op)\n",
                      info->si_addr, static_cast<size_t>(static_cast<char*>(info->si_addr) - r->base), r->bytes,
                      static_cast<void*>(r->base));
  else if (r)
    n = std::snprintf(line, sizeof(line),
                      "cpu-guarded: access at %p, in a guard page of the allocation of %zu bytes at %p (an op "
                      "or a copy ran past its end)\n",
                      info->si_addr, r->bytes, static_cast<void*>(r->base));
  else
    n = std::snprintf(line, sizeof(line), "cpu-guarded: segmentation fault at %p, outside backend memory\n",
                      info->si_addr);
  if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(std::min<int>(n, sizeof(line) - 1)));
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
  if (g_previous_segv.sa_flags & SA_SIGINFO) {
    if (g_previous_segv.sa_sigaction) g_previous_segv.sa_sigaction(sig, info, context);
  } else if (g_previous_segv.sa_handler != SIG_DFL && g_previous_segv.sa_handler != SIG_IGN) {
    g_previous_segv.sa_handler(sig);
  }
  // Returning re-runs the faulting access under the restored disposition.
}

void GuardedBackend::install_segv_report() {
  std::lock_guard<std::mutex> lock(g_segv_mutex);
  if (g_segv_users++ > 0) return;
  struct sigaction sa {};
  sa.sa_sigaction = segv_report;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_previous_segv);
}

void GuardedBackend::uninstall_segv_report() {
  std::lock_guard<std::mutex> lock(g_segv_mutex);
  if (--g_segv_users > 0) return;
  struct sigaction current {};
  sigaction(SIGSEGV, nullptr, &current);
  // Put the previous handler back unless someone replaced the report since.
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == segv_report)
    sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

}  // namespace

std::unique_ptr<Backend> make_guarded_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<GuardedBackend>(std::move(inner));
}

}  // namespace tetra
