#include "kernels/cpu/peak.h"


#include <chrono>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tetra {

namespace {

constexpr int kAccumulators = 12;  // enough independent chains to cover FMA latency x ports

#if defined(__AVX512F__)
// Stores the accumulators to memory the compiler must assume is read, so the loop is not removed.
void keep_alive(const __m512* acc) {
  alignas(64) float lanes[16];
  float sink = 0.0f;
  for (int i = 0; i < kAccumulators; ++i) {
    _mm512_store_ps(lanes, acc[i]);
    for (float x : lanes) sink += x;
  }
  volatile float keep = sink;
  (void)keep;
}
#endif

// Runs `iters` iterations of kAccumulators independent vector FMAs; returns FLOPs done.
double fma_loop(long iters, bool bf16) {
#if defined(__AVX512F__)
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(0.0f);
  const __m512 a = _mm512_set1_ps(1e-7f), b = _mm512_set1_ps(0.999f);
#if defined(__AVX512BF16__)
  if (bf16) {
    const __m512bh ah = (__m512bh)_mm512_set1_epi16(0x3f80), bh = (__m512bh)_mm512_set1_epi16(0x3380);
    for (long it = 0; it < iters; ++it)
      for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], ah, bh);
    keep_alive(acc);
    return static_cast<double>(iters) * kAccumulators * 16 * 4;  // 16 lanes x 2 FMAs x 2 FLOPs
  }
#endif
  (void)bf16;
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_fmadd_ps(acc[i], b, a);
  keep_alive(acc);
  return static_cast<double>(iters) * kAccumulators * 16 * 2;
#else
  // Portable fallback: the compiler vectorises this to the widest FMA it has.
  (void)bf16;
  float acc[kAccumulators * 8] = {};
  for (long it = 0; it < iters; ++it)
#pragma omp simd
    for (int i = 0; i < kAccumulators * 8; ++i) acc[i] = acc[i] * 0.999f + 1e-7f;
  float sink = 0.0f;
  for (float x : acc) sink += x;
  volatile float keep = sink;
  (void)keep;
  return static_cast<double>(iters) * kAccumulators * 8 * 2;
#endif
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// AMX: each _tile_dpbf16ps multiplies a (16 x 32) bf16 tile by a (32 x 16) one into a (16 x 16)
// fp32 tile: 16*16*32 FMAs = 16384 FLOPs. Four independent accumulator tiles keep the unit busy.
// Returns FLOPs done, or 0 when the kernel refuses this thread the AMX state.
double amx_loop(long iters) {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return 0.0;
  struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t a[16 * 32];
  for (uint16_t& x : a) x = 0x3c00;  // bf16 2^-7: small, no overflow over many iterations
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  for (long it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float keep = out[0];
  (void)keep;
  return static_cast<double>(iters) * 4 * 16384;
}
#endif

// One core's rate, the best of several short trials, times the number of threads (the cores are
// identical). Measuring one thread is what makes this robust: a parallel trial is as slow as its
// slowest thread, and on a shared machine one of them is often waiting for a core.
template <typename Loop>
double best_rate(int threads, Loop loop) {
  double best = 0.0;
  for (int trial = 0; trial < 10; ++trial) {
    auto t0 = std::chrono::steady_clock::now();
    const double flops = loop();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (flops / seconds > best) best = flops / seconds;
  }
  return best * threads / 1e9;
}

}  // namespace

double measure_cpu_peak_gflops(int threads, bool bf16) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  // oneDNN runs bf16 matmuls on AMX where the CPU has it: that unit is the ceiling then.
  // amx_loop asks the kernel for the AMX state first and returns 0 where the CPU has none.
  if (bf16) {
    const double amx = best_rate(threads, [] { return amx_loop(100000); });
    if (amx > 0.0) return amx;
  }
#endif
  const long iters = 400000;
  fma_loop(iters, bf16);  // warm up clocks
  return best_rate(threads, [&] { return fma_loop(iters, bf16); });
}

}  // namespace tetra
