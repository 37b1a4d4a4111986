// The CPU backend's memory ops: alignment, huge pages for large blocks, and large fills and copies
// split over threads, at sizes that do not divide evenly into the threads' chunks.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/host_memory.h"

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

namespace {

// The VmFlags line of the /proc/self/smaps mapping that holds p ("" where none does).
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < line.find(' ')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

}  // namespace

TEST_CASE("cpu backend: blocks of 4 MiB and more are 2 MiB aligned and advised onto huge pages",
          "[backend]") {
  auto be = make_cpu_backend(2);
  const size_t two_mib = size_t{2} << 20;
  for (size_t bytes : {(size_t{4} << 20), (size_t{4} << 20) + 1, (size_t{37} << 20) + 4097}) {
    INFO("bytes " << bytes);
    auto* p = static_cast<uint8_t*>(be->alloc(bytes));
    CHECK(reinterpret_cast<uintptr_t>(p) % two_mib == 0);
    be->memset_zero(p, bytes);  // every byte is usable
    p[bytes - 1] = 1;
    // Linux records the advice as the mapping's "hg" flag wherever THP is built into the kernel
    // (its sysfs directory exists), whatever mode THP is in.
    std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
    if (thp) {
      const std::string flags = vm_flags_of(p);
      INFO("smaps " << flags);
      CHECK(flags.find(" hg") != std::string::npos);
    } else {
      WARN("this kernel has no transparent huge pages: only the alignment is checked");
    }
    be->free(p);
  }
  // A size the address space cannot hold is an error, not a wrapped-around small block.
  CHECK_THROWS_WITH(be->alloc(SIZE_MAX - 5), Catch::Contains("more than the address space holds"));
  // Smaller blocks keep the cache-line alignment only.
  void* small = be->alloc((size_t{4} << 20) - 64);
  CHECK(reinterpret_cast<uintptr_t>(small) % 64 == 0);
  be->free(small);
}

TEST_CASE("cpu backend: the memory report reads the THP mode and the process's huge pages",
          "[backend]") {
  CHECK(cpu::describe_huge_pages("always [madvise] never\n",
                                 "Rss:  2900000 kB\nAnonHugePages:   2768896 kB\nShmemHugePages: 0 kB\n") ==
        "host memory: 2704 MiB of the process on 2 MiB pages (transparent huge pages: madvise)");
  CHECK(cpu::describe_huge_pages("[always] madvise never\n", "AnonHugePages: 0 kB\n") ==
        "host memory: 0 MiB of the process on 2 MiB pages (transparent huge pages: always)");
  CHECK_THAT(cpu::describe_huge_pages("always madvise [never]\n", "AnonHugePages: 0 kB\n"),
             Catch::StartsWith("host memory on 4 KiB pages: transparent huge pages are off ('never')") &&
                 Catch::Contains("/sys/kernel/mm/transparent_hugepage/enabled"));
  CHECK_THAT(cpu::describe_huge_pages("", ""),
             Catch::StartsWith("host memory on 4 KiB pages: transparent huge pages are not available"));
  CHECK(cpu::describe_huge_pages("always [madvise] never\n", "") ==
        "host memory: transparent huge pages madvise");
  // This process, read live.
  auto be = make_cpu_backend(1);
  CHECK_THAT(be->memory_report(), Catch::StartsWith("host memory"));
}
