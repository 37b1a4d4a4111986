// The Mixture-of-Experts ops on the GPU against the CPU backend: router forward (softmax, lse,
// top-k with ties to the lower index) and backward, the row gather, combine and its backward, the
// gates and the shared expert's sigmoid gate.
// Odd sizes throughout; the row ops also run with pointers one element off the 16-byte grid, so
// the 16-byte, 4-byte and 2-byte copy paths all run.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

// Per-element |got - ref| <= tol[i] (NaN never passes), reporting the worst element.
void require_within(const std::vector<float>& ref, const std::vector<float>& got,
                    const std::vector<double>& tol, const std::string& what) {
  REQUIRE(ref.size() == got.size());
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(err <= tol[i])) ++bad;
    const double excess = std::isfinite(err) ? err - tol[i] : 1e300;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  INFO(what << ": " << bad << " of " << ref.size() << " elements out of tolerance; worst at "
            << worst << ": cpu " << ref[worst] << " cuda " << got[worst] << " tol " << tol[worst]);
  REQUIRE(bad == 0);
}

std::vector<int32_t> to_ints(const std::vector<float>& v) {
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<int32_t>(v[i]);
  return out;
}

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

void* at(void* p, int64_t elements, DType t) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(t));
}

// n distinct positions out of [0, M) in random order, about 1 in 7 replaced by -1 (dropped).
std::vector<int32_t> positions(int64_t n, int64_t M, uint64_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(M));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  for (auto& p : all)
    if (rng() % 7 == 0) p = -1;
  return all;
}

}  // namespace

// Forward. Logits lie on a grid of step 1/8 in [-2, 2]: many exact ties within a row (equal
// logits give equal probabilities on each backend, so both must order them by index), and
// distinct probabilities differ by a factor e^(1/8) at least, far beyond any rounding, so the
// top-k indices must agree exactly. Probabilities: expf is within 2 ulp on both sides, the row
// sums of E exponentials differ by up to 2 E u relatively, one division each: rtol (2E + 16) u.
// lse = max + log(sum): the same relative sum error as an absolute one, plus log's and the
// add's rounding.
TEST_CASE("cuda moe_router_forward vs cpu: softmax, lse, top-k with ties", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 40;
  for (int64_t N : {1, 5, 33, 1000}) {
    for (int64_t E : {1, 4, 8, 37, 64, 160}) {
      for (int64_t K : {int64_t{1}, int64_t{2}, std::min<int64_t>(E, 8)}) {
        if (K > E) continue;
        INFO("N=" << N << " E=" << E << " K=" << K);
        std::mt19937_64 rng(seed += 3);
        std::vector<float> logits(static_cast<size_t>(N * E));
        for (float& l : logits) l = -2.0f + 0.125f * static_cast<float>(rng() % 33);
        Twin lg(logits, DType::F32), probs(N * E, DType::F32), lse(N, DType::F32),
            tprob(N * K, DType::F32);
        Twin idx(std::vector<int32_t>(static_cast<size_t>(N * K), -7));
        be.cpu->moe_router_forward(probs.cpu_f32(), lse.cpu_f32(), static_cast<int32_t*>(idx.cpu()),
                                   tprob.cpu_f32(), lg.cpu_f32(), N, E, K, MoeScore::SOFTMAX, nullptr);
        be.gpu->moe_router_forward(probs.gpu_f32(), lse.gpu_f32(), static_cast<int32_t*>(idx.gpu()),
                                   tprob.gpu_f32(), lg.gpu_f32(), N, E, K, MoeScore::SOFTMAX, nullptr);
        const double rtol = (2.0 * E + 16.0) * kU;
        const std::vector<float> pr = probs.cpu_values(), lr = lse.cpu_values(),
                                 tr = tprob.cpu_values();
        std::vector<double> ptol(pr.size()), ltol(lr.size()), ttol(tr.size());
        for (size_t i = 0; i < pr.size(); ++i) ptol[i] = rtol * std::fabs(pr[i]);
        for (size_t i = 0; i < lr.size(); ++i) ltol[i] = rtol * (1.0 + std::fabs(lr[i]));
        for (size_t i = 0; i < tr.size(); ++i) ttol[i] = rtol * std::fabs(tr[i]);
        REQUIRE(idx.gpu_values() == idx.cpu_values());
        require_within(pr, probs.gpu_values(), ptol, "probs");
        require_within(lr, lse.gpu_values(), ltol, "lse");
        require_within(tr, tprob.gpu_values(), ttol, "topk_prob");
      }
    }
  }
}

// Backward, on the CPU forward's outputs. dp is assembled in the same order on both sides; the
// dot product sum_j p_j dp_j over E terms differs by up to 2 (E + 1) u D, D = sum_j |p_j dp_j|,
// and is multiplied by p_j; the rest is a few roundings of terms of size
// p_j (|dp_j| + |dot| + |z|).
TEST_CASE("cuda moe_router_backward vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 60;
  for (int64_t N : {1, 7, 500}) {
    for (int64_t E : {2, 8, 37, 64}) {
      for (int64_t K : {int64_t{1}, std::min<int64_t>(E, 4)}) {
        for (bool with_expert_grad : {false, true}) {
          INFO("N=" << N << " E=" << E << " K=" << K << " expert_grad=" << with_expert_grad);
          const float z_scale = 1e-2f;
          Twin lg(random_values(static_cast<size_t>(N * E), seed += 3, 3.0f), DType::F32);
          Twin probs(N * E, DType::F32), lse(N, DType::F32), tprob(N * K, DType::F32);
          Twin idx(std::vector<int32_t>(static_cast<size_t>(N * K), 0));
          auto* idx_cpu = static_cast<int32_t*>(idx.cpu());
          be.cpu->moe_router_forward(probs.cpu_f32(), lse.cpu_f32(), idx_cpu, tprob.cpu_f32(),
                                     lg.cpu_f32(), N, E, K, MoeScore::SOFTMAX, nullptr);
          const std::vector<float> p = probs.cpu_values(), l = lse.cpu_values();
          const std::vector<int32_t> ix = to_ints(idx.cpu_values());
          Twin p_in(p, DType::F32), lse_in(l, DType::F32), idx_in(ix);
          const std::vector<float> dtp = random_values(static_cast<size_t>(N * K), seed += 3);
          const std::vector<float> eg = random_values(static_cast<size_t>(E), seed += 3, 0.1f);
          Twin dtopk(dtp, DType::F32), expert_grad(eg, DType::F32), dlogits(N * E, DType::F32);
          be.cpu->moe_router_backward(dlogits.cpu_f32(), p_in.cpu_f32(), lse_in.cpu_f32(),
                                      idx_in.cpu_i32(), dtopk.cpu_f32(),
                                      with_expert_grad ? expert_grad.cpu_f32() : nullptr, z_scale,
                                      N, E, K, MoeScore::SOFTMAX);
          be.gpu->moe_router_backward(dlogits.gpu_f32(), p_in.gpu_f32(), lse_in.gpu_f32(),
                                      idx_in.gpu_i32(), dtopk.gpu_f32(),
                                      with_expert_grad ? expert_grad.gpu_f32() : nullptr, z_scale,
                                      N, E, K, MoeScore::SOFTMAX);
          std::vector<double> tol(static_cast<size_t>(N * E));
          for (int64_t i = 0; i < N; ++i) {
            std::vector<double> dp(static_cast<size_t>(E), 0.0);
            for (int64_t j = 0; j < E; ++j) dp[j] = with_expert_grad ? eg[j] : 0.0;
            for (int64_t k = 0; k < K; ++k) dp[ix[i * K + k]] += dtp[i * K + k];
            double D = 0.0, dot = 0.0;
            for (int64_t j = 0; j < E; ++j) {
              D += std::fabs(p[i * E + j] * dp[j]);
              dot += p[i * E + j] * dp[j];
            }
            const double z = std::fabs(2.0 * z_scale * l[i]);
            for (int64_t j = 0; j < E; ++j) {
              const double pj = p[i * E + j];
              tol[i * E + j] = 2.0 * (E + 1) * kU * pj * D +
                               8.0 * kU * pj * (std::fabs(dp[j]) + std::fabs(dot) + z);
            }
          }
          require_within(dlogits.cpu_values(), dlogits.gpu_values(), tol, "dlogits");
        }
      }
    }
  }
}

// Gather is a copy: bitwise, and the destination rows past M are untouched.
TEST_CASE("cuda moe_gather_rows vs cpu: bitwise", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 80;
  for (int64_t C : {1, 3, 8, 768, 771}) {
    for (int64_t offset : {0, 1}) {
      for (DType act : {DType::F32, DType::BF16, DType::F16}) {
        INFO("C=" << C << " offset=" << offset << " " << dtype_name(act));
        const int64_t R = 37, M = 53;
        std::mt19937_64 rng(seed += 3);
        std::vector<int32_t> rows(static_cast<size_t>(M));
        for (auto& r : rows) r = static_cast<int32_t>(rng() % R);
        Twin src(random_values(static_cast<size_t>(offset + R * C), seed += 3), act);
        Twin dst(random_values(static_cast<size_t>(offset + (M + 1) * C), seed += 3), act);
        Twin rw(rows);
        be.cpu->moe_gather_rows(at(dst.cpu(), offset, act), at(src.cpu(), offset, act),
                                rw.cpu_i32(), M, C, act);
        be.gpu->moe_gather_rows(at(dst.gpu(), offset, act), at(src.gpu(), offset, act),
                                rw.gpu_i32(), M, C, act);
        REQUIRE(dst.gpu_values() == dst.cpu_values());
      }
    }
  }
}

// Combine: out = (accumulate ? out : 0) + sum_k w y[pos], an fp32 sum of K + 1 terms rounded
// once to the activation type. Orders may differ (the kernels use the CPU's, fused the same way,
// so in practice the bits agree): 2 (K + 1) u S, S the sum of the terms' magnitudes, plus one
// step of the final rounding (2^-23 |ref| for fp32, 2^-7 |ref| for bf16, 2^-10 |ref| for fp16).
TEST_CASE("cuda moe_combine vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 100;
  for (int64_t N : {1, 17, 300}) {
    for (int64_t K : {1, 2, 4}) {
      for (int64_t C : {1, 8, 768, 771}) {
        for (int variant = 0; variant < 4; ++variant) {
          const bool accumulate = variant & 1, weighted = variant & 2;
          for (DType act : {DType::F32, DType::BF16, DType::F16}) {
            for (int64_t offset : {0, 1}) {
              INFO("N=" << N << " K=" << K << " C=" << C << " accumulate=" << accumulate
                        << " weighted=" << weighted << " offset=" << offset << " "
                        << dtype_name(act));
              const int64_t M = N * K + 5;
              const std::vector<int32_t> pos = positions(N * K, M, seed += 3);
              const std::vector<float> w = random_values(static_cast<size_t>(N * K), seed += 3);
              Twin y(random_values(static_cast<size_t>(offset + M * C), seed += 3), act);
              Twin out(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
              Twin ps(pos), ws(w, DType::F32);
              const std::vector<float> out0 = out.cpu_values(), yv = y.cpu_values();
              be.cpu->moe_combine(at(out.cpu(), offset, act), at(y.cpu(), offset, act),
                                  ps.cpu_i32(), weighted ? ws.cpu_f32() : nullptr, N, K, C,
                                  accumulate, act);
              be.gpu->moe_combine(at(out.gpu(), offset, act), at(y.gpu(), offset, act),
                                  ps.gpu_i32(), weighted ? ws.gpu_f32() : nullptr, N, K, C,
                                  accumulate, act);
              const std::vector<float> ref = out.cpu_values(), got = out.gpu_values();
              const double round = act == DType::F32 ? 2.0 * kU : storage_ulp(act);
              std::vector<double> tol(ref.size(), 0.0);
              for (int64_t i = 0; i < N; ++i) {
                for (int64_t c = 0; c < C; ++c) {
                  const size_t e = static_cast<size_t>(offset + i * C + c);
                  double s = accumulate ? std::fabs(out0[e]) : 0.0;
                  for (int64_t k = 0; k < K; ++k) {
                    const int32_t p = pos[i * K + k];
                    if (p < 0) continue;
                    s += std::fabs((weighted ? w[i * K + k] : 1.0) * yv[offset + p * C + c]);
                  }
                  tol[e] = 2.0 * (K + 1) * kU * s + round * std::fabs(ref[e]);
                }
              }
              require_within(ref, got, tol, "combine out");
              if (offset == 1) CHECK(bits(got[0]) == bits(out0[0]));
            }
          }
        }
      }
    }
  }
}

// Combine backward: dy rows are w * dout rounded once (a single product: bitwise), rows no
// position names are untouched; dweights are dot products over C in different orders:
// 2 (C + 1) u sum_c |dout y|, and exactly 0 for a dropped assignment.
TEST_CASE("cuda moe_combine_backward vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 200;
  for (int64_t N : {1, 17, 300}) {
    for (int64_t K : {1, 2, 4}) {
      for (int64_t C : {1, 8, 768, 771}) {
        for (DType act : {DType::F32, DType::BF16, DType::F16}) {
          for (int64_t offset : {0, 1}) {
            INFO("N=" << N << " K=" << K << " C=" << C << " offset=" << offset << " "
                      << dtype_name(act));
            const int64_t M = N * K + 5;
            const std::vector<int32_t> pos = positions(N * K, M, seed += 3);
            Twin ps(pos), ws(random_values(static_cast<size_t>(N * K), seed += 3), DType::F32);
            Twin dout(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
            Twin y(random_values(static_cast<size_t>(offset + M * C), seed += 3), act);
            Twin dy(random_values(static_cast<size_t>(offset + M * C), seed += 3), act);
            Twin dw(std::vector<float>(static_cast<size_t>(N * K), 5.0f), DType::F32);
            be.cpu->moe_combine_backward(at(dy.cpu(), offset, act), dw.cpu_f32(),
                                         at(dout.cpu(), offset, act), at(y.cpu(), offset, act),
                                         ps.cpu_i32(), ws.cpu_f32(), N, K, C, act);
            be.gpu->moe_combine_backward(at(dy.gpu(), offset, act), dw.gpu_f32(),
                                         at(dout.gpu(), offset, act), at(y.gpu(), offset, act),
                                         ps.gpu_i32(), ws.gpu_f32(), N, K, C, act);
            REQUIRE(dy.gpu_values() == dy.cpu_values());
            const std::vector<float> d = dout.cpu_values(), yv = y.cpu_values();
            std::vector<double> tol(static_cast<size_t>(N * K), 0.0);
            for (int64_t a = 0; a < N * K; ++a) {
              const int32_t p = pos[a];
              if (p < 0) continue;  // must be exactly 0
              double s = 0.0;
              for (int64_t c = 0; c < C; ++c)
                s += std::fabs(static_cast<double>(d[offset + (a / K) * C + c]) *
                               yv[offset + p * C + c]);
              tol[a] = 2.0 * (C + 1) * kU * s;
            }
            require_within(dw.cpu_values(), dw.gpu_values(), tol, "dweights");
          }
        }
      }
    }
  }
}


// Sigmoid scores (math::sigmoid on both sides) with a selection bias of whole numbers: logits on
// the 1/8 grid give scores at least ~1e-2 apart unless equal, and a whole-number bias cannot
// bring two distinct keys within rounding of each other, so the chosen experts must agree
// exactly; scores, their normalisation and sum as the softmax's tolerances. Backward: ds + (dp -
// dot) / S times s (1 - s), with s = probs S rounded once more.
TEST_CASE("cuda moe_router sigmoid scores with a selection bias vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 140;
  for (int64_t N : {1, 7, 300}) {
    for (int64_t E : {4, 37, 64}) {
      for (int64_t K : {int64_t{1}, int64_t{6}}) {
        for (bool with_bias : {false, true}) {
          INFO("N=" << N << " E=" << E << " K=" << K << " bias=" << with_bias);
          std::mt19937_64 rng(seed += 3);
          std::vector<float> logits(static_cast<size_t>(N * E)), bias(static_cast<size_t>(E));
          for (float& l : logits) l = -2.0f + 0.125f * static_cast<float>(rng() % 33);
          for (float& b : bias) b = static_cast<float>(rng() % 3);
          Twin lg(logits, DType::F32), tb(bias, DType::F32), probs(N * E, DType::F32), lse(N, DType::F32),
              tprob(N * K, DType::F32);
          Twin idx(std::vector<int32_t>(static_cast<size_t>(N * K), -7));
          be.cpu->moe_router_forward(probs.cpu_f32(), lse.cpu_f32(), static_cast<int32_t*>(idx.cpu()),
                                     tprob.cpu_f32(), lg.cpu_f32(), N, E, K, MoeScore::SIGMOID,
                                     with_bias ? tb.cpu_f32() : nullptr);
          be.gpu->moe_router_forward(probs.gpu_f32(), lse.gpu_f32(), static_cast<int32_t*>(idx.gpu()),
                                     tprob.gpu_f32(), lg.gpu_f32(), N, E, K, MoeScore::SIGMOID,
                                     with_bias ? tb.gpu_f32() : nullptr);
          REQUIRE(idx.gpu_values() == idx.cpu_values());
          const double rtol = (2.0 * E + 16.0) * kU;
          const std::vector<float> pr = probs.cpu_values(), lr = lse.cpu_values(), tr = tprob.cpu_values();
          std::vector<double> ptol(pr.size()), ltol(lr.size()), ttol(tr.size());
          for (size_t i = 0; i < pr.size(); ++i) ptol[i] = rtol * std::fabs(pr[i]);
          for (size_t i = 0; i < lr.size(); ++i) ltol[i] = rtol * std::fabs(lr[i]);
          for (size_t i = 0; i < tr.size(); ++i) ttol[i] = 16.0 * kU * std::fabs(tr[i]);
          require_within(pr, probs.gpu_values(), ptol, "probs");
          require_within(lr, lse.gpu_values(), ltol, "lse");
          require_within(tr, tprob.gpu_values(), ttol, "topk_prob");
          // Backward on the CPU forward's outputs.
          const std::vector<int32_t> ix = to_ints(idx.cpu_values());
          Twin p_in(pr, DType::F32), lse_in(lr, DType::F32), idx_in(ix);
          const std::vector<float> dtp = random_values(static_cast<size_t>(N * K), seed += 3);
          const std::vector<float> eg = random_values(static_cast<size_t>(E), seed += 3, 0.1f);
          Twin dtopk(dtp, DType::F32), expert_grad(eg, DType::F32), dlogits(N * E, DType::F32);
          be.cpu->moe_router_backward(dlogits.cpu_f32(), p_in.cpu_f32(), lse_in.cpu_f32(), idx_in.cpu_i32(),
                                      dtopk.cpu_f32(), expert_grad.cpu_f32(), 0.0f, N, E, K, MoeScore::SIGMOID);
          be.gpu->moe_router_backward(dlogits.gpu_f32(), p_in.gpu_f32(), lse_in.gpu_f32(), idx_in.gpu_i32(),
                                      dtopk.gpu_f32(), expert_grad.gpu_f32(), 0.0f, N, E, K, MoeScore::SIGMOID);
          std::vector<double> tol(static_cast<size_t>(N * E));
          for (int64_t i = 0; i < N; ++i) {
            double D = 0.0, dot = 0.0;
            for (int64_t j = 0; j < E; ++j) D += std::fabs(pr[i * E + j] * eg[j]), dot += pr[i * E + j] * eg[j];
            const double S = lr[i];
            for (int64_t j = 0; j < E; ++j) {
              double ds = 0.0;
              for (int64_t k = 0; k < K; ++k)
                if (ix[i * K + k] == j) ds += dtp[i * K + k];
              const double sj = pr[i * E + j] * S;
              const double g = std::fabs(ds) + (std::fabs(eg[j]) + std::fabs(dot)) / S;
              tol[i * E + j] = (2.0 * (E + 1) * kU * D / S + 16.0 * kU * g) * sj * (1.0 - sj) + 1e-12;
            }
          }
          require_within(dlogits.cpu_values(), dlogits.gpu_values(), tol, "dlogits");
        }
      }
    }
  }
}

// Gates from the chosen probabilities (math::moe_gates_row, one function on both sides):
// renormalised or not, scaled or not. The GPU may contract a multiply and an add into one FMA, so
// each value is held to a few units of fp32 rounding of the terms it sums.
TEST_CASE("cuda moe_gates_forward and backward vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 90;
  for (int64_t N : {1, 7, 300}) {
    for (int64_t K : {1, 2, 6}) {
      for (bool normalize : {false, true}) {
        for (float scale : {1.0f, 2.5f}) {
          INFO("N=" << N << " K=" << K << " normalize=" << normalize << " scale=" << scale);
          std::vector<float> q = random_values(static_cast<size_t>(N * K), seed += 3);
          for (float& v : q) v = 0.05f + std::fabs(v);  // probabilities: positive
          const std::vector<float> dg = random_values(static_cast<size_t>(N * K), seed += 3);
          Twin tq(q, DType::F32), tdg(dg, DType::F32), gates(N * K, DType::F32), dq(N * K, DType::F32);
          be.cpu->moe_gates_forward(gates.cpu_f32(), tq.cpu_f32(), N, K, normalize, scale);
          be.gpu->moe_gates_forward(gates.gpu_f32(), tq.gpu_f32(), N, K, normalize, scale);
          be.cpu->moe_gates_backward(dq.cpu_f32(), tdg.cpu_f32(), tq.cpu_f32(), N, K, normalize, scale);
          be.gpu->moe_gates_backward(dq.gpu_f32(), tdg.gpu_f32(), tq.gpu_f32(), N, K, normalize, scale);
          std::vector<double> tol_g(static_cast<size_t>(N * K)), tol_d(static_cast<size_t>(N * K));
          for (int64_t i = 0; i < N; ++i) {
            double s = 0, dot = 0;
            for (int64_t k = 0; k < K; ++k) s += q[i * K + k], dot += std::fabs(dg[i * K + k] * q[i * K + k]);
            const double f = normalize ? scale / s : scale;
            for (int64_t k = 0; k < K; ++k) {
              tol_g[i * K + k] = 16 * kU * q[i * K + k] * f * (K + 2);
              tol_d[i * K + k] = 16 * kU * f * (std::fabs(dg[i * K + k]) + (normalize ? dot / s : 0.0)) * (K + 2);
            }
          }
          require_within(gates.cpu_values(), gates.gpu_values(), tol_g, "gates");
          require_within(dq.cpu_values(), dq.gpu_values(), tol_d, "dtopk_prob");
        }
      }
    }
  }
}

}  // namespace tetra::cuda_testing

namespace tetra::cuda_testing {
namespace {

// The shared expert's sigmoid gate (math::moe_shared_gate and _grad on both sides): gate and
// out += gate y forward; dy = gate dout (bit for bit: one product of the same values) and
// dlogits = gate (1 - gate) <dout, y> backward. The GPU may contract the sigmoid's and the
// update's multiply-adds into FMAs and sums the dot in another order: the gate is held to a few
// units of fp32 rounding, out to those of its terms plus one storage rounding, dlogits to the
// dot's rounding over C terms.
TEST_CASE("cuda moe_shared_gate_forward and backward vs cpu", "[cuda][moe]") {
  Backends& be = backends();
  uint64_t seed = 400;
  for (int64_t N : {1, 17, 300}) {
    for (int64_t C : {1, 8, 768, 771}) {
      for (DType act : {DType::F32, DType::BF16, DType::F16}) {
        for (int64_t offset : {0, 1}) {
          INFO("N=" << N << " C=" << C << " offset=" << offset << " " << dtype_name(act));
          std::vector<float> lg = random_values(static_cast<size_t>(N), seed += 3);
          for (float& v : lg) v *= 3.0f;
          Twin logits(lg, DType::F32), gate(N, DType::F32), dlogits(N, DType::F32);
          Twin y(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
          Twin out(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
          Twin dout(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
          Twin dy(random_values(static_cast<size_t>(offset + N * C), seed += 3), act);
          const std::vector<float> out0 = out.cpu_values(), yv = y.cpu_values(), d = dout.cpu_values();
          be.cpu->moe_shared_gate_forward(at(out.cpu(), offset, act), gate.cpu_f32(), logits.cpu_f32(),
                                          at(y.cpu(), offset, act), N, C, act);
          be.gpu->moe_shared_gate_forward(at(out.gpu(), offset, act), gate.gpu_f32(), logits.gpu_f32(),
                                          at(y.gpu(), offset, act), N, C, act);
          const std::vector<float> g = gate.cpu_values();
          std::vector<double> tol_g(static_cast<size_t>(N));
          for (int64_t i = 0; i < N; ++i) tol_g[i] = 16 * kU * g[i];
          require_within(g, gate.gpu_values(), tol_g, "gate");
          const std::vector<float> ref = out.cpu_values();
          const double round = act == DType::F32 ? 2.0 * kU : storage_ulp(act);
          std::vector<double> tol(ref.size(), 0.0);
          for (int64_t i = 0; i < N; ++i)
            for (int64_t c = 0; c < C; ++c) {
              const size_t e = static_cast<size_t>(offset + i * C + c);
              tol[e] = 4.0 * kU * (std::fabs(out0[e]) + 5.0 * std::fabs(g[i] * yv[e])) + round * std::fabs(ref[e]);
            }
          require_within(ref, out.gpu_values(), tol, "out");
          gate.upload(g);  // both backwards from the same gate: dy is then one product of the same values

          be.cpu->moe_shared_gate_backward(at(dy.cpu(), offset, act), dlogits.cpu_f32(), at(dout.cpu(), offset, act),
                                           at(y.cpu(), offset, act), gate.cpu_f32(), N, C, act);
          be.gpu->moe_shared_gate_backward(at(dy.gpu(), offset, act), dlogits.gpu_f32(), at(dout.gpu(), offset, act),
                                           at(y.gpu(), offset, act), gate.gpu_f32(), N, C, act);
          REQUIRE(dy.gpu_values() == dy.cpu_values());
          std::vector<double> tol_d(static_cast<size_t>(N));
          for (int64_t i = 0; i < N; ++i) {
            double s = 0.0;
            for (int64_t c = 0; c < C; ++c)
              s += std::fabs(static_cast<double>(d[offset + i * C + c]) * yv[offset + i * C + c]);
            tol_d[i] = (2.0 * (C + 1) + 4.0) * kU * s * g[i] * (1.0 - g[i]) + 1e-30;
          }
          require_within(dlogits.cpu_values(), dlogits.gpu_values(), tol_d, "dlogits");
        }
      }
    }
  }
}

}  // namespace
}  // namespace tetra::cuda_testing
