// Causal self-attention (forward and backward) and RoPE on the CPU. bf16 attention runs on AMX
// tiles instead where the CPU has them (attention_amx.cpp; CpuBackend::set_amx_attention); these
// kernels are the path for fp32 and fp16, and for bf16 elsewhere.
//
// qkv (B, T, (NH + 2*NKV) * HS) holds per token NH query heads, then NKV key heads, then NKV value
// heads; query head h reads kv head h / (NH / NKV) (grouped-query attention). Scores are scaled by
// 1/sqrt(HS); lse (B, NH, T) saves each query row's log-sum-exp for the backward pass.
//
// Flash-attention style: the (T, T) score matrix of a head is never stored. Work is cut into
// square blocks of kBlock queries x kBlock keys. Forward keeps, per query block, a running max m,
// a running sum l and an unnormalised output accumulator, rescaled as each key block arrives
// (online softmax). Backward recomputes each probability tile from the saved lse:
//   p_ij = exp(s_ij - lse_i),  D_i = dout_i · out_i,  ds_ij = p_ij (dout_i · v_j - D_i)
//   dv_j += p_ij dout_i,  dq_i += scale ds_ij k_j,  dk_j += scale ds_ij q_i.
// Every product of two tiles goes through one register-blocked kernel (tile_gemm) written with
// GCC vector extensions (16 fp32 lanes = one AVX-512 register; narrower ISAs split it), so QK^T,
// PV and the five backward products run as small dense GEMMs on fp32 copies of the operands, at
// close to the FMA peak; on diagonal tiles the causally masked half is skipped. The rest of the
// time goes to moving head rows in and out of the strided qkv / out layouts (prefetched).
//
// Parallelism and determinism: forward runs one task per (b, head, query block); backward one
// task per (b, kv head), which owns dk and dv of that kv head, so the GQA heads sharing it never
// race and every sum runs in a fixed order whatever the thread count. Per-thread scratch is a set
// of buffers that only grow (no allocation once the largest shape has been seen), one set per
// thread of the backend's team, owned by the backend (scratch.h).
//
// Storage is float, bf16 or fp16 (template T); all math is fp32. exp is a vectorised polynomial (the
// compiler does not vectorise expf without -ffast-math), accurate to a few ulp.

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "kernels/common/math.h"
#include "kernels/cpu/attention_amx.h"
#include "kernels/cpu/attention_layout.h"
#include "kernels/cpu/attention_tiles.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra {
namespace {

using namespace cpu::tiles;

// Geometry of qkv / out shared by forward and backward.
struct AttnShape : cpu::QkvLayout {
  int64_t HSP;    // HS rounded up to 16: scratch rows are padded with zeros to whole vectors
  int64_t G;      // query heads per kv head
  int64_t n_qb;   // query (= key) blocks per sequence
  float scale;    // 1 / sqrt(HS)
};

AttnShape make_shape(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const char* op) {
  TETRA_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0,
              "{}: sizes must be positive, got B={} T={} NH={} NKV={} HS={}", op, B, T, NH, NKV,
              HS);
  TETRA_CHECK(NH % NKV == 0, "{}: NH ({}) must be a multiple of NKV ({})", op, NH, NKV);
  AttnShape s{cpu::qkv_layout(B, T, NH, NKV, HS), math::round_up(HS, 16), NH / NKV,
              math::ceil_div(T, kBlock), 1.0f / std::sqrt(static_cast<float>(HS))};
  return s;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
// Per-thread forward state. K and V of one (b, kv head), converted to fp32 rows (Tp, HSP), are
// kept while the thread's consecutive tasks use them: its query blocks in increasing order and
// the G heads that share the kv head. Converted blocks are reused, never redone.
struct FwdScratch {
  std::vector<float> k, v, qt, st, acc;
  int64_t b = -1, kvh = -1, blocks = 0;  // K/V blocks [0, blocks) of (b, kvh) are in k and v
};

// One query block [i0, i0 + nq) of head h. Tiles are held transposed (keys x queries), so the
// softmax statistics of kBlock queries are vectors and need no horizontal reductions:
//   st (nkr, kBlock)    = K_blk (nkr, HS) · (scale Q)^T (HS, kBlock)
//   acc (kBlock, HSP)  += P (kBlock, nkr) · V_blk (nkr, HSP)       with P read from st
template <typename T>
void attention_forward_block(T* out, float* lse, const T* qkv, const AttnShape& s, int64_t b,
                             int64_t h, int64_t qb, FwdScratch& w) {
  const int64_t kvh = h / s.G, HS = s.HS, HSP = s.HSP;
  const int64_t i0 = qb * kBlock, nq = std::min(kBlock, s.T - i0);
  float* kc = scratch(w.k, s.n_qb * kBlock * HSP);
  float* vc = scratch(w.v, s.n_qb * kBlock * HSP);
  float* qt = scratch(w.qt, HSP * kBlock);
  float* st = scratch(w.st, kBlock * kBlock);
  float* acc = scratch(w.acc, kBlock * HSP);
  if (w.b != b || w.kvh != kvh) {
    w.b = b;
    w.kvh = kvh;
    w.blocks = 0;
  }
  for (; w.blocks <= qb; ++w.blocks) {
    const int64_t j0 = w.blocks * kBlock, nk = std::min(kBlock, s.T - j0);
    load_rows(kc + j0 * HSP, HSP, kBlock, qkv + s.k_at(b, j0, kvh), s.row, nk, HS, 1.0f);
    load_rows(vc + j0 * HSP, HSP, kBlock, qkv + s.v_at(b, j0, kvh), s.row, nk, HS, 1.0f);
  }
  load_rows_transposed(qt, kBlock, HSP, qkv + s.q_at(b, i0, h), s.row, nq, HS, s.scale);
  std::memset(acc, 0, sizeof(float) * kBlock * HSP);
  constexpr int64_t kVecs = kBlock / 16;
  v16 m[kVecs], l[kVecs];
  for (int64_t u = 0; u < kVecs; ++u) {
    m[u] = splat16(kNegInf);
    l[u] = v16{};
  }

  for (int64_t kbi = 0; kbi <= qb; ++kbi) {
    const int64_t j0 = kbi * kBlock, nk = std::min(kBlock, s.T - j0);
    const int64_t nkr = math::round_up(nk, kRows);
    const float* kb = kc + j0 * HSP;
    const float* vb = vc + j0 * HSP;
    const bool diagonal = kbi == qb;  // j0 == i0
    tile_gemm(st, kBlock, kb, HSP, 1, qt, kBlock, nkr, kBlock, HS, /*zero_init=*/true,
              diagonal ? Causal::N_FROM_ROW : Causal::NONE);
    if (diagonal) {  // mask keys after the query and padded keys
      for (int64_t j = 0; j < nkr; ++j)
        for (int64_t i = 0; i < kBlock; ++i)
          if (j > i || j >= nk) st[j * kBlock + i] = kNegInf;
    }
    // Online softmax, 16 queries at a time.
    online_softmax_tile(st, nkr, m, l, acc, HSP);
    tile_gemm(acc, HSP, st, 1, kBlock, vb, HSP, math::round_up(nq, kRows), HSP, nkr, false,
              diagonal ? Causal::K_UPTO_ROW : Causal::NONE);
  }

  for (int64_t i = 0; i < nq; ++i) {
    float mi = m[i / 16][i % 16], li = l[i / 16][i % 16];
    float inv = 1.0f / li;
    if (i + kPrefetchRows < nq) prefetch_head<1>(out + s.o_at(b, i0 + i + kPrefetchRows, h), HS);
    T* o = out + s.o_at(b, i0 + i, h);
    const float* a = acc + i * HSP;
    for (int64_t x = 0; x < HS; ++x) o[x] = from_f32<T>(a[x] * inv);
    lse[(b * s.NH + h) * s.T + i0 + i] = mi + std::log(li);
  }
}

template <typename T>
void attention_forward_impl(T* out, float* lse, const T* qkv, const AttnShape& s, int nt,
                            std::span<FwdScratch> scratch) {
  const int64_t n_tasks = s.B * s.NH * s.n_qb;
#pragma omp parallel num_threads(nt)
  {
    FwdScratch& w = scratch[omp_get_thread_num()];
    w.b = -1;  // K/V cached by an earlier call are stale
    // Tasks ordered (b, h, qb), qb fastest, handed out a whole head at a time: a thread walks
    // the query blocks of a head in order, reusing the converted K/V (and keeps them for the
    // next head if it shares the kv head). Dynamic, so a thread that loses its core to another
    // process does not hold the others up.
#pragma omp for schedule(dynamic, s.n_qb)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t qb = task % s.n_qb, bh = task / s.n_qb;
      attention_forward_block(out, lse, qkv, s, bh / s.NH, bh % s.NH, qb, w);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
struct BwdScratch {
  std::vector<float> k, kt, vt, dk, dv, q, dout, out, dq, p, dp, d;
};

// All of kv head kvh of batch b: its G query heads and every query block. K (Tp, HSP), K^T and
// V^T (HSP, Tp) are converted once; dK and dV (Tp, HSP) accumulate over heads and blocks.
// Per query block, with Qs = scale * Q:
//   S  (nqr, kBlock) = Qs · K^T_blk        P = exp(S - lse), masked to 0
//   dV_blk += P^T · dO                      dP (nqr, kBlock) = dO · V^T_blk
//   dS = P * (dP - D)                       dQ += dS · K_blk,   dK_blk += dS^T · Qs
// and finally dq = scale * dQ (dK needs no extra scale: Qs carries it).
template <typename T>
void attention_backward_kv_head(T* dqkv, const T* dout, const T* qkv, const T* out,
                                const float* lse, const AttnShape& s, int64_t b, int64_t kvh,
                                BwdScratch& w) {
  const int64_t HS = s.HS, HSP = s.HSP, T_ = s.T, Tp = s.n_qb * kBlock;
  float* k = scratch(w.k, Tp * HSP);
  float* kt = scratch(w.kt, HSP * Tp);
  float* vt = scratch(w.vt, HSP * Tp);
  float* dk = scratch(w.dk, Tp * HSP);
  float* dv = scratch(w.dv, Tp * HSP);
  float* q = scratch(w.q, kBlock * HSP);
  float* dob = scratch(w.dout, kBlock * HSP);
  float* ob = scratch(w.out, kBlock * HSP);
  float* dq = scratch(w.dq, kBlock * HSP);
  float* p = scratch(w.p, kBlock * kBlock);
  float* dp = scratch(w.dp, kBlock * kBlock);
  float* dvec = scratch(w.d, 2 * kBlock);  // D_i, then lse_i
  float* lsev = dvec + kBlock;

  // Each strided head row is read from memory once; the transposes work on the fp32 copies
  // (V's rows pass through dv, which is cleared afterwards).
  load_rows(k, HSP, Tp, qkv + s.k_at(b, 0, kvh), s.row, T_, HS, 1.0f);
  transpose(kt, k, Tp, HSP);
  load_rows(dv, HSP, Tp, qkv + s.v_at(b, 0, kvh), s.row, T_, HS, 1.0f);
  transpose(vt, dv, Tp, HSP);
  std::memset(dk, 0, sizeof(float) * Tp * HSP);
  std::memset(dv, 0, sizeof(float) * Tp * HSP);

  for (int64_t g = 0; g < s.G; ++g) {
    const int64_t h = kvh * s.G + g;
    for (int64_t qb = 0; qb < s.n_qb; ++qb) {
      const int64_t i0 = qb * kBlock, nq = std::min(kBlock, T_ - i0);
      const int64_t nqr = math::round_up(nq, kRows);
      load_rows(q, HSP, kBlock, qkv + s.q_at(b, i0, h), s.row, nq, HS, s.scale);
      load_rows(dob, HSP, kBlock, dout + s.o_at(b, i0, h), s.NH * HS, nq, HS, 1.0f);
      load_rows(ob, HSP, kBlock, out + s.o_at(b, i0, h), s.NH * HS, nq, HS, 1.0f);
      for (int64_t i = 0; i < nq; ++i) {
        v16 acc = v16{};
        for (int64_t x = 0; x < HSP; x += 16)
          acc += load16(dob + i * HSP + x) * load16(ob + i * HSP + x);
        dvec[i] = hsum16(acc);
        lsev[i] = lse[(b * s.NH + h) * T_ + i0 + i];
      }
      for (int64_t i = nq; i < kBlock; ++i) dvec[i] = lsev[i] = 0.0f;
      std::memset(dq, 0, sizeof(float) * kBlock * HSP);

      for (int64_t kbi = 0; kbi <= qb; ++kbi) {
        const int64_t j0 = kbi * kBlock, nk = std::min(kBlock, T_ - j0);
        const bool diagonal = kbi == qb;  // j0 == i0
        const Causal upto = diagonal ? Causal::N_UPTO_ROW : Causal::NONE;
        tile_gemm(p, kBlock, q, HSP, 1, kt + j0, Tp, nqr, kBlock, HS, true, upto);
        tile_gemm(dp, kBlock, dob, HSP, 1, vt + j0, Tp, nqr, kBlock, HS, true, upto);
        for (int64_t i = 0; i < nqr; ++i) {
          // Keys [0, valid) take part: none for padded queries, up to the query itself on the
          // diagonal, all real keys otherwise. The rest of P and dS (possibly never computed
          // above) is zeroed.
          const int64_t valid = i >= nq ? 0 : (diagonal ? std::min(i + 1, nk) : nk);
          softmax_grad_row(p + i * kBlock, dp + i * kBlock, valid, lsev[i], dvec[i]);
        }
        // dp now holds dS.
        tile_gemm(dv + j0 * HSP, HSP, p, 1, kBlock, dob, HSP, kBlock, HSP, nqr, false,
                  diagonal ? Causal::K_FROM_ROW : Causal::NONE);
        tile_gemm(dq, HSP, dp, kBlock, 1, k + j0 * HSP, HSP, nqr, HSP, kBlock, false,
                  diagonal ? Causal::K_UPTO_ROW : Causal::NONE);
        tile_gemm(dk + j0 * HSP, HSP, dp, 1, kBlock, q, HSP, kBlock, HSP, nqr, false,
                  diagonal ? Causal::K_FROM_ROW : Causal::NONE);
      }
      for (int64_t i = 0; i < nq; ++i) {
        if (i + kPrefetchRows < nq)
          prefetch_head<1>(dqkv + s.q_at(b, i0 + i + kPrefetchRows, h), HS);
        T* d = dqkv + s.q_at(b, i0 + i, h);
        const float* a = dq + i * HSP;
        for (int64_t x = 0; x < HS; ++x) d[x] = from_f32<T>(a[x] * s.scale);
      }
    }
  }
  for (int64_t t = 0; t < T_; ++t) {
    if (t + kPrefetchRows < T_) {
      prefetch_head<1>(dqkv + s.k_at(b, t + kPrefetchRows, kvh), HS);
      prefetch_head<1>(dqkv + s.v_at(b, t + kPrefetchRows, kvh), HS);
    }
    T* dkr = dqkv + s.k_at(b, t, kvh);
    T* dvr = dqkv + s.v_at(b, t, kvh);
    for (int64_t x = 0; x < HS; ++x) {
      dkr[x] = from_f32<T>(dk[t * HSP + x]);
      dvr[x] = from_f32<T>(dv[t * HSP + x]);
    }
  }
}

template <typename T>
void attention_backward_impl(T* dqkv, const T* dout, const T* qkv, const T* out,
                             const float* lse, const AttnShape& s, int nt,
                             std::span<BwdScratch> scratch) {
  const int64_t n_tasks = s.B * s.NKV;
#pragma omp parallel num_threads(nt)
  {
    BwdScratch& w = scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task)
      attention_backward_kv_head(dqkv, dout, qkv, out, lse, s, task / s.NKV, task % s.NKV, w);
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------
// cos/sin of pos * inv_freq(i) for pos < T, i < HS/2, each (T, HS/2). The angle is formed in
// fp32 exactly as a device kernel would: float(pos) * inv_freq. A model calls RoPE with the same
// (T, HS, frequencies) in every layer, so the backend keeps the last table.
// With positions (context parallelism) row t of the table is position positions[t]; the table is
// kept with the positions it was made for.
struct RopeTable {
  int64_t T = 0, HS = 0;
  math::RopeFreqs freqs{0.0f};
  std::vector<int32_t> positions;  // empty: 0 .. T-1
  std::vector<float> cos_t, sin_t;
};

const RopeTable& rope_table(RopeTable& table, int64_t T, int64_t HS, const math::RopeFreqs& freqs,
                            const int32_t* positions) {
  const bool same_positions =
      positions ? table.positions.size() == static_cast<size_t>(T) &&
                      std::equal(table.positions.begin(), table.positions.end(), positions)
                : table.positions.empty();
  if (table.T == T && table.HS == HS && table.freqs == freqs && same_positions) return table;
  if (positions)
    table.positions.assign(positions, positions + T);
  else
    table.positions.clear();
  const int64_t half = HS / 2;
  table.cos_t.resize(T * half);
  table.sin_t.resize(T * half);
  for (int64_t i = 0; i < half; ++i) {
    float inv = math::rope_inv_freq(static_cast<int>(i), static_cast<int>(HS), freqs);
    for (int64_t t = 0; t < T; ++t) {
      float angle = static_cast<float>(positions ? positions[t] : t) * inv;
      table.cos_t[t * half + i] = std::cos(angle);
      table.sin_t[t * half + i] = std::sin(angle);
    }
  }
  table.T = T;
  table.HS = HS;
  table.freqs = freqs;
  return table;
}

// Rotates the NH query and NKV key heads of every token; sign = +1 forward, -1 the inverse.
template <typename T>
void rope_impl(T* qkv, int64_t B, int64_t T_, int64_t NH, int64_t NKV, int64_t HS,
               const math::RopeFreqs& freqs, float sign, int nt, RopeTable& cache, const int32_t* positions) {
  const RopeTable& table = rope_table(cache, T_, HS, freqs, positions);
  const int64_t half = HS / 2, row = (NH + 2 * NKV) * HS, heads = NH + NKV;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t bt = 0; bt < B * T_; ++bt) {
    const int64_t t = bt % T_;
    const float* c = table.cos_t.data() + t * half;
    const float* sn = table.sin_t.data() + t * half;
    for (int64_t hd = 0; hd < heads; ++hd) {
      T* x = qkv + bt * row + hd * HS;
      for (int64_t i = 0; i < half; ++i) {
        float x0 = to_f32(x[i]), x1 = to_f32(x[i + half]);
        math::rope_rotate(x0, x1, c[i], sign * sn[i]);
        x[i] = from_f32<T>(x0);
        x[i + half] = from_f32<T>(x1);
      }
    }
  }
}

void check_rope(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const math::RopeFreqs& freqs,
                const char* op) {
  TETRA_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0,
              "{}: sizes must be positive, got B={} T={} NH={} NKV={} HS={}", op, B, T, NH, NKV,
              HS);
  TETRA_CHECK(HS % 2 == 0, "{}: head size must be even, got HS={}", op, HS);
  TETRA_CHECK(freqs.theta > 0.0f, "{}: theta must be positive, got {}", op, freqs.theta);
  TETRA_CHECK(freqs.factor > 0.0f && (freqs.kind != math::RopeFreqs::LLAMA3 ||
                                      (freqs.high_freq_factor > freqs.low_freq_factor && freqs.low_freq_factor > 0.0f &&
                                       freqs.original_max_position > 0.0f)),
              "{}: rope scaling factor {} (llama3: low_freq_factor {} < high_freq_factor {}, original length {})", op,
              freqs.factor, freqs.low_freq_factor, freqs.high_freq_factor, freqs.original_max_position);
}

}  // namespace

void CpuBackend::attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                   int64_t NH, int64_t NKV, int64_t HS, DType act) {
  AttnShape s = make_shape(B, T, NH, NKV, HS, "attention_forward");
  if (act == DType::BF16 && amx_attention_ && cpu::amx_available()) {
    cpu::amx_attention_forward(static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv), B, T,
                               NH, NKV, HS, threads_, scratch_);
    attention_forward_kernel_ = "amx (bf16 tiles)";
    return;
  }
  attention_forward_kernel_ = "flash (fp32 tiles)";
  cpu::with_float_type(act, "attention_forward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    attention_forward_impl(static_cast<S*>(out), lse, static_cast<const S*>(qkv), s, threads_,
                           scratch_.per_thread<FwdScratch>());
  });
}

void CpuBackend::attention_backward(void* dqkv, const void* dout, const void* qkv,
                                    const void* out, const float* lse, int64_t B, int64_t T,
                                    int64_t NH, int64_t NKV, int64_t HS, DType act) {
  AttnShape s = make_shape(B, T, NH, NKV, HS, "attention_backward");
  if (act == DType::BF16 && amx_attention_ && cpu::amx_available()) {
    cpu::amx_attention_backward(static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout),
                                static_cast<const bf16*>(qkv), static_cast<const bf16*>(out), lse,
                                B, T, NH, NKV, HS, threads_, scratch_);
    attention_backward_kernel_ = "amx (bf16 tiles)";
    return;
  }
  attention_backward_kernel_ = "flash (fp32 tiles)";
  cpu::with_float_type(act, "attention_backward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    attention_backward_impl(static_cast<S*>(dqkv), static_cast<const S*>(dout),
                            static_cast<const S*>(qkv), static_cast<const S*>(out), lse, s,
                            threads_, scratch_.per_thread<BwdScratch>());
  });
}

std::string CpuBackend::kernel_report() const {
  std::string report;
  if (attention_forward_kernel_ != nullptr) {
    report = std::string("attention forward ") + attention_forward_kernel_;
    if (attention_backward_kernel_ != nullptr)
      report += std::string(", backward ") + attention_backward_kernel_;
  }
  if (bf16_gemm_kernel_ != nullptr)
    report += (report.empty() ? "" : "; ") + std::string("bf16 gemm ") + bf16_gemm_kernel_;
  return report;
}


void CpuBackend::rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                              int64_t HS, const math::RopeFreqs& freqs, DType act, const int32_t* positions) {
  check_rope(B, T, NH, NKV, HS, freqs, "rope_forward");
  cpu::with_float_type(act, "rope_forward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    rope_impl(static_cast<S*>(qkv), B, T, NH, NKV, HS, freqs, 1.0f, threads_,
              scratch_.shared<RopeTable>(), positions);
  });
}

void CpuBackend::rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                               int64_t HS, const math::RopeFreqs& freqs, DType act, const int32_t* positions) {
  check_rope(B, T, NH, NKV, HS, freqs, "rope_backward");
  cpu::with_float_type(act, "rope_backward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    rope_impl(static_cast<S*>(dqkv), B, T, NH, NKV, HS, freqs, -1.0f, threads_,
              scratch_.shared<RopeTable>(), positions);
  });
}

}  // namespace tetra
