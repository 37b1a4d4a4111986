// Where each head's vectors lie in the attention ops' tensors (the layout of kernels/backend.h):
// qkv (B, T, (NH + 2 NKV) HS) holds per token NH query heads, then NKV key heads, then NKV value
// heads; out (B, T, NH HS). Shared by the CPU attention kernels (attention.cpp, attention_amx.cpp).
#pragma once

#include <cstdint>

namespace tetra::cpu {

struct QkvLayout {
  int64_t B, T, NH, NKV, HS;
  int64_t row;  // elements per token in qkv: (NH + 2 * NKV) * HS
  // Offsets of head h's (kv head kvh's) vector at token t of batch b.
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * row + h * HS; }
  int64_t k_at(int64_t b, int64_t t, int64_t kvh) const {
    return (b * T + t) * row + (NH + kvh) * HS;
  }
  int64_t v_at(int64_t b, int64_t t, int64_t kvh) const {
    return (b * T + t) * row + (NH + NKV + kvh) * HS;
  }
  int64_t o_at(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * NH * HS + h * HS; }
};

inline QkvLayout qkv_layout(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  return QkvLayout{B, T, NH, NKV, HS, (NH + 2 * NKV) * HS};
}

}  // namespace tetra::cpu
