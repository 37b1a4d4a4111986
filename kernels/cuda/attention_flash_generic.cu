// Causal flash attention on CUDA cores, fp32 math for every storage type: the path for fp32
// activations and for head sizes the 16-bit tensor-core kernels do not take (HS > 128, up to 256),
// plus the D = rowsum(dO * O) pass shared by both backward paths.
//
// Tiles of 32 queries x 32 keys, 8 warps per block, each warp owning 4 rows of the tile; head
// vectors are padded with zeros to HSP = 32 NX and each lane owns columns lane + 32 c (c < NX).
// Rows read lane-wise (one row per lane) are stored with a pitch of HSP + 1 floats so that the 32
// lanes hit 32 different banks; rows read by the whole warp at once (broadcast) are unpadded.
//
// Forward: online softmax as in the tensor-core kernel (log2 domain, running max and sum), P stays
// fp32.
// Backward: a dK/dV kernel per (32 keys, kv head, batch) looping over the group's query heads and
// the query chunks from the diagonal on, and a dQ kernel per (32 queries, head, batch) looping over
// the key chunks up to the diagonal; each writes its outputs once (no atomics, fixed sum order).
#include "kernels/cuda/attention.cuh"

namespace tetra::cuda::attn {
namespace {

constexpr int kThreads = 256;  // 8 warps x 4 rows = 32 rows per tile
constexpr int kRows = 4;
constexpr float kNegInf = -INFINITY;

template <typename E>
struct GenericArgs {
  const E* qkv;
  const E* dout;  // backward
  E* out;         // forward: out; backward: dqkv
  float* lse;
  const float* lse_in;
  const float* d_rows;
  int T, NH, NKV, HS, group;
  int64_t row, orow;
  float scale, scale_log2;
};

// Rows [t0, t0 + 32) of one head into a (32, pitch) fp32 tile times `mul`, zero-padded (rows
// >= T, columns >= HS up to HSP).
template <typename T>
__device__ __forceinline__ void load_rows(float* dst, int pitch, int HSP, const T* src,
                                          int64_t stride, int t0, int T_, int HS, float mul) {
  for (int i = threadIdx.x; i < 32 * HSP; i += kThreads) {
    const int r = i / HSP, x = i % HSP, t = t0 + r;
    dst[r * pitch + x] = t < T_ && x < HS ? ld(src + static_cast<int64_t>(t) * stride + x) * mul
                                          : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward. grid (query tiles, NH, B); shared: Q (32 x HSP, scaled to log2 units), K (32 x HSP+1),
// V (32 x HSP).
// ---------------------------------------------------------------------------------------------
template <int NX>
constexpr int fwd_smem_bytes() {
  return (32 * 32 * NX * 2 + 32 * (32 * NX + 1)) * 4;
}

template <typename T, int NX>
__global__ void __launch_bounds__(kThreads) flash_fwd_generic_kernel(GenericArgs<T> a) {
  constexpr int HSP = 32 * NX, KP = HSP + 1;
  extern __shared__ float smem_fwd[];
  float* s_q = smem_fwd;
  float* s_k = s_q + 32 * HSP;
  float* s_v = s_k + 32 * KP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / a.group, i0 = qb * 32, w0 = warp * kRows;
  const T* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  const T* k = base + static_cast<int64_t>(a.NH + kvh) * a.HS;
  const T* v = base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS;
  load_rows(s_q, HSP, HSP, base + static_cast<int64_t>(h) * a.HS, a.row, i0, a.T, a.HS,
            a.scale_log2);

  float acc[kRows][NX], m[kRows], l[kRows];  // l: this lane's keys only
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
#pragma unroll
    for (int cx = 0; cx < NX; ++cx) acc[r][cx] = 0.0f;
  }
  for (int kb = 0; kb <= qb; ++kb) {
    __syncthreads();
    load_rows(s_k, KP, HSP, k, a.row, kb * 32, a.T, a.HS, 1.0f);
    load_rows(s_v, HSP, HSP, v, a.row, kb * 32, a.T, a.HS, 1.0f);
    __syncthreads();
    // Lane = key: s[r] = q_r . k_lane (log2 units).
    float s[kRows] = {};
#pragma unroll 8
    for (int x = 0; x < HSP; ++x) {
      const float kx = s_k[lane * KP + x];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] += s_q[(w0 + r) * HSP + x] * kx;
    }
    // The last key tile is the diagonal one, so keys >= T of real queries are masked here too;
    // key 0 is never masked, so m is finite from the first tile on.
    const int j = kb * 32 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (kb == qb && j > i0 + w0 + r) s[r] = kNegInf;
      const float m_new = fmaxf(m[r], warp_max(s[r]));
      const float corr = exp2f(m[r] - m_new);
      s[r] = exp2f(s[r] - m_new);
      l[r] = l[r] * corr + s[r];
      m[r] = m_new;
#pragma unroll
      for (int cx = 0; cx < NX; ++cx) acc[r][cx] *= corr;
    }
    // O += P V: key jj's probabilities come from lane jj.
    for (int jj = 0; jj < 32; ++jj) {
      float p[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) p[r] = __shfl_sync(kFullMask, s[r], jj);
#pragma unroll
      for (int cx = 0; cx < NX; ++cx) {
        const float vx = s_v[jj * HSP + lane + 32 * cx];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][cx] += p[r] * vx;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float lr = warp_sum(l[r]);
    const int i = i0 + w0 + r;
    if (i >= a.T) continue;
    const float inv = 1.0f / lr;
    T* o = a.out + (static_cast<int64_t>(b) * a.T + i) * a.orow + static_cast<int64_t>(h) * a.HS;
#pragma unroll
    for (int cx = 0; cx < NX; ++cx)
      if (lane + 32 * cx < a.HS) st(o + lane + 32 * cx, acc[r][cx] * inv);
    if (lane == 0)
      a.lse[(static_cast<int64_t>(b) * a.NH + h) * a.T + i] = (m[r] + log2f(lr)) * kLn2;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, dK and dV. grid (key tiles, NKV, B); shared: K, V (32 x HSP, broadcast), Q, dO
// (32 x HSP+1, lane-wise), lse * log2 e and D of the 32 queries.
// ---------------------------------------------------------------------------------------------
template <int NX>
constexpr int bwd_smem_bytes() {
  return (2 * 32 * 32 * NX + 2 * 32 * (32 * NX + 1) + 64) * 4;
}

template <typename T, int NX>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_generic_kernel(GenericArgs<T> a) {
  constexpr int HSP = 32 * NX, QP = HSP + 1;
  extern __shared__ float smem_dkdv[];
  float* s_k = smem_dkdv;
  float* s_v = s_k + 32 * HSP;
  float* s_q = s_v + 32 * HSP;
  float* s_do = s_q + 32 * QP;
  float* s_lse = s_do + 32 * QP;
  float* s_d = s_lse + 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int jb = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int j0 = jb * 32, w0 = warp * kRows;
  const T* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  load_rows(s_k, HSP, HSP, base + static_cast<int64_t>(a.NH + kvh) * a.HS, a.row, j0, a.T, a.HS,
            1.0f);
  load_rows(s_v, HSP, HSP, base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS, a.row, j0, a.T,
            a.HS, 1.0f);
  float dk[kRows][NX], dv[kRows][NX];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int cx = 0; cx < NX; ++cx) dk[r][cx] = dv[r][cx] = 0.0f;
  const int n_qc = (a.T + 31) / 32;

  for (int gi = 0; gi < a.group; ++gi) {
    const int h = kvh * a.group + gi;
    const T* q = base + static_cast<int64_t>(h) * a.HS;
    const T* dout =
        a.dout + static_cast<int64_t>(b) * a.T * a.orow + static_cast<int64_t>(h) * a.HS;
    const int64_t bh = (static_cast<int64_t>(b) * a.NH + h) * a.T;
    for (int qc = jb; qc < n_qc; ++qc) {  // query chunks before the keys see none of them
      const int i0 = qc * 32, i = i0 + lane;
      __syncthreads();
      load_rows(s_q, QP, HSP, q, a.row, i0, a.T, a.HS, 1.0f);
      load_rows(s_do, QP, HSP, dout, a.orow, i0, a.T, a.HS, 1.0f);
      if (threadIdx.x < 32) {
        s_lse[lane] = i < a.T ? a.lse_in[bh + i] * kLog2e : 0.0f;
        s_d[lane] = i < a.T ? a.d_rows[bh + i] : 0.0f;
      }
      __syncthreads();
      // Lane = query i: s[r] = k_r . q_i, dp[r] = v_r . dO_i for this warp's keys r.
      float s[kRows] = {}, dp[kRows] = {};
#pragma unroll 8
      for (int x = 0; x < HSP; ++x) {
        const float qx = s_q[lane * QP + x], ox = s_do[lane * QP + x];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          s[r] += s_k[(w0 + r) * HSP + x] * qx;
          dp[r] += s_v[(w0 + r) * HSP + x] * ox;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int j = j0 + w0 + r;
        const float p = i >= j && i < a.T ? exp2f(s[r] * a.scale_log2 - s_lse[lane]) : 0.0f;
        s[r] = p;
        dp[r] = p * (dp[r] - s_d[lane]);
      }
      // dV_r += sum_i p[r][i] dO_i and dK_r += sum_i dS[r][i] q_i, query ii from lane ii.
      for (int ii = 0; ii < 32; ++ii) {
        float p[kRows], ds[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          p[r] = __shfl_sync(kFullMask, s[r], ii);
          ds[r] = __shfl_sync(kFullMask, dp[r], ii);
        }
#pragma unroll
        for (int cx = 0; cx < NX; ++cx) {
          const float ox = s_do[ii * QP + lane + 32 * cx], qx = s_q[ii * QP + lane + 32 * cx];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            dv[r][cx] += p[r] * ox;
            dk[r][cx] += ds[r] * qx;
          }
        }
      }
    }
  }
  T* dbase = a.out + static_cast<int64_t>(b) * a.T * a.row;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int j = j0 + w0 + r;
    if (j >= a.T) continue;
    T* dkr = dbase + static_cast<int64_t>(j) * a.row + static_cast<int64_t>(a.NH + kvh) * a.HS;
    T* dvr = dkr + static_cast<int64_t>(a.NKV) * a.HS;
#pragma unroll
    for (int cx = 0; cx < NX; ++cx) {
      const int x = lane + 32 * cx;
      if (x < a.HS) {
        st(dkr + x, dk[r][cx] * a.scale);
        st(dvr + x, dv[r][cx]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, dQ. grid (query tiles, NH, B); shared: Q, dO (32 x HSP, broadcast), K, V (32 x HSP+1).
// ---------------------------------------------------------------------------------------------
template <typename T, int NX>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_generic_kernel(GenericArgs<T> a) {
  constexpr int HSP = 32 * NX, KP = HSP + 1;
  extern __shared__ float smem_dq[];
  float* s_q = smem_dq;
  float* s_do = s_q + 32 * HSP;
  float* s_k = s_do + 32 * HSP;
  float* s_v = s_k + 32 * KP;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / a.group, i0 = qb * 32, w0 = warp * kRows;
  const T* base = a.qkv + static_cast<int64_t>(b) * a.T * a.row;
  const T* k = base + static_cast<int64_t>(a.NH + kvh) * a.HS;
  const T* v = base + static_cast<int64_t>(a.NH + a.NKV + kvh) * a.HS;
  load_rows(s_q, HSP, HSP, base + static_cast<int64_t>(h) * a.HS, a.row, i0, a.T, a.HS, 1.0f);
  load_rows(s_do, HSP, HSP,
            a.dout + static_cast<int64_t>(b) * a.T * a.orow + static_cast<int64_t>(h) * a.HS,
            a.orow, i0, a.T, a.HS, 1.0f);
  const int64_t bh = (static_cast<int64_t>(b) * a.NH + h) * a.T;
  float lse2[kRows], drow[kRows], dq[kRows][NX];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = i0 + w0 + r;
    lse2[r] = i < a.T ? a.lse_in[bh + i] * kLog2e : 0.0f;
    drow[r] = i < a.T ? a.d_rows[bh + i] : 0.0f;
#pragma unroll
    for (int cx = 0; cx < NX; ++cx) dq[r][cx] = 0.0f;
  }
  for (int kc = 0; kc <= qb; ++kc) {
    const int j = kc * 32 + lane;
    __syncthreads();
    load_rows(s_k, KP, HSP, k, a.row, kc * 32, a.T, a.HS, 1.0f);
    load_rows(s_v, KP, HSP, v, a.row, kc * 32, a.T, a.HS, 1.0f);
    __syncthreads();
    // Lane = key j: s[r] = q_r . k_j, dp[r] = dO_r . v_j.
    float s[kRows] = {}, dp[kRows] = {};
#pragma unroll 8
    for (int x = 0; x < HSP; ++x) {
      const float kx = s_k[lane * KP + x], vx = s_v[lane * KP + x];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s[r] += s_q[(w0 + r) * HSP + x] * kx;
        dp[r] += s_do[(w0 + r) * HSP + x] * vx;
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = i0 + w0 + r;
      const float p = j <= i && i < a.T ? exp2f(s[r] * a.scale_log2 - lse2[r]) : 0.0f;
      s[r] = p * (dp[r] - drow[r]);  // dS
    }
    for (int jj = 0; jj < 32; ++jj) {
      float ds[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) ds[r] = __shfl_sync(kFullMask, s[r], jj);
#pragma unroll
      for (int cx = 0; cx < NX; ++cx) {
        const float kx = s_k[jj * KP + lane + 32 * cx];
#pragma unroll
        for (int r = 0; r < kRows; ++r) dq[r][cx] += ds[r] * kx;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = i0 + w0 + r;
    if (i >= a.T) continue;
    T* dqr = a.out + (static_cast<int64_t>(b) * a.T + i) * a.row + static_cast<int64_t>(h) * a.HS;
#pragma unroll
    for (int cx = 0; cx < NX; ++cx)
      if (lane + 32 * cx < a.HS) st(dqr + lane + 32 * cx, dq[r][cx] * a.scale);
  }
}

// D[(b NH + h) T + t] = dO . O of one (token, head) row per warp.
template <typename T>
__global__ void row_dots_kernel(float* d_rows, const T* dout, const T* out, int64_t rows, int T_,
                                int NH, int HS) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       w < rows; w += warps) {
    const T* o = out + w * HS;
    const T* d = dout + w * HS;
    float acc = 0.0f;
    for (int x = lane; x < HS; x += 32) acc += ld(d + x) * ld(o + x);
    acc = warp_sum(acc);
    if (lane == 0) {
      const int64_t h = w % NH, bt = w / NH, t = bt % T_, b = bt / T_;
      d_rows[(b * NH + h) * T_ + t] = acc;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <typename T>
GenericArgs<T> make_args(const Dims& d) {
  GenericArgs<T> a{};
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

// Dynamic shared memory above 48 KiB must be opted into per kernel.
template <typename K>
void allow_smem(K kernel, int bytes) {
  if (bytes > 48 * 1024)
    TETRA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

dim3 grid_of(const Dims& d, int64_t heads) {
  TETRA_CHECK(heads <= 65535 && d.B <= 65535 && d.T <= (int64_t{1} << 30),
              "attention: grid limits exceeded (B={} heads={} T={}; at most 65535, 65535, 2^30)",
              d.B, heads, d.T);
  return dim3(static_cast<unsigned>((d.T + 31) / 32), static_cast<unsigned>(heads),
              static_cast<unsigned>(d.B));
}

template <typename T, int NX>
void launch_forward(const GenericArgs<T>& a, const Dims& d, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<NX>();
  allow_smem(flash_fwd_generic_kernel<T, NX>, smem);
  flash_fwd_generic_kernel<T, NX><<<grid_of(d, d.NH), kThreads, smem, stream>>>(a);
  TETRA_CUDA_LAUNCHED();
}

template <typename T, int NX>
void launch_backward(const GenericArgs<T>& a, const Dims& d, cudaStream_t stream) {
  constexpr int smem = bwd_smem_bytes<NX>();  // the dQ kernel needs slightly less
  allow_smem(flash_bwd_dkdv_generic_kernel<T, NX>, smem);
  allow_smem(flash_bwd_dq_generic_kernel<T, NX>, smem);
  flash_bwd_dkdv_generic_kernel<T, NX><<<grid_of(d, d.NKV), kThreads, smem, stream>>>(a);
  TETRA_CUDA_LAUNCHED();
  flash_bwd_dq_generic_kernel<T, NX><<<grid_of(d, d.NH), kThreads, smem, stream>>>(a);
  TETRA_CUDA_LAUNCHED();
}

// Calls launch<NX>() with NX = ceil(HS / 32), 1..8.
#define TETRA_WITH_NX(HS, CALL)                                                  \
  switch ((HS + 31) / 32) {                                                      \
    case 1: { constexpr int NX = 1; CALL; } break;                               \
    case 2: { constexpr int NX = 2; CALL; } break;                               \
    case 3: { constexpr int NX = 3; CALL; } break;                               \
    case 4: { constexpr int NX = 4; CALL; } break;                               \
    case 5: { constexpr int NX = 5; CALL; } break;                               \
    case 6: { constexpr int NX = 6; CALL; } break;                               \
    case 7: { constexpr int NX = 7; CALL; } break;                               \
    default: { constexpr int NX = 8; CALL; } break;                              \
  }

}  // namespace

template <typename T>
void flash_generic_forward(const Dims& d, T* out, float* lse, const T* qkv, cudaStream_t stream) {
  TETRA_CHECK(d.HS <= kMaxFusedHeadSize, "attention_forward: head size {} above the {} supported",
              d.HS, kMaxFusedHeadSize);
  GenericArgs<T> a = make_args<T>(d);
  a.qkv = qkv;
  a.out = out;
  a.lse = lse;
  TETRA_WITH_NX(d.HS, (launch_forward<T, NX>(a, d, stream)))
}

template <typename T>
void flash_generic_backward(const Dims& d, T* dqkv, const T* dout, const T* qkv,
                            const float* lse, const float* d_rows, cudaStream_t stream) {
  TETRA_CHECK(d.HS <= kMaxFusedHeadSize, "attention_backward: head size {} above the {} supported",
              d.HS, kMaxFusedHeadSize);
  GenericArgs<T> a = make_args<T>(d);
  a.qkv = qkv;
  a.dout = dout;
  a.out = dqkv;
  a.lse_in = lse;
  a.d_rows = d_rows;
  TETRA_WITH_NX(d.HS, (launch_backward<T, NX>(a, d, stream)))
}

template <typename T>
void attention_row_dots(const Dims& d, float* d_rows, const T* dout, const T* out,
                        cudaStream_t stream) {
  const int64_t rows = d.B * d.T * d.NH;
  row_dots_kernel<T><<<grid_for(rows * 32, 256), 256, 0, stream>>>(
      d_rows, dout, out, rows, static_cast<int>(d.T), static_cast<int>(d.NH),
      static_cast<int>(d.HS));
  TETRA_CUDA_LAUNCHED();
}

#define TETRA_INSTANTIATE(T)                                                                    \
  template void flash_generic_forward<T>(const Dims&, T*, float*, const T*, cudaStream_t);      \
  template void flash_generic_backward<T>(const Dims&, T*, const T*, const T*, const float*,    \
                                          const float*, cudaStream_t);                          \
  template void attention_row_dots<T>(const Dims&, float*, const T*, const T*, cudaStream_t);
TETRA_INSTANTIATE(float)
TETRA_INSTANTIATE(bf16_t)
TETRA_INSTANTIATE(f16_t)
#undef TETRA_INSTANTIATE
#undef TETRA_WITH_NX

}  // namespace tetra::cuda::attn
