// The machine's arithmetic ceiling, measured: the denominator of MFU on the CPU backend.
#pragma once

namespace tetra {

// GFLOP/s of `threads` cores: one core's best rate over several ~3 ms trials of a tight
// fused-multiply-add loop over independent accumulators (each FMA = 2 FLOPs), times `threads`
// (one thread per physical core is assumed: SMT siblings share the FMA units). With `bf16`: on CPUs with AMX-BF16 (where
// oneDNN's bf16 matmuls run on the tile unit) the rate of a loop of AMX tile dot products; else
// the rate of the AVX512-BF16 dot-product instruction (vdpbf16ps); else the fp32 rate.
double measure_cpu_peak_gflops(int threads, bool bf16);

}  // namespace tetra
