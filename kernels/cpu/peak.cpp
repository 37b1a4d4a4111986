#include "kernels/cpu/peak.h"

#include <omp.h>

#include <chrono>

#if defined(__AVX512F__)
#include <immintrin.h>
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

}  // namespace

double measure_cpu_peak_gflops(int threads, bool bf16) {
  // The best of several short trials: a trial that shares a core with another process runs slow,
  // and the ceiling is the fastest the hardware went.
  const long iters = 40000;
  fma_loop(iters, bf16);  // warm up clocks
  double best = 0.0;
  for (int trial = 0; trial < 8; ++trial) {
    double flops = 0.0;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += fma_loop(iters, bf16);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (flops / seconds > best) best = flops / seconds;
  }
  return best / 1e9;
}

}  // namespace tetra
