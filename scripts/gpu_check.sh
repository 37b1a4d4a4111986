#!/usr/bin/env bash
# The one script to run on a GPU machine (one NVIDIA H200, 16 cores, CUDA, maybe none of our Debian
# -dev packages, no network): builds Tetra for sm_90, runs the CUDA tests and two training
# benchmarks, and leaves what it found in OUTDIR. One shot: the whole run, every stage's kill
# grace included, ends within TOTAL_S = 520 s (a device command's limit is 600 s), so a GPU
# window is never lost to a script killed from outside with nothing written.
#
# Stages, in this order, each under its own time limit (clamped to the time left; a stage that
# would get less than 5 s is SKIPPED); a stage that fails or times out is logged and the next one
# still runs; the exit code is 0 only if no stage failed (a test that skips itself, exit 77, is
# SKIPPED, not failed):
#   env           nvidia-smi, compiler, CMake and CUDA versions; where cuBLASLt, NVRTC, cuDNN and
#                 NCCL were found (env.txt)
#   deps          the dependency folder, when the machine lacks our packages (below)
#   configure     CMake, Release, -DTETRA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90, Ninja if present,
#                 TETRA_TORCH_PYTHON = the python3 on PATH, TETRA_MPI=OFF unless the deps folder
#                 brought OpenMPI
#   build_tests   test_cuda_ops, test_cuda_shared_math, test_cuda_sdpa_graph (first: they need
#                 only the kernels, so a slow build still leaves the op tests to run)
#   build_tetra   tetra and test_nccl
#   sdpa_graph    the cuDNN SDPA graphs against cudnn-frontend's lowering (no GPU needed)
#   shared_math   the shared element-wise math on the GPU against the host
#   ops_cudnn     test_cuda_ops -d yes "[cudnn]": cuDNN's SDPA forced on its representative
#                 shapes, under CUDNN_LOGLEVEL_DBG=2 (cuDNN's own warnings and errors in the log)
#   ops           test_cuda_ops -d yes "~[cudnn]": every other CUDA op against the CPU, each
#                 test case's duration in the log
#   nccl_np1      the NCCL communicator on one GPU
#   bench_*       tetra on configs/bench_gpt2_124m_cuda.json (GPT-2 124M, bf16, T = 1024) and
#                 configs/bench_llama_1b_cuda.json (a 1.1B Llama, bf16, T = 2048), synthetic data:
#                 tokens/s and MFU from metrics.jsonl (median of the steps after the first 5),
#                 peak GPU memory (nvidia-smi, sampled every 0.5 s) and each rank's planned
#                 device memory beside the backend's measured peak (metrics.jsonl's "memory"
#                 event); GPT-2 again with selective recomputation (norm, act) beside it
#   train_parity  tests/cuda/test_train_parity.py (GPU against CPU loss curves), with the time left
# Each stage's line goes to summary.txt when it starts and again when it ends, so a stage cut
# short (by its limit, or the whole script by a signal) still leaves its log and a line.
#
# Libraries: cuBLASLt and NVRTC from $CUDA_HOME/lib64 (cuDNN's runtime-fusion engines dlopen
# NVRTC), cuDNN and NCCL from $CUDA_HOME, the system, or the Python wheels (nvidia-cudnn-*,
# nvidia-nccl-*, nvidia-cuda-nvrtc-*, PyTorch's); every directory found goes on LD_LIBRARY_PATH.
#
# Dependencies: what is installed is used; where a build dependency is missing, the folder (or
# .tar.xz) made by scripts/prepare_gpu_deps.sh on a Debian machine is (CMAKE_PREFIX_PATH,
# PKG_CONFIG_PATH, LD_LIBRARY_PATH). It is looked for as the second argument, $TETRA_GPU_DEPS, or
# <repo>/.gpu-deps(.tar.xz) (git-ignored: carry it to the GPU machine with the tree);
# GPU_CHECK_USE_DEPS=1 uses it even where the packages are installed.
#
# OUTDIR gets at most 8 files (what a device run brings back): summary.txt (stages, results),
# env.txt, build.log, tests.log (shared_math, ops_cudnn, ops, nccl_np1), bench_gpt2_124m_cuda.log,
# bench_llama_1b_cuda.log (each run's output and metrics.jsonl), train_parity.log. Work files live
# in $GPU_CHECK_WORK (default /tmp/tetra-gpu-check). GPU_CHECK_JOBS overrides the build's -j.
#
# Usage: scripts/gpu_check.sh OUTDIR [DEPS]
set -uo pipefail

[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [DEPS folder or .tar.xz from scripts/prepare_gpu_deps.sh]" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
DEPS_ARG=${2:-${TETRA_GPU_DEPS:-}}
WORK=${GPU_CHECK_WORK:-/tmp/tetra-gpu-check}
BUILD=$WORK/build
TOTAL_S=${TOTAL_S:-520}
KILL_GRACE=5  # seconds between a stage's SIGTERM and its SIGKILL
JOBS=${GPU_CHECK_JOBS:-$(nproc 2>/dev/null || echo 16)}
T0=$(date +%s)
mkdir -p "$WORK"
: >"$OUT/summary.txt"
FAILED=()
SKIPPED=()
CURRENT=

elapsed() { echo $(($(date +%s) - T0)); }
remaining() { echo $((TOTAL_S - $(elapsed))); }
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
STAGE_PID=
# A signal to the script (an outer time limit) ends the running stage's process group, notes it
# and exits: the summary never stops at a stage without saying so.
on_signal() {
  [ -n "$STAGE_PID" ] && kill -TERM -- -"$STAGE_PID" 2>/dev/null
  note "interrupted (signal) at +$(elapsed)s${CURRENT:+ during stage $CURRENT}"
  exit 130
}
trap on_signal INT TERM

# stage NAME LIMIT_S LOG CMD...: runs CMD under `timeout` (the limit clamped to the time left,
# less the kill grace and 3 s for the summary), appending its output to LOG; records
# "NAME started" and then "NAME ok|SKIPPED|FAILED (why) seconds".
stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left
  left=$(($(remaining) - KILL_GRACE - 3))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    note "$(printf '%-20s SKIPPED     (no time left: %ss of %ss used)' "$name" "$(elapsed)" "$TOTAL_S")"
    SKIPPED+=("$name")
    return 1
  fi
  local t rc from
  t=$(date +%s)
  from=$(($(wc -l <"$log" 2>/dev/null || echo 0) + 1))
  note "$(printf '%-20s started     +%ds, limit %ds, log %s' "$name" "$(elapsed)" "$limit" "$(basename "$log")")"
  echo "== $name (limit ${limit}s, +$(elapsed)s): $*" >>"$log"
  CURRENT=$name
  # In the background and waited for, so that a signal to the script is handled at once (timeout
  # leads its own process group, which on_signal ends).
  timeout --kill-after=$KILL_GRACE "$limit" "$@" >>"$log" 2>&1 </dev/null &
  STAGE_PID=$!
  wait $STAGE_PID
  rc=$?
  STAGE_PID=
  CURRENT=
  local dt=$(($(date +%s) - t))
  echo "== $name: exit $rc after ${dt}s" >>"$log"
  if [ $rc -eq 0 ]; then
    note "$(printf '%-20s ok          %4ds' "$name" "$dt")"
  elif [ $rc -eq 77 ]; then
    note "$(printf '%-20s SKIPPED     %4ds  (the test skipped itself: %s; see %s)' "$name" "$dt" \
      "$(grep -m1 -iE 'skipp|no cuda device' "$log" | tail -c 120 | tr -d '\n')" "$(basename "$log")")"
    SKIPPED+=("$name")
  else
    # The stage's last line of output says why, most of the time.
    local why last
    last=$(tail -n +"$from" "$log" | grep -v '^== ' | grep -v '^\s*$' | tail -1 | cut -c1-160)
    why="rc $rc${last:+: $last}"
    [ $rc -eq 3 ] && why="not built"
    { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && why="timed out after ${limit}s"
    note "$(printf '%-20s FAILED      %4ds  (%s; see %s)' "$name" "$dt" "$why" "$(basename "$log")")"
    FAILED+=("$name")
  fi
  return $rc
}

note "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), source $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')), budget ${TOTAL_S}s"

# ---- env ------------------------------------------------------------------------------------------
HAVE_GPU=0
{
  timeout 20 nvidia-smi
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  echo "--- tools"
  for t in nvcc cmake ninja g++ python3 mpirun pkg-config; do printf '%-11s %s\n' "$t" "$(command -v $t || echo absent)"; done
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  g++ --version 2>&1 | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
  echo "cores: $(nproc 2>/dev/null), build jobs: $JOBS"
} >"$OUT/env.txt" 2>&1
if grep -q "NVIDIA-SMI" "$OUT/env.txt"; then
  HAVE_GPU=1
  note "$(printf '%-20s ok          %s' env "$(grep -A1 '^name' "$OUT/env.txt" | tail -1)")"
else
  note "$(printf '%-20s FAILED      (nvidia-smi: no GPU or no driver; the GPU stages will skip or fail; see env.txt)' env)"
  FAILED+=(env)
fi

# ---- CUDA libraries: cuBLASLt, NVRTC, cuDNN, NCCL -------------------------------------------------
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -x "$CUDA_HOME/bin/nvcc" ] || { command -v nvcc >/dev/null && CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); }
PY_NVIDIA=$(python3 -c 'import nvidia, os; print(os.pathsep.join(nvidia.__path__))' 2>/dev/null | cut -d: -f1 || true)
LIB_DIRS=("$CUDA_HOME/lib64")
# find_lib NAME [HEADER]: prints "<library file> <include dir>" (the first place holding the
# library, and the header where one is asked for): the toolkit, the system, the Python wheels.
find_lib() {
  local name=$1 header=${2:-} d sub
  local places=("$CUDA_HOME/lib64:$CUDA_HOME/include" "$CUDA_HOME/targets/x86_64-linux/lib:$CUDA_HOME/targets/x86_64-linux/include"
                "/usr/lib/x86_64-linux-gnu:/usr/include")
  if [ -n "$PY_NVIDIA" ]; then
    for sub in "$name" cu13 cu12 cublas cuda_nvrtc; do places+=("$PY_NVIDIA/$sub/lib:$PY_NVIDIA/$sub/include"); done
  fi
  for d in "${places[@]}"; do
    local lib=${d%%:*} inc=${d##*:} f
    f=$(ls "$lib"/lib$name.so "$lib"/lib$name.so.[0-9]* 2>/dev/null | head -1)
    if [ -n "$f" ] && { [ -z "$header" ] || [ -f "$inc/$header" ]; }; then
      echo "$f $inc"
      return 0
    fi
  done
  return 1
}
CMAKE_EXTRA=()
EXTRA_INC=()
add_lib_dir() { local d; d=$(dirname "$1"); [[ " ${LIB_DIRS[*]} " == *" $d "* ]] || LIB_DIRS+=("$d"); }
echo "--- libraries" >>"$OUT/env.txt"
for lib in cublasLt nvrtc; do
  found=
  found=$(find_lib $lib) && add_lib_dir "${found% *}"
  echo "$lib: ${found% *}" >>"$OUT/env.txt"
  [ -n "$found" ] || echo "$lib: not found" >>"$OUT/env.txt"
done
found=
if found=$(find_lib nccl nccl.h); then
  CMAKE_EXTRA+=("-DTETRA_NCCL_LIBRARY=${found% *}" "-DTETRA_NCCL_INCLUDE_DIR=${found#* }")
  add_lib_dir "${found% *}"
fi
echo "nccl: ${found:-not found}" >>"$OUT/env.txt"
found=
if found=$(find_lib cudnn cudnn.h); then
  CMAKE_EXTRA+=("-DTETRA_CUDNN_LIBRARY=${found% *}")
  [ "${found#* }" != "$CUDA_HOME/include" ] && EXTRA_INC+=("-I${found#* }")
  add_lib_dir "${found% *}"
  grep -hE '#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' "${found#* }"/cudnn_version.h 2>/dev/null | head -3 | awk '{printf "%s ", $3} END {print ""}' |
    sed 's/^/cudnn version: /' >>"$OUT/env.txt"
fi
echo "cudnn: ${found:-not found}" >>"$OUT/env.txt"
LD_LIBRARY_PATH=$(IFS=:; echo "${LIB_DIRS[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$OUT/env.txt"

# ---- dependencies ---------------------------------------------------------------------------------
have_system_deps() {
  local h
  for h in nlohmann/json.hpp spdlog/spdlog.h fmt/core.h CLI/CLI.hpp catch2/catch.hpp; do
    [ -f "/usr/include/$h" ] || [ -f "/usr/local/include/$h" ] || return 1
  done
  command -v pkg-config >/dev/null && pkg-config --exists sentencepiece libpcre2-8
}
MPI=OFF
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
  export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$multi
  export PATH=$PATH:$DEPS/usr/bin  # pkg-config where the machine has none
  if [ -x "$DEPS/usr/bin/mpirun" ]; then  # a relocated OpenMPI
    export OPAL_PREFIX=$DEPS/usr PATH=$DEPS/usr/bin:$PATH
    export LD_LIBRARY_PATH=$multi/openmpi/lib:$LD_LIBRARY_PATH
    MPI=ON
  fi
  cat "$DEPS/PACKAGES.txt" 2>/dev/null
}
DEPS=
if [ "${GPU_CHECK_USE_DEPS:-0}" != 1 ] && have_system_deps; then
  note "$(printf '%-20s ok          installed packages' deps)"
else
  if [ -z "$DEPS_ARG" ]; then
    for c in "$REPO/.gpu-deps" "$REPO/.gpu-deps.tar.xz"; do [ -e "$c" ] && DEPS_ARG=$c && break; done
  fi
  if [ -z "$DEPS_ARG" ]; then
    note "$(printf '%-20s FAILED      (build dependencies missing and no folder from scripts/prepare_gpu_deps.sh given)' deps)"
    FAILED+=(deps)
  elif use_deps "$DEPS_ARG" >>"$OUT/build.log" 2>&1; then
    note "$(printf '%-20s ok          %s (OpenMPI: %s)' deps "$DEPS" "$MPI")"
  else
    note "$(printf '%-20s FAILED      (unpacking %s; see build.log)' deps "$DEPS_ARG")"
    FAILED+=(deps)
  fi
fi

# ---- configure and build --------------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
CUDA_FLAGS=${EXTRA_INC[*]:-}
PYTHON=$(command -v python3 || echo /usr/bin/python3)
stage configure 45 "$OUT/build.log" cmake -S "$REPO" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DTETRA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
  -DTETRA_MPI=$MPI -DTETRA_TORCH_PYTHON="$PYTHON" \
  "-DCMAKE_CXX_FLAGS=$CUDA_FLAGS" "-DCMAKE_CUDA_FLAGS=$CUDA_FLAGS" "${CMAKE_EXTRA[@]}"
stage build_tests 200 "$OUT/build.log" cmake --build "$BUILD" -j"$JOBS" \
  --target test_cuda_ops test_cuda_shared_math test_cuda_sdpa_graph
stage build_tetra 150 "$OUT/build.log" cmake --build "$BUILD" -j"$JOBS" --target tetra test_nccl
grep -E 'warning' "$OUT/build.log" | grep -v '^==' | sort -u | head -20 | sed 's/^/  build warning: /' | tee -a "$OUT/summary.txt"

# ---- CUDA tests -----------------------------------------------------------------------------------
T=$BUILD/tests
# "${RUN[@]}" BINARY ARGS...: the binary (exec'd, so `timeout` signals it directly), or a clear
# failure when the build did not produce it.
RUN=(bash -c 'if [ -x "$1" ]; then exec "$@"; else echo "$1 was not built (see build.log)"; exit 3; fi' run)
stage sdpa_graph 15 "$OUT/tests.log" "${RUN[@]}" "$T/test_cuda_sdpa_graph"
stage shared_math 20 "$OUT/tests.log" "${RUN[@]}" "$T/test_cuda_shared_math"
stage ops_cudnn 50 "$OUT/tests.log" env CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr \
  "${RUN[@]}" "$T/test_cuda_ops" -d yes "[cudnn]"
stage ops 110 "$OUT/tests.log" "${RUN[@]}" "$T/test_cuda_ops" -d yes "~[cudnn]"
grep -E '^[0-9.]+ s: ' "$OUT/tests.log" | sort -rn | head -5 | sed 's/^/  slowest case: /' | tee -a "$OUT/summary.txt"
grep -E 'test cases?:|FAILED:' "$OUT/tests.log" | sort | uniq -c | head -10 | sed 's/^/  /' | tee -a "$OUT/summary.txt"
grep -m3 -E 'cuDNN SDPA passed over|no SDPA plan' "$OUT/tests.log" | cut -c1-400 | sed 's/^/  cudnn: /' | tee -a "$OUT/summary.txt"
stage nccl_np1 30 "$OUT/tests.log" env OMP_NUM_THREADS=1 "${RUN[@]}" "$T/test_nccl"

# ---- benchmarks -----------------------------------------------------------------------------------
# bench CONFIG LIMIT [LABEL --set KEY=VALUE ...]: one training run of configs/CONFIG.json (named
# LABEL, default CONFIG; the --set overrides appended), its GPU memory sampled; the figures, and the
# device memory the plan gave beside the peak the backend measured, into summary.txt.
bench() {
  local name=$1 limit=$2 label=${3:-$1}
  shift 2
  [ $# -gt 0 ] && shift
  local run=$WORK/runs/$label log=$OUT/$label.log
  rm -rf "$run" && mkdir -p "$run"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$run/gpu_mem.txt" 2>/dev/null &
  local sampler=$!
  stage "$label" "$limit" "$log" env OMP_NUM_THREADS="$JOBS" "${RUN[@]}" "$BUILD/tetra" \
    --config "$REPO/configs/$name.json" --set "logging.dir=$run" --set "training.threads=$JOBS" "$@"
  local rc=$?
  kill $sampler 2>/dev/null
  wait $sampler 2>/dev/null
  { echo "--- $run/metrics.jsonl"; cat "$run/metrics.jsonl" 2>/dev/null; } >>"$log"
  grep -o "kernels: .*" "$log" | head -1 | sed "s/^/  $label: /" | tee -a "$OUT/summary.txt"
  grep -m1 -iE "peak.*(TFLOP|flops)|MFU against" "$log" | sed "s/^/  $label: /" | tee -a "$OUT/summary.txt"
  timeout 5 python3 - "$label" "$run" "$rc" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, statistics, sys
name, run, rc = sys.argv[1], sys.argv[2], sys.argv[3]
steps, peaks, memory = [], {}, None
try:
    for line in open(os.path.join(run, "metrics.jsonl")):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if j.get("event") == "memory":  # the plan beside the backend's measured peak, per rank
            memory = j["ranks"]
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
med = lambda k: statistics.median(s.get(k, float("nan")) for s in timed) if timed else float("nan")
print(f"  {name}: exit {rc}, {len(steps)} steps logged; tokens/s {med('tokens_per_s'):,.0f}, "
      f"MFU {100 * med('mfu'):.1f}% (median of {len(timed)} steps), ms/step {med('ms'):.1f}, "
      f"final loss {steps[-1].get('loss', float('nan')) if steps else float('nan'):.4f}")
print(f"  {name}: peak GPU memory in use {max(used) if used else float('nan'):,} MiB (nvidia-smi)"
      + "".join(f"; {k} {v / 2**20:,.0f} MiB" for k, v in peaks.items()))
for r in memory or []:
    print(f"  {name}: rank {r['rank']} device memory planned {r['planned_bytes'] / 2**20:,.1f} MiB, "
          f"measured peak {r['measured_peak_bytes'] / 2**20:,.1f} MiB "
          f"(ratio {r['measured_peak_bytes'] / max(r['planned_bytes'], 1):.4f})")
if memory is None:
    print(f"  {name}: no memory event in metrics.jsonl (the run did not finish)")
EOF
}
bench bench_gpt2_124m_cuda 50
# The same with selective recomputation of the norms and activations: its step time beside the
# run above, and its planned against measured device memory.
bench bench_gpt2_124m_cuda 35 bench_gpt2_124m_cuda_recompute --set 'training.recompute="selective"' \
  --set 'training.recompute_modules=["norm","act"]'
bench bench_llama_1b_cuda 70

# ---- training parity, with the time left ----------------------------------------------------------
stage train_parity 600 "$OUT/train_parity.log" env OMP_NUM_THREADS="$JOBS" "$PYTHON" \
  "$REPO/tests/cuda/test_train_parity.py" --tetra "$BUILD/tetra" --workdir "$WORK/train_parity"

note "total $(elapsed)s of ${TOTAL_S}s; $([ ${#FAILED[@]} -eq 0 ] && echo "no stage failed" || echo "failed: ${FAILED[*]}")$([ ${#SKIPPED[@]} -gt 0 ] && echo "; skipped: ${SKIPPED[*]}")"
[ ${#FAILED[@]} -eq 0 ]
