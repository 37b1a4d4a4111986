// The machine's arithmetic ceiling, measured: the denominator of MFU on the CPU backend.
#pragma once

namespace tetra {

// GFLOP/s of a tight fused-multiply-add loop over independent accumulators on `threads` threads
// (each FMA = 2 FLOPs), the best of several ~5 ms trials. With `bf16`, the rate of the bf16 dot-product
// instruction (vdpbf16ps: 2 FMAs per fp32 lane) where the CPU has AVX512-BF16, else the fp32 rate.
double measure_cpu_peak_gflops(int threads, bool bf16);

}  // namespace tetra
