// bf16 GEMM on AMX tiles, C (M, N) = alpha * op(A) · op(B) + beta * C + bias, fp32 accumulation.
//
// oneDNN 2.6 runs bf16 matmuls on AMX too, but at GPT-2's shapes on two cores it reaches ~1.2
// TFLOP/s, a sixth of the tile units' rate on this class of CPU (~3.7 TFLOP/s per core, measured
// with register-resident tiles). This kernel is a plain BLIS-style blocking around a 32 x 32
// micro-kernel:
//
//   micro-kernel  C (32, 32) fp32 in tmm0-3 += A (32, kc) [tmm4-5] · B (kc, 32) [tmm6-7], k by 32:
//                 four tile loads per four tile products (amx.h, tile_block).
//   B             packed per chunk of columns (1 MiB, half a core's L2) into the tiles'
//                 pair-interleaved layout, panels of 16 columns each (kc/2 rows of 16 32-bit
//                 pairs, contiguous); a B stored transposed by 16 x 16 word transposes.
//   A             read in place when it is row-major, its rows start on cache lines and the block
//                 is whole; otherwise (a transposed A, a partial block of rows, a ragged end of K)
//                 packed in tile order (a transposed A by 32 x 32 transposes): per pass by all
//                 threads together where a block is used more than once, else per block.
//   K             in passes of at most kMaxKPass (the tied output layer's dX has K = vocabulary);
//                 several passes accumulate in fp32 (in C itself when C is fp32 and the epilogue
//                 is trivial, else in a buffer).
//   epilogue      alpha * acc + beta * C + bias, in that order, rounded once to C's type (bf16:
//                 to nearest even, as math::f32_to_bf16_bits).
//
// Threads split C by whole 32-wide blocks, along M or N (whichever has more blocks); every
// element's sum runs over the same K passes in the same order on one thread, so results do not
// depend on the thread count. Padding (ragged M, N, K) is zero-filled in the packed operands.
#include "kernels/cpu/gemm_amx.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <span>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_loops.h"
#include "kernels/common/check.h"
#include "kernels/common/math.h"

#if defined(TETRA_AMX_COMPILED)

namespace tetra::cpu {
namespace {

constexpr int64_t kBlock = 32;               // rows and columns of C per micro-kernel call
constexpr int64_t kMaxKPass = 4096;          // K per pass
constexpr int64_t kPackBytes = 1024 * 1024;  // a thread's packed B chunk: half its L2

// Tile rows must start on cache lines (amx.h, Buffer): operands are read in place only where
// their rows do.
bool lines(const void* p, int64_t ld_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 64 == 0 && ld_bytes % 64 == 0;
}

// Each thread's own buffers, one set per thread of the backend's team (CpuScratch::per_thread).
struct ThreadScratch {
  Buffer<uint32_t> b;  // packed B chunk
  Buffer<bf16> a;      // one packed 32-row block of A
  Buffer<float> c;     // one 32 x 32 block of C
};

// Buffers a call's threads share, one set per backend (CpuScratch::shared): two backends driven
// from two host threads each have their own.
struct Shared {
  Buffer<bf16> a;         // a pass's op(A), packed by all threads together
  Buffer<float> acc;      // fp32 accumulator across K passes
  Buffer<uint32_t> b[2];  // B chunks packed by all threads together (threads split the rows)
};

struct Problem {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha, beta;
  const bf16 *A, *B, *bias;
  int64_t lda, ldb, ldc;
  void* C;
  DType c_type;
};

// ---------------------------------------------------------------------------------------------
// Packing
// ---------------------------------------------------------------------------------------------
// 16 x 16 transpose of 32-bit words: out[c] = (r[0][c], ..., r[15][c]).
TETRA_AMX_TARGET inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4 g + s], lane L = rows 4g..4g+3 of column 4 L + s.
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int s = 0; s < 4; ++s) {
    const __m512i p01 = _mm512_shuffle_i32x4(u[s], u[4 + s], 0x44);
    const __m512i p23 = _mm512_shuffle_i32x4(u[s], u[4 + s], 0xEE);
    const __m512i q01 = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], 0x44);
    const __m512i q23 = _mm512_shuffle_i32x4(u[8 + s], u[12 + s], 0xEE);
    r[0 + s] = _mm512_shuffle_i32x4(p01, q01, 0x88);
    r[4 + s] = _mm512_shuffle_i32x4(p01, q01, 0xDD);
    r[8 + s] = _mm512_shuffle_i32x4(p23, q23, 0x88);
    r[12 + s] = _mm512_shuffle_i32x4(p23, q23, 0xDD);
  }
}

inline __mmask32 mask32(int64_t n) {  // the low n of 32 bits, n clamped to [0, 32]
  return n <= 0 ? 0u : n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1u;
}

// w[0], w[1] = the words (a[i], b[i]) of 16-bit elements i = 0-15 and 16-31 (a in the low half).
TETRA_AMX_TARGET inline void pair_words(__m512i a, __m512i b, __m512i w[2]) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56,
                                      24, 55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17,
                                      48, 16);
  w[0] = _mm512_permutex2var_epi16(a, lo, b);
  w[1] = _mm512_permutex2var_epi16(a, hi, b);
}

// Packs op(B) rows [k0, k0 + kc) and columns [n0, n0 + ncols) (ncols a multiple of 16; kc of 32)
// into panels of 16 columns: panel p at dst + p * (kc / 2) * 16, word [kp][c] = the pair
// (op(B)[k0 + 2kp][n0 + 16p + c], op(B)[k0 + 2kp + 1][n0 + 16p + c]). Outside op(B): zeros.
TETRA_AMX_TARGET void pack_b(uint32_t* dst, const Problem& g, int64_t k0, int64_t kc, int64_t n0,
                             int64_t ncols) {
  const int64_t panel = kc / 2 * 16;
  const uint16_t* B = reinterpret_cast<const uint16_t*>(g.B);
  if (!g.trans_b) {  // stored (K, N): interleave pairs of rows, 32 columns (two panels) at a time
    const int64_t panels = ncols / 16;
    for (int64_t kp = 0; kp < kc / 2; ++kp) {
      const int64_t k = k0 + 2 * kp;
      const uint16_t* r0 = k < g.K ? B + k * g.ldb : nullptr;
      const uint16_t* r1 = k + 1 < g.K ? B + (k + 1) * g.ldb : nullptr;
      for (int64_t p = 0; p < panels; p += 2) {
        const int64_t c0 = n0 + 16 * p;
        const __mmask32 m = mask32(std::min<int64_t>(g.N - c0, 16 * (panels - p)));
        const __m512i a = r0 ? _mm512_maskz_loadu_epi16(m, r0 + c0) : _mm512_setzero_si512();
        const __m512i b = r1 ? _mm512_maskz_loadu_epi16(m, r1 + c0) : _mm512_setzero_si512();
        __m512i w[2];
        pair_words(a, b, w);
        _mm512_storeu_si512(dst + p * panel + kp * 16, w[0]);
        if (p + 1 < panels) _mm512_storeu_si512(dst + (p + 1) * panel + kp * 16, w[1]);
      }
    }
    return;
  }
  // stored (N, K): word (kp, c) is the pair at row n0 + 16p + c, columns k0 + 2kp, +1: 16 x 16
  // word transposes.
  for (int64_t p = 0; p < ncols / 16; ++p) {
    const int64_t c0 = n0 + 16 * p;
    for (int64_t kp0 = 0; kp0 < kc / 2; kp0 += 16) {
      const int64_t k = k0 + 2 * kp0;
      const __mmask32 km = mask32(g.K - k);
      __m512i r[16];
      for (int c = 0; c < 16; ++c)
        r[c] = c0 + c < g.N ? _mm512_maskz_loadu_epi16(km, B + (c0 + c) * g.ldb + k)
                            : _mm512_setzero_si512();
      transpose_16x16(r);
      uint32_t* d = dst + p * panel + kp0 * 16;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(d + i * 16, r[i]);
    }
  }
}

// dst (32 x 32, rows 32 apart, 64-byte aligned) = src (32 x 32, rows lds apart)^T, 16-bit: rows
// of src paired into words (the pair-interleaved layout), then two 16 x 16 word transposes, so
// every store is a whole line.
TETRA_AMX_TARGET void transpose_step(uint16_t* dst, const uint16_t* src, int64_t lds) {
  __m512i w0[16], w1[16];  // word (kp, m) = (src[2kp][m], src[2kp + 1][m]), m < 16 and m >= 16
  for (int kp = 0; kp < 16; ++kp) {
    __m512i w[2];
    pair_words(_mm512_loadu_si512(src + 2 * kp * lds), _mm512_loadu_si512(src + (2 * kp + 1) * lds),
               w);
    w0[kp] = w[0];
    w1[kp] = w[1];
  }
  transpose_16x16(w0);
  transpose_16x16(w1);
  for (int m = 0; m < 16; ++m) {
    _mm512_store_si512(dst + m * 32, w0[m]);
    _mm512_store_si512(dst + (16 + m) * 32, w1[m]);
  }
}

// Packs op(A) rows [m0, m0 + 32) and columns [k0, k0 + kc) into dst in tile order: per 32 columns
// (step s) a 32 x 32 block, rows 32 elements apart, at dst + 1024 s, so each of its two tiles is
// 1 KiB of consecutive lines. Outside op(A): zeros.
constexpr int64_t kAStep = kBlock * 32;  // elements of one step of packed A

TETRA_AMX_TARGET void pack_a(bf16* dst, const Problem& g, int64_t m0, int64_t k0, int64_t kc) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  const uint16_t* A = reinterpret_cast<const uint16_t*>(g.A);
  const int64_t rows = std::min<int64_t>(kBlock, g.M - m0);
  if (!g.trans_a) {
    for (int64_t r = 0; r < kBlock; ++r)
      for (int64_t k = 0; k < kc; k += 32) {
        const __mmask32 m = r < rows ? mask32(g.K - k0 - k) : 0u;
        _mm512_store_si512(d + k * kBlock + r * 32,
                           _mm512_maskz_loadu_epi16(m, A + (m0 + r) * g.lda + k0 + k));
      }
    return;
  }
  // stored (K, M): op(A)[m][k] = A[k][m]. Whole steps by the 32 x 32 transpose, whole 8 x 32
  // pieces of a ragged last step by the 8 x 32 one (8 columns never straddle a step), the rest
  // element by element.
  const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(kc, g.K - k0));
  const int64_t ksteps = valid / 32 * 32, kfull = valid / 8 * 8;
  if (rows == kBlock) {
    for (int64_t k = 0; k < ksteps; k += 32)
      transpose_step(d + k / 32 * kAStep, A + (k0 + k) * g.lda + m0, g.lda);
    for (int64_t k = ksteps; k < kfull; k += 8)
      transpose_8x32(d + k / 32 * kAStep + k % 32, 32, A + (k0 + k) * g.lda + m0, g.lda);
  }
  for (int64_t r = 0; r < kBlock; ++r) {
    for (int64_t k = rows == kBlock ? kfull : 0; k < kc; ++k) {
      const bool in = r < rows && k0 + k < g.K;
      d[k / 32 * kAStep + r * 32 + k % 32] = in ? A[(k0 + k) * g.lda + m0 + r] : uint16_t{0};
    }
  }
}

// Where a micro-kernel finds op(A)'s 32 rows: tile 0 (rows 0-15) of step s at a + s * step,
// tile 1 at + second, rows `stride` bytes apart. In place: step 32, second 16 lda, stride 2 lda;
// packed: step kAStep, second 512, stride 64.
struct ABlock {
  const bf16* a;
  int64_t step, second, stride;
};

// ---------------------------------------------------------------------------------------------
// Micro-kernel and epilogue
// ---------------------------------------------------------------------------------------------
// c (32 x 32 fp32, ldc floats) = [c +] op(A) block (32 x kc) · b (panels b0, b1: kc/2 x 16 words).
TETRA_AMX_TARGET inline void micro(float* c, int64_t ldc, bool load, const ABlock& ab,
                                   const uint32_t* b0, const uint32_t* b1, int64_t kc) {
  const char* a = reinterpret_cast<const char*>(ab.a);
  const TilePair at{a, a + ab.second * 2, ab.step * 2, ab.stride};
  const TilePair bt{reinterpret_cast<const char*>(b0), reinterpret_cast<const char*>(b1), 1024, 64};
  tile_block(c, ldc, load, at, bt, kc / 32);
}

// fp32 -> bf16 bits, to nearest even, NaN kept NaN (math::f32_to_bf16_bits), in the high half of
// each 32-bit lane.
TETRA_AMX_TARGET inline __m512i round_bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

// Two vectors of 16 fp32 as 32 bf16, in order.
TETRA_AMX_TARGET inline __m512i to_bf16(__m512 lo, __m512 hi) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35,
                                       33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(round_bf16_high(lo), odd, round_bf16_high(hi));
}

TETRA_AMX_TARGET inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// C rows [m0, m0 + rows), columns [n0, n0 + cols) = alpha * acc + beta * C + bias, 32 columns (one
// 64-byte store of bf16) at a time.
TETRA_AMX_TARGET void epilogue(const Problem& g, const float* acc, int64_t ld, int64_t m0,
                               int64_t n0, int64_t rows, int64_t cols) {
  const __m512 alpha = _mm512_set1_ps(g.alpha), beta = _mm512_set1_ps(g.beta);
  const uint16_t* bias = reinterpret_cast<const uint16_t*>(g.bias);
  const bool f32 = g.c_type == DType::F32;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * ld;
    const int64_t at = (m0 + r) * g.ldc + n0;
    float* C32 = static_cast<float*>(g.C) + at;
    uint16_t* C16 = static_cast<uint16_t*>(g.C) + at;
    for (int64_t c = 0; c < cols; c += 32) {
      __m512 v[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t j = c + 16 * h;
        const __mmask16 m = static_cast<__mmask16>(mask32(cols - j));
        v[h] = _mm512_maskz_loadu_ps(m, a + j);
        if (g.alpha != 1.0f) v[h] = _mm512_mul_ps(v[h], alpha);
        if (g.beta != 0.0f) {
          const __m512 c0 = f32 ? _mm512_maskz_loadu_ps(m, C32 + j)
                                : from_bf16(_mm256_maskz_loadu_epi16(m, C16 + j));
          v[h] = _mm512_add_ps(v[h], _mm512_mul_ps(beta, c0));
        }
        if (bias) v[h] = _mm512_add_ps(v[h], from_bf16(_mm256_maskz_loadu_epi16(m, bias + n0 + j)));
        if (f32) _mm512_mask_storeu_ps(C32 + j, m, v[h]);
      }
      if (!f32) _mm512_mask_storeu_epi16(C16 + c, mask32(cols - c), to_bf16(v[0], v[1]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------
struct Plan {
  int64_t Mb, Nb;         // blocks of 32 rows / columns of C
  int64_t passes, kc;     // K in `passes` passes of kc (a multiple of 32; the last may be ragged)
  int64_t chunk_blocks;   // column blocks per packed B chunk
  bool split_m;           // threads split the rows (else the columns)
  bool c_is_acc;          // C is fp32 and its own accumulator (alpha 1, no bias, beta 0 or 1)
  bool acc_buffer;        // several passes into a C that is not its own accumulator
  bool prepack_a;         // each pass's op(A) packed once, by all threads, before its products
};

TETRA_AMX_TARGET void run(const Problem& g, int threads, CpuScratch& scratch) {
  Plan p;
  p.Mb = math::ceil_div(g.M, kBlock);
  p.Nb = math::ceil_div(g.N, kBlock);
  const int64_t Kp = math::round_up(g.K, 32);
  p.passes = math::ceil_div(Kp, kMaxKPass);
  p.kc = math::round_up(math::ceil_div(Kp, p.passes), 32);
  p.passes = math::ceil_div(Kp, p.kc);
  p.chunk_blocks = std::max<int64_t>(1, kPackBytes / (p.kc * 2 * kBlock));
  p.split_m = p.Mb >= p.Nb;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, p.split_m ? p.Mb : p.Nb)));
  p.c_is_acc = g.c_type == DType::F32 && g.alpha == 1.0f && g.bias == nullptr &&
               (g.beta == 0.0f || g.beta == 1.0f);
  p.acc_buffer = p.passes > 1 && !p.c_is_acc;
  // A block of op(A) rows is used once per chunk of B columns of every thread that needs it: where
  // that is more than once and A cannot be read in place, each pass's op(A) is packed whole first,
  // once. Where that copy would be large (the output layer's weight gradient: A is the logits'
  // gradient, 103 MB in bf16 for GPT-2 at 1024 tokens), one chunk of up to twice the size that
  // holds every column of the thread packs each A block once instead.
  const bool a_in_place = !g.trans_a && lines(g.A, g.lda * 2);
  const int64_t my_cols = p.split_m ? p.Nb : math::ceil_div(p.Nb, threads);
  constexpr int64_t kMaxPackedA = 16 << 20;
  if (!a_in_place && p.Mb * kBlock * p.kc * 2 > kMaxPackedA &&
      my_cols * kBlock * p.kc * 2 <= 2 * kPackBytes)
    p.chunk_blocks = my_cols;
  const int64_t uses = math::ceil_div(my_cols, p.chunk_blocks) * (p.split_m ? 1 : threads);
  p.prepack_a = !a_in_place && uses > 1;
  const int64_t a_block = kBlock * p.kc;  // elements of one packed 32-row block of op(A)

  Shared& sh = scratch.shared<Shared>();
  const std::span<ThreadScratch> slots = scratch.per_thread<ThreadScratch>();
  bf16* a_pass = p.prepack_a ? grow(sh.a, p.Mb * a_block) : nullptr;
  const int64_t acc_ld = p.Nb * kBlock + 16;
  float* acc = p.acc_buffer ? grow(sh.acc, p.Mb * kBlock * acc_ld) : nullptr;

  const bool c_in_place = lines(g.C, g.ldc * 4);
  // Threads that split the rows all need every chunk of B: they pack it together, into one of two
  // shared buffers in turn (the barrier after packing chunk c + 1 also means every thread is done
  // with chunk c, so its buffer may be packed again).
  const bool shared_b = p.split_m && threads > 1;
  uint32_t* b_shared[2] = {nullptr, nullptr};
  if (shared_b)
    for (int i = 0; i < 2; ++i) b_shared[i] = grow(sh.b[i], p.chunk_blocks * kBlock * p.kc / 2);
  // Each thread's scratch is grown here, in a region without barriers, so that an allocation
  // failure is an exception on the caller's thread rather than a throw inside the product's region
  // (where it would end the process).
  const int64_t b_words = shared_b ? 0 : p.chunk_blocks * kBlock * p.kc / 2;
  std::exception_ptr failed;
#pragma omp parallel num_threads(threads)
  {
    try {
      ThreadScratch& w = slots[omp_get_thread_num()];
      grow(w.a, a_block);
      grow(w.c, kBlock * kBlock);
      grow(w.b, b_words);
    } catch (...) {
#pragma omp critical(tetra_amx_gemm_scratch)
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);

  static const TileConfig config;
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&config);
    ThreadScratch& w = slots[omp_get_thread_num()];
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t mb0 = p.split_m ? p.Mb * t / nt : 0, mb1 = p.split_m ? p.Mb * (t + 1) / nt : p.Mb;
    const int64_t nb0 = p.split_m ? 0 : p.Nb * t / nt, nb1 = p.split_m ? p.Nb : p.Nb * (t + 1) / nt;
    // Even chunks of this thread's columns.
    const int64_t chunks = math::ceil_div(nb1 - nb0, p.chunk_blocks);
    bf16* a_blk = grow(w.a, a_block);
    float* cbuf = grow(w.c, kBlock * kBlock);
    int64_t turn = 0;
    for (int64_t pass = 0; pass < p.passes; ++pass) {
      const int64_t k0 = pass * p.kc;
      const bool first = pass == 0, last = pass + 1 == p.passes;
      if (p.prepack_a) {
        if (!first) {
#pragma omp barrier
        }
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < p.Mb; ++mb)
          pack_a(a_pass + mb * a_block, g, mb * kBlock, k0, p.kc);
      }
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t cb0 = nb0 + (nb1 - nb0) * ch / chunks, cb1 = nb0 + (nb1 - nb0) * (ch + 1) / chunks;
        if (cb1 == cb0) continue;
        const int64_t panel = p.kc / 2 * 16;
        uint32_t* bp;
        if (shared_b) {
          bp = b_shared[turn++ % 2];
          const int64_t panels = (cb1 - cb0) * 2, p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
          pack_b(bp + p0 * panel, g, k0, p.kc, cb0 * kBlock + 16 * p0, 16 * (p1 - p0));
#pragma omp barrier
        } else {
          bp = grow(w.b, (cb1 - cb0) * kBlock * p.kc / 2);
          pack_b(bp, g, k0, p.kc, cb0 * kBlock, (cb1 - cb0) * kBlock);
        }
        for (int64_t mb = mb0; mb < mb1; ++mb) {
          const int64_t m0 = mb * kBlock, rows = std::min<int64_t>(kBlock, g.M - m0);
          ABlock a{nullptr, kAStep, 512, 64};
          if (p.prepack_a) {
            a.a = a_pass + mb * a_block;
          } else if (a_in_place && rows == kBlock && k0 + p.kc <= g.K) {
            a = ABlock{g.A + m0 * g.lda + k0, 32, 16 * g.lda, 2 * g.lda};
          } else {
            pack_a(a_blk, g, m0, k0, p.kc);
            a.a = a_blk;
          }
          for (int64_t nb = cb0; nb < cb1; ++nb) {
            const int64_t n0 = nb * kBlock, cols = std::min<int64_t>(kBlock, g.N - n0);
            const uint32_t* b0 = bp + (nb - cb0) * 2 * panel;
            if (p.acc_buffer) {
              float* c = acc + m0 * acc_ld + n0;
              micro(c, acc_ld, !first, a, b0, b0 + panel, p.kc);
              if (last) epilogue(g, c, acc_ld, m0, n0, rows, cols);
            } else if (p.c_is_acc) {
              const bool load = !first || g.beta != 0.0f;
              float* C = static_cast<float*>(g.C) + m0 * g.ldc + n0;
              if (c_in_place && rows == kBlock && cols == kBlock) {
                micro(C, g.ldc, load, a, b0, b0 + panel, p.kc);
              } else {
                for (int64_t r = 0; r < rows && load; ++r)
                  std::memcpy(cbuf + r * kBlock, C + r * g.ldc, sizeof(float) * cols);
                micro(cbuf, kBlock, load, a, b0, b0 + panel, p.kc);
                for (int64_t r = 0; r < rows; ++r)
                  std::memcpy(C + r * g.ldc, cbuf + r * kBlock, sizeof(float) * cols);
              }
            } else {  // one pass, then the epilogue
              micro(cbuf, kBlock, false, a, b0, b0 + panel, p.kc);
              epilogue(g, cbuf, kBlock, m0, n0, rows, cols);
            }
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

void amx_gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const bf16* A, int64_t lda, const bf16* B, int64_t ldb, float beta, void* C,
                   int64_t ldc, DType c_type, const bf16* bias, int threads,
                   CpuScratch& scratch) {
  TETRA_CHECK(amx_available(), "gemm: AMX is not available on this CPU");
  check_gemm_args(trans_a, trans_b, M, N, K, lda, ldb, ldc, DType::BF16, c_type);
  TETRA_CHECK(c_type == DType::F32 || c_type == DType::BF16,
              "gemm: the AMX path writes an F32 or BF16 C, got {}", dtype_name(c_type));
  if (M == 0 || N == 0) return;
  const Problem g{trans_a, trans_b, M, N, K, alpha, beta, A, B, bias, lda, ldb, ldc, C, c_type};
  run(g, threads, scratch);
}

}  // namespace tetra::cpu

#else  // not x86-64 with GCC/Clang: no AMX

namespace tetra::cpu {
void amx_gemm_bf16(bool, bool, int64_t, int64_t, int64_t, float, const bf16*, int64_t, const bf16*,
                   int64_t, float, void*, int64_t, DType, const bf16*, int, CpuScratch&) {
  TETRA_CHECK(false, "gemm: AMX is not available on this CPU");
}
}  // namespace tetra::cpu

#endif

namespace tetra {

#if defined(TETRA_HAVE_DNNL)
constexpr const char* kFallback = "onednn";
#else
constexpr const char* kFallback = "loops";
#endif

bool CpuBackend::gemm_amx(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                          float alpha, const void* A, int64_t lda, const void* B, int64_t ldb,
                          DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
                          const void* bias) {
  if (ab_type != DType::BF16 || (c_type != DType::F32 && c_type != DType::BF16)) return false;
  if (!amx_gemm_ || !cpu::amx_available()) {
    bf16_gemm_kernel_ = kFallback;
    return false;
  }
  bf16_gemm_kernel_ = "amx (bf16 tiles)";
  cpu::amx_gemm_bf16(trans_a, trans_b, M, N, K, alpha, static_cast<const bf16*>(A), lda,
                     static_cast<const bf16*>(B), ldb, beta, C, ldc, c_type,
                     static_cast<const bf16*>(bias), threads_, scratch_);
  return true;
}

}  // namespace tetra
