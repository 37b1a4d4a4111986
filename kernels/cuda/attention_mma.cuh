// 16-bit tensor-core building blocks of the flash-attention kernels: the mma.sync m16n8k16
// instruction (bf16 or fp16 inputs, fp32 accumulators), ldmatrix, and the copies of one head's
// rows between global memory and a shared-memory tile. Everything is templated on the storage
// type T (bf16_t or f16_t): the two instruction variants have the same fragment layouts, so only
// the instruction and the fp32 -> T rounding differ.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16 or .f16): lane = 4 g + c (g = lane / 4 is
// the "group", c = lane % 4 its index in the group).
//   A (16 x 16, row-major), 4 registers of 2 16-bit values: a0 = A[g][2c, 2c+1], a1 = A[g+8][2c, 2c+1],
//     a2 = A[g][2c+8, 2c+9], a3 = A[g+8][2c+8, 2c+9]   (the lower column in the low 16 bits)
//   B (16 x 8, k x n), 2 registers: b0 = B[2c, 2c+1][g], b1 = B[2c+8, 2c+9][g]
//   C (16 x 8, fp32), 4 floats: c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1]
// Two C tiles side by side (columns 0-7 and 8-15) hold, element for element, the A fragment of
// their 16 x 16 product with the next operand (after rounding to T): a0 = (c0, c1) of the
// left tile, a1 = (c2, c3) of the left, a2 / a3 the same of the right. That is how P (and dS)
// stay in registers between the two products of a flash kernel.
//
// Shared tiles are row-major with a pitch of HSP + 8 elements (16 bytes more than a row), so the 8
// rows a fragment load or an ldmatrix touches fall in 8 different groups of 4 banks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace tetra::cuda::attn {

// The bits of a stored value, and of an fp32 value rounded to T (nearest even).
__device__ __forceinline__ uint32_t raw_bits(bf16_t x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t raw_bits(f16_t x) { return __half_as_ushort(x); }
template <typename T>
__device__ __forceinline__ uint32_t rounded_bits(float x) {
  return raw_bits(from_float<T>(x));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return rounded_bits<T>(lo) | (rounded_bits<T>(hi) << 16);
}

// Two consecutive elements of a shared tile (4-byte aligned: an even column of an even pitch).
template <typename T>
__device__ __forceinline__ uint32_t ld_pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
template <typename T>
__device__ __forceinline__ void st_pair(T* p, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(p) = pack2<T>(lo, hi);
}

// c += a * b, with a and b holding T pairs.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  static_assert(std::is_same_v<T, bf16_t> || std::is_same_v<T, f16_t>, "mma: bf16 or fp16 only");
  if constexpr (std::is_same_v<T, bf16_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The A fragment of rows [r0, r0 + 16) and columns [k0, k0 + 16) of a shared tile (pitch ld).
template <typename T>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const T* tile, int ld, int r0,
                                            int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const T* p = tile + (r0 + g) * ld + k0 + 2 * c;
  a[0] = ld_pair(p);
  a[1] = ld_pair(p + 8 * ld);
  a[2] = ld_pair(p + 8);
  a[3] = ld_pair(p + 8 * ld + 8);
}

// The B fragment of B = X^T for rows [n0, n0 + 8) of a tile X (B[k][n] = X[n0 + n][k0 + k]):
// the rows of X are the columns of B, so both registers are contiguous pairs.
template <typename T>
__device__ __forceinline__ void load_bt_frag(uint32_t& b0, uint32_t& b1, const T* tile,
                                             int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const T* p = tile + (n0 + g) * ld + k0 + 2 * c;
  b0 = ld_pair(p);
  b1 = ld_pair(p + 8);
}

// The B fragments of B = X (B[k][n] = X[k0 + k][n0 + n]) for two n8 tiles, columns [n0, n0 + 16):
// ldmatrix.trans of four 8 x 8 blocks. Lanes 8m..8m+7 give the rows of block m: block 0 = rows
// k0..k0+7 x columns n0..n0+7 (b0 of the left tile), 1 = rows k0+8.. (its b1), 2 and 3 the same
// for columns n0+8... Transposed, lane 4g + c receives X[2c, 2c+1][g] of each block: b0 / b1.
template <typename T>
__device__ __forceinline__ void load_b_frags_x2(uint32_t (&b)[4], const T* tile, int ld,
                                                int k0, int n0) {
  const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
  const T* p = tile + (k0 + r + (m & 1) * 8) * ld + n0 + (m >> 1) * 8;
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(addr)
               : "memory");
}

// Copies rows [t0, t0 + ROWS) of one head (row t at src + t * stride, HS elements) into a shared
// tile (ROWS, HSP) of pitch LD, 16 bytes per thread and step; rows t >= T and columns >= HS are
// zero. `vec` (HS % 8 == 0 and src 16-byte aligned) allows 16-byte global loads; otherwise each
// element is loaded alone.
template <int ROWS, int HSP, int LD, int THREADS, typename TE>
__device__ __forceinline__ void load_tile(TE* tile, const TE* src, int64_t stride, int t0,
                                          int T, int HS, bool vec) {
  constexpr int kChunks = HSP / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, x = (i % kChunks) * 8, t = t0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (t < T && x < HS) {
      const TE* s = src + static_cast<int64_t>(t) * stride + x;
      if (vec) {
        v = *reinterpret_cast<const uint4*>(s);
      } else {
        uint32_t h[8];
        for (int e = 0; e < 8; ++e) h[e] = x + e < HS ? raw_bits(s[e]) : 0u;
        v = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                       h[6] | (h[7] << 16));
      }
    }
    *reinterpret_cast<uint4*>(tile + r * LD + x) = v;
  }
}

// The reverse: rows t < T and columns < HS of the tile to dst (row t at dst + t * stride).
template <int ROWS, int HSP, int LD, int THREADS, typename TE>
__device__ __forceinline__ void store_tile(TE* dst, int64_t stride, const TE* tile, int t0,
                                           int T, int HS, bool vec) {
  constexpr int kChunks = HSP / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, x = (i % kChunks) * 8, t = t0 + r;
    if (t >= T || x >= HS) continue;
    TE* d = dst + static_cast<int64_t>(t) * stride + x;
    const TE* s = tile + r * LD + x;
    if (vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
    } else {
      for (int e = 0; e < 8 && x + e < HS; ++e) d[e] = s[e];
    }
  }
}

}  // namespace tetra::cuda::attn
