"""Which OpenBLAS kernel a benchmark's BLAS-backed peer runs, and why.

An OpenBLAS built for many CPUs (DYNAMIC_ARCH, as Debian's is) picks one kernel set, its "core",
when it loads, and with OPENBLAS_VERBOSE=2 names it on stderr ("Core: SkylakeX"). On a CPU missing
from its tables it can fall back to a generic kernel: Debian's 0.3.21 sends every Intel family-6
model it does not know (Emerald Rapids, model 207, is one) to the SSE3 Prescott kernel, and there a
GPT-2 124M step (B=4, T=64, fp32, 2 threads) took 7.5 s against 2.6 s with SkylakeX. A ratio against
that peer would flatter Tetra, so the rule for every published ratio is:

- The kernel OpenBLAS picked uses the widest vector ISA this CPU has (AVX-512, else AVX2; or the
  CPU has neither): keep it. That is OpenBLAS's own choice, and on a CPU it knows it is the right
  one.
- It picked a narrower kernel (Prescott, Nehalem, Sandybridge, ...; or Haswell on an AVX-512 CPU):
  time the peer briefly under its own choice and under each named kernel for the CPU's ISA
  (Cooperlake, SkylakeX, Haswell on AVX-512; Haswell, Zen on AVX2) and keep the fastest.

Each name is first checked with a cheap probe (load libblas.so.3 with OPENBLAS_CORETYPE set and
read the core it reports): 0.3.21 cannot force "Cooperlake" by name (its lookup stops one entry
short: "Core not found: Cooperlake") and then falls back to autodetection, and a build without a
kernel does the same, so a trial is keyed by the core that really ran, and two names that end on
one core are timed once.

Usage (under the environment the peer will run in; the peer's OPENBLAS_CORETYPE is unset):
    python3 tools/openblas_kernel.py [--try "SkylakeX Haswell"] [--rounds 1] -- TRIAL_CMD...
TRIAL_CMD is a short run of the peer whose last stdout line is JSON with "ms_all" (each timed
step's ms; tools/bench_torch_gpt.py with few steps): a trial's time is its fastest step, and with
--rounds above 1 the median of the rounds'. Progress goes to stderr; stdout gets one JSON line:
{"coretype": name to set as OPENBLAS_CORETYPE, or null to leave it unset, "core": the core the
peer will run, "auto_core", "cpu", "isa", "reason", "trials": [{"asked", "core", "ms"}]}.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

# The vector ISA each x86 core's kernels are written for (OpenBLAS's corename table, 0.3.21 and
# later). A core missing here counts as generic.
ISA_LEVEL = {"sse": 0, "avx": 1, "avx2": 2, "avx512": 3}
CORE_ISA = {
    "SapphireRapids": "avx512", "Cooperlake": "avx512", "SkylakeX": "avx512",
    "Haswell": "avx2", "Zen": "avx2",
    "Sandybridge": "avx", "Bulldozer": "avx", "Piledriver": "avx", "Steamroller": "avx",
    "Excavator": "avx",
}
# The named kernels worth a trial on a CPU whose widest ISA is the key, best first.
NAMED_KERNELS = {
    "avx512_bf16": ["Cooperlake", "SkylakeX", "Haswell"],
    "avx512": ["SkylakeX", "Haswell"],
    "avx2": ["Haswell", "Zen"],
}
# Loads the BLAS the peer links (torch links libblas.so.3), so OpenBLAS reports its core.
PROBE = [sys.executable, "-c", "import ctypes; ctypes.CDLL('libblas.so.3')"]


def reported_core(stderr_text):
    """The core OpenBLAS reported with OPENBLAS_VERBOSE=2 (its last "Core: X" line), or None when
    there is none (the BLAS is not OpenBLAS, or not one built for several CPUs)."""
    cores = re.findall(r"^Core: (\S+)\s*$", stderr_text, flags=re.MULTILINE)
    return cores[-1] if cores else None


def cpu_isa(flags):
    """The widest vector ISA OpenBLAS kernels can use on a CPU with these /proc/cpuinfo flags:
    "avx512_bf16", "avx512" (F, BW, DQ and VL: what the SkylakeX kernels need), "avx2" (with FMA)
    or None (anything else, non-x86 included)."""
    flags = set(flags)
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def kernels_to_try(core, isa):
    """The named kernels to time against OpenBLAS's own choice `core` on a CPU of ISA `isa`
    (cpu_isa's answer): none when core already uses the CPU's widest ISA, when the CPU has neither
    AVX-512 nor AVX2, or when the BLAS reported no core."""
    if core is None or isa is None:
        return []
    cpu_level = ISA_LEVEL["avx512" if isa.startswith("avx512") else isa]
    if ISA_LEVEL[CORE_ISA.get(core, "sse")] >= cpu_level:
        return []
    return [k for k in NAMED_KERNELS[isa] if k.lower() != core.lower()]


def choose(auto_core, trials):
    """The trial to keep: the fastest of those that ran (ms not None); OpenBLAS's own choice (asked
    None) on a tie. trials: [{"asked": name or None, "core": reported core, "ms": ms or None}].
    Returns (coretype, core): coretype None means leave OPENBLAS_CORETYPE unset."""
    ran = [t for t in trials if t["ms"] is not None]
    if not ran:
        return None, auto_core
    best = min(ran, key=lambda t: (t["ms"], t["asked"] is not None))
    return best["asked"], best["core"]


def cpu_description(cpuinfo_text):
    """vendor, family, model and model name of the first CPU in /proc/cpuinfo's text."""
    fields = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return (f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} ({fields.get('model name', '?')})"), \
        fields.get("flags", "").split()


def run_env(coretype):
    env = dict(os.environ, OPENBLAS_VERBOSE="2")
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


def probe_core(coretype):
    out = subprocess.run(PROBE, env=run_env(coretype), capture_output=True, text=True)
    return reported_core(out.stderr)


def time_trial(cmd, coretype):
    """ms of the trial run's fastest step, and the core it reported; ms None when it failed."""
    out = subprocess.run(cmd, env=run_env(coretype), capture_output=True, text=True)
    core = reported_core(out.stderr)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        print(f"openblas_kernel: trial with OPENBLAS_CORETYPE={coretype} failed "
              f"(exit {out.returncode}): {tail[0]}", file=sys.stderr)
        return None, core
    # The fastest step: on a shared machine a burst of load slows some steps, never speeds one.
    run = json.loads(out.stdout.strip().splitlines()[-1])
    return min(run.get("ms_all") or [run["ms_per_step"]]), core


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--try", dest="try_kernels", default="",
                    help="named kernels to time besides OpenBLAS's own choice, whatever it is")
    ap.add_argument("--rounds", type=int, default=1, help="trials per kernel, alternating")
    ap.add_argument("--cpuinfo", default="/proc/cpuinfo")
    ap.add_argument("trial", nargs=argparse.REMAINDER, help="-- TRIAL_CMD...")
    args = ap.parse_args()
    trial_cmd = args.trial[1:] if args.trial[:1] == ["--"] else args.trial
    if not trial_cmd:
        ap.error("no trial command after --")

    with open(args.cpuinfo) as f:
        cpu, flags = cpu_description(f.read())
    isa = cpu_isa(flags)
    auto_core = probe_core(None)
    forced = args.try_kernels.split()
    names = forced or kernels_to_try(auto_core, isa)
    result = {"coretype": None, "core": auto_core, "auto_core": auto_core, "cpu": cpu, "isa": isa,
              "trials": []}
    if auto_core is None:
        result["reason"] = "the BLAS reported no OpenBLAS core (not OpenBLAS): nothing to choose"
    elif not names:
        result["reason"] = (f"OpenBLAS chose {auto_core} itself, a kernel for this CPU's widest ISA "
                            f"({isa or 'neither AVX-512 nor AVX2'}): kept")
    else:
        # One trial per distinct core: OpenBLAS's own choice first, then each name that really
        # ends on another core.
        asked = {auto_core: None}
        for name in names:
            core = probe_core(name)
            if core is None:
                print(f"openblas_kernel: OPENBLAS_CORETYPE={name} reported no core; skipped",
                      file=sys.stderr)
            elif core not in asked:
                asked[core] = name
            else:
                print(f"openblas_kernel: OPENBLAS_CORETYPE={name} runs {core}, already tried",
                      file=sys.stderr)
        times = {core: [] for core in asked}
        for _ in range(args.rounds):
            for core, name in asked.items():
                ms, ran = time_trial(trial_cmd, name)
                if ran is not None and ran != core:
                    print(f"openblas_kernel: asked for {core}, the run reported {ran}; dropped",
                          file=sys.stderr)
                    ms = None
                print(f"openblas_kernel: {core} (OPENBLAS_CORETYPE={name if name else 'unset'}): "
                      + (f"{ms:.0f} ms, fastest step" if ms is not None else "failed"), file=sys.stderr)
                if ms is not None:
                    times[core].append(ms)
        result["trials"] = [{"asked": name, "core": core,
                             "ms": statistics.median(times[core]) if times[core] else None}
                            for core, name in asked.items()]
        result["coretype"], result["core"] = choose(auto_core, result["trials"])
        why = (f"OpenBLAS chose {auto_core}; {' '.join(forced)} tried on request" if forced
               else f"OpenBLAS chose {auto_core}, narrower than this CPU's {isa}")
        timed = ", ".join(f"{t['core']} {t['ms']:.0f} ms" if t["ms"] is not None
                          else f"{t['core']} failed" for t in result["trials"])
        result["reason"] = f"{why}; fastest steps {timed}: {result['core']} kept"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
