#!/usr/bin/env bash
# Pipeline schedules side by side on this machine: per-step time, the measured bubble (the share of
# the schedule's time the pipeline ranks did not compute) and the analytic one, for gpipe, 1f1b and
# interleaved (2 virtual stages), against the same model on one rank with the same total cores.
#
# Model: GPT-2 style, 8 layers, hidden 384, T = 128, micro-batch 2, global batch 16 (m = 8
# micro-batches per step), fp32. Each pipeline rank gets cores / pp threads (pp = 2 by default,
# so ranks x threads = cores and the layouts compare on equal hardware). Steps after the first
# are averaged; measured communication is checked against the prediction in every step.
#
# Usage: scripts/bench_pipeline.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6),
# BENCH_PP (2), BENCH_MICRO_BATCHES (8).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
PP=${BENCH_PP:-2}
M=${BENCH_MICRO_BATCHES:-8}
CORES=$(nproc)

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "bench_pipeline: $(lscpu | sed -n 's/^Model name: *//p'), $CORES cores; pp $PP, $M micro-batches per step"
printf "%-22s %9s %10s %12s %12s %s\n" layout ms/step "vs 1 rank" "bubble" "ideal" "in flight per rank"
run_case() {  # name pp schedule virtual_stages
  local name="$1" pp="$2" schedule="$3" vp="$4"
  local threads=$((CORES / pp)); [[ $threads -ge 1 ]] || threads=1
  local dir="$WORK/$name"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 128, "num_layers": 8, "hidden_size": 384, "num_heads": 6},
 "parallel": {"pp": $pp, "schedule": "$schedule", "virtual_stages": $vp},
 "training": {"micro_batch_size": 2, "global_batch_size": $((2 * M)), "steps": $STEPS, "threads": $threads,
              "peak_gflops": 100, "log_every": 1000},
 "optimizer": {"lr": 1e-3},
 "data": {"synthetic": true},
 "logging": {"dir": "$dir", "level": "warn"}}
JSON
  if [[ $pp -gt 1 ]]; then
    mpirun --oversubscribe --bind-to none -np "$pp" "$TETRA_BIN" --config "$dir/config.json" >"$dir/out" 2>&1
  else
    "$TETRA_BIN" --config "$dir/config.json" >"$dir/out" 2>&1
  fi || { echo "$name failed:"; tail -20 "$dir/out"; exit 1; }
  /usr/bin/python3 - "$dir/metrics.jsonl" "$name" "${BASELINE_MS:-0}" <<'PY'
import json, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "step" in j][1:]
name, base = sys.argv[2], float(sys.argv[3])
ms = sum(s["ms"] for s in steps) / len(steps)
bad = [s["step"] for s in steps for c in s.get("comm", {}).values() if not c["match"]]
if bad:
    sys.exit(f"{name}: measured communication differs from the prediction in steps {bad}")
p = [s.get("pipeline") for s in steps]
ratio = f"{ms / base:9.2f}x" if base > 0 else f"{'1.00x':>10}"
if p[0]:
    bubble = sum(x["bubble"] for x in p) / len(p)
    print(f"{name:<22} {ms:9.1f} {ratio} {100 * bubble:11.1f}% {100 * p[0]['ideal_bubble']:11.1f}% {p[0]['peak_in_flight']}")
else:
    print(f"{name:<22} {ms:9.1f} {ratio} {'-':>12} {'-':>12}")
open(sys.argv[1] + ".ms", "w").write(str(ms))
PY
}
run_case "1 rank" 1 1f1b 1
BASELINE_MS=$(cat "$WORK/1 rank/metrics.jsonl.ms")
export BASELINE_MS
run_case "pp$PP gpipe" "$PP" gpipe 1
run_case "pp$PP 1f1b" "$PP" 1f1b 1
run_case "pp$PP interleaved v2" "$PP" interleaved 2
