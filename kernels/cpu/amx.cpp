// AMX availability: see amx.h.
#include "kernels/cpu/amx.h"

#if defined(TETRA_AMX_COMPILED)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tetra::cpu {

namespace {

// CPUID.(7,0):EDX bits 24 (AMX-TILE) and 22 (AMX-BF16), then Linux's grant of the tile data
// state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool detect_amx() {
#if defined(TETRA_AMX_COMPILED)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
  if (!tile || !bf16) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

bool amx_available() {
  static const bool available = detect_amx();
  return available;
}

}  // namespace tetra::cpu
