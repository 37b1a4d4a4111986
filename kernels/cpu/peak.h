// The machine's arithmetic ceiling, measured: the denominator of MFU on the CPU backend.
#pragma once

namespace tetra {

// GFLOP/s of a tight fused-multiply-add loop over independent accumulators on `threads` threads
// (each FMA = 2 FLOPs), the best of several ~5 ms trials. With `bf16`: on CPUs with AMX-BF16 (where
// oneDNN's bf16 matmuls run on the tile unit) the rate of a loop of AMX tile dot products; else
// the rate of the AVX512-BF16 dot-product instruction (vdpbf16ps); else the fp32 rate.
double measure_cpu_peak_gflops(int threads, bool bf16);

}  // namespace tetra
