#!/usr/bin/env bash
# Where a training step's time goes under each parallel layout: compute, and the communication of
# each group that compute did not hide, side by side in one run on this machine.
#
# The same model (a GPT-2-style 6-layer, 512-hidden model, T = 256, global batch 8, fp32) trains
# BENCH_STEPS steps under each layout, every rank pinned to one core (ranks x threads = cores, so
# layouts are compared on equal hardware). From metrics.jsonl (global rank 0's view, steps after
# the first) it prints: ms per step; per group the time the step waited for it (blocked ms: the
# communication not overlapped with compute) and the bytes this rank sent; and compute = step -
# waits. The measured volumes are checked against the layout's prediction in every step.
#
# Usage: scripts/bench_comm.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6),
# BENCH_LAYOUTS ("dp tp sp distopt" quadruples separated by commas).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
CORES=$(nproc)
LAYOUTS=${BENCH_LAYOUTS:-"1 1 0 0, 2 1 0 0, 2 1 0 1, 1 2 0 0, 1 2 1 0"}
if [[ $CORES -ge 4 ]]; then LAYOUTS="$LAYOUTS, 2 2 1 1, 4 1 0 1"; fi

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "bench_comm: $(lscpu | sed -n 's/^Model name: *//p'), $CORES cores; $(mpirun --version | head -1)"
printf "%-26s %9s %9s %12s %12s %12s %12s\n" layout ms/step compute "tp wait ms" "tp MB sent" "dp wait ms" "dp MB sent"
IFS=',' read -ra CASES <<<"$LAYOUTS"
for case in "${CASES[@]}"; do
  read -r dp tp sp distopt <<<"$case"
  world=$((dp * tp))
  threads=$((CORES / world)); [[ $threads -ge 1 ]] || threads=1
  name="dp$dp tp$tp"
  if [[ $sp == 1 ]]; then name="$name sp"; fi
  if [[ $distopt == 1 ]]; then name="$name distopt"; fi
  sp_json=false; if [[ $sp == 1 ]]; then sp_json=true; fi
  distopt_json=false; if [[ $distopt == 1 ]]; then distopt_json=true; fi
  dir="$WORK/$dp-$tp-$sp-$distopt"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 256, "num_layers": 6, "hidden_size": 512, "num_heads": 8},
 "parallel": {"dp": $dp, "tp": $tp, "sequence_parallel": $sp_json,
              "distributed_optimizer": $distopt_json,
              "bucket_size": 4000000},
 "training": {"micro_batch_size": $((8 / dp < 4 ? 8 / dp : 4)), "global_batch_size": 8, "steps": $STEPS,
              "threads": $threads, "peak_gflops": 100},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
  cmd=("$TETRA_BIN" --config "$dir/config.json")
  if [[ $world -gt 1 ]]; then cmd=(mpirun --oversubscribe --bind-to ${BENCH_BIND:-core} -np "$world" "${cmd[@]}"); fi
  OMP_NUM_THREADS=$threads "${cmd[@]}" >"$dir/out" 2>&1 || { echo "$name: failed"; cat "$dir/out"; exit 1; }
  python3 - "$dir/metrics.jsonl" "$name" <<'PY'
import json, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "step" in j][1:]
def mean(f):
    return sum(f(s) for s in steps) / len(steps)
ms = mean(lambda s: s["ms"])
def group(g, key):
    return mean(lambda s: s.get("comm", {}).get(g, {}).get(key, 0.0))
waits = group("tp", "blocked_ms") + group("dp", "blocked_ms")
ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
print(f"{sys.argv[2]:<26} {ms:9.1f} {ms - waits:9.1f} {group('tp', 'blocked_ms'):12.1f} "
      f"{group('tp', 'sent_bytes') / 1e6:12.2f} {group('dp', 'blocked_ms'):12.1f} "
      f"{group('dp', 'sent_bytes') / 1e6:12.2f}{'' if ok else '  VOLUME MISMATCH'}")
PY
done
