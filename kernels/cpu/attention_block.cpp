// Blocks of attention for context parallelism (Backend::attention_block_forward / _backward): Tq
// queries against Tk keys of strided views, every key visible or causal, merged into a running
// (o, lse) by log-sum-exp. The tile machinery is the causal kernels' (attention_tiles.h); the
// differences are the separate q / k / v / o views, the key range (all of Tk, or up to the
// diagonal), the merge, and a backward that accumulates fp32 dq, dk, dv (the ring carries dk, dv
// home and sums them there).
//
// Forward, per task (b, head, query block): scores S = K_blk (scale Q)^T held transposed (keys x
// queries), online softmax over the key blocks, then the block's result (o_b, lse_b) merged:
//   lse = log(exp(lse_old) + exp(lse_b)),  o = o_old exp(lse_old - lse) + o_b exp(lse_b - lse).
// Backward, per task (b, kv head), with the finished output's lse and D_i = dout_i . out_i:
//   P = exp(S - lse), dS = P (dO V^T - D), dV += P^T dO, dQ += scale dS K, dK += dS^T (scale Q).
// Each task owns the dk, dv rows of its kv head and the dq rows of its query heads: no races,
// and every sum runs in a fixed order whatever the thread count. Diagonal (causal) tiles are
// computed whole and masked (the causal kernels skip their masked half; blocks are not on the
// hot path of a run without context parallelism).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <span>

#include "kernels/common/check.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"

namespace tetra {
namespace {

using namespace cpu::tiles;

struct BlockShape {
  const AttnBlock& b;
  int64_t HSP, G, n_qb, n_kb, Tkp;
  float scale;
};

BlockShape block_shape(const AttnBlock& b, const char* op) {
  TETRA_CHECK(b.B > 0 && b.Tq > 0 && b.Tk > 0 && b.NH > 0 && b.NKV > 0 && b.HS > 0,
              "{}: sizes must be positive, got B={} Tq={} Tk={} NH={} NKV={} HS={}", op, b.B, b.Tq, b.Tk, b.NH, b.NKV,
              b.HS);
  TETRA_CHECK(b.NH % b.NKV == 0, "{}: NH ({}) must be a multiple of NKV ({})", op, b.NH, b.NKV);
  TETRA_CHECK(!b.causal || b.Tq == b.Tk, "{}: a causal block needs Tq == Tk, got {} and {}", op, b.Tq, b.Tk);
  TETRA_CHECK(b.lse && b.lse_ld >= b.Tq, "{}: lse needs a leading dimension of at least Tq ({}), got {}", op, b.Tq,
              b.lse_ld);
  const int64_t n_kb = math::ceil_div(b.Tk, kBlock);
  return BlockShape{b, math::round_up(b.HS, 16), b.NH / b.NKV, math::ceil_div(b.Tq, kBlock), n_kb, n_kb * kBlock,
                    1.0f / std::sqrt(static_cast<float>(b.HS))};
}

template <typename T>
const T* at(const AttnView& v, int64_t b, int64_t t, int64_t h, int64_t HS) {
  return static_cast<const T*>(v.p) + b * v.seq + t * v.row + h * HS;
}
template <typename T>
T* at_mut(const AttnView& v, int64_t b, int64_t t, int64_t h, int64_t HS) {
  return static_cast<T*>(v.p) + b * v.seq + t * v.row + h * HS;
}

// Rows [t0, t0 + n) of head h of a view into dst (rows, ld) fp32, times mul; the rest zeroed.
template <typename T>
void load_view(float* dst, int64_t ld, int64_t rows, const AttnView& v, int64_t b, int64_t t0, int64_t n, int64_t h,
               int64_t HS, float mul) {
  load_rows(dst, ld, rows, at<T>(v, b, t0, h, HS), v.row, n, HS, mul);
}

struct BlockFwdScratch {
  std::vector<float> k, v, qt, st, acc;
  int64_t b = -1, kvh = -1;
};

template <typename T>
void block_forward_task(const BlockShape& s, AttnView o, bool first, int64_t b, int64_t h, int64_t qb,
                        BlockFwdScratch& w) {
  const AttnBlock& blk = s.b;
  const int64_t HS = blk.HS, HSP = s.HSP, kvh = h / s.G;
  const int64_t i0 = qb * kBlock, nq = std::min(kBlock, blk.Tq - i0);
  float* kc = scratch(w.k, s.Tkp * HSP);
  float* vc = scratch(w.v, s.Tkp * HSP);
  float* qt = scratch(w.qt, HSP * kBlock);
  float* st = scratch(w.st, kBlock * kBlock);
  float* acc = scratch(w.acc, kBlock * HSP);
  if (w.b != b || w.kvh != kvh) {  // every key of this (b, kv head), converted once
    load_view<T>(kc, HSP, s.Tkp, blk.k, b, 0, blk.Tk, kvh, HS, 1.0f);
    load_view<T>(vc, HSP, s.Tkp, blk.v, b, 0, blk.Tk, kvh, HS, 1.0f);
    w.b = b;
    w.kvh = kvh;
  }
  load_rows_transposed(qt, kBlock, HSP, at<T>(blk.q, b, i0, h, HS), blk.q.row, nq, HS, s.scale);
  std::memset(acc, 0, sizeof(float) * kBlock * HSP);
  constexpr int64_t kVecs = kBlock / 16;
  v16 m[kVecs], l[kVecs];
  for (int64_t u = 0; u < kVecs; ++u) {
    m[u] = splat16(kNegInf);
    l[u] = v16{};
  }
  const int64_t last_kb = blk.causal ? qb : s.n_kb - 1;
  for (int64_t kbi = 0; kbi <= last_kb; ++kbi) {
    const int64_t j0 = kbi * kBlock, nk = std::min(kBlock, blk.Tk - j0);
    const int64_t nkr = math::round_up(nk, kRows);
    const bool diagonal = blk.causal && kbi == qb;
    tile_gemm(st, kBlock, kc + j0 * HSP, HSP, 1, qt, kBlock, nkr, kBlock, HS, /*zero_init=*/true);
    for (int64_t j = 0; j < nkr; ++j)  // padded keys, and keys after the query on the diagonal
      for (int64_t i = 0; i < kBlock; ++i)
        if (j >= nk || (diagonal && j > i)) st[j * kBlock + i] = kNegInf;
    online_softmax_tile(st, nkr, m, l, acc, HSP);
    tile_gemm(acc, HSP, st, 1, kBlock, vc + j0 * HSP, HSP, math::round_up(nq, kRows), HSP, nkr, false);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float mi = m[i / 16][i % 16], li = l[i / 16][i % 16];
    const float lse_b = mi + std::log(li);
    float* lp = blk.lse + (b * blk.NH + h) * blk.lse_ld + i0 + i;
    float* op = at_mut<float>(o, b, i0 + i, h, HS);
    const float* a = acc + i * HSP;
    if (li == 0.0f) {  // no key visible to this query in the block: it adds nothing
      if (first) {
        for (int64_t x = 0; x < HS; ++x) op[x] = 0.0f;
        *lp = kNegInf;
      }
      continue;
    }
    if (first) {
      const float inv = 1.0f / li;
      for (int64_t x = 0; x < HS; ++x) op[x] = a[x] * inv;
      *lp = lse_b;
      continue;
    }
    const float old = *lp;
    if (old == kNegInf) {
      for (int64_t x = 0; x < HS; ++x) op[x] = a[x] / li;
      *lp = lse_b;
      continue;
    }
    const float mx = std::max(old, lse_b);
    const float lse = mx + std::log(std::exp(old - mx) + std::exp(lse_b - mx));
    const float w_old = std::exp(old - lse), w_new = std::exp(lse_b - lse) / li;
    for (int64_t x = 0; x < HS; ++x) op[x] = op[x] * w_old + a[x] * w_new;
    *lp = lse;
  }
}

struct BlockBwdScratch {
  std::vector<float> k, kt, vt, dk, dv, q, dout, out, dq, p, dp, d;
};

template <typename T>
void block_backward_task(const BlockShape& s, const AttnView& dout, const AttnView& out, const AttnView& dqv,
                         const AttnView& dkv, const AttnView& dvv, int64_t b, int64_t kvh, BlockBwdScratch& w) {
  const AttnBlock& blk = s.b;
  const int64_t HS = blk.HS, HSP = s.HSP, Tkp = s.Tkp;
  float* k = scratch(w.k, Tkp * HSP);
  float* kt = scratch(w.kt, HSP * Tkp);
  float* vt = scratch(w.vt, HSP * Tkp);
  float* dk = scratch(w.dk, Tkp * HSP);
  float* dv = scratch(w.dv, Tkp * HSP);
  float* q = scratch(w.q, kBlock * HSP);
  float* dob = scratch(w.dout, kBlock * HSP);
  float* ob = scratch(w.out, kBlock * HSP);
  float* dq = scratch(w.dq, kBlock * HSP);
  float* p = scratch(w.p, kBlock * kBlock);
  float* dp = scratch(w.dp, kBlock * kBlock);
  float* dvec = scratch(w.d, 2 * kBlock);
  float* lsev = dvec + kBlock;
  load_view<T>(k, HSP, Tkp, blk.k, b, 0, blk.Tk, kvh, HS, 1.0f);
  transpose(kt, k, Tkp, HSP);
  load_view<T>(dv, HSP, Tkp, blk.v, b, 0, blk.Tk, kvh, HS, 1.0f);
  transpose(vt, dv, Tkp, HSP);
  std::memset(dk, 0, sizeof(float) * Tkp * HSP);
  std::memset(dv, 0, sizeof(float) * Tkp * HSP);
  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t h = kvh * s.G + g;
    for (int64_t qb = 0; qb < s.n_qb; ++qb) {
      const int64_t i0 = qb * kBlock, nq = std::min(kBlock, blk.Tq - i0);
      const int64_t nqr = math::round_up(nq, kRows);
      load_view<T>(q, HSP, kBlock, blk.q, b, i0, nq, h, HS, s.scale);
      load_view<T>(dob, HSP, kBlock, dout, b, i0, nq, h, HS, 1.0f);
      load_view<T>(ob, HSP, kBlock, out, b, i0, nq, h, HS, 1.0f);
      for (int64_t i = 0; i < nq; ++i) {
        v16 acc = v16{};
        for (int64_t x = 0; x < HSP; x += 16) acc += load16(dob + i * HSP + x) * load16(ob + i * HSP + x);
        dvec[i] = hsum16(acc);
        lsev[i] = blk.lse[(b * blk.NH + h) * blk.lse_ld + i0 + i];
      }
      for (int64_t i = nq; i < kBlock; ++i) dvec[i] = lsev[i] = 0.0f;
      std::memset(dq, 0, sizeof(float) * kBlock * HSP);
      const int64_t last_kb = blk.causal ? qb : s.n_kb - 1;
      for (int64_t kbi = 0; kbi <= last_kb; ++kbi) {
        const int64_t j0 = kbi * kBlock, nk = std::min(kBlock, blk.Tk - j0);
        const bool diagonal = blk.causal && kbi == qb;
        tile_gemm(p, kBlock, q, HSP, 1, kt + j0, Tkp, nqr, kBlock, HS, true);
        tile_gemm(dp, kBlock, dob, HSP, 1, vt + j0, Tkp, nqr, kBlock, HS, true);
        for (int64_t i = 0; i < nqr; ++i) {
          // Keys [0, valid) of the tile take part: none for padded queries, up to the query on the
          // diagonal, every real key otherwise.
          const int64_t valid = i >= nq ? 0 : (diagonal ? std::min(i + 1, nk) : nk);
          softmax_grad_row(p + i * kBlock, dp + i * kBlock, valid, lsev[i], dvec[i]);
        }
        tile_gemm(dv + j0 * HSP, HSP, p, 1, kBlock, dob, HSP, kBlock, HSP, nqr, false);
        tile_gemm(dq, HSP, dp, kBlock, 1, k + j0 * HSP, HSP, nqr, HSP, kBlock, false);
        tile_gemm(dk + j0 * HSP, HSP, dp, 1, kBlock, q, HSP, kBlock, HSP, nqr, false);
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* d = at_mut<float>(dqv, b, i0 + i, h, HS);
        const float* a = dq + i * HSP;
        for (int64_t x = 0; x < HS; ++x) d[x] += a[x] * s.scale;
      }
    }
  }
  for (int64_t t = 0; t < blk.Tk; ++t) {
    float* dkr = at_mut<float>(dkv, b, t, kvh, HS);
    float* dvr = at_mut<float>(dvv, b, t, kvh, HS);
    for (int64_t x = 0; x < HS; ++x) {
      dkr[x] += dk[t * HSP + x];
      dvr[x] += dv[t * HSP + x];
    }
  }
}

}  // namespace

void CpuBackend::attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) {
  const BlockShape s = block_shape(blk, "attention_block_forward");
  const int64_t n_tasks = blk.B * blk.NH * s.n_qb;
  cpu::with_float_type(act, "attention_block_forward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    std::span<BlockFwdScratch> scratch = scratch_.per_thread<BlockFwdScratch>();
#pragma omp parallel num_threads(threads_)
    {
      BlockFwdScratch& w = scratch[static_cast<size_t>(omp_get_thread_num())];
      w.b = -1;  // K/V converted by an earlier call are stale
#pragma omp for schedule(dynamic, s.n_qb)
      for (int64_t task = 0; task < n_tasks; ++task) {
        const int64_t qb = task % s.n_qb, bh = task / s.n_qb;
        block_forward_task<S>(s, o, first, bh / blk.NH, bh % blk.NH, qb, w);
      }
    }
  });
}

void CpuBackend::attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq,
                                          AttnView dk, AttnView dv, DType act) {
  const BlockShape s = block_shape(blk, "attention_block_backward");
  const int64_t n_tasks = blk.B * blk.NKV;
  cpu::with_float_type(act, "attention_block_backward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    std::span<BlockBwdScratch> scratch = scratch_.per_thread<BlockBwdScratch>();
#pragma omp parallel num_threads(threads_)
    {
      BlockBwdScratch& w = scratch[static_cast<size_t>(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < n_tasks; ++task)
        block_backward_task<S>(s, dout, out, dq, dk, dv, task / blk.NKV, task % blk.NKV, w);
    }
  });
}

}  // namespace tetra
