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

// `text` with control characters written as escapes ("\\u0000" for a NUL), so that a message
// quoting a user's key or value is printed whole (a C string ends at the first NUL) and cannot
// move the terminal's cursor. Newlines and tabs are kept.
inline std::string printable(const std::string& text) {
  static const char* const hex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) {
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace tetra
