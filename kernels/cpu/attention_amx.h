// Causal attention in bf16 on AMX tiles: see attention_amx.cpp. The CPU backend's attention ops
// take this path for bf16 activations where amx_available() (the CPU has AMX-BF16 and
// the OS grants this process the tile state), and the fp32 flash kernels elsewhere.
#pragma once

#include <cstdint>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/scratch.h"
#include "kernels/common/dtype.h"

namespace tetra::cpu {

// The contracts of Backend::attention_forward / attention_backward (kernels/backend.h) for bf16,
// on at most `threads` threads, with the backend's scratch (which has a slot for each of them).
void amx_attention_forward(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t HS, int threads, CpuScratch& scratch);
void amx_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                            const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t HS, int threads, CpuScratch& scratch);

}  // namespace tetra::cpu
