// CUDA softmax cross-entropy (kernels/cuda/loss.cu) against the CPU ops: the fused op (losses,
// and dlogits separate from or in place over the logits) and the three vocab-parallel passes on
// slices of the vocabulary (v0 = 0 and v0 > 0), in fp32, bf16 and fp16 storage, at V from 1 to
// GPT-2's 50257 (odd: rows start at every alignment, so the kernels' scalar heads and tails around the
// 16-byte chunks all run), with ignored targets and a row of large logits.
//
// Tolerances:
// - Row max and the target's logit: exact (the same values, no arithmetic).
// - Sums of exp and losses: both backends use math::exp_fast on the same inputs (equal up to
//   the compilers' multiply-add contraction in its polynomial, a few ulp); the sums run in other
//   orders (the GPU also rescales per-thread partial sums when its running max grows), a
//   relative error of a few ulp times log2(V). rtol 1e-5 on sums; losses, (M - l_t) + log(S),
//   err by ~1e-6 absolute: atol 1e-5, rtol 1e-5.
// - fp32 dlogits: scale * e / S, relative error that of S plus the exponential's: rtol 1e-5; the
//   target's element e_t k - scale cancels when p_t ~ 1: atol 1e-6 (scale = 0.37).
// - bf16 / fp16 dlogits: additionally 1 ulp, at most 2^-7 (bf16) or 2^-10 (fp16) of the value; fp16
//   gradients below 2^-14 (p ~ 1/V at V = 50257) are subnormal, their ulp 2^-24 under the atol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

constexpr float kScale = 0.37f;

double grad_rtol(DType g) { return storage_ulp(g) + 1e-5; }
constexpr double kGradAtol = 1e-6;

// Logits (N, V) uniform in [-4, 4), row 2 (if any) shifted by +30 (a softmax that would
// overflow without the max subtraction).
std::vector<float> make_logits(int64_t N, int64_t V, uint64_t seed) {
  std::vector<float> l = random_values(static_cast<size_t>(N * V), seed, 4.0f);
  if (N > 2)
    for (int64_t j = 0; j < V; ++j) l[static_cast<size_t>(2 * V + j)] += 30.0f;
  return l;
}

// Targets in [0, V), every fifth row (from row 3) ignored (-1).
std::vector<int32_t> make_targets(int64_t N, int64_t V, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    t[static_cast<size_t>(i)] =
        i % 5 == 3 ? -1 : static_cast<int32_t>((static_cast<int64_t>(seed) * 7 + i * 7919) % V);
  return t;
}

// The columns [v0, v0 + Vl) of the (N, V) values.
std::vector<float> columns(const std::vector<float>& v, int64_t N, int64_t V, int64_t v0,
                           int64_t Vl) {
  std::vector<float> out(static_cast<size_t>(N * Vl));
  for (int64_t i = 0; i < N; ++i) std::copy_n(v.begin() + i * V + v0, Vl, out.begin() + i * Vl);
  return out;
}

const char* name(DType t) { return type_name(t); }

enum class Grad { NONE, SEPARATE, IN_PLACE };
const char* name(Grad g) {
  return g == Grad::NONE ? "no dlogits" : g == Grad::SEPARATE ? "dlogits" : "dlogits in place";
}

struct Types {
  DType logits, grad;
};
const Types kTypes[] = {{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32},
                        {DType::F16, DType::F16},  {DType::F16, DType::F32}};

void check_cross_entropy(Types ty, Grad mode, int64_t N, int64_t V, uint64_t seed) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const std::vector<int32_t> target_values = make_targets(N, V, seed);
  Twin logits(make_logits(N, V, seed), ty.logits), targets(target_values);
  Twin dlogits(random_values(static_cast<size_t>(N * V), seed + 1), ty.grad);
  Twin losses(random_values(static_cast<size_t>(N), seed + 2), DType::F32);
  Twin& g = mode == Grad::IN_PLACE ? logits : dlogits;
  const DType gt = mode == Grad::IN_PLACE ? ty.logits : ty.grad;
  cpu.cross_entropy(losses.cpu_f32(), mode == Grad::NONE ? nullptr : g.cpu(), gt, logits.cpu(),
                    ty.logits, targets.cpu_i32(), N, V, kScale);
  gpu.cross_entropy(losses.gpu_f32(), mode == Grad::NONE ? nullptr : g.gpu(), gt, logits.gpu(),
                    ty.logits, targets.gpu_i32(), N, V, kScale);
  const std::vector<float> loss_gpu = losses.gpu_values();
  require_close(losses.cpu_values(), loss_gpu, 1e-5, 1e-5, "cross_entropy losses");
  for (int64_t i = 0; i < N; ++i)
    if (target_values[static_cast<size_t>(i)] < 0)
      REQUIRE(loss_gpu[static_cast<size_t>(i)] == 0.0f);
  if (mode != Grad::NONE) {
    const std::vector<float> grad_gpu = g.gpu_values();
    require_close(g.cpu_values(), grad_gpu, grad_rtol(gt), kGradAtol, "cross_entropy dlogits");
    for (int64_t i = 0; i < N; ++i)  // an ignored row's gradient is exactly zero
      if (target_values[static_cast<size_t>(i)] < 0)
        for (int64_t j = 0; j < V; ++j) REQUIRE(grad_gpu[static_cast<size_t>(i * V + j)] == 0.0f);
  }
}

// The three vocab-parallel passes over the slices [0, split) and [split, V), each pass checked
// against the CPU's from the same inputs (the global values combined on the host from the CPU's
// results), then the GPU's passes alone, combined on the host, against the CPU's fused losses.
void check_vocab_parallel(Types ty, Grad mode, int64_t N, int64_t V, int64_t split, uint64_t seed) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const std::vector<float> full = make_logits(N, V, seed);
  const std::vector<int32_t> target_values = make_targets(N, V, seed);
  Twin targets(target_values);
  struct SliceRange {
    int64_t v0, Vl;
  };
  const SliceRange slices[2] = {{0, split}, {split, V - split}};
  const size_t n = static_cast<size_t>(N);

  // Pass 1, and the global max.
  std::vector<float> global_max(n, -std::numeric_limits<float>::infinity()), gpu_max = global_max;
  for (const SliceRange& s : slices) {
    Twin l(columns(full, N, V, s.v0, s.Vl), ty.logits), row_max(n, DType::F32);
    cpu.vocab_ce_max(row_max.cpu_f32(), l.cpu(), ty.logits, N, s.Vl);
    gpu.vocab_ce_max(row_max.gpu_f32(), l.gpu(), ty.logits, N, s.Vl);
    const std::vector<float> c = row_max.cpu_values(), g = row_max.gpu_values();
    require_close(c, g, 0.0, 0.0, "vocab_ce_max");
    for (size_t i = 0; i < n; ++i) global_max[i] = std::max(global_max[i], c[i]);
    for (size_t i = 0; i < n; ++i) gpu_max[i] = std::max(gpu_max[i], g[i]);
  }
  // Pass 2, and the global sums.
  Twin row_max(global_max, DType::F32), gpu_row_max(gpu_max, DType::F32);
  std::vector<float> sumexp(n, 0.0f), target_logit(n, 0.0f), gpu_sumexp = sumexp,
                                                             gpu_target_logit = target_logit;
  for (const SliceRange& s : slices) {
    Twin l(columns(full, N, V, s.v0, s.Vl), ty.logits), se(n, DType::F32), tl(n, DType::F32);
    cpu.vocab_ce_sums(se.cpu_f32(), tl.cpu_f32(), l.cpu(), ty.logits, row_max.cpu_f32(),
                      targets.cpu_i32(), s.v0, N, s.Vl);
    gpu.vocab_ce_sums(se.gpu_f32(), tl.gpu_f32(), l.gpu(), ty.logits, row_max.gpu_f32(),
                      targets.gpu_i32(), s.v0, N, s.Vl);
    require_close(se.cpu_values(), se.gpu_values(), 1e-5, 0.0, "vocab_ce_sums sumexp");
    require_close(tl.cpu_values(), tl.gpu_values(), 0.0, 0.0, "vocab_ce_sums target_logit");
    const std::vector<float> cs = se.cpu_values(), ct = tl.cpu_values();
    for (size_t i = 0; i < n; ++i) sumexp[i] += cs[i], target_logit[i] += ct[i];
    // The GPU-only chain, from the GPU's own max.
    gpu.vocab_ce_sums(se.gpu_f32(), tl.gpu_f32(), l.gpu(), ty.logits, gpu_row_max.gpu_f32(),
                      targets.gpu_i32(), s.v0, N, s.Vl);
    const std::vector<float> gs = se.gpu_values(), gt = tl.gpu_values();
    for (size_t i = 0; i < n; ++i) gpu_sumexp[i] += gs[i], gpu_target_logit[i] += gt[i];
  }
  // Pass 3 from the same global values, and the GPU-only chain.
  Twin se(sumexp, DType::F32), tl(target_logit, DType::F32);
  Twin gpu_se(gpu_sumexp, DType::F32), gpu_tl(gpu_target_logit, DType::F32);
  std::vector<float> gpu_losses(n, 0.0f);
  for (const SliceRange& s : slices) {
    Twin l(columns(full, N, V, s.v0, s.Vl), ty.logits);
    Twin separate(random_values(static_cast<size_t>(N * s.Vl), seed + 5), ty.grad);
    Twin losses(random_values(n, seed + 6), DType::F32);
    Twin& g = mode == Grad::IN_PLACE ? l : separate;
    const DType gt = mode == Grad::IN_PLACE ? ty.logits : ty.grad;
    cpu.vocab_ce_finish(losses.cpu_f32(), mode == Grad::NONE ? nullptr : g.cpu(), gt, l.cpu(),
                        ty.logits, row_max.cpu_f32(), se.cpu_f32(), tl.cpu_f32(), targets.cpu_i32(),
                        s.v0, N, s.Vl, kScale);
    gpu.vocab_ce_finish(losses.gpu_f32(), mode == Grad::NONE ? nullptr : g.gpu(), gt, l.gpu(),
                        ty.logits, row_max.gpu_f32(), se.gpu_f32(), tl.gpu_f32(), targets.gpu_i32(),
                        s.v0, N, s.Vl, kScale);
    require_close(losses.cpu_values(), losses.gpu_values(), 1e-5, 1e-5, "vocab_ce_finish losses");
    if (mode != Grad::NONE)
      require_close(g.cpu_values(), g.gpu_values(), grad_rtol(gt), kGradAtol,
                    "vocab_ce_finish dlogits");
    // Losses alone from the GPU's own global values (the logits are not read for them).
    gpu.vocab_ce_finish(losses.gpu_f32(), nullptr, gt, l.gpu(), ty.logits, gpu_row_max.gpu_f32(),
                        gpu_se.gpu_f32(), gpu_tl.gpu_f32(), targets.gpu_i32(), s.v0, N, s.Vl,
                        kScale);
    gpu_losses = losses.gpu_values();
  }
  Twin l(full, ty.logits), fused(n, DType::F32);
  cpu.cross_entropy(fused.cpu_f32(), nullptr, ty.logits, l.cpu(), ty.logits, targets.cpu_i32(), N,
                    V, kScale);
  require_close(fused.cpu_values(), gpu_losses, 1e-5, 1e-5, "vocab-parallel vs fused losses");
}

}  // namespace

TEST_CASE("cuda cross_entropy matches the cpu", "[cuda][loss]") {
  for (const Types& ty : kTypes)
    for (Grad mode : {Grad::NONE, Grad::SEPARATE, Grad::IN_PLACE}) {
      if (mode == Grad::IN_PLACE && ty.logits != ty.grad) continue;
      for (int64_t N : {1, 7, 33})
        for (int64_t V : {1, 5, 771, 50257})
          DYNAMIC_SECTION(name(ty.logits) << "/" << name(ty.grad) << " " << name(mode) << " N=" << N
                                          << " V=" << V) {
            check_cross_entropy(ty, mode, N, V, 10 + N + V);
          }
    }
}

TEST_CASE("cuda cross_entropy at the padded GPT-2 vocabulary (aligned rows)", "[cuda][loss]") {
  for (const Types& ty : kTypes) DYNAMIC_SECTION(name(ty.logits) << "/" << name(ty.grad)) {
      check_cross_entropy(ty, Grad::SEPARATE, 9, 50304, 20);
    }
}

TEST_CASE("cuda vocab-parallel cross-entropy passes match the cpu", "[cuda][loss]") {
  for (const Types& ty : kTypes)
    for (Grad mode : {Grad::NONE, Grad::SEPARATE, Grad::IN_PLACE}) {
      if (mode == Grad::IN_PLACE && ty.logits != ty.grad) continue;
      for (int64_t N : {1, 7, 33})
        for (auto [V, split] : {std::pair<int64_t, int64_t>{13, 5}, {771, 385}, {50257, 25000}})
          DYNAMIC_SECTION(name(ty.logits) << "/" << name(ty.grad) << " " << name(mode) << " N=" << N
                                          << " V=" << V << " split " << split) {
            check_vocab_parallel(ty, mode, N, V, split, 30 + N + V);
          }
    }
}

}  // namespace tetra::cuda_testing
