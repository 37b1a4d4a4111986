#!/usr/bin/env bash
# Tetra against PyTorch on the CPU: one GPT-2 124M training step (forward + backward + AdamW),
# batch 4, T in {64, 256}, fp32 and bf16, 2 threads, side by side in one run (these shared machines
# drift ±20% between runs, so only figures from the same run compare).
#
# For each case it prints ms/step, tokens/s, the Tetra/torch tokens/s ratio, both GFLOP/s (FLOPs
# per token 6 N + 12 L T C, N = matmul parameters including the tied lm_head) as a share of the
# fp32 FMA ceiling measured here (an AVX-512 FMA loop on both threads; one yardstick for every
# row), and the peak RSS of each process (/usr/bin/time). The bf16 dot-product (vdpbf16ps)
# ceiling is printed too; on CPUs with AMX, oneDNN's bf16 GEMMs (torch's under autocast) can
# exceed both, and the header says when AMX is present.
#
# The torch peer is run at its best, as cpu-performance.md measured it: tcmalloc preloaded when
# installed (libtcmalloc-minimal4 or libgoogle-perftools4), OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE
# unset for it alone, and an optimised BLAS: Debian's torch calls whatever libblas.so.3 the
# alternatives system points to, and the reference (netlib) BLAS there is ~100x slower than
# OpenBLAS, so when it is the reference one an installed OpenBLAS is put first on the torch
# command's library path. The output says which allocator and BLAS torch really ran with.
#
# And the OpenBLAS kernel at its best (tools/openblas_kernel.py): OpenBLAS picks its kernel for
# the CPU when it loads, but on a CPU it does not know it can fall back to a generic one (Debian's
# 0.3.21 runs Prescott's SSE3 kernel on an Intel Emerald Rapids: 2.8x slower than SkylakeX on this
# benchmark's step). Where its own choice is narrower than the CPU's widest ISA (AVX-512, else
# AVX2), the peer is timed briefly (T=64 fp32, 1 warm-up + 2 steps) under its choice and under the
# named kernels for that ISA, and the fastest (by its fastest step) is kept; otherwise its own
# choice stands. The output says which kernel the peer ran, and why.
#
# Usage: scripts/bench_cpu.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_WARMUP
# (2), BENCH_STEPS (5 timed steps), BENCH_ROUNDS (2: Tetra and torch alternate this many times per
# case, so a burst of load on the machine hits both), BENCH_SEQ_LENS ("64 256"),
# BENCH_PRECISIONS ("fp32 bf16"),
# TCMALLOC (a libtcmalloc*.so to preload), TORCH_BLAS_DIR (a directory holding libblas.so.3),
# BENCH_OPENBLAS_TRY (named OpenBLAS kernels to time against OpenBLAS's own choice whatever that
# is, e.g. "SkylakeX Haswell"; the fastest is kept).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${TETRA_BUILD_DIR:-$REPO/build-release}
WARMUP=${BENCH_WARMUP:-2}
STEPS=${BENCH_STEPS:-5}
ROUNDS=${BENCH_ROUNDS:-2}
SEQ_LENS=${BENCH_SEQ_LENS:-"64 256"}
PRECISIONS=${BENCH_PRECISIONS:-"fp32 bf16"}
THREADS=2
BATCH=4
PY=/usr/bin/python3
LIBDIR=/usr/lib/$(uname -m)-linux-gnu
export OMP_NUM_THREADS=$THREADS

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tetra-bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ---- Tetra, Release ------------------------------------------------------------------------------
if [ -z "${TETRA_BIN:-}" ]; then
  if ! { [ -f "$BUILD/build.ninja" ] || cmake -S "$REPO" -B "$BUILD" -G Ninja \
           -DCMAKE_BUILD_TYPE=Release -DTETRA_CUDA=OFF; } >"$WORK/build.log" 2>&1 ||
     ! cmake --build "$BUILD" -j2 --target tetra >>"$WORK/build.log" 2>&1; then
    echo "bench_cpu: building tetra in $BUILD failed:" >&2
    tail -20 "$WORK/build.log" >&2
    exit 1
  fi
  TETRA_BIN=$BUILD/tetra
fi
[ -x "$TETRA_BIN" ] || { echo "bench_cpu: no tetra binary at $TETRA_BIN" >&2; exit 1; }

# ---- the FMA ceiling on this machine -------------------------------------------------------------
cat >"$WORK/ceiling.c" <<'EOF'
// Peak arithmetic of all threads: independent FMA chains (fp32) and bf16 dot products (vdpbf16ps,
// fp32 accumulate), enough chains to cover the FMA latency. Prints "fp32 GFLOPS bf16 GFLOPS".
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
#define CHAINS 12
#define ITERS 20000000L
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vec;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
static float SUM(__m256 v) { float f[8]; _mm256_storeu_ps(f, v); return f[0] + f[7]; }
#endif
static double run(int bf16) {
  double best = 0;
  float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = now();
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
      threads = omp_get_num_threads();
      vec acc[CHAINS];
      for (int j = 0; j < CHAINS; ++j) acc[j] = SET1(1e-3f * j);
      const vec a = SET1(0.999f), b = SET1(1e-3f);
      if (!bf16) {
        for (long i = 0; i < ITERS; ++i)
          for (int j = 0; j < CHAINS; ++j) acc[j] = FMA(acc[j], a, b);
      } else {
#if defined(__AVX512BF16__)
        const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
        for (long i = 0; i < ITERS; ++i)
          for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], ab, bb);
#endif
      }
      for (int j = 0; j < CHAINS; ++j) sink += SUM(acc[j]);
    }
    double flops = (double)threads * ITERS * CHAINS * LANES * 2 * (bf16 ? 2 : 1);
    double gf = flops / (now() - t0) / 1e9;
    if (gf > best) best = gf;
  }
  if (sink == 12345.f) printf("#");  // keep the chains alive
  return best;
}
int main(void) {
  double fp32 = run(0);
#if defined(__AVX512BF16__)
  double bf16 = run(1);
#else
  double bf16 = 0;  // no bf16 dot-product instruction on this CPU
#endif
  printf("%.1f %.1f\n", fp32, bf16);
  return 0;
}
EOF
if cc -O3 -march=native -fopenmp "$WORK/ceiling.c" -o "$WORK/ceiling" 2>"$WORK/ceiling.err"; then
  read -r CEIL_FP32 CEIL_BF16 < <("$WORK/ceiling")
else
  echo "bench_cpu: could not build the FMA-ceiling probe: $(head -3 "$WORK/ceiling.err")" >&2
  CEIL_FP32=0 CEIL_BF16=0
fi

# ---- the torch peer's environment ----------------------------------------------------------------
# The peer's allocator and BLAS come from Debian's packages; install them when missing (a
# benchmark of a peer at less than its best would flatter Tetra).
peer_missing=()
for pkg in libopenblas0-pthread libtcmalloc-minimal4; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || peer_missing+=("$pkg")
done
if [ ${#peer_missing[@]} -gt 0 ] && [ -z "${TCMALLOC:-}${TORCH_BLAS_DIR:-}" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "bench_cpu: installing the torch peer's ${peer_missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${peer_missing[@]}" >/dev/null 2>&1 ||
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        --no-install-recommends "${peer_missing[@]}" >/dev/null; } ||
    echo "bench_cpu: could not install ${peer_missing[*]}; the peer runs without them" >&2
fi
TCMALLOC_LIB=${TCMALLOC:-}
if [ -z "$TCMALLOC_LIB" ]; then
  for lib in "$LIBDIR/libtcmalloc_minimal.so.4" "$LIBDIR/libtcmalloc.so.4"; do
    if [ -e "$lib" ]; then TCMALLOC_LIB=$lib; break; fi
  done
fi
if [ -n "$TCMALLOC_LIB" ]; then
  ALLOC_NOTE="tcmalloc preloaded ($TCMALLOC_LIB)"
else
  ALLOC_NOTE="tcmalloc NOT installed (apt-get install libtcmalloc-minimal4): torch runs on glibc"
  ALLOC_NOTE+=" malloc, slower than its best"
fi
BLAS_DIR=${TORCH_BLAS_DIR:-}
SYSTEM_BLAS=$(readlink -f "$LIBDIR/libblas.so.3" 2>/dev/null || echo none)
if [ -z "$BLAS_DIR" ] && [[ "$SYSTEM_BLAS" == "$LIBDIR/blas/"* || "$SYSTEM_BLAS" == none ]]; then
  for dir in "$LIBDIR/openblas-pthread" "$LIBDIR/openblas-openmp" "$LIBDIR/openblas-serial"; do
    if [ -e "$dir/libblas.so.3" ]; then BLAS_DIR=$dir; break; fi
  done
  if [ -z "$BLAS_DIR" ]; then
    BLAS_NOTE="the system libblas.so.3 is the reference BLAS ($SYSTEM_BLAS) and no OpenBLAS is"
    BLAS_NOTE+=" installed (apt-get install libopenblas0-pthread): torch's fp32 GEMMs are far from"
    BLAS_NOTE+=" its best"
  fi
fi
[ -n "$BLAS_DIR" ] && BLAS_NOTE="torch BLAS from $BLAS_DIR (system libblas.so.3: $SYSTEM_BLAS)"
[ -z "${BLAS_NOTE:-}" ] && BLAS_NOTE="torch BLAS: system libblas.so.3 = $SYSTEM_BLAS"

torch_env=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)
[ -n "$TCMALLOC_LIB" ] && torch_env+=("LD_PRELOAD=$TCMALLOC_LIB")
[ -n "$BLAS_DIR" ] && torch_env+=("LD_LIBRARY_PATH=$BLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")

# The peer's OpenBLAS kernel: its own choice unless that is narrower than the CPU (see above).
echo "  the torch peer's OpenBLAS kernel ..." >&2
kernel_try=()
[ -n "${BENCH_OPENBLAS_TRY:-}" ] && kernel_try=(--try "$BENCH_OPENBLAS_TRY")
if ! "${torch_env[@]}" "$PY" "$REPO/tools/openblas_kernel.py" "${kernel_try[@]}" -- \
    "$PY" "$REPO/tools/bench_torch_gpt.py" --seq-len 64 --batch "$BATCH" --precision fp32 \
    --steps 2 --warmup 1 --threads "$THREADS" >"$WORK/kernel.json"; then
  echo "bench_cpu: choosing the torch peer's OpenBLAS kernel failed" >&2
  exit 1
fi
# Three lines: the OPENBLAS_CORETYPE to set (empty: leave it unset), the core, the reason.
{ read -r KERNEL_CORETYPE; read -r KERNEL_CORE; read -r KERNEL_REASON; } < <("$PY" -c '
import json, sys
k = json.load(open(sys.argv[1]))
print(k["coretype"] or ""); print(k["core"] or ""); print(k["reason"] + "; CPU " + k["cpu"])
' "$WORK/kernel.json")
[ -n "$KERNEL_CORETYPE" ] && torch_env+=("OPENBLAS_CORETYPE=$KERNEL_CORETYPE")
# Every peer run reports the core it ran (stderr), checked against this choice.
torch_env+=(OPENBLAS_VERBOSE=2)

echo "bench_cpu: GPT-2 124M, batch $BATCH, $THREADS threads," \
     "$WARMUP warm-up + $STEPS timed steps (median)"
echo "  tetra: $TETRA_BIN"
echo "  torch: $ALLOC_NOTE"
echo "  torch: $BLAS_NOTE"
if [ -n "$KERNEL_CORE" ]; then
  echo "  torch: OpenBLAS kernel $KERNEL_CORE (OPENBLAS_CORETYPE=${KERNEL_CORETYPE:-unset}):" \
       "$KERNEL_REASON"
else
  echo "  torch: $KERNEL_REASON"
fi
AMX_NOTE="no AMX"
grep -qw amx_bf16 /proc/cpuinfo && AMX_NOTE="AMX-BF16 present: bf16 GEMMs using it can beat both"
echo "  ceiling (this machine, $THREADS threads): fp32 FMA $CEIL_FP32 GFLOP/s," \
     "bf16 dot product (vdpbf16ps) $CEIL_BF16 GFLOP/s; $AMX_NOTE"
# Tetra advises its large buffers onto transparent huge pages; Linux honours that in the modes
# "madvise" and "always" (kernels/cpu/host_memory.h). The torch peer asks for none (its
# AnonHugePages stayed 0 kB under tcmalloc, measured at T=256).
THP_MODE=$(sed -n 's/.*\[\([a-z]*\)\].*/\1/p' /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || true)
echo "  transparent huge pages: ${THP_MODE:-not available}" \
     "(Tetra's large buffers are on 2 MiB pages in the modes madvise and always)"

# ---- the runs ------------------------------------------------------------------------------------
results=$WORK/results.jsonl
: >"$results"
for T in $SEQ_LENS; do
  for P in $PRECISIONS; do
    case_dir=$WORK/T${T}_$P
    mkdir -p "$case_dir"
    peak=$CEIL_FP32  # Tetra's MFU then reads as the same share of the same ceiling
    [ "${peak%.*}" -gt 0 ] 2>/dev/null || peak=100
    cat >"$case_dir/config.json" <<EOF
{
  "model": {"vocab_size": 50257, "seq_len": $T, "num_layers": 12, "hidden_size": 768,
            "num_heads": 12, "norm": "layernorm", "activation": "gelu", "position": "learned",
            "tie_embeddings": true, "bias": true},
  "training": {"precision": "$P", "micro_batch_size": $BATCH, "global_batch_size": $BATCH,
               "steps": $((WARMUP + STEPS)), "threads": $THREADS, "peak_gflops": $peak},
  "optimizer": {"lr": 6e-4, "warmup_steps": 0, "decay": "constant", "grad_clip": 1.0},
  "data": {"synthetic": true},
  "logging": {"dir": "$case_dir/logs"}
}
EOF
    for R in $(seq "$ROUNDS"); do
      echo "  T=$T $P round $R/$ROUNDS: tetra ..." >&2
      rm -rf "$case_dir/logs"
      if ! /usr/bin/time -f "%M" -o "$case_dir/tetra$R.rss" \
          "$TETRA_BIN" --config "$case_dir/config.json" >"$case_dir/tetra.log" 2>&1; then
        echo "bench_cpu: tetra failed on T=$T $P; last lines:" >&2
        tail -5 "$case_dir/tetra.log" >&2
        exit 1
      fi
      cp "$case_dir/logs/metrics.jsonl" "$case_dir/metrics$R.jsonl"
      echo "  T=$T $P round $R/$ROUNDS: torch ..." >&2
      if ! "${torch_env[@]}" /usr/bin/time -f "%M" -o "$case_dir/torch$R.rss" \
          "$PY" "$REPO/tools/bench_torch_gpt.py" --seq-len "$T" --batch "$BATCH" --precision "$P" \
          --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" >"$case_dir/torch$R.json" \
          2>"$case_dir/torch$R.err"; then
        echo "bench_cpu: torch peer failed on T=$T $P:" >&2
        tail -5 "$case_dir/torch$R.err" >&2
        exit 1
      fi
      ran=$(sed -n 's/^Core: //p' "$case_dir/torch$R.err" | tail -1)
      if [ "$ran" != "$KERNEL_CORE" ]; then
        echo "bench_cpu: the torch peer ran OpenBLAS kernel '${ran:-none}'" \
             "where '${KERNEL_CORE:-none}' was chosen" >&2
        exit 1
      fi
    done
    "$PY" - "$case_dir" "$T" "$P" "$WARMUP" "$BATCH" "$ROUNDS" >>"$results" <<'EOF'
import json, statistics, sys
case, t, p = sys.argv[1], int(sys.argv[2]), sys.argv[3]
warmup, batch, rounds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
rss = lambda f: int(open(f).read().split()[-1]) / 1024  # /usr/bin/time %M: KiB
tetra_ms, torch_ms, round_ratios, loss = [], [], [], None
for r in range(1, rounds + 1):
    rows = [json.loads(l) for l in open(f"{case}/metrics{r}.jsonl") if l.strip()]
    ms = [x["ms"] for x in rows if "loss" in x and x["step"] > warmup]
    torch = json.loads(open(f"{case}/torch{r}.json").read().strip().splitlines()[-1])
    tetra_ms += ms
    torch_ms += torch["ms_all"]
    round_ratios.append(statistics.median(torch["ms_all"]) / statistics.median(ms))
    loss = rows[-1].get("loss")
print(json.dumps({"T": t, "precision": p, "tetra_ms": statistics.median(tetra_ms),
                  "tetra_spread": max(tetra_ms) / min(tetra_ms),
                  "torch_spread": max(torch_ms) / min(torch_ms),
                  "round_ratios": round_ratios,
                  "tetra_rss": max(rss(f"{case}/tetra{r}.rss") for r in range(1, rounds + 1)),
                  "tetra_loss": loss, "torch_ms": statistics.median(torch_ms),
                  "torch_rss": max(rss(f"{case}/torch{r}.rss") for r in range(1, rounds + 1)),
                  "torch_blas": torch["blas"], "torch_alloc": torch["allocator"], "batch": batch}))
EOF
  done
done

# ---- the table -----------------------------------------------------------------------------------
"$PY" - "$results" "$CEIL_FP32" "$KERNEL_CORE" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ceil = float(sys.argv[2])
L, C, V = 12, 768, 50257
n_matmul = L * 12 * C * C + V * C
print()
print(f"{'':10} | {'ms/step':^19} | {'tokens/s':^26} | {'GFLOP/s (% of fp32 FMA ceiling)':^37} | "
      f"{'peak RSS MiB':^15} | ratio per round")
print(f"{'T':>4} {'prec':>5} | {'tetra':>9} {'torch':>9} | {'tetra':>8} {'torch':>8} "
      f"{'ratio':>8} | "
      f"{'tetra':>9} {'':>8} {'torch':>9} {'':>8} | {'tetra':>7} {'torch':>7}")
for r in rows:
    t, p = r["T"], r["precision"]
    tokens = r["batch"] * t
    flops = (6 * n_matmul + 12 * L * t * C) * tokens
    tt, to = tokens / (r["tetra_ms"] / 1e3), tokens / (r["torch_ms"] / 1e3)
    gt, go = flops / (r["tetra_ms"] / 1e3) / 1e9, flops / (r["torch_ms"] / 1e3) / 1e9
    pct = lambda g: f"{100 * g / ceil:5.1f}%" if ceil > 0 else "   n/a"
    print(f"{t:>4} {p:>5} | {r['tetra_ms']:9.0f} {r['torch_ms']:9.0f} | {tt:8.1f} {to:8.1f} "
          f"{tt / to:8.2f} | {gt:9.1f} ({pct(gt)}) {go:9.1f} ({pct(go)}) | {r['tetra_rss']:7.0f} "
          f"{r['torch_rss']:7.0f} | " + " ".join(f"{x:.2f}" for x in r["round_ratios"]))
print(f"\nms/step: median of the timed steps of every round (Tetra and torch alternate, one run "
      f"each per round); peak RSS: the largest of the rounds; ratio: Tetra tokens/s / torch "
      f"tokens/s (> 1: Tetra faster), overall and per round; FLOPs/token = 6*{n_matmul} + "
      f"12*L*T*C; % of the fp32 FMA ceiling ({ceil:.0f} GFLOP/s) in every row.")
# A step time that varies by more than 25% within one run means the machine was busy (another
# process took a core: with 2 threads, every OpenMP barrier then waits for the descheduled one).
noisy = [f"T={r['T']} {r['precision']} {impl} (slowest/fastest step {r[impl + '_spread']:.2f})"
         for r in rows for impl in ("tetra", "torch") if r[impl + "_spread"] > 1.25]
if noisy:
    print("NOISY (step times vary > 25%; rerun on a quiet machine): " + "; ".join(noisy))
print(f"torch ran with BLAS {rows[0]['torch_blas']}, OpenBLAS kernel {sys.argv[3] or 'n/a'}, and "
      f"allocator {rows[0]['torch_alloc'] or 'glibc malloc'}")
EOF
