"""tools/openblas_kernel.py's choice of the benchmark peer's OpenBLAS kernel, on canned
OPENBLAS_VERBOSE=2 output and /proc/cpuinfo flags (nothing is run or timed).

Usage: python3 tests/tools/test_openblas_kernel.py --root <source dir>
"""
import argparse
import importlib.util
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--root", required=True)
spec = importlib.util.spec_from_file_location("openblas_kernel",
                                              f"{ap.parse_args().root}/tools/openblas_kernel.py")
ok = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ok)

failures = []


def check(what, got, want):
    if got != want:
        failures.append(f"{what}: got {got!r}, want {want!r}")


# OPENBLAS_VERBOSE=2 output: the last "Core:" line is the core that runs. 0.3.21 cannot force
# Cooperlake by name and says so before autodetecting; other libraries print nothing.
check("plain", ok.reported_core("Core: SkylakeX\n"), "SkylakeX")
check("forced name unknown", ok.reported_core("Core not found: Cooperlake\nCore: Cooperlake\n"),
      "Cooperlake")
check("bogus name, autodetected", ok.reported_core("Core not found: Bogus\nCore: Prescott\n"),
      "Prescott")
check("among other stderr", ok.reported_core("warning: x\nCore: Haswell\nTraceback\n"), "Haswell")
check("reference BLAS", ok.reported_core(""), None)
check("not a Core line", ok.reported_core("Core not found: Zen\n"), None)

# /proc/cpuinfo flags (abridged) of the CPUs that matter.
base = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c".split()
avx2 = base + ["avx2", "fma", "bmi2"]
avx512 = avx2 + ["avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"]
emerald_rapids = avx512 + ["avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]
zen5 = avx512 + ["avx512_bf16", "avx512_vnni", "avx512vbmi"]
knights_landing = avx2 + ["avx512f", "avx512cd", "avx512er", "avx512pf"]  # no BW/DQ/VL
check("isa Emerald Rapids", ok.cpu_isa(emerald_rapids), "avx512_bf16")
check("isa Zen 5", ok.cpu_isa(zen5), "avx512_bf16")
check("isa Skylake-SP", ok.cpu_isa(avx512), "avx512")
check("isa AVX2", ok.cpu_isa(avx2), "avx2")
check("isa AVX-512F without BW/DQ/VL", ok.cpu_isa(knights_landing), "avx2")
check("isa AVX only", ok.cpu_isa(base), None)
check("isa arm", ok.cpu_isa("fp asimd evtstrm aes pmull sha1 sha2 crc32".split()), None)

# OpenBLAS's own choice is kept when it uses the CPU's widest ISA (a CPU it knows).
check("Zen 5, Cooperlake picked", ok.kernels_to_try("Cooperlake", "avx512_bf16"), [])
check("Sapphire Rapids", ok.kernels_to_try("Cooperlake", "avx512_bf16"), [])
check("Skylake-SP", ok.kernels_to_try("SkylakeX", "avx512"), [])
check("AVX2 CPU, Haswell", ok.kernels_to_try("Haswell", "avx2"), [])
check("Zen 2, Zen", ok.kernels_to_try("Zen", "avx2"), [])
check("AVX-only CPU, Sandybridge", ok.kernels_to_try("Sandybridge", None), [])
check("no OpenBLAS", ok.kernels_to_try(None, "avx512_bf16"), [])
# A generic (narrower) kernel on an AVX-512 or AVX2 CPU: the named kernels for its ISA.
check("Emerald Rapids, Prescott", ok.kernels_to_try("Prescott", "avx512_bf16"),
      ["Cooperlake", "SkylakeX", "Haswell"])
check("AVX-512 CPU, Nehalem", ok.kernels_to_try("Nehalem", "avx512"), ["SkylakeX", "Haswell"])
check("AVX-512 CPU, Haswell", ok.kernels_to_try("Haswell", "avx512"), ["SkylakeX"])
check("AVX2 CPU, Sandybridge", ok.kernels_to_try("Sandybridge", "avx2"), ["Haswell", "Zen"])
check("unknown core name counts as generic", ok.kernels_to_try("Unknown", "avx2"),
      ["Haswell", "Zen"])

# The fastest trial that ran wins; a failed trial (ms None) never does; on a tie OpenBLAS's own.
emr = [{"asked": None, "core": "Prescott", "ms": 7500.0},
       {"asked": "Cooperlake", "core": "Cooperlake", "ms": 2800.0},
       {"asked": "SkylakeX", "core": "SkylakeX", "ms": 2600.0},
       {"asked": "Haswell", "core": "Haswell", "ms": 4000.0}]
check("Emerald Rapids trials", ok.choose("Prescott", emr), ("SkylakeX", "SkylakeX"))
check("own choice fastest", ok.choose("Prescott", [dict(emr[0], ms=1000.0)] + emr[1:]),
      (None, "Prescott"))
check("tie keeps own choice", ok.choose("Haswell", [{"asked": None, "core": "Haswell", "ms": 5.0},
                                                    {"asked": "SkylakeX", "core": "SkylakeX",
                                                     "ms": 5.0}]), (None, "Haswell"))
check("failed trial skipped", ok.choose("Prescott", [emr[0], dict(emr[2], ms=None), emr[3]]),
      ("Haswell", "Haswell"))
check("all failed", ok.choose("Prescott", [dict(t, ms=None) for t in emr]), (None, "Prescott"))

cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
           "model name\t: INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz\nflags\t\t: fpu avx2 fma\n"
           "\nprocessor\t: 1\nvendor_id\t: Other\n")
check("cpu description", ok.cpu_description(cpuinfo),
      ("GenuineIntel family 6 model 207 (INTEL(R) XEON(R) PLATINUM 8581C CPU @ 2.10GHz)",
       ["fpu", "avx2", "fma"]))

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("openblas_kernel: all checks passed")
