// Host memory of the CPU backend: see host_memory.h.
#include "kernels/cpu/host_memory.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra::cpu {

namespace {
constexpr size_t kLine = 64;
}  // namespace

void* host_alloc(size_t bytes, const char* what) {
  // aligned_alloc wants a size that is a multiple of the alignment.
  const bool huge = bytes >= kHugeBytes;
  const size_t align = huge ? kHugePageBytes : kLine;
  TETRA_CHECK(bytes <= SIZE_MAX - align, "cpu: {} bytes of host memory requested for {}: more than "
              "the address space holds", bytes, what);
  const size_t rounded = std::max(math::round_up(bytes, align), align);
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

std::string describe_huge_pages(const std::string& thp_enabled, const std::string& smaps_rollup) {
  // "always [madvise] never": the bracketed word is the mode in force.
  std::string mode;
  const size_t open = thp_enabled.find('['), close = thp_enabled.find(']', open);
  if (open != std::string::npos && close != std::string::npos)
    mode = thp_enabled.substr(open + 1, close - open - 1);
  if (mode.empty() || mode == "never") {
    return fmt::format(
        "host memory on 4 KiB pages: transparent huge pages are {} here; with 'madvise' (or "
        "'always') in /sys/kernel/mm/transparent_hugepage/enabled the large buffers would sit on "
        "2 MiB pages (GPT-2 124M bf16 steps ~8% faster)",
        mode.empty() ? "not available" : "off ('never')");
  }
  long long huge_kb = -1;
  const size_t at = smaps_rollup.find("AnonHugePages:");
  if (at != std::string::npos) huge_kb = std::atoll(smaps_rollup.c_str() + at + 14);
  if (huge_kb < 0) return fmt::format("host memory: transparent huge pages {}", mode);
  return fmt::format("host memory: {} MiB of the process on 2 MiB pages (transparent huge pages: {})",
                     huge_kb / 1024, mode);
}

std::string huge_page_report() {
  auto slurp = [](const char* path) {
    std::ifstream in(path);
    std::stringstream text;
    if (in) text << in.rdbuf();
    return text.str();
  };
  return describe_huge_pages(slurp("/sys/kernel/mm/transparent_hugepage/enabled"),
                             slurp("/proc/self/smaps_rollup"));
}

}  // namespace tetra::cpu
