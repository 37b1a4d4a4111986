// The pieces two byte-pair-encoding tokenizers share (tokenizer_gpt2.cpp, tokenizer_hf.cpp): the
// byte <-> character mapping of byte-level BPE, and the merge table.
//
// Byte-level BPE (OpenAI's GPT-2, and every Hugging Face tokenizer with a ByteLevel pre-tokenizer)
// shows each byte as a printable character so that vocabularies are text: printable Latin-1 bytes
// stand for themselves, the other 68 bytes for U+0100.. in byte order (bytes_to_unicode in OpenAI's
// encoder.py). The mapping is a bijection, so the tokenizers undo it once, at load, and run BPE on
// raw bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tetra {

// The character (code point) that stands for each byte.
inline std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> cp{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) cp[b] = printable[b] ? static_cast<uint32_t>(b) : 256 + n++;
  return cp;
}

// (left id, right id) -> (rank, merged id), open addressing with linear probing.
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t id;
  };

  void build(const std::vector<std::pair<uint64_t, Merge>>& entries) {
    size_t cap = 16;
    while (cap < entries.size() * 2) cap *= 2;
    shift_ = 64 - __builtin_ctzll(cap);
    keys_.assign(cap, kEmpty);
    values_.assign(cap, Merge{0, 0});
    for (const auto& [key, merge] : entries) {
      size_t i = slot(key);
      while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & (cap - 1);
      keys_[i] = key;  // a later duplicate overwrites, as Python's dict(zip(merges, ranks)) does
      values_[i] = merge;
    }
  }

  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t key = pack(left, right);
    for (size_t i = slot(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

  static uint64_t pack(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  size_t slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }

  std::vector<uint64_t> keys_{kEmpty, kEmpty};
  std::vector<Merge> values_{Merge{0, 0}, Merge{0, 0}};
  int shift_ = 63;
};

}  // namespace tetra
