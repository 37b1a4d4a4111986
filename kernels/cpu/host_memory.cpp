// Host memory of the CPU backend: see host_memory.h.
#include "kernels/cpu/host_memory.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "trainer/core/check.h"

namespace tetra::cpu {

namespace {
constexpr size_t kLine = 64;
size_t round_up_bytes(size_t x, size_t m) { return (x + m - 1) / m * m; }
}  // namespace

void* host_alloc(size_t bytes, const char* what) {
  // aligned_alloc wants a size that is a multiple of the alignment.
  const bool huge = bytes >= kHugeBytes;
  const size_t align = huge ? kHugePageBytes : kLine;
  TETRA_CHECK(bytes <= SIZE_MAX - align, "cpu: {} bytes of host memory requested for {}: more than "
              "the address space holds", bytes, what);
  const size_t rounded = std::max(round_up_bytes(bytes, align), align);
  void* ptr = std::aligned_alloc(align, rounded);
  TETRA_CHECK(ptr != nullptr, "cpu: allocating {} bytes of host memory for {} failed (out of memory)",
              bytes, what);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice only: where THP is off, absent or out of huge pages the block keeps 4 KiB pages, which
  // is correct, just slower; so the result is not checked.
  if (huge) (void)madvise(ptr, rounded, MADV_HUGEPAGE);
#endif
  return ptr;
}

void host_free(void* ptr) { std::free(ptr); }

}  // namespace tetra::cpu
