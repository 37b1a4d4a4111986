// Causal attention in bf16 on AMX tiles (Intel Advanced Matrix Extensions), where the CPU has them.
//
// The fp32 flash kernels in attention.cpp multiply at the fp32 FMA rate; AMX multiplies bf16 tiles
// with fp32 accumulation several times faster. This path takes bf16 attention when the CPU and the
// OS allow AMX (amx_available()); elsewhere the flash kernels run.
//
// Every product is C (M, N) (+)= A (M, K) · B (K, N) on whole tiles (M, N multiples of 32, K of
// 32): A row-major bf16, B in the tiles' pair-interleaved ("VNNI") layout, B32[k/2][n] = the bf16
// pair (B[k][n], B[k+1][n]) in one 32-bit word; C fp32. Shapes are padded with zeros: HS to HSp (a
// multiple of 32), T to Tp (a multiple of 64), and padded keys are masked like future ones.
//
// Forward, one task per (b, head) (K and V packed once per kv head), query blocks of 64 rows
// [r0, r0 + 64) against keys [0, r0 + 64):
//   S = Q_blk K^T (fp32)   P = softmax(scale S), keys j > i masked   lse_i = max + log(sum)
//   O_blk = P V            with P rounded to bf16, as GPU flash attention does.
// Backward, one task per (b, kv head) (it owns dK and dV: GQA heads never race), per query head of
// the group and query block, P recomputed from the saved lse:
//   dV += P^T dO_blk   dP = dO_blk V^T   dS = P (dP - D), D_i = dO_i · O_i
//   dQ_blk = scale dS K   dK += scale dS^T Q_blk          with dS rounded to bf16.
// dK and dV accumulate in fp32 tiles over the whole group and are rounded once. Scores and
// softmax statistics are fp32. The orders are fixed, so results do not depend on the threads.
//
// The precision differs from the flash kernels (which keep P and dS in fp32) by those two bf16
// roundings: tests/unit/test_kernels_attention_amx.cpp bounds it.
#include "kernels/cpu/attention_amx.h"

#include "kernels/common/check.h"

#include "kernels/cpu/amx.h"

#if defined(TETRA_AMX_COMPILED)
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "kernels/common/math.h"
#include "kernels/cpu/attention_layout.h"

namespace tetra::cpu {
namespace {

constexpr int64_t kQBlock = 64;  // query rows per block (and the key padding unit)

// C (M, N) fp32 (ldc) = [C +] A (M, K) bf16 (lda) · B, B given as B32 (K/2, N) words (ldb words).
// M, N multiples of 32, K a multiple of 32. The tile configuration must be loaded.
TETRA_AMX_TARGET void tile_product(float* c, int64_t ldc, const bf16* a, int64_t lda,
                                   const uint32_t* b, int64_t ldb, int64_t M, int64_t N,
                                   int64_t K, bool accumulate) {
  const char* A = reinterpret_cast<const char*>(a);
  const char* Bw = reinterpret_cast<const char*>(b);
  for (int64_t m = 0; m < M; m += 32) {
    const TilePair at{A + m * lda * 2, A + (m + 16) * lda * 2, 64, lda * 2};
    for (int64_t n = 0; n < N; n += 32) {
      const TilePair bt{Bw + n * 4, Bw + (n + 16) * 4, 16 * ldb * 4, ldb * 4};
      tile_block(c + m * ldc + n, ldc, accumulate, at, bt, K / 32);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Operand layouts. Rows of one head lie `ld` elements apart in qkv / out; rows >= `rows` and
// columns >= `cols` are padding (zero).
// ---------------------------------------------------------------------------------------------
// dst (rows_p, HSp) bf16 row-major = src rows [0, rows), columns [0, cols), zero-padded.
void copy_rows(bf16* dst, int64_t HSp, int64_t rows_p, const bf16* src, int64_t ld, int64_t rows,
               int64_t cols) {
  for (int64_t r = 0; r < rows_p; ++r) {
    bf16* d = dst + r * HSp;
    if (r < rows) {
      std::memcpy(d, src + r * ld, sizeof(bf16) * cols);
      std::memset(d + cols, 0, sizeof(bf16) * (HSp - cols));
    } else {
      std::memset(d, 0, sizeof(bf16) * HSp);
    }
  }
}

// B32 (rows_p / 2, HSp) = pairs of consecutive rows of X (rows_p, HSp) row-major: the tile layout
// of X as the B operand (X's rows are the product's K dimension).
TETRA_AMX_TARGET void pair_rows(uint32_t* dst, const bf16* x, int64_t rows_p, int64_t HSp) {
  for (int64_t kp = 0; kp < rows_p / 2; ++kp) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(x + 2 * kp * HSp);
    const uint16_t* r1 = r0 + HSp;
    uint32_t* d = dst + kp * HSp;
    for (int64_t n = 0; n < HSp; n += 16) {
      const __m512i lo =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + n)));
      const __m512i hi =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + n)));
      _mm512_storeu_si512(d + n, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// B32 (HSp / 2, rows_p) of X^T for X (rows_p, HSp) row-major: word [dp][r] is X's pair
// (X[r][2dp], X[r][2dp + 1]), i.e. X viewed as (rows_p, HSp / 2) words, transposed. The product's
// K dimension is then X's columns (head dimension), N its rows.
TETRA_AMX_TARGET void pair_columns(uint32_t* dst, int64_t ldd, const bf16* x, int64_t rows_p,
                                   int64_t HSp) {
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  const int64_t w = HSp / 2;  // words per row
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(w)));
  for (int64_t r = 0; r < rows_p; r += 16) {
    const uint32_t* base = x32 + r * w;
    for (int64_t dp = 0; dp < w; ++dp) {
      const __m512i v = _mm512_i32gather_epi32(idx, base + dp, 4);
      _mm512_storeu_si512(dst + dp * ldd + r, v);
    }
  }
}

TETRA_AMX_TARGET void transpose16(bf16* dst, int64_t ldd, const bf16* src, int64_t lds,
                                  int64_t rows, int64_t cols) {
  auto* d = reinterpret_cast<uint16_t*>(dst);
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t c0 = 0; c0 < cols; c0 += 32)
    for (int64_t r0 = 0; r0 < rows; r0 += 8)
      transpose_8x32(d + c0 * ldd + r0, ldd, s + r0 * lds + c0, lds);
}

// ---------------------------------------------------------------------------------------------
// Shapes and per-thread scratch
// ---------------------------------------------------------------------------------------------
struct Dims : QkvLayout {
  int64_t G, HSp, Tp;
  int64_t ld;  // rows of score blocks and of K^T / V^T: Tp + 32, so rows never lie 4 KiB apart
  float scale;
};

Dims make_dims(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t Tp = math::round_up(T, kQBlock);
  return Dims{qkv_layout(B, T, NH, NKV, HS), NH / NKV, math::round_up(HS, 32), Tp, Tp + 32,
              1.0f / std::sqrt(static_cast<float>(HS))};
}

// One per thread of the backend's team (CpuScratch::per_thread), grown only.
struct Scratch {
  Buffer<bf16> k, v, qb, dob, p, pt;               // rows (padded), P / dS and their transposes
  Buffer<uint32_t> kt32, vt32, k32, v32, q32, do32;  // B operands
  Buffer<float> s, dp, acc, dk, dv;
  int64_t packed_b = -1, packed_kvh = -1;  // forward: whose K^T and V are in kt32 / v32
};

// Row i (absolute query r0 + i) of a score block: P over keys [0, n), live keys j <= r0 + i.
// shift = the row max (forward) or the saved lse (backward); returns the sum of the exps.
inline float exp_row(float* s, int64_t live, int64_t n, float scale, float shift) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < live; ++j) {
    const float e = math::exp_fast(s[j] * scale - shift);
    s[j] = e;
    sum += e;
  }
  for (int64_t j = live; j < n; ++j) s[j] = 0.0f;
  return sum;
}

// max of s[0, n), n >= 1, in 16 independent lanes (a single running max is one long dependency
// chain, which the compiler does not vectorise without fast-math).
inline float row_max(const float* s, int64_t n) {
  float lanes[16];
  for (int l = 0; l < 16; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = s[j + l] > lanes[l] ? s[j + l] : lanes[l];
  for (int l = 0; j < n; ++j, ++l) lanes[l] = s[j] > lanes[l] ? s[j] : lanes[l];
  float mx = lanes[0];
  for (int l = 1; l < 16; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  return mx;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
void forward_head(bf16* out, float* lse, const bf16* qkv, const Dims& d, int64_t b, int64_t h,
                  Scratch& w) {
  const int64_t kvh = h / d.G, HSp = d.HSp, Tp = d.Tp, L = d.ld;
  bf16* k = grow(w.k, Tp * HSp);
  bf16* v = grow(w.v, Tp * HSp);
  uint32_t* kt32 = grow(w.kt32, HSp / 2 * L);
  uint32_t* v32 = grow(w.v32, Tp / 2 * HSp);
  bf16* qb = grow(w.qb, kQBlock * HSp);
  bf16* p = grow(w.p, kQBlock * L);
  float* s = grow(w.s, kQBlock * L);
  float* acc = grow(w.acc, kQBlock * HSp);
  if (w.packed_b != b || w.packed_kvh != kvh) {  // the G query heads of a kv head pack it once
    copy_rows(k, HSp, Tp, qkv + d.k_at(b, 0, kvh), d.row, d.T, d.HS);
    copy_rows(v, HSp, Tp, qkv + d.v_at(b, 0, kvh), d.row, d.T, d.HS);
    pair_columns(kt32, L, k, Tp, HSp);
    pair_rows(v32, v, Tp, HSp);
    w.packed_b = b;
    w.packed_kvh = kvh;
  }
  for (int64_t r0 = 0; r0 < d.T; r0 += kQBlock) {
    const int64_t nq = std::min(kQBlock, d.T - r0), nk = r0 + kQBlock;  // keys [0, nk)
    copy_rows(qb, HSp, kQBlock, qkv + d.q_at(b, r0, h), d.row, nq, d.HS);
    tile_product(s, L, qb, HSp, kt32, L, kQBlock, nk, HSp, false);
    for (int64_t i = 0; i < kQBlock; ++i) {
      float* si = s + i * L;
      bf16* pi = p + i * L;
      if (i >= nq) {  // padded query row: P = 0
        std::memset(pi, 0, sizeof(bf16) * nk);
        continue;
      }
      const int64_t live = r0 + i + 1;
      const float mx = row_max(si, live) * d.scale;
      const float sum = exp_row(si, live, nk, d.scale, mx);
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) pi[j] = from_f32<bf16>(si[j] * inv);
      lse[(b * d.NH + h) * d.T + r0 + i] = mx + std::log(sum);
    }
    tile_product(acc, HSp, p, L, v32, HSp, kQBlock, HSp, nk, false);
    for (int64_t i = 0; i < nq; ++i) {
      bf16* o = out + d.o_at(b, r0 + i, h);
      const float* a = acc + i * HSp;
#pragma omp simd
      for (int64_t x = 0; x < d.HS; ++x) o[x] = from_f32<bf16>(a[x]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
void backward_kv_head(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                      const float* lse, const Dims& d, int64_t b, int64_t kvh, Scratch& w) {
  const int64_t HSp = d.HSp, Tp = d.Tp, L = d.ld;
  bf16* k = grow(w.k, Tp * HSp);
  bf16* v = grow(w.v, Tp * HSp);
  uint32_t* kt32 = grow(w.kt32, HSp / 2 * L);
  uint32_t* vt32 = grow(w.vt32, HSp / 2 * L);
  uint32_t* k32 = grow(w.k32, Tp / 2 * HSp);
  uint32_t* q32 = grow(w.q32, kQBlock / 2 * HSp);
  uint32_t* do32 = grow(w.do32, kQBlock / 2 * HSp);
  bf16* qb = grow(w.qb, kQBlock * HSp);
  bf16* dob = grow(w.dob, kQBlock * HSp);
  bf16* p = grow(w.p, kQBlock * L);
  bf16* pt = grow(w.pt, Tp * kQBlock);
  float* s = grow(w.s, kQBlock * L);
  float* dp = grow(w.dp, kQBlock * L);
  float* acc = grow(w.acc, kQBlock * HSp);
  float* dk = grow(w.dk, Tp * HSp);
  float* dv = grow(w.dv, Tp * HSp);
  copy_rows(k, HSp, Tp, qkv + d.k_at(b, 0, kvh), d.row, d.T, d.HS);
  copy_rows(v, HSp, Tp, qkv + d.v_at(b, 0, kvh), d.row, d.T, d.HS);
  pair_columns(kt32, L, k, Tp, HSp);
  pair_columns(vt32, L, v, Tp, HSp);
  pair_rows(k32, k, Tp, HSp);
  std::memset(dk, 0, sizeof(float) * Tp * HSp);
  std::memset(dv, 0, sizeof(float) * Tp * HSp);
  float dsum[kQBlock];
  for (int64_t h = kvh * d.G; h < (kvh + 1) * d.G; ++h) {
    for (int64_t r0 = 0; r0 < d.T; r0 += kQBlock) {
      const int64_t nq = std::min(kQBlock, d.T - r0), nk = r0 + kQBlock;
      copy_rows(qb, HSp, kQBlock, qkv + d.q_at(b, r0, h), d.row, nq, d.HS);
      copy_rows(dob, HSp, kQBlock, dout + d.o_at(b, r0, h), d.NH * d.HS, nq, d.HS);
      pair_rows(q32, qb, kQBlock, HSp);
      pair_rows(do32, dob, kQBlock, HSp);
      for (int64_t i = 0; i < kQBlock; ++i) {
        float acc_d = 0.0f;
        if (i < nq) {
          const bf16* oi = out + d.o_at(b, r0 + i, h);
          const bf16* doi = dob + i * HSp;
#pragma omp simd reduction(+ : acc_d)
          for (int64_t x = 0; x < d.HS; ++x) acc_d += to_f32(doi[x]) * to_f32(oi[x]);
        }
        dsum[i] = acc_d;
      }
      // P, recomputed from the saved log-sum-exp.
      tile_product(s, L, qb, HSp, kt32, L, kQBlock, nk, HSp, false);
      const float* lse_row = lse + (b * d.NH + h) * d.T + r0;
      for (int64_t i = 0; i < kQBlock; ++i) {
        float* si = s + i * L;
        if (i < nq)
          exp_row(si, r0 + i + 1, nk, d.scale, lse_row[i]);
        else
          std::memset(si, 0, sizeof(float) * nk);
        bf16* pi = p + i * L;
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) pi[j] = from_f32<bf16>(si[j]);
      }
      // dV[0, nk) += P^T dO_blk
      transpose16(pt, kQBlock, p, L, kQBlock, nk);
      tile_product(dv, HSp, pt, kQBlock, do32, HSp, nk, HSp, kQBlock, true);
      // dP = dO_blk V^T;  dS = P (dP - D)
      tile_product(dp, L, dob, HSp, vt32, L, kQBlock, nk, HSp, false);
      for (int64_t i = 0; i < kQBlock; ++i) {
        const float* si = s + i * L;
        const float* dpi = dp + i * L;
        bf16* dsi = p + i * L;
        const float di = dsum[i];
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) dsi[j] = from_f32<bf16>(si[j] * (dpi[j] - di));
      }
      // dQ_blk = scale dS K  (each query row written once: dqkv is overwritten)
      tile_product(acc, HSp, p, L, k32, HSp, kQBlock, HSp, nk, false);
      for (int64_t i = 0; i < nq; ++i) {
        bf16* dq = dqkv + d.q_at(b, r0 + i, h);
        const float* a = acc + i * HSp;
#pragma omp simd
        for (int64_t x = 0; x < d.HS; ++x) dq[x] = from_f32<bf16>(a[x] * d.scale);
      }
      // dK[0, nk) += dS^T Q_blk  (scaled once at the end)
      transpose16(pt, kQBlock, p, L, kQBlock, nk);
      tile_product(dk, HSp, pt, kQBlock, q32, HSp, nk, HSp, kQBlock, true);
    }
  }
  for (int64_t t = 0; t < d.T; ++t) {
    bf16* dkt = dqkv + d.k_at(b, t, kvh);
    bf16* dvt = dqkv + d.v_at(b, t, kvh);
    for (int64_t x = 0; x < d.HS; ++x) dkt[x] = from_f32<bf16>(dk[t * HSp + x] * d.scale);
    for (int64_t x = 0; x < d.HS; ++x) dvt[x] = from_f32<bf16>(dv[t * HSp + x]);
  }
}

// Runs task(i, scratch) for i in [0, n) on the team's threads, `chunk` consecutive tasks at a time
// (dynamically: a thread that loses its core holds no one up), each thread with the tile
// configuration loaded and its own Scratch, and releases the tiles after (oneDNN's AMX kernels
// load their own configuration on every call). Packed operands cached by an earlier call are stale.
template <typename Task>
TETRA_AMX_TARGET void run_tasks(int64_t n, int64_t chunk, int threads, CpuScratch& scratch,
                                Task&& task) {
  static const TileConfig config;
  const std::span<Scratch> slots = scratch.per_thread<Scratch>();
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&config);
    Scratch& w = slots[omp_get_thread_num()];
    w.packed_b = w.packed_kvh = -1;
#pragma omp for schedule(dynamic, chunk)
    for (int64_t i = 0; i < n; ++i) task(i, w);
    _tile_release();
  }
}

}  // namespace

void amx_attention_forward(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t HS, int threads,
                           CpuScratch& scratch) {
  TETRA_CHECK(amx_available(), "attention: AMX is not available on this CPU");
  const Dims d = make_dims(B, T, NH, NKV, HS);
  // Tasks (b, h), a kv head's G query heads together where that leaves every thread work, so
  // their thread packs K and V once.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(d.G, B * NH / threads));
  run_tasks(B * NH, chunk, threads, scratch, [&](int64_t task, Scratch& w) {
    forward_head(out, lse, qkv, d, task / NH, task % NH, w);
  });
}

void amx_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                            const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t HS, int threads, CpuScratch& scratch) {
  TETRA_CHECK(amx_available(), "attention: AMX is not available on this CPU");
  const Dims d = make_dims(B, T, NH, NKV, HS);
  run_tasks(B * NKV, 1, threads, scratch, [&](int64_t task, Scratch& w) {
    backward_kv_head(dqkv, dout, qkv, out, lse, d, task / NKV, task % NKV, w);
  });
}

}  // namespace tetra::cpu

#else  // not x86-64 with GCC/Clang: no AMX

namespace tetra::cpu {
void amx_attention_forward(bf16*, float*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int, CpuScratch&) {
  TETRA_CHECK(false, "attention: AMX is not available on this CPU");
}
void amx_attention_backward(bf16*, const bf16*, const bf16*, const bf16*, const float*, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int, CpuScratch&) {
  TETRA_CHECK(false, "attention: AMX is not available on this CPU");
}
}  // namespace tetra::cpu

#endif
