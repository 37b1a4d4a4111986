#!/usr/bin/env bash
# The one script to run on a GPU machine (one NVIDIA H200, 16 cores, CUDA, maybe none of our Debian
# -dev packages, no network), done in under 8 minutes: builds Tetra for sm_90, runs the CUDA tests
# and two training benchmarks, and leaves what it found in OUTDIR.
#
# Stages, each under its own time limit (and the whole under TOTAL_S, 470 s by default); a stage
# that fails or times out is logged and the next one still runs; the exit code is 0 only if every
# stage passed:
#   env       nvidia-smi, compiler, CMake and CUDA versions, where cuDNN and NCCL were found
#   deps      the dependency folder, when the machine lacks our packages (below)
# (env and deps are quick and not time-limited)
#   configure CMake, Release, -DTETRA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90, Ninja if present
#   build     tetra and the CUDA test programs, -j$(nproc)
#   tests     ctest -R '^cuda:' --output-on-failure (the NCCL test's 2-rank run skips itself with
#             one GPU: NCCL needs a GPU per rank)
#   bench_*   tetra on configs/bench_gpt2_124m_cuda.json (GPT-2 124M, bf16, T = 1024) and
#             configs/bench_llama_1b_cuda.json (a 1.1B Llama, bf16, T = 2048), synthetic data,
#             30 steps each: tokens/s and MFU from metrics.jsonl (median of the steps after the
#             first 5), peak GPU memory (nvidia-smi, sampled every 0.5 s, and any peak-memory
#             figure the trainer writes)
#
# Dependencies: what is installed is used; where a build dependency is missing, the folder (or
# .tar.xz) made by scripts/prepare_gpu_deps.sh on a Debian machine is (CMAKE_PREFIX_PATH,
# PKG_CONFIG_PATH, LD_LIBRARY_PATH). It is looked for as the second argument, $TETRA_GPU_DEPS, or
# <repo>/.gpu-deps(.tar.xz) (git-ignored: carry it to the GPU machine with the tree);
# GPU_CHECK_USE_DEPS=1 uses it even where the packages are installed.
# cuDNN and NCCL are taken from /usr/local/cuda, else from the Python
# packages nvidia-cudnn / nvidia-nccl (PyTorch's), which hold them too.
#
# OUTDIR gets at most 8 files (what a device run brings back): summary.txt (stages, results),
# env.txt, build.log, tests.log, bench_gpt2_124m_cuda.log, bench_llama_1b_cuda.log (each run's
# output and metrics.jsonl). Work files live in $GPU_CHECK_WORK (default /tmp/tetra-gpu-check).
#
# Usage: scripts/gpu_check.sh OUTDIR [DEPS]
set -uo pipefail

[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [DEPS folder or .tar.xz from scripts/prepare_gpu_deps.sh]" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
DEPS_ARG=${2:-${TETRA_GPU_DEPS:-}}
WORK=${GPU_CHECK_WORK:-/tmp/tetra-gpu-check}
BUILD=$WORK/build
TOTAL_S=${TOTAL_S:-470}
JOBS=$(nproc 2>/dev/null || echo 16)
T0=$(date +%s)
mkdir -p "$WORK"
: >"$OUT/summary.txt"
FAILED=()

remaining() { echo $((TOTAL_S - ($(date +%s) - T0))); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# stage NAME LIMIT_S LOG CMD...: runs CMD under `timeout` (the limit clamped to the time left),
# appending its output to LOG; records "NAME ok|FAILED (rc) seconds".
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left
  left=$(remaining)
  [ "$limit" -gt "$((left - 5))" ] && limit=$((left - 5))
  if [ "$limit" -lt 5 ]; then
    note "$(printf '%-22s SKIPPED (no time left of %ss)' "$name" "$TOTAL_S")"
    FAILED+=("$name")
    return 1
  fi
  local t=$(date +%s) rc
  echo "== $name (limit ${limit}s): $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t))
  if [ $rc -eq 0 ]; then
    note "$(printf '%-22s ok          %4ds' "$name" "$dt")"
  else
    local why="rc $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="timed out after ${limit}s"
    note "$(printf '%-22s FAILED      %4ds  (%s; see %s)' "$name" "$dt" "$why" "$(basename "$log")")"
    FAILED+=("$name")
  fi
  return $rc
}

note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), source $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'))"

# ---- env ------------------------------------------------------------------------------------------
{
  timeout 20 nvidia-smi
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  echo "--- tools"
  for t in nvcc cmake ninja g++ python3 mpirun pkg-config; do printf '%-11s %s\n' "$t" "$(command -v $t || echo absent)"; done
  nvcc --version | tail -2
  cmake --version | head -1
  g++ --version | head -1
  echo "cores: $JOBS"
} >"$OUT/env.txt" 2>&1
if grep -q "NVIDIA-SMI" "$OUT/env.txt"; then
  note "$(printf '%-22s ok          %s' env "$(grep -A1 '^name' "$OUT/env.txt" | tail -1)")"
else
  note "env                    FAILED (nvidia-smi: no GPU or no driver; see env.txt)"
  FAILED+=(env)
fi

# ---- CUDA libraries: cuDNN and NCCL ---------------------------------------------------------------
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PY_NVIDIA=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
# find_cuda_lib NAME HEADER: prints "<library file> <include dir>" (the first place holding both).
find_cuda_lib() {
  local name=$1 header=$2 d
  for d in "$CUDA_HOME/lib64:$CUDA_HOME/include" "/usr/lib/x86_64-linux-gnu:/usr/include" \
           ${PY_NVIDIA:+"$PY_NVIDIA/$name/lib:$PY_NVIDIA/$name/include"} \
           ${PY_NVIDIA:+"$PY_NVIDIA/cu13/lib:$PY_NVIDIA/cu13/include"}; do
    local lib=${d%%:*} inc=${d##*:} f
    f=$(ls "$lib"/lib$name.so "$lib"/lib$name.so.[0-9]* 2>/dev/null | head -1)
    if [ -n "$f" ] && [ -f "$inc/$header" ]; then
      echo "$f $inc"
      return 0
    fi
  done
  return 1
}
CMAKE_EXTRA=()
EXTRA_INC=()
found=
if found=$(find_cuda_lib nccl nccl.h); then
  CMAKE_EXTRA+=("-DTETRA_NCCL_LIBRARY=${found% *}" "-DTETRA_NCCL_INCLUDE_DIR=${found#* }")
  export LD_LIBRARY_PATH=$(dirname "${found% *}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "nccl: ${found:-not found}" >>"$OUT/env.txt"
found=
if found=$(find_cuda_lib cudnn cudnn.h); then
  CMAKE_EXTRA+=("-DTETRA_CUDNN_LIBRARY=${found% *}")
  [ "${found#* }" != "$CUDA_HOME/include" ] && EXTRA_INC+=("-I${found#* }")
  export LD_LIBRARY_PATH=$(dirname "${found% *}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
echo "cudnn: ${found:-not found}" >>"$OUT/env.txt"

# ---- dependencies ---------------------------------------------------------------------------------
have_system_deps() {
  local h
  for h in nlohmann/json.hpp spdlog/spdlog.h fmt/core.h CLI/CLI.hpp catch2/catch.hpp; do
    [ -f "/usr/include/$h" ] || [ -f "/usr/local/include/$h" ] || return 1
  done
  command -v pkg-config >/dev/null && pkg-config --exists sentencepiece libpcre2-8
}
use_deps() {
  local src=$1 dir
  if [ -f "$src" ]; then  # an archive: unpack it once
    mkdir -p "$WORK/deps" && tar -C "$WORK/deps" -xJf "$src" || return 1
    dir=$(find "$WORK/deps" -mindepth 1 -maxdepth 1 -type d | head -1)
  else
    dir=$src
  fi
  [ -d "$dir/usr/include" ] || { echo "no usr/include under $dir: not a prepare_gpu_deps.sh folder"; return 1; }
  DEPS=$(cd "$dir" && pwd)
  local multi=$DEPS/usr/lib/x86_64-linux-gnu
  CMAKE_EXTRA+=("-DCMAKE_PREFIX_PATH=$DEPS/usr")
  export PKG_CONFIG_PATH=$multi/pkgconfig:$DEPS/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$multi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:$DEPS/usr/bin  # pkg-config where the machine has none
  if [ -x "$DEPS/usr/bin/mpirun" ]; then  # a relocated OpenMPI
    export OPAL_PREFIX=$DEPS/usr PATH=$DEPS/usr/bin:$PATH
    export LD_LIBRARY_PATH=$multi/openmpi/lib:$LD_LIBRARY_PATH
  fi
  cat "$DEPS/PACKAGES.txt" 2>/dev/null
}
DEPS=
if [ "${GPU_CHECK_USE_DEPS:-0}" != 1 ] && have_system_deps; then
  note "deps                   installed packages"
else
  if [ -z "$DEPS_ARG" ]; then
    for c in "$REPO/.gpu-deps" "$REPO/.gpu-deps.tar.xz"; do [ -e "$c" ] && DEPS_ARG=$c && break; done
  fi
  if [ -z "$DEPS_ARG" ]; then
    note "deps                   FAILED: build dependencies missing and no folder from scripts/prepare_gpu_deps.sh given"
    FAILED+=(deps)
  else
    if use_deps "$DEPS_ARG" >>"$OUT/build.log" 2>&1; then
      note "deps                   ok          $DEPS"
    else
      note "deps                   FAILED (unpacking $DEPS_ARG; see build.log)"
      FAILED+=(deps)
    fi
  fi
fi

# ---- configure and build --------------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
CUDA_FLAGS=${EXTRA_INC[*]:-}
stage configure 60 "$OUT/build.log" cmake -S "$REPO" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DTETRA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
  "-DCMAKE_CXX_FLAGS=$CUDA_FLAGS" "-DCMAKE_CUDA_FLAGS=$CUDA_FLAGS" "${CMAKE_EXTRA[@]}"
TARGETS=(tetra test_cuda_ops test_cuda_shared_math test_nccl)
stage build 240 "$OUT/build.log" cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

# ---- CUDA tests -----------------------------------------------------------------------------------
# cuda:nccl_np2 (with MPI) skips itself on a machine with one GPU.
stage tests 120 "$OUT/tests.log" ctest --test-dir "$BUILD" -R '^cuda:' --output-on-failure --timeout 110
[ -f "$OUT/tests.log" ] &&
  note "  ctest: $(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1); skipped:" \
       "$(grep -E '^\s+[0-9]+ - .*\(Skipped\)' "$OUT/tests.log" | sed 's/.* - //; s/ (Skipped)//' | tr '\n' ' ')"

# ---- benchmarks -----------------------------------------------------------------------------------
# bench NAME: one training run, its GPU memory sampled; the figures into summary.txt.
bench() {
  local name=$1 run=$WORK/runs/$1 log=$OUT/$1.log
  rm -rf "$run" && mkdir -p "$run"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$run/gpu_mem.txt" 2>/dev/null &
  local sampler=$!
  stage "$name" 80 "$log" env OMP_NUM_THREADS="$JOBS" "$BUILD/tetra" --config "$REPO/configs/$name.json" \
    --set "logging.dir=$run" --set "training.threads=$JOBS"
  local rc=$?
  kill $sampler 2>/dev/null
  wait $sampler 2>/dev/null
  { echo "--- $run/metrics.jsonl"; cat "$run/metrics.jsonl" 2>/dev/null; } >>"$log"
  grep -o "kernels: .*" "$log" | head -1 | sed "s/^/  $name: /" | tee -a "$OUT/summary.txt"
  python3 - "$name" "$run" "$rc" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, statistics, sys
name, run, rc = sys.argv[1], sys.argv[2], sys.argv[3]
steps, peaks = [], {}
try:
    for line in open(os.path.join(run, "metrics.jsonl")):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        for k, v in j.items():  # any peak-memory figure the trainer writes
            if isinstance(v, (int, float)) and ("peak" in k and ("mem" in k or "bytes" in k)):
                peaks[k] = max(peaks.get(k, 0), v)
        if "tokens_per_s" in j:
            steps.append(j)
except OSError:
    pass
used = [int(x) for x in open(os.path.join(run, "gpu_mem.txt")).read().split() if x.strip().isdigit()] \
    if os.path.exists(os.path.join(run, "gpu_mem.txt")) else []
timed = [s for s in steps if s.get("step", 0) > 5 and "skipped" not in s] or steps
med = lambda k: statistics.median(s[k] for s in timed) if timed else float("nan")
print(f"  {name}: exit {rc}, {len(steps)} steps logged; tokens/s {med('tokens_per_s'):,.0f}, "
      f"MFU {100 * med('mfu'):.1f}% (median of {len(timed)} steps), ms/step {med('ms'):.1f}, "
      f"final loss {steps[-1]['loss'] if steps else float('nan'):.4f}")
print(f"  {name}: peak GPU memory in use {max(used) if used else float('nan'):,} MiB (nvidia-smi)"
      + "".join(f"; {k} {v / 2**20:,.0f} MiB" for k, v in peaks.items()))
EOF
}
if [ -x "$BUILD/tetra" ]; then
  for b in bench_gpt2_124m_cuda bench_llama_1b_cuda; do bench "$b"; done
else
  note "bench                  SKIPPED (no tetra binary)"
  FAILED+=(bench)
fi

note "total $(($(date +%s) - T0))s; $([ ${#FAILED[@]} -eq 0 ] && echo "all stages passed" || echo "failed: ${FAILED[*]}")"
[ ${#FAILED[@]} -eq 0 ]
