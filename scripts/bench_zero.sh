#!/usr/bin/env bash
# ZeRO stages side by side: the same model and data trained under parallel.zero_stage 0 to 3 at
# dp 2 on this machine, every rank pinned to its share of the cores. Per stage: ms per step (steps
# after the first), the time a step waited for the DP group (exposed communication: what backward
# and the optimizer did not hide), the DP bytes this rank sent per step, the planned gradient
# bytes per rank (--dry-run's "gradients" line: the whole fp32 buffer, or ZeRO-2/3's shard and
# staging) and every rank's measured peak memory beside its plan (metrics.jsonl's "memory" event;
# the CPU backend counts every allocation). Each stage's losses are checked against stage 0's
# (fp32: sums reordered only, within 1e-5 relative; bf16: 2e-2, tests/parity/test_layouts.py's),
# and its measured communication against the prediction in every step.
# Stage 3's "grads MiB" is the gradients' line; its weights are a shard plus two gathered units.
#
# The model: GPT-2 style, 12 layers, 384 hidden, vocab 8192, T = 256 (24 M parameters), fp32
# (in bf16 the peak is the start-up's, while the whole fp32 weights are sharded: the same for
# every stage), global batch 8 of micro-batches of 2 (two per DP rank at dp 2: ZeRO-2
# reduce-scatters each micro-batch's gradient, ZeRO-1 the step's once).
#
# Usage: scripts/bench_zero.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6),
# BENCH_DP (2), BENCH_STAGES ("0 1 2"), BENCH_PRECISION (bf16).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
DP=${BENCH_DP:-2}
STAGES=${BENCH_STAGES:-"0 1 2 3"}
PRECISION=${BENCH_PRECISION:-fp32}
CORES=$(nproc)
THREADS=$((CORES / DP)); [[ $THREADS -ge 1 ]] || THREADS=1

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "bench_zero: $(lscpu | sed -n 's/^Model name: *//p'), $CORES cores; dp $DP x $THREADS threads; $PRECISION"
printf "%-8s %9s %12s %12s %12s %16s %16s %8s\n" stage ms/step "dp wait ms" "dp MB sent" "grads MiB" \
  "peak MiB/rank" "plan MiB/rank" "loss"
for stage in $STAGES; do
  dir="$WORK/zero$stage"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 256, "num_layers": 12, "hidden_size": 384, "num_heads": 6},
 "parallel": {"dp": $DP, "zero_stage": $stage, "bucket_size": 1000000},
 "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": $STEPS, "threads": $THREADS,
              "precision": "$PRECISION", "peak_gflops": 100, "seed": 5},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
  "$TETRA_BIN" train --config "$dir/config.json" --dry-run >"$dir/plan" 2>&1
  OMP_NUM_THREADS=$THREADS mpirun --oversubscribe --bind-to ${BENCH_BIND:-core} -np "$DP" "$TETRA_BIN" \
    --config "$dir/config.json" >"$dir/out" 2>&1 || { echo "zero $stage: failed"; cat "$dir/out"; exit 1; }
  python3 - "$dir/metrics.jsonl" "$stage" "$WORK/zero0/metrics.jsonl" "$dir/plan" "$PRECISION" <<'PY'
import json, re, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [j for j in lines if "step" in j]
timed = steps[1:]
def mean(f):
    return sum(f(s) for s in timed) / len(timed)
ms = mean(lambda s: s["ms"])
wait = mean(lambda s: s.get("comm", {}).get("dp", {}).get("blocked_ms", 0.0))
sent = mean(lambda s: s.get("comm", {}).get("dp", {}).get("sent_bytes", 0.0))
ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
mem = [j for j in lines if j.get("event") == "memory"][-1]["ranks"]
peak = max(r["measured_peak_bytes"] for r in mem) / 2**20
plan = max(r["planned_bytes"] for r in mem) / 2**20
ref = [j["loss"] for j in map(json.loads, open(sys.argv[3])) if "step" in j]
worst = max(abs(s["loss"] - r) / abs(r) for s, r in zip(steps, ref))
same = "ok" if worst <= (1e-5 if sys.argv[5] == "fp32" else 2e-2) or sys.argv[2] == "0" else f"OFF {worst:.1e}"
grads = re.search(r"^\s*gradients\s+([0-9.]+) MiB", open(sys.argv[4]).read(), re.M)
print(f"zero {sys.argv[2]:<3} {ms:9.1f} {wait:12.1f} {sent / 1e6:12.2f} {float(grads.group(1)) if grads else -1:12.1f} "
      f"{peak:16.1f} {plan:16.1f} {same:>8}"
      f"{'' if ok else '  VOLUME MISMATCH'}")
PY
done
