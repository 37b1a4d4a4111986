// Causal flash attention for 16-bit activations (bf16 or fp16: template TE) on tensor cores
// (mma.sync m16n8k16, fp32 accumulation), head sizes up to 128 (padded with zeros to HSP = 32, 64,
// 96 or 128). The two types share every line: only the mma instruction variant and the rounding
// of P and dS to TE differ (attention_mma.cuh).
//
// Forward (FlashAttention-2): one block of 4 warps per (64 queries, head, batch); each warp owns
// 16 query rows, keeps its Q fragments in registers and walks the key blocks 0..diagonal: S = Q K^T
// (fp32), online softmax in the log2 domain (running max m, running sum l, the output rescaled
// by exp2(m_old - m_new)), then O += P V with P rounded to TE in registers.
// lse = ln 2 (m + log2 l).
//
// Backward, deterministic without atomics, recomputing P = exp(S - lse) from the saved lse:
//   D_i = dO_i . O_i                                   (attention_row_dots, before both kernels)
//   dkdv: one block per (64 keys, kv head, batch), each warp 16 keys; it loops over the G query
//     heads of its kv head and over every query chunk at or after its keys, in that fixed order:
//       S^T = K Q^T, P^T, dP^T = V dO^T, dS^T = P^T (dP^T - D),  dV += P^T dO,  dK += dS^T Q
//   dq: one block per (64 queries, head, batch), each warp 16 queries, over the key chunks up to
//     the diagonal: S, P, dP = dO V^T, dS = P (dP - D),  dQ += dS K
//   with dQ and dK scaled by 1/sqrt(HS) at the end. S and dP are computed twice (once per
//   kernel): the price of giving every gradient element a single writer.
// P and dS are rounded to TE before their products, as flash kernels do. In fp16, P (in [0, 1])
// keeps three more mantissa bits than in bf16; dS can overflow fp16's range where the upstream
// gradient is huge, which then shows as an infinite gradient: the overflow that dynamic loss
// scaling detects and answers by skipping the step and lowering the scale.
#include <cfloat>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_mma.cuh"

namespace tetra::cuda::attn {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr float kNegInf = -INFINITY;

template <typename TE>
struct MmaArgs {
  const TE* qkv;
  const TE* dout;  // backward
  TE* out;         // forward: out; backward: dqkv
  float* lse;          // forward output
  const float* lse_in;  // backward input
  const float* d_rows;  // backward input (B, NH, T)
  int T, NH, NKV, HS, group;
  int64_t row;   // qkv / dqkv elements per token
  int64_t orow;  // out / dout elements per token (NH HS)
  float scale, scale_log2;
  bool vec_qkv, vec_o;  // 16-byte global accesses allowed on qkv/dqkv, on out/dout
};

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  return v + __shfl_xor_sync(kFullMask, v, 2);
}

// ---------------------------------------------------------------------------------------------
// Forward. grid (query blocks, NH, B); the last query blocks (most key blocks) start first.
// ---------------------------------------------------------------------------------------------
template <typename TE, int HSP>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(MmaArgs<TE> a) {
  constexpr int LD = HSP + 8, KT = HSP / 16, DT = HSP / 8;
  __shared__ __align__(16) TE s_k[64 * LD];  // Q first, then each key block
  __shared__ __align__(16) TE s_v[64 * LD];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / a.group, i0 = qb * 64, r0 = warp * 16;
  const TE* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  const TE* q = base + static_cast<int64_t>(h) * a.HS;
  const TE* k = base + static_cast<int64_t>(a.NH + kvh) * a.HS;
  const TE* v = base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS;

  load_tile<64, HSP, LD, kThreads>(s_k, q, a.row, i0, a.T, a.HS, a.vec_qkv);
  __syncthreads();
  uint32_t qf[KT][4];
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) load_a_frag(qf[kk], s_k, LD, r0, kk * 16);

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};  // l: this thread's columns only
  const int qrow[2] = {i0 + r0 + g, i0 + r0 + g + 8};

  for (int kb = 0; kb <= qb; ++kb) {
    __syncthreads();  // every warp is done with the previous tiles (and the Q fragments)
    load_tile<64, HSP, LD, kThreads>(s_k, k, a.row, kb * 64, a.T, a.HS, a.vec_qkv);
    load_tile<64, HSP, LD, kThreads>(s_v, v, a.row, kb * 64, a.T, a.HS, a.vec_qkv);
    __syncthreads();

    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        uint32_t b0, b1;
        load_bt_frag(b0, b1, s_k, LD, nt * 8, kk * 16);
        mma<TE>(s[nt], qf[kk], b0, b1);
      }
    // Scores in log2 units; on the diagonal block keys after the query are masked (so are keys
    // >= T for real queries: the last key block is always a diagonal one).
    const bool diagonal = kb == qb;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = kb * 64 + nt * 8 + 2 * c + (e & 1);
        s[nt][e] = diagonal && j > qrow[e >> 1] ? kNegInf : s[nt][e] * a.scale_log2;
      }
    // Online softmax per row (the 4 lanes of a quad share a row). Key 0 is in block 0 and never
    // masked, so m is finite from the first block on and exp2(-inf - m) = 0.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = kNegInf;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      const float m_new = fmaxf(m[r], quad_max(mx));
      const float corr = exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= corr;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        o[dt][2 * r] *= corr;
        o[dt][2 * r + 1] *= corr;
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[nt][e] = exp2f(s[nt][e] - m_new);
          l[r] += s[nt][e];
        }
    }
    // O += P V over the block's 64 keys, 16 at a time.
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      const uint32_t pa[4] = {pack2<TE>(s[2 * kc][0], s[2 * kc][1]),
                              pack2<TE>(s[2 * kc][2], s[2 * kc][3]),
                              pack2<TE>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              pack2<TE>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        uint32_t vb[4];
        load_b_frags_x2(vb, s_v, LD, kc * 16, dt * 8);
        mma<TE>(o[dt], pa, vb[0], vb[1]);
        mma<TE>(o[dt + 1], pa, vb[2], vb[3]);
      }
    }
  }

  // Normalise, stage the 16-bit rows in shared memory, store them 16 bytes at a time.
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lr = quad_sum(l[r]);
    const float inv = 1.0f / lr;
    const int tr = r0 + g + 8 * r;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      st_pair(s_k + tr * LD + dt * 8 + 2 * c, o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (c == 0 && qrow[r] < a.T)
      a.lse[(static_cast<int64_t>(b) * a.NH + h) * a.T + qrow[r]] = (m[r] + log2f(lr)) * kLn2;
  }
  __syncthreads();
  TE* out = a.out + static_cast<int64_t>(b) * a.T * a.orow + static_cast<int64_t>(h) * a.HS;
  store_tile<64, HSP, LD, kThreads>(out, a.orow, s_k, i0, a.T, a.HS, a.vec_o);
}

// ---------------------------------------------------------------------------------------------
// Backward, dK and dV. grid (key blocks, NKV, B); dynamic shared memory (dkdv_smem_bytes).
// ---------------------------------------------------------------------------------------------
template <int HSP>
constexpr int dkdv_smem_bytes() {
  return (2 * 64 + 2 * 32) * (HSP + 8) * 2 + 2 * 32 * 4;
}

template <typename TE, int HSP>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_kernel(MmaArgs<TE> a) {
  constexpr int LD = HSP + 8, KT = HSP / 16, DT = HSP / 8;
  extern __shared__ uint4 smem_dkdv[];
  TE* s_k = reinterpret_cast<TE*>(smem_dkdv);  // 64 keys
  TE* s_v = s_k + 64 * LD;                          // 64 keys
  TE* s_q = s_v + 64 * LD;                          // 32 queries
  TE* s_do = s_q + 32 * LD;                         // 32 queries
  float* s_lse = reinterpret_cast<float*>(s_do + 32 * LD);  // lse * log2 e of the 32 queries
  float* s_d = s_lse + 32;                                  // D of the 32 queries
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int jb = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int j0 = jb * 64, r0 = warp * 16;  // this warp's keys: j0 + r0 + [0, 16)
  const TE* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  load_tile<64, HSP, LD, kThreads>(s_k, base + static_cast<int64_t>(a.NH + kvh) * a.HS, a.row, j0,
                                   a.T, a.HS, a.vec_qkv);
  load_tile<64, HSP, LD, kThreads>(s_v, base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS,
                                   a.row, j0, a.T, a.HS, a.vec_qkv);
  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.0f;
  const int n_qc = (a.T + 31) / 32;

  for (int gi = 0; gi < a.group; ++gi) {
    const int h = kvh * a.group + gi;
    const TE* q = base + static_cast<int64_t>(h) * a.HS;
    const TE* dout =
        a.dout + static_cast<int64_t>(b) * a.T * a.orow + static_cast<int64_t>(h) * a.HS;
    const int64_t bh = (static_cast<int64_t>(b) * a.NH + h) * a.T;
    // Query chunks before j0 see none of these keys.
    for (int qc = 2 * jb; qc < n_qc; ++qc) {
      const int i0 = qc * 32;
      __syncthreads();  // every warp is done with the previous chunk
      load_tile<32, HSP, LD, kThreads>(s_q, q, a.row, i0, a.T, a.HS, a.vec_qkv);
      load_tile<32, HSP, LD, kThreads>(s_do, dout, a.orow, i0, a.T, a.HS, a.vec_o);
      if (threadIdx.x < 32) {
        const int i = i0 + threadIdx.x;
        s_lse[threadIdx.x] = i < a.T ? a.lse_in[bh + i] * kLog2e : 0.0f;
        s_d[threadIdx.x] = i < a.T ? a.d_rows[bh + i] : 0.0f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x 32 queries.
      float st[4][4], dpt[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t ka[4], va[4];
        load_a_frag(ka, s_k, LD, r0, kk * 16);
        load_a_frag(va, s_v, LD, r0, kk * 16);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          uint32_t b0, b1;
          load_bt_frag(b0, b1, s_q, LD, nt * 8, kk * 16);
          mma<TE>(st[nt], ka, b0, b1);
          load_bt_frag(b0, b1, s_do, LD, nt * 8, kk * 16);
          mma<TE>(dpt[nt], va, b0, b1);
        }
      }
      // P^T (zero where the query precedes the key or lies past T) and dS^T = P^T (dP^T - D).
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + r0 + g + 8 * (e >> 1), col = nt * 8 + 2 * c + (e & 1), i = i0 + col;
          const float p =
              i >= j && i < a.T ? exp2f(st[nt][e] * a.scale_log2 - s_lse[col]) : 0.0f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - s_d[col]);
        }
      // dV += P^T dO and dK += dS^T Q over the 32 queries, 16 at a time.
#pragma unroll
      for (int kc = 0; kc < 2; ++kc) {
        const uint32_t pa[4] = {pack2<TE>(st[2 * kc][0], st[2 * kc][1]),
                                pack2<TE>(st[2 * kc][2], st[2 * kc][3]),
                                pack2<TE>(st[2 * kc + 1][0], st[2 * kc + 1][1]),
                                pack2<TE>(st[2 * kc + 1][2], st[2 * kc + 1][3])};
        const uint32_t da[4] = {pack2<TE>(dpt[2 * kc][0], dpt[2 * kc][1]),
                                pack2<TE>(dpt[2 * kc][2], dpt[2 * kc][3]),
                                pack2<TE>(dpt[2 * kc + 1][0], dpt[2 * kc + 1][1]),
                                pack2<TE>(dpt[2 * kc + 1][2], dpt[2 * kc + 1][3])};
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
          uint32_t fb[4];
          load_b_frags_x2(fb, s_do, LD, kc * 16, dt * 8);
          mma<TE>(dv[dt], pa, fb[0], fb[1]);
          mma<TE>(dv[dt + 1], pa, fb[2], fb[3]);
          load_b_frags_x2(fb, s_q, LD, kc * 16, dt * 8);
          mma<TE>(dk[dt], da, fb[0], fb[1]);
          mma<TE>(dk[dt + 1], da, fb[2], fb[3]);
        }
      }
    }
  }

  // dK (scaled) and dV through the K and V tiles to dqkv.
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tr = r0 + g + 8 * r;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      st_pair(s_k + tr * LD + dt * 8 + 2 * c, dk[dt][2 * r] * a.scale, dk[dt][2 * r + 1] * a.scale);
      st_pair(s_v + tr * LD + dt * 8 + 2 * c, dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
  __syncthreads();
  TE* dbase = a.out + static_cast<int64_t>(b) * a.T * a.row;
  store_tile<64, HSP, LD, kThreads>(dbase + static_cast<int64_t>(a.NH + kvh) * a.HS, a.row, s_k,
                                    j0, a.T, a.HS, a.vec_qkv);
  store_tile<64, HSP, LD, kThreads>(dbase + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS, a.row,
                                    s_v, j0, a.T, a.HS, a.vec_qkv);
}

// ---------------------------------------------------------------------------------------------
// Backward, dQ. grid (query blocks, NH, B).
// ---------------------------------------------------------------------------------------------
template <typename TE, int HSP>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_kernel(MmaArgs<TE> a) {
  constexpr int LD = HSP + 8, KT = HSP / 16, DT = HSP / 8;
  // Q in rows 0-63 and dO in rows 64-127 until their fragments are in registers; then each key
  // chunk: K in rows 0-31, V in rows 32-63.
  __shared__ __align__(16) TE s_buf[128 * LD];
  TE* s_kc = s_buf;
  TE* s_vc = s_buf + 32 * LD;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / a.group, i0 = qb * 64, r0 = warp * 16;
  const TE* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  const TE* k = base + static_cast<int64_t>(a.NH + kvh) * a.HS;
  const TE* v = base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS;
  const TE* dout =
      a.dout + static_cast<int64_t>(b) * a.T * a.orow + static_cast<int64_t>(h) * a.HS;

  load_tile<64, HSP, LD, kThreads>(s_buf, base + static_cast<int64_t>(h) * a.HS, a.row, i0, a.T,
                                   a.HS, a.vec_qkv);
  load_tile<64, HSP, LD, kThreads>(s_buf + 64 * LD, dout, a.orow, i0, a.T, a.HS, a.vec_o);
  __syncthreads();
  uint32_t qf[KT][4], df[KT][4];
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    load_a_frag(qf[kk], s_buf, LD, r0, kk * 16);
    load_a_frag(df[kk], s_buf + 64 * LD, LD, r0, kk * 16);
  }
  const int qrow[2] = {i0 + r0 + g, i0 + r0 + g + 8};
  const int64_t bh = (static_cast<int64_t>(b) * a.NH + h) * a.T;
  float lse2[2], drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = qrow[r] < a.T ? a.lse_in[bh + qrow[r]] * kLog2e : 0.0f;
    drow[r] = qrow[r] < a.T ? a.d_rows[bh + qrow[r]] : 0.0f;
  }
  float dq[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.0f;

  const int last_kc = min((i0 + 63) / 32, (a.T - 1) / 32);
  for (int kc = 0; kc <= last_kc; ++kc) {
    const int j0 = kc * 32;
    __syncthreads();  // fragments loaded / previous chunk consumed by every warp
    load_tile<32, HSP, LD, kThreads>(s_kc, k, a.row, j0, a.T, a.HS, a.vec_qkv);
    load_tile<32, HSP, LD, kThreads>(s_vc, v, a.row, j0, a.T, a.HS, a.vec_qkv);
    __syncthreads();

    float s[4][4], dp[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        uint32_t b0, b1;
        load_bt_frag(b0, b1, s_kc, LD, nt * 8, kk * 16);
        mma<TE>(s[nt], qf[kk], b0, b1);
        load_bt_frag(b0, b1, s_vc, LD, nt * 8, kk * 16);
        mma<TE>(dp[nt], df[kk], b0, b1);
      }
    // dS = P (dP - D), P zero where the key follows the query (or the query lies past T).
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, j = j0 + nt * 8 + 2 * c + (e & 1);
        const float p =
            j <= qrow[r] && qrow[r] < a.T ? exp2f(s[nt][e] * a.scale_log2 - lse2[r]) : 0.0f;
        s[nt][e] = p * (dp[nt][e] - drow[r]);
      }
    // dQ += dS K over the chunk's 32 keys, 16 at a time.
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      const uint32_t da[4] = {pack2<TE>(s[2 * kh][0], s[2 * kh][1]),
                              pack2<TE>(s[2 * kh][2], s[2 * kh][3]),
                              pack2<TE>(s[2 * kh + 1][0], s[2 * kh + 1][1]),
                              pack2<TE>(s[2 * kh + 1][2], s[2 * kh + 1][3])};
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        uint32_t kb4[4];
        load_b_frags_x2(kb4, s_kc, LD, kh * 16, dt * 8);
        mma<TE>(dq[dt], da, kb4[0], kb4[1]);
        mma<TE>(dq[dt + 1], da, kb4[2], kb4[3]);
      }
    }
  }

  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tr = r0 + g + 8 * r;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      st_pair(s_buf + tr * LD + dt * 8 + 2 * c, dq[dt][2 * r] * a.scale,
              dq[dt][2 * r + 1] * a.scale);
  }
  __syncthreads();
  TE* dq_out = a.out + static_cast<int64_t>(b) * a.T * a.row + static_cast<int64_t>(h) * a.HS;
  store_tile<64, HSP, LD, kThreads>(dq_out, a.row, s_buf, i0, a.T, a.HS, a.vec_qkv);
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <typename TE>
MmaArgs<TE> make_args(const Dims& d) {
  MmaArgs<TE> a{};
  a.T = static_cast<int>(d.T);
  a.NH = static_cast<int>(d.NH);
  a.NKV = static_cast<int>(d.NKV);
  a.HS = static_cast<int>(d.HS);
  a.group = static_cast<int>(d.group());
  a.row = d.row();
  a.orow = d.NH * d.HS;
  a.scale = d.scale();
  a.scale_log2 = a.scale * kLog2e;
  return a;
}

void check_grid(const Dims& d, const char* op) {
  TETRA_CHECK(d.NH <= 65535 && d.B <= 65535 && d.T <= (int64_t{1} << 30),
              "{}: grid limits exceeded (B={} NH={} T={}; at most 65535, 65535, 2^30)", op, d.B,
              d.NH, d.T);
}

template <typename TE, int HSP>
void launch_forward(const MmaArgs<TE>& a, const Dims& d, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((d.T + 63) / 64), static_cast<unsigned>(d.NH),
                  static_cast<unsigned>(d.B));
  flash_fwd_kernel<TE, HSP><<<grid, kThreads, 0, stream>>>(a);
  TETRA_CUDA_LAUNCHED();
}

template <typename TE, int HSP>
void launch_backward(const MmaArgs<TE>& a, const Dims& d, cudaStream_t stream) {
  constexpr int smem = dkdv_smem_bytes<HSP>();
  if (smem > 48 * 1024)
    TETRA_CUDA_CHECK(cudaFuncSetAttribute(flash_bwd_dkdv_kernel<TE, HSP>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const unsigned blocks = static_cast<unsigned>((d.T + 63) / 64);
  flash_bwd_dkdv_kernel<TE, HSP><<<dim3(blocks, static_cast<unsigned>(d.NKV),
                                    static_cast<unsigned>(d.B)),
                               kThreads, smem, stream>>>(a);
  TETRA_CUDA_LAUNCHED();
  flash_bwd_dq_kernel<TE, HSP>
      <<<dim3(blocks, static_cast<unsigned>(d.NH), static_cast<unsigned>(d.B)), kThreads, 0,
         stream>>>(a);
  TETRA_CUDA_LAUNCHED();
}

// Head sizes are padded with zero columns to one of the instantiated sizes.
int padded_head(int64_t HS) { return HS <= 32 ? 32 : HS <= 64 ? 64 : HS <= 96 ? 96 : 128; }

}  // namespace

bool flash_mma_supports(const Dims& d) { return d.HS <= 128; }

template <typename TE>
void flash_mma_forward(const Dims& d, TE* out, float* lse, const TE* qkv, cudaStream_t stream) {
  check_grid(d, "attention_forward");
  MmaArgs<TE> a = make_args<TE>(d);
  a.qkv = qkv;
  a.out = out;
  a.lse = lse;
  a.vec_qkv = d.HS % 8 == 0 && aligned16(qkv);
  a.vec_o = d.HS % 8 == 0 && aligned16(out);
  switch (padded_head(d.HS)) {
    case 32: launch_forward<TE, 32>(a, d, stream); break;
    case 64: launch_forward<TE, 64>(a, d, stream); break;
    case 96: launch_forward<TE, 96>(a, d, stream); break;
    default: launch_forward<TE, 128>(a, d, stream); break;
  }
}

template <typename TE>
void flash_mma_backward(const Dims& d, TE* dqkv, const TE* dout, const TE* qkv, const float* lse,
                        const float* d_rows, cudaStream_t stream) {
  check_grid(d, "attention_backward");
  MmaArgs<TE> a = make_args<TE>(d);
  a.qkv = qkv;
  a.dout = dout;
  a.out = dqkv;
  a.lse_in = lse;
  a.d_rows = d_rows;
  a.vec_qkv = d.HS % 8 == 0 && aligned16(qkv) && aligned16(dqkv);
  a.vec_o = d.HS % 8 == 0 && aligned16(dout);
  switch (padded_head(d.HS)) {
    case 32: launch_backward<TE, 32>(a, d, stream); break;
    case 64: launch_backward<TE, 64>(a, d, stream); break;
    case 96: launch_backward<TE, 96>(a, d, stream); break;
    default: launch_backward<TE, 128>(a, d, stream); break;
  }
}

#define TETRA_INSTANTIATE_MMA(TE)                                                              \
  template void flash_mma_forward<TE>(const Dims&, TE*, float*, const TE*, cudaStream_t);      \
  template void flash_mma_backward<TE>(const Dims&, TE*, const TE*, const TE*, const float*,   \
                                       const float*, cudaStream_t);
TETRA_INSTANTIATE_MMA(bf16_t)
TETRA_INSTANTIATE_MMA(f16_t)
#undef TETRA_INSTANTIATE_MMA

}  // namespace tetra::cuda::attn
