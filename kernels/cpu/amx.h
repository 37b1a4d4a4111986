// What the CPU kernels that run on AMX tiles (Intel Advanced Matrix Extensions) share: the
// availability check, the tile configuration, the target attribute, a 32 x 32
// block product and a 16-bit transpose.
//
// Every tile product is C (16, 16) fp32 += A (16, 32) bf16 · B (32, 16) bf16, A row-major and B in
// the tiles' pair-interleaved ("VNNI") layout: B32[k/2][n] = the bf16 pair (B[k][n], B[k+1][n]) in
// one 32-bit word.
//
// Only for x86-64 GCC-compatible compilers (TETRA_AMX_COMPILED); elsewhere amx_available() is false.
#pragma once

#include <cstdint>

#include "kernels/cpu/host_memory.h"  // Buffer, grow: the kernels' 64-byte-aligned scratch

#if defined(__x86_64__) && defined(__GNUC__)
#define TETRA_AMX_COMPILED 1
// GCC 12's AVX-512 headers build several intrinsics on _mm512_undefined_*(), which its own
// -Wuninitialized then reports at the header's lines (a false positive, gone in later GCC). The
// pragma applies to the header's lines only: diagnostics state is per source location.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#define TETRA_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#endif

namespace tetra::cpu {

// The CPU reports AMX-TILE and AMX-BF16 and Linux granted this process the tile data state
// (checked once; without the grant the first tile instruction faults).
bool amx_available();

#if defined(TETRA_AMX_COMPILED)

// Tile configuration (palette 1): every tile 16 rows of 64 bytes. The kernels use tmm0-3 for a
// 32 x 32 fp32 block of C, tmm4-5 for two 16 x 32 bf16 blocks of A, tmm6-7 for two 16-pair x 16
// blocks of B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};
static_assert(sizeof(TileConfig) == 64);

// Where a 32 x 32 block product finds one operand's two tiles for k step s (32 values of k):
// tile 0 at base0 + s * step, tile 1 at base1 + s * step (bytes), rows `stride` bytes apart. For
// A the tiles are rows 0-15 and 16-31 (16 x 32 bf16), for B columns 0-15 and 16-31 (16 pairs of
// k x 16 words in the pair-interleaved layout).
struct TilePair {
  const char* base0;
  const char* base1;
  int64_t step, stride;
};

// C (32 x 32 fp32 at c, rows ldc floats apart) = [C +] A · B over `steps` k steps of 32, on tmm0-7
// (the configuration must be loaded): four tile loads per four tile products.
TETRA_AMX_TARGET inline void tile_block(float* c, int64_t ldc, bool accumulate, const TilePair& a,
                                        const TilePair& b, int64_t steps) {
  const int64_t sc = ldc * 4;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    _tile_loadd(1, c + 16, sc);
    _tile_loadd(2, c + 16 * ldc, sc);
    _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a.base0 + s * a.step, a.stride);
    _tile_loadd(6, b.base0 + s * b.step, b.stride);
    _tile_loadd(5, a.base1 + s * a.step, a.stride);
    _tile_loadd(7, b.base1 + s * b.step, b.stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c + 16 * ldc, sc);
  _tile_stored(3, c + 16 * ldc + 16, sc);
}

// dst (32, 8) = src (8, 32)^T, 16-bit elements; src rows lds apart, dst rows ldd apart.
TETRA_AMX_TARGET inline void transpose_8x32(uint16_t* dst, int64_t ldd, const uint16_t* src,
                                            int64_t lds) {
  __m512i r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
  const __m512i t0 = _mm512_unpacklo_epi16(r[0], r[1]), t1 = _mm512_unpackhi_epi16(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi16(r[2], r[3]), t3 = _mm512_unpackhi_epi16(r[2], r[3]);
  const __m512i t4 = _mm512_unpacklo_epi16(r[4], r[5]), t5 = _mm512_unpackhi_epi16(r[4], r[5]);
  const __m512i t6 = _mm512_unpacklo_epi16(r[6], r[7]), t7 = _mm512_unpackhi_epi16(r[6], r[7]);
  const __m512i u0 = _mm512_unpacklo_epi32(t0, t2), u1 = _mm512_unpackhi_epi32(t0, t2);
  const __m512i u2 = _mm512_unpacklo_epi32(t1, t3), u3 = _mm512_unpackhi_epi32(t1, t3);
  const __m512i u4 = _mm512_unpacklo_epi32(t4, t6), u5 = _mm512_unpackhi_epi32(t4, t6);
  const __m512i u6 = _mm512_unpacklo_epi32(t5, t7), u7 = _mm512_unpackhi_epi32(t5, t7);
  // Within each 128-bit lane L, v[i] holds column 8 L + i of the 8 rows.
  const __m512i v[8] = {_mm512_unpacklo_epi64(u0, u4), _mm512_unpackhi_epi64(u0, u4),
                        _mm512_unpacklo_epi64(u1, u5), _mm512_unpackhi_epi64(u1, u5),
                        _mm512_unpacklo_epi64(u2, u6), _mm512_unpackhi_epi64(u2, u6),
                        _mm512_unpacklo_epi64(u3, u7), _mm512_unpackhi_epi64(u3, u7)};
  for (int i = 0; i < 8; ++i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * ldd), _mm512_castsi512_si128(v[i]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (8 + i) * ldd),
                     _mm512_extracti32x4_epi32(v[i], 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (16 + i) * ldd),
                     _mm512_extracti32x4_epi32(v[i], 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (24 + i) * ldd),
                     _mm512_extracti32x4_epi32(v[i], 3));
  }
}

#endif  // TETRA_AMX_COMPILED

}  // namespace tetra::cpu
