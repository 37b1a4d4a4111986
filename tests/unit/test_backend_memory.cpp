// The CPU backend's memory ops: alignment, and large fills and copies split over threads, at
// sizes that do not divide evenly into the threads' chunks.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

using namespace tetra;

TEST_CASE("cpu backend: aligned alloc, zero-fill and copy of every size", "[backend]") {
  for (int threads : {1, 2, 3, 6}) {
    auto be = make_cpu_backend(threads);
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{4097}, (size_t{1} << 20) - 1,
                         (size_t{1} << 20) + 1, (size_t{1} << 20) + 7,
                         size_t{3} * (size_t{1} << 20) + 12345, size_t{64} * (6 * 4096 + 1) + 64 * 6 + 1}) {
      INFO("threads " << threads << ", bytes " << bytes);
      auto* a = static_cast<uint8_t*>(be->alloc(bytes + 2));
      auto* b = static_cast<uint8_t*>(be->alloc(bytes + 2));
      CHECK(reinterpret_cast<uintptr_t>(a) % 64 == 0);
      for (size_t i = 0; i < bytes + 2; ++i) {
        a[i] = static_cast<uint8_t>(i * 31 + 7);
        b[i] = 0xAB;
      }
      // Zero [1, 1 + bytes): the bytes around it must be untouched.
      be->memset_zero(a + 1, bytes);
      size_t wrong = 0;
      for (size_t i = 1; i < bytes + 1; ++i) wrong += a[i] != 0;
      CHECK(wrong == 0);
      CHECK(a[0] == 7);
      CHECK(a[bytes + 1] == static_cast<uint8_t>((bytes + 1) * 31 + 7));
      for (size_t i = 0; i < bytes + 2; ++i) a[i] = static_cast<uint8_t>(i * 13 + 1);
      be->copy(b + 1, a + 1, bytes);
      wrong = 0;
      for (size_t i = 1; i < bytes + 1; ++i) wrong += b[i] != a[i];
      CHECK(wrong == 0);
      CHECK(b[0] == 0xAB);
      CHECK(b[bytes + 1] == 0xAB);
      be->free(a);
      be->free(b);
    }
  }
}
