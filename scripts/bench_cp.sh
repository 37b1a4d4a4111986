#!/usr/bin/env bash
# Context parallelism side by side: a Llama-style model (RoPE, GQA, SwiGLU) at T = 8192 trained
# with parallel.cp 1 and 2 on this machine, one thread per rank (so cp 2 uses twice the cores: the
# question is what splitting the sequence buys per rank, not a same-core race). Per run: ms per
# step (steps after the first), the planned activation memory per rank (--dry-run's
# "activations" line) and every rank's measured peak backend memory beside its plan
# (metrics.jsonl's "memory" event; the CPU backend counts every allocation), the cp group's bytes
# sent per step and the time a step waited for them (the ring's exposed part: what the blocks
# computing meanwhile did not hide), and the losses against cp 1's (fp32: 1e-5 relative; bf16
# 2e-2) with the measured communication checked against the prediction in every step.
#
# Usage: scripts/bench_cp.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (3),
# BENCH_T (8192), BENCH_CPS ("1 2"), BENCH_CP_COMM (p2p), BENCH_PRECISION (fp32).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-3}
T=${BENCH_T:-8192}
CPS=${BENCH_CPS:-"1 2"}
COMM=${BENCH_CP_COMM:-p2p}
PRECISION=${BENCH_PRECISION:-fp32}

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "bench_cp: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; T $T, one thread per rank, $PRECISION, cp_comm $COMM"
printf "%-6s %10s %14s %16s %16s %12s %12s %8s\n" cp ms/step "act plan MiB" "peak MiB/rank" "plan MiB/rank" \
  "cp MB sent" "cp wait ms" loss
for cp in $CPS; do
  dir="$WORK/cp$cp"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": $T, "num_layers": 4, "hidden_size": 256, "num_heads": 8,
           "num_kv_heads": 2, "ffn_hidden_size": 704, "norm": "rmsnorm", "activation": "swiglu",
           "position": "rope", "tie_embeddings": false, "bias": false},
 "parallel": {"cp": $cp, "cp_comm": "$COMM"},
 "training": {"micro_batch_size": 1, "global_batch_size": 1, "steps": $STEPS, "threads": 1,
              "precision": "$PRECISION", "peak_gflops": 100, "seed": 5, "loss_chunk_rows": 1024},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
  "$TETRA_BIN" train --config "$dir/config.json" --dry-run >"$dir/plan" 2>&1
  OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to ${BENCH_BIND:-core} -np "$cp" "$TETRA_BIN" \
    --config "$dir/config.json" >"$dir/out" 2>&1 || { echo "cp $cp: failed"; cat "$dir/out"; exit 1; }
  python3 - "$dir/metrics.jsonl" "$cp" "$WORK/cp1/metrics.jsonl" "$dir/plan" "$PRECISION" <<'PY'
import json, os, re, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [j for j in lines if "step" in j]
timed = steps[1:] or steps
def mean(f):
    return sum(f(s) for s in timed) / len(timed)
ms = mean(lambda s: s["ms"])
wait = mean(lambda s: s.get("comm", {}).get("cp", {}).get("blocked_ms", 0.0))
sent = mean(lambda s: s.get("comm", {}).get("cp", {}).get("sent_bytes", 0.0))
ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
mem = [j for j in lines if j.get("event") == "memory"][-1]["ranks"]
peak = max(r["measured_peak_bytes"] for r in mem) / 2**20
plan = max(r["planned_bytes"] for r in mem) / 2**20
act = re.search(r"^\s*activations\s+([0-9.]+) MiB", open(sys.argv[4]).read(), re.M)
same = "ref"
if sys.argv[2] != "1" and os.path.exists(sys.argv[3]):
    ref = [j["loss"] for j in map(json.loads, open(sys.argv[3])) if "step" in j]
    worst = max(abs(s["loss"] - r) / abs(r) for s, r in zip(steps, ref))
    same = "ok" if worst <= (1e-5 if sys.argv[5] == "fp32" else 2e-2) else f"OFF {worst:.1e}"
print(f"cp {sys.argv[2]:<3} {ms:10.0f} {float(act.group(1)) if act else -1:14.1f} {peak:16.1f} {plan:16.1f} "
      f"{sent / 1e6:12.1f} {wait:12.1f} {same:>8}{'' if ok else '  VOLUME MISMATCH'}")
PY
done
