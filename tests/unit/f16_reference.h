// An independent fp16 (IEEE binary16) reference for the tests, sharing nothing with
// kernels/common/math.h: each of the 65536 bit patterns' value from the format's definition
// (sign, 5-bit exponent with bias 15, 10-bit mantissa; ldexp in double), and fp32 -> fp16 by
// looking up the nearest value in the sorted table of finite fp16 values, exactly in double
// (fp32 and fp16 values, and their differences here, are exact in double), ties to the even bit
// pattern. Beyond 65504 the next value of the table would be 65536 (= 2^16), which is infinity:
// 65520, the midpoint, ties to that even pattern and so to infinity, as IEEE rounding says.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace tetra_test {

// The value of fp16 bit pattern h (NaN for the NaN patterns).
inline double f16_value_by_definition(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f)
    v = mant == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (exp == 0)
    v = std::ldexp(static_cast<double>(mant), -24);  // subnormal: mant * 2^-24
  else
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  return sign ? -v : v;
}

// The values of the patterns 0x0000 .. 0x7c00 (0x7c00, infinity, stands as 65536 for the search).
inline const std::vector<double>& f16_positive_table() {
  static const std::vector<double> table = [] {
    std::vector<double> t(0x7c01);
    for (uint32_t h = 0; h < 0x7c00; ++h) t[h] = f16_value_by_definition(static_cast<uint16_t>(h));
    t[0x7c00] = 65536.0;
    return t;
  }();
  return table;
}

// fp32 -> fp16 round to nearest, ties to even, for a non-NaN x.
inline uint16_t f16_round_by_search(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  const std::vector<double>& t = f16_positive_table();
  if (a >= 65536.0) return sign | 0x7c00;
  const size_t i = static_cast<size_t>(std::lower_bound(t.begin(), t.end(), a) - t.begin());
  if (t[i] == a) return static_cast<uint16_t>(sign | i);
  const size_t lo = i - 1, hi = i;  // t[lo] < a < t[hi]
  const double below = a - t[lo], above = t[hi] - a;
  size_t pick;
  if (below < above)
    pick = lo;
  else if (above < below)
    pick = hi;
  else
    pick = (lo % 2 == 0) ? lo : hi;
  return static_cast<uint16_t>(sign | pick);
}

}  // namespace tetra_test
