// The tile machinery of the CPU attention kernels (attention.cpp: causal self-attention;
// attention_block.cpp: context parallelism's blocks): 16-lane fp32 vectors, the register-blocked
// tile product and the loads of strided head rows into fp32 scratch (attention.cpp's header
// comment explains them).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/common/dtype.h"
#include "kernels/common/math.h"

namespace tetra::cpu::tiles {

constexpr int64_t kBlock = 64;  // queries and keys per tile; a multiple of 16 (vector width)
constexpr int64_t kRows = 4;    // rows of one register block of tile_gemm
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// 16-lane fp32 vectors
// ---------------------------------------------------------------------------------------------
using v16 = float __attribute__((vector_size(64)));
using v16i = int32_t __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 splat16(float x) { return v16{} + x; }

// exp of 16 lanes: math::exp_fast (the exponential every backend shares), which is exactly 0
// below -87.3 and for -inf (the mark of masked scores), so masked entries drop out of every sum.
// The lane loop is branch-free and GCC turns it into vector code.
inline v16 exp16(v16 x) {
  alignas(64) float in[16], out[16];
  store16(in, x);
#pragma omp simd
  for (int i = 0; i < 16; ++i) out[i] = math::exp_fast(in[i]);
  return load16(out);
}

// ---------------------------------------------------------------------------------------------
// Tile products: C (M, N) (+)= A (M, K) · B (K, N), all fp32 scratch.
//   A(r, k) = a[r * a_rs + k * a_ks]  (so A may be read transposed), B rows are ldb apart.
//   M is a multiple of kRows, N a multiple of 16. With `zero_init` C is overwritten, not read.
// The register block is kRows x (16 * NV) accumulators, which stay in registers over K.
// ---------------------------------------------------------------------------------------------
template <int NV>
inline void micro_tile(float* c, int64_t ldc, const float* a, int64_t a_rs, int64_t a_ks,
                       const float* b, int64_t ldb, int64_t K, bool zero_init) {
  v16 acc[kRows][NV];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = zero_init ? v16{} : load16(c + r * ldc + 16 * v);
  for (int64_t k = 0; k < K; ++k) {
    v16 bk[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bk[v] = load16(b + k * ldb + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      float ar = a[r * a_rs + k * a_ks];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bk[v];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store16(c + r * ldc + 16 * v, acc[r][v]);
}

// On a diagonal tile (query block == key block) half of the work is causally masked. Rows and
// the inner index k (or the columns n) then count positions in the same block, and the caller
// says which part is known to be zero or unused, so it is skipped:
//   K_UPTO_ROW   A(r, k) == 0 for k > r: k runs over [0, r]        (P · V, dS · K)
//   K_FROM_ROW   A(r, k) == 0 for k < r: k runs over [r, K)        (P^T · dO, dS^T · Q)
//   N_UPTO_ROW   only C(r, n <= r) is used: columns up to r        (Q · K^T, dO · V^T)
//   N_FROM_ROW   only C(r, n >= r) is used: columns from r         (K · Q^T)
// in units of register blocks and vectors. Skipped k terms are exact zeros, so results are
// unchanged; skipped columns of C are left unwritten and the caller masks them.
enum class Causal : uint8_t { NONE, K_UPTO_ROW, K_FROM_ROW, N_UPTO_ROW, N_FROM_ROW };

inline void tile_gemm(float* c, int64_t ldc, const float* a, int64_t a_rs, int64_t a_ks, const float* b,
               int64_t ldb, int64_t M, int64_t N, int64_t K, bool zero_init,
               Causal causal = Causal::NONE) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    int64_t k0 = 0, k1 = K, n_begin = 0, n_end = N;
    switch (causal) {
      case Causal::K_UPTO_ROW: k1 = std::min(K, m0 + kRows); break;
      case Causal::K_FROM_ROW: k0 = std::min(K, m0); break;
      case Causal::N_UPTO_ROW: n_end = std::min(N, math::round_up(m0 + kRows, 16)); break;
      case Causal::N_FROM_ROW: n_begin = m0 / 16 * 16; break;
      case Causal::NONE: break;
    }
    const float* aa = a + m0 * a_rs + k0 * a_ks;
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
      const int64_t nv = std::min<int64_t>(4, (n_end - n0) / 16);
      float* cc = c + m0 * ldc + n0;
      const float* bb = b + k0 * ldb + n0;
      const int64_t kk = k1 - k0;
      switch (nv) {
        case 4: micro_tile<4>(cc, ldc, aa, a_rs, a_ks, bb, ldb, kk, zero_init); break;
        case 3: micro_tile<3>(cc, ldc, aa, a_rs, a_ks, bb, ldb, kk, zero_init); break;
        case 2: micro_tile<2>(cc, ldc, aa, a_rs, a_ks, bb, ldb, kk, zero_init); break;
        default: micro_tile<1>(cc, ldc, aa, a_rs, a_ks, bb, ldb, kk, zero_init); break;
      }
    }
  }
}

// A grow-only per-thread buffer of floats.
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Rows of one head lie (NH + 2*NKV) * HS elements apart in qkv (NH * HS in out): kilobytes, too
// far for the hardware's stride prefetchers, so every row would be a full cache miss. Loops over
// rows prefetch the head vector kPrefetchRows rows ahead.
constexpr int64_t kPrefetchRows = 8;

template <int kWrite, typename T>
inline void prefetch_head(const T* p, int64_t HS) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < HS * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, kWrite);
}

// Copy rows [t0, t0 + n) of one head (at src + t * row) into dst (rows, ld) as fp32, multiplied
// by `mul`; rows n..rows-1 and columns HS..ld-1 are zeroed.
template <typename T>
void load_rows(float* dst, int64_t ld, int64_t rows, const T* src, int64_t row, int64_t n,
               int64_t HS, float mul) {
  for (int64_t t = 0; t < rows; ++t) {
    float* d = dst + t * ld;
    if (t < n) {
      if (t + kPrefetchRows < n) prefetch_head<0>(src + (t + kPrefetchRows) * row, HS);
      const T* s = src + t * row;
      for (int64_t x = 0; x < HS; ++x) d[x] = to_f32(s[x]) * mul;
      for (int64_t x = HS; x < ld; ++x) d[x] = 0.0f;
    } else {
      std::memset(d, 0, sizeof(float) * ld);
    }
  }
}

// The same, transposed: dst (ld_rows, cols) with dst[x * cols + t] = mul * (src row t)[x], zero
// where t >= n or x >= HS. cols and ld_rows are multiples of 16. Works in 16 x 16 blocks so that
// both the reads and the writes are whole cache lines (a plain column scatter with a stride of
// a few KiB would thrash L1's sets).
template <typename T>
void load_rows_transposed(float* dst, int64_t cols, int64_t ld_rows, const T* src, int64_t row,
                          int64_t n, int64_t HS, float mul) {
  alignas(64) float blk[16][16];  // [x][t]
  for (int64_t t0 = 0; t0 < cols; t0 += 16) {
    const int64_t nt = std::clamp<int64_t>(n - t0, 0, 16);
    for (int64_t t = t0 + 16; t < std::min(n, t0 + 32); ++t) prefetch_head<0>(src + t * row, HS);
    for (int64_t x0 = 0; x0 < ld_rows; x0 += 16) {
      const int64_t nx = std::clamp<int64_t>(HS - x0, 0, 16);
      std::memset(blk, 0, sizeof(blk));
      for (int64_t t = 0; t < nt; ++t) {
        const T* sr = src + (t0 + t) * row + x0;
        for (int64_t x = 0; x < nx; ++x) blk[x][t] = to_f32(sr[x]) * mul;
      }
      for (int64_t x = 0; x < 16; ++x) store16(dst + (x0 + x) * cols + t0, load16(blk[x]));
    }
  }
}

// dst (cols, rows) = src (rows, cols)^T for fp32 scratch already in cache; rows and cols are
// multiples of 16, and each 16 x 16 block stays within L1.
inline void transpose(float* dst, const float* src, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16)
      for (int64_t r = r0; r < r0 + 16; ++r) {
        const v16 v = load16(src + r * cols + c0);
        for (int c = 0; c < 16; ++c) dst[(c0 + c) * rows + r] = v[c];
      }
}

// Sum of the 16 lanes, in a fixed order.
inline float hsum16(v16 v) {
  float acc = 0.0f;
  for (int i = 0; i < 16; ++i) acc += v[i];
  return acc;
}

// ---------------------------------------------------------------------------------------------
// The flash-attention steps both kernels share
// ---------------------------------------------------------------------------------------------
// Online softmax of one key tile against kBlock queries: st (nkr, kBlock) holds the scaled scores
// (keys x queries, masked ones -inf) and is overwritten with exp(s - m_new); the running max m and
// sum l (kBlock / 16 vectors each) are updated, and the output accumulator acc (kBlock, HSP)
// rescaled, before the caller adds P V.
inline void online_softmax_tile(float* st, int64_t nkr, v16* m, v16* l, float* acc, int64_t HSP) {
  for (int64_t u = 0; u < kBlock / 16; ++u) {
    v16 mx = m[u];
    for (int64_t j = 0; j < nkr; ++j) {
      const v16 x = load16(st + j * kBlock + 16 * u);
      mx = x > mx ? x : mx;
    }
    const v16 corr = exp16(m[u] - mx);  // first tile: exp(-inf) = 0
    v16 sum = v16{};
    for (int64_t j = 0; j < nkr; ++j) {
      const v16 p = exp16(load16(st + j * kBlock + 16 * u) - mx);
      store16(st + j * kBlock + 16 * u, p);
      sum += p;
    }
    m[u] = mx;
    l[u] = l[u] * corr + sum;
    for (int64_t i = 0; i < 16; ++i) {
      float* a = acc + (16 * u + i) * HSP;
      for (int64_t x = 0; x < HSP; ++x) a[x] *= corr[i];
    }
  }
}

// Backward of one tile, row i of nqr: p (scores q k^T) becomes P = exp(s - lse_i) and dp (dO V^T)
// becomes dS = P (dp - D_i) over keys [0, valid); the rest of both rows is zeroed.
inline void softmax_grad_row(float* pr, float* dsr, int64_t valid, float lse_i, float d_i) {
  const v16 li = splat16(lse_i), di = splat16(d_i);
  for (int64_t j = 0; j < math::round_up(valid, 16); j += 16) {
    const v16 pj = exp16(load16(pr + j) - li);
    store16(pr + j, pj);
    store16(dsr + j, pj * (load16(dsr + j) - di));
  }
  for (int64_t j = valid; j < kBlock; ++j) pr[j] = dsr[j] = 0.0f;
}

}  // namespace tetra::cpu::tiles
