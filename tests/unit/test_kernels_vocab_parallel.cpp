// Tests of the vocab-parallel ops of the CPU backend (tensor parallelism over the vocabulary): the
// three cross-entropy passes vocab_ce_max / vocab_ce_sums / vocab_ce_finish, and the embedding ops
// on a slice of the vocabulary.
//
// A vocabulary of odd size (V = 37) is split into slices, equal and unequal ones (one of them a
// single column). The test plays the TP group: each "rank" gets its own contiguous copy of its
// slice, the ops run on it, and the all-reduces between the passes (MAX, then SUM) are plain loops
// here, in rank order. The combined result is compared with the single-rank ops (cross_entropy,
// embedding over the whole table) and with a double-precision plain-loop reference.
//
// Tolerances are derived from fp32's unit roundoff u = 2^-24 (see vocab_ce_tolerances below); the
// BF16 ones add the final rounding of a gradient to bf16.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/unit/kernel_testing.h"
#include "kernels/common/check.h"

namespace {

using tetra::Backend;
using tetra::DType;

using tetra_test::expect_bitwise_equal;
using tetra_test::expect_close;
using tetra_test::randn;
using tetra_test::Tol;

// Slice boundaries 0 = b[0] < b[1] < ... < b[k] = V: slice r holds columns [b[r], b[r+1]).
using Split = std::vector<int64_t>;

constexpr int64_t kV = 37;
const std::vector<Split> kSplits = {
    {0, 12, 25, 37},  // three nearly equal slices
    {0, 1, 30, 37},   // unequal, the first a single column
    {0, 29, 36, 37},  // unequal, the last a single column
    {0, 37},          // one slice: the whole vocabulary
};

// x rounded to bf16-representable values, kept as float.
std::vector<float> bf16_exact(std::vector<float> x) {
  for (auto& v : x) v = tetra::math::round_bf16(v);
  return x;
}

// A tensor stored as F32 or BF16; `values` are its elements widened to float.
struct Stored {
  DType type;
  std::vector<float> f;
  std::vector<uint16_t> h;
  Stored(const std::vector<float>& x, DType t) : type(t) {
    if (t == DType::F32) {
      f = x;
    } else {
      h.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) h[i] = tetra::math::f32_to_bf16_bits(x[i]);
    }
  }
  void* data() { return type == DType::F32 ? static_cast<void*>(f.data()) : h.data(); }
  std::vector<float> values() const {
    if (type == DType::F32) return f;
    std::vector<float> r(h.size());
    for (size_t i = 0; i < h.size(); ++i) r[i] = tetra::math::bf16_bits_to_f32(h[i]);
    return r;
  }
};

// Columns [v0, v0 + Vl) of a row-major (rows, V) matrix, as a contiguous (rows, Vl) one.
std::vector<float> columns(const std::vector<float>& x, int64_t rows, int64_t V, int64_t v0,
                           int64_t Vl) {
  std::vector<float> r(rows * Vl);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < Vl; ++j) r[i * Vl + j] = x[i * V + v0 + j];
  return r;
}

// ---- cross-entropy -------------------------------------------------------------------------------
enum class Grad { NONE, SEPARATE, IN_PLACE };

struct CeResult {
  std::vector<float> losses;   // (N)
  std::vector<float> dlogits;  // (N, V), the ranks' slices put back together; empty for Grad::NONE
};

// Runs the three vocab-parallel passes on every slice of `logits` (N, V) stored as `lt`, with the
// all-reduces done here. Also checks what each pass returns on its own against plain loops:
// the slice's row max and target logit exactly, its exp sum against a double sum (relative
// (Vl + 3) u: Vl exps within 2 ulp = 4u and Vl - 1 additions, doubled for margin).
CeResult vocab_parallel_ce(Backend& be, const std::vector<float>& logits, DType lt, DType gt,
                           Grad grad, const std::vector<int32_t>& targets, int64_t N, int64_t V,
                           const Split& split, float scale) {
  const size_t P = split.size() - 1;
  const double u = std::ldexp(1.0, -24);
  std::vector<Stored> parts;
  for (size_t r = 0; r < P; ++r)
    parts.emplace_back(columns(logits, N, V, split[r], split[r + 1] - split[r]), lt);

  // Pass 1, then the all-reduce MAX.
  std::vector<float> row_max(N, -std::numeric_limits<float>::infinity());
  for (size_t r = 0; r < P; ++r) {
    const int64_t Vl = split[r + 1] - split[r];
    std::vector<float> m(N), want(N);
    be.vocab_ce_max(m.data(), parts[r].data(), lt, N, Vl);
    const auto x = parts[r].values();
    for (int64_t i = 0; i < N; ++i) {
      want[i] = x[i * Vl];
      for (int64_t j = 1; j < Vl; ++j) want[i] = std::max(want[i], x[i * Vl + j]);
      row_max[i] = std::max(row_max[i], m[i]);
    }
    expect_bitwise_equal(m, want, "slice " + std::to_string(r) + " row max");
  }

  // Pass 2, then the all-reduce SUM.
  std::vector<float> sumexp(N, 0.0f), target_logit(N, 0.0f);
  for (size_t r = 0; r < P; ++r) {
    const int64_t v0 = split[r], Vl = split[r + 1] - v0;
    std::vector<float> se(N, -1.0f), tl(N, -1.0f), want_tl(N, 0.0f);
    std::vector<double> want_se(N, 0.0);
    be.vocab_ce_sums(se.data(), tl.data(), parts[r].data(), lt, row_max.data(), targets.data(), v0,
                     N, Vl);
    const auto x = parts[r].values();
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < Vl; ++j)
        want_se[i] += std::exp(static_cast<double>(x[i * Vl + j]) - row_max[i]);
      if (targets[i] >= v0 && targets[i] < v0 + Vl) want_tl[i] = x[i * Vl + targets[i] - v0];
      sumexp[i] += se[i];
      target_logit[i] += tl[i];
    }
    const std::string name = "slice " + std::to_string(r);
    // atol: exps below exp(-87.3) are flushed to 0 (true value < 1.2e-38 each).
    expect_close(se, want_se, {1e-36, 2.0 * (Vl + 3) * u}, name + " sumexp");
    expect_bitwise_equal(tl, want_tl, name + " target logit");
  }

  // Pass 3 on every rank: each computes every row's loss (bitwise the same on all, from the same
  // global sums) and the gradient of its own slice.
  CeResult out;
  if (grad != Grad::NONE) out.dlogits.assign(N * V, 0.0f);
  for (size_t r = 0; r < P; ++r) {
    const int64_t v0 = split[r], Vl = split[r + 1] - v0;
    std::vector<float> losses(N, -1.0f);
    Stored separate(std::vector<float>(grad == Grad::SEPARATE ? N * Vl : 0, 7.0f), gt);
    Stored* g = grad == Grad::SEPARATE ? &separate : grad == Grad::IN_PLACE ? &parts[r] : nullptr;
    be.vocab_ce_finish(losses.data(), g ? g->data() : nullptr, gt, parts[r].data(), lt,
                       row_max.data(), sumexp.data(), target_logit.data(), targets.data(), v0, N,
                       Vl, scale);
    if (r == 0) {
      out.losses = losses;
    } else {
      expect_bitwise_equal(losses, out.losses, "losses of rank " + std::to_string(r) + " vs 0");
    }
    if (!g) continue;
    const auto d = g->values();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < Vl; ++j) out.dlogits[i * V + v0 + j] = d[i * Vl + j];
  }
  return out;
}

// Double-precision reference: losses (N) and dlogits (N, V) of scale * CE on the given values.
void ref_ce(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t N,
            int64_t V, double scale, std::vector<double>& losses, std::vector<double>& dlogits) {
  losses.assign(N, 0.0);
  dlogits.assign(N * V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < 0) continue;
    const float* l = logits.data() + i * V;
    double mx = l[0], s = 0.0;
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(l[j]));
    for (int64_t j = 0; j < V; ++j) s += std::exp(l[j] - mx);
    losses[i] = mx + std::log(s) - l[targets[i]];
    for (int64_t j = 0; j < V; ++j)
      dlogits[i * V + j] = scale * (std::exp(l[j] - mx) / s - (j == targets[i] ? 1.0 : 0.0));
  }
}

// Tolerances of the vocab-parallel result, derived from u = 2^-24 (the fp32 unit roundoff):
// - vs the single-rank cross_entropy: both take the same max and the same exps (the same
//   math::exp_fast on the same differences); only the exp sum s adds the same V positive terms in
//   another order, and each order errs by <= (V - 1) u relative, so the two s differ by
//   d = 2 (V - 1) u relative. log(s) then differs by <= d absolute, plus the rounding of each log
//   (< 1 ulp of log(s) <= log V: 2u log V each); the final additions round once more each (2u
//   relative). A gradient element e * (scale / s) differs by d plus two roundings in each (4u)
//   relative; the target column, e * k - scale, may cancel: the same error times scale absolute.
// - vs the double reference: s errs by <= r = (V + 3) u (V exps within 2 ulp = 4u, V - 1
//   additions); the loss by r + 2u log V absolute and 2u relative (the roundings of max - l[t] and
//   of the sum, neither operand larger than the loss); a gradient element by r + 6u relative
//   (its exp 4u, a division and a product) and the target column by scale times that absolute.
//   Worst-case bounds, doubled for margin.
// - BF16 gradients: vs the double reference, one rounding to bf16 (half an ulp: 2^-8 relative);
//   vs cross_entropy's BF16 gradient, two nearly equal fp32 values may round to neighbouring bf16
//   values: one bf16 ulp, <= 2^-7 relative.
struct CeTolerances {
  Tol loss_vs_single, grad_vs_single, loss_vs_double, grad_vs_double;
};
CeTolerances vocab_ce_tolerances(int64_t V, double scale, DType gt) {
  const double u = std::ldexp(1.0, -24), log_v = std::log(static_cast<double>(V));
  const double d = 2.0 * (V - 1) * u, r = (V + 3) * u;
  const double bf_single = gt == DType::BF16 ? 1.0 / 128 : 0.0;
  const double bf_double = gt == DType::BF16 ? 1.0 / 256 : 0.0;
  CeTolerances t;
  t.loss_vs_single = {2.0 * (d + 4.0 * u * log_v), 2.0 * 2.0 * u};
  t.grad_vs_single = {2.0 * scale * (d + 4.0 * u), 2.0 * (d + 4.0 * u) + bf_single};
  t.loss_vs_double = {2.0 * (r + 2.0 * u * log_v), 2.0 * 2.0 * u};
  t.grad_vs_double = {2.0 * scale * (r + 6.0 * u), 2.0 * (r + 6.0 * u) + bf_double};
  return t;
}

// N = 10 rows over V = 37: large row offsets (exp without the max would overflow), rows whose
// maximum lies in one slice only, a row with exp underflowing to 0 in whole slices, a uniform row,
// targets at the slice boundaries, two ignored rows.
struct CeCase {
  int64_t N = 10, V = kV;
  std::vector<float> logits;
  std::vector<int32_t> targets = {0, 12, -1, 4, 11, 24, 36, -100, 25, 0};
  float scale = 1.0f / 8;  // 8 counted rows
  CeCase() {
    logits = randn(N * V, 91, 3.0f);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < V; ++j) logits[i * V + j] += 40.0f * static_cast<float>(i);
    for (int64_t j = 0; j < 29; ++j) logits[3 * V + j] -= 1e4f;  // target 4 here: loss ~1e4
    for (int64_t j = 0; j < V; ++j) logits[5 * V + j] = 0.25f;   // loss = log V
    for (int64_t j = 25; j < V; ++j) logits[6 * V + j] -= 1e4f;  // target 36: loss ~1e4
    logits[8 * V + 30] += 20.0f;                                 // a clear maximum, in one slice
    std::mt19937 gen(92);
    targets[9] = static_cast<int32_t>(gen() % V);
  }
};

TEST_CASE("vocab-parallel cross-entropy reproduces cross_entropy and a double reference",
          "[kernels][vocab_parallel]") {
  auto be = tetra::make_cpu_backend(2);
  const CeCase c;
  const int64_t N = c.N, V = c.V;
  for (DType lt : {DType::F32, DType::BF16}) {
    // Logits as stored: the references see exactly the values the kernels read.
    const auto stored = lt == DType::F32 ? c.logits : bf16_exact(c.logits);
    std::vector<double> ref_loss, ref_grad;
    ref_ce(stored, c.targets, N, V, c.scale, ref_loss, ref_grad);
    for (DType gt : {DType::F32, DType::BF16}) {
      // The single-rank op on the whole (N, V) logits, gradient of type gt in its own buffer.
      Stored full(stored, lt), full_grad(std::vector<float>(N * V), gt);
      std::vector<float> single_loss(N);
      be->cross_entropy(single_loss.data(), full_grad.data(), gt, full.data(), lt,
                        c.targets.data(), N, V, c.scale);
      const auto single_grad = full_grad.values();
      const CeTolerances tol = vocab_ce_tolerances(V, c.scale, gt);
      for (Grad grad : {Grad::SEPARATE, Grad::IN_PLACE, Grad::NONE}) {
        if (grad == Grad::IN_PLACE && lt != gt) continue;
        for (const Split& split : kSplits) {
          std::ostringstream what;
          what << "logits " << tetra::dtype_name(lt) << " dlogits " << tetra::dtype_name(gt)
               << (grad == Grad::IN_PLACE ? " in place" : grad == Grad::NONE ? " none" : "")
               << ", " << split.size() - 1 << " slices:";
          for (int64_t b : split) what << ' ' << b;
          INFO(what.str());
          const CeResult got =
              vocab_parallel_ce(*be, stored, lt, gt, grad, c.targets, N, V, split, c.scale);
          expect_close(got.losses, single_loss, tol.loss_vs_single, "losses vs cross_entropy");
          expect_close(got.losses, ref_loss, tol.loss_vs_double, "losses vs double");
          CHECK(got.losses[2] == 0.0f);  // ignored rows
          CHECK(got.losses[7] == 0.0f);
          CHECK(got.losses[5] == Approx(std::log(static_cast<double>(V))).epsilon(1e-6));
          if (grad == Grad::NONE) continue;
          expect_close(got.dlogits, single_grad, tol.grad_vs_single, "dlogits vs cross_entropy");
          expect_close(got.dlogits, ref_grad, tol.grad_vs_double, "dlogits vs double");
          for (int64_t i : {2, 7})  // ignored rows: exactly zero (the buffers held garbage)
            for (int64_t j = 0; j < V; ++j) CHECK(got.dlogits[i * V + j] == 0.0f);
        }
      }
    }
  }
}

TEST_CASE("vocab-parallel cross-entropy: a NaN logit poisons its row only, bad arguments throw",
          "[kernels][vocab_parallel]") {
  auto be = tetra::make_cpu_backend(2);
  const CeCase c;
  const int64_t N = c.N, V = c.V;
  auto bad = c.logits;
  bad[4 * V + 30] = std::nanf("");  // in the last slice of {0, 12, 25, 37}
  const CeResult got = vocab_parallel_ce(*be, bad, DType::F32, DType::F32, Grad::SEPARATE,
                                         c.targets, N, V, kSplits[0], c.scale);
  for (int64_t i = 0; i < N; ++i) CHECK(std::isnan(got.losses[i]) == (i == 4));

  std::vector<float> logits(c.logits.begin(), c.logits.begin() + N * 12), f(N, 1.0f), losses(N);
  CHECK_THROWS_AS(be->vocab_ce_finish(losses.data(), logits.data(), DType::BF16, logits.data(),
                                      DType::F32, f.data(), f.data(), f.data(), c.targets.data(),
                                      0, N, 12, c.scale),
                  tetra::Error);
  CHECK_THROWS_AS(be->vocab_ce_max(f.data(), logits.data(), DType::F32, N, 0), tetra::Error);
  CHECK_THROWS_AS(be->vocab_ce_sums(f.data(), f.data(), logits.data(), DType::F32, f.data(),
                                    c.targets.data(), -1, N, 12),
                  tetra::Error);
  CHECK_THROWS_AS(be->vocab_ce_max(f.data(), logits.data(), DType::I32, N, 12), tetra::Error);
}

// ---- embedding -----------------------------------------------------------------------------------
// The weights are bf16-representable, as the bf16 compute weights of a mixed-precision run are:
// then every element of the summed output has at most two non-zero terms (the token's row on the
// rank holding it, the position row on rank 0), the zero rows add exactly, fp32 addition is
// commutative, and the sum rounded to bf16 is the single-rank op's bf16(e + p) — so the results
// must be bitwise equal, for F32 and BF16 activations alike. Backward: each slice's row gets the
// same gradient terms in the same (token) order as in the whole table, so again bitwise.
TEST_CASE("vocab-parallel embedding: summed slice outputs and concatenated slice gradients equal "
          "the whole-table op",
          "[kernels][vocab_parallel]") {
  auto be = tetra::make_cpu_backend(2);
  const int64_t B = 2, T = 9, C = 45, V = kV;
  std::vector<int32_t> tokens = {0, 11, 12, 24, 25, 36, 1, 29, 30};  // slice boundaries
  std::mt19937 gen(93);
  for (int64_t i = 0; i < T; ++i) tokens.push_back(static_cast<int32_t>(gen() % V));
  tokens[T + 3] = tokens[2];  // a repeated id
  const auto wte = bf16_exact(randn(V * C, 94)), wpe = bf16_exact(randn(T * C, 95));
  const auto dout = bf16_exact(randn(B * T * C, 96));
  const auto dwte0 = randn(V * C, 97), dwpe0 = randn(T * C, 98);  // accumulated into

  for (DType act : {DType::F32, DType::BF16}) {
    Stored dout_s(dout, act);
    std::vector<float> dwte_full = dwte0, dwpe_full = dwpe0;
    be->embedding_backward(dwte_full.data(), dwpe_full.data(), dout_s.data(), tokens.data(), B, T,
                           C, 0, V, act);
    for (DType w : {DType::F32, DType::BF16}) {
      Stored te(wte, w), pe(wpe, w), out_full(std::vector<float>(B * T * C), act);
      be->embedding_forward(out_full.data(), tokens.data(), te.data(), pe.data(), B, T, C, 0, V,
                            act, w);
      for (const Split& split : kSplits) {
        std::ostringstream what;
        what << "act " << tetra::dtype_name(act) << " w " << tetra::dtype_name(w) << ", slices:";
        for (int64_t b : split) what << ' ' << b;
        INFO(what.str());
        std::vector<float> sum(B * T * C, 0.0f);
        for (size_t r = 0; r + 1 < split.size(); ++r) {
          const int64_t v0 = split[r], Vl = split[r + 1] - v0;
          Stored te_r(columns(wte, 1, V * C, v0 * C, Vl * C), w);  // rows [v0, v0 + Vl)
          Stored out_r(std::vector<float>(B * T * C, 7.0f), act);  // garbage: must be overwritten
          be->embedding_forward(out_r.data(), tokens.data(), te_r.data(),
                                r == 0 ? pe.data() : nullptr, B, T, C, v0, Vl, act, w);
          const auto o = out_r.values();
          for (int64_t k = 0; k < B * T * C; ++k) sum[k] += o[k];
        }
        if (act == DType::BF16)
          for (auto& v : sum) v = tetra::math::round_bf16(v);
        expect_bitwise_equal(sum, out_full.values(), "summed slice outputs vs whole table");
      }
    }
    for (const Split& split : kSplits) {
      std::ostringstream what;
      what << "act " << tetra::dtype_name(act) << ", slices:";
      for (int64_t b : split) what << ' ' << b;
      INFO(what.str());
      std::vector<float> dwte_cat, dwpe = dwpe0;
      for (size_t r = 0; r + 1 < split.size(); ++r) {
        const int64_t v0 = split[r], Vl = split[r + 1] - v0;
        auto dwte_r = columns(dwte0, 1, V * C, v0 * C, Vl * C);
        be->embedding_backward(dwte_r.data(), r == 0 ? dwpe.data() : nullptr, dout_s.data(),
                               tokens.data(), B, T, C, v0, Vl, act);
        dwte_cat.insert(dwte_cat.end(), dwte_r.begin(), dwte_r.end());
      }
      expect_bitwise_equal(dwte_cat, dwte_full, "concatenated slice dwte vs whole table");
      expect_bitwise_equal(dwpe, dwpe_full, "dwpe (from one slice) vs whole table");
    }
  }
}

}  // namespace
