// Small text formatting helpers for user-facing summaries.
#pragma once

#include <cstdint>
#include <string>

namespace tetra {

// 1234567 -> "1,234,567"
inline std::string grouped(int64_t n) {
  const std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

}  // namespace tetra
