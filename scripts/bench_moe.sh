#!/usr/bin/env bash
# Expert parallelism on this machine: per training step, the time and bytes of the MoE token
# exchanges (dispatch and combine all-to-alls, forward and backward, with the count exchange)
# against the time of the expert computation, for ep = 1, 2 and 4 at dp = 4.
#
# The model: a GPT-2-style 4-block MoE (hidden 256, 8 experts of ffn 512, top-2, every block,
# dropless), T = 256, micro-batch 2, global batch 8 (one micro-batch per DP rank), fp32; 4 ranks of
# one thread each (on a 2-core machine they are oversubscribed: the all-to-all time then includes
# waiting for the ranks sharing a core). From metrics.jsonl (global rank 0's view, mean over the
# steps after the first) it prints: ms per step; expert ms (the expert GEMMs and activations,
# forward and backward); dispatch and combine ms (wall time of the exchanges, including waiting for
# the other ranks); the MB of tokens this rank sent to other EP ranks; and the ep group's blocked
# time and bytes as its communicator counted them. With ep > 1 each layout runs once per entry of
# BENCH_CHUNKS (parallel.ep_overlap_chunks, default "1 2"): the exchanges in that many chunks,
# overlapped with the experts (dispatch and combine ms are then the exposed part).
#
# BENCH_MODE=dense instead compares, on one rank of two threads, each MoE model with the dense
# model of the same active parameters and tokens (dense ffn = top_k x expert ffn, the router
# aside), side by side in one run: 4 blocks of hidden 256, T = 256, micro-batch 4, fp32, dropless;
# "8x512 top-2" (Mixtral-like) and the fine-grained "64x128 top-6" and "32x128 top-4". It prints
# ms per step of each (median of the steps after the first), the expert ms of the MoE one, and the
# ratio MoE step / dense step.
#
# Usage: scripts/bench_moe.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6),
# BENCH_EPS (default "1 2 4"), BENCH_CHUNKS (default "1 2"), BENCH_MODE (exchange, or dense).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
EPS=${BENCH_EPS:-"1 2 4"}
CHUNKS=${BENCH_CHUNKS:-"1 2"}
MODE=${BENCH_MODE:-exchange}

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ "$MODE" == dense ]]; then
  echo "bench_moe (MoE vs dense of the same active size, 1 rank, 2 threads): $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  # run NAME MLP-JSON: one 1-rank training run; prints "median-ms expert-ms".
  run() {
    local dir="$WORK/$1"
    mkdir -p "$dir"
    cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 256, "num_layers": 4, "hidden_size": 256, "num_heads": 4, $2},
 "training": {"micro_batch_size": 4, "global_batch_size": 4, "steps": $STEPS, "threads": 2, "peak_gflops": 100},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
    "$TETRA_BIN" --config "$dir/config.json" >"$dir/out" 2>&1 || { echo "$1: failed" >&2; cat "$dir/out" >&2; exit 1; }
    python3 - "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "step" in j][1:]
ms = statistics.median(s["ms"] for s in steps)
ex = statistics.median(s.get("moe", {}).get("expert_ms", 0.0) for s in steps)
print(f"{ms:.1f} {ex:.1f}")
PY
  }
  printf "%-16s %12s %11s %14s %10s\n" model "dense ms" "MoE ms" "MoE expert ms" "MoE/dense"
  for spec in "8x512 top-2:8:2:512" "64x128 top-6:64:6:128" "32x128 top-4:32:4:128"; do
    IFS=: read -r name E k F <<<"$spec"
    read -r dense_ms _ < <(run "dense$E" "\"ffn_hidden_size\": $((k * F))")
    read -r moe_ms expert_ms < <(run "moe$E" "\"moe\": {\"num_experts\": $E, \"top_k\": $k, \"ffn_hidden_size\": $F}")
    python3 -c "import sys; n, d, m, e = sys.argv[1:]; print(f'{n:<16} {float(d):12.1f} {float(m):11.1f} {float(e):14.1f} {float(m) / float(d):10.2f}')" \
      "$name" "$dense_ms" "$moe_ms" "$expert_ms"
  done
  exit 0
fi

echo "bench_moe: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(mpirun --version | head -1)"
printf "%-18s %9s %10s %12s %11s %14s %12s %11s\n" layout ms/step "expert ms" "dispatch ms" "combine ms" \
  "tokens MB sent" "ep wait ms" "ep MB sent"
for ep in $EPS; do
 for chunks in $CHUNKS; do
  [[ "$ep" == 1 && "$chunks" != 1 ]] && continue
  [[ "$chunks" -gt $((8 / ep)) ]] && continue  # at most the 8 experts / ep a rank holds
  dir="$WORK/ep${ep}_c$chunks"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 256, "num_layers": 4, "hidden_size": 256, "num_heads": 4,
           "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 512}},
 "parallel": {"dp": 4, "ep": $ep, "ep_overlap_chunks": $chunks},
 "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": $STEPS, "threads": 1, "peak_gflops": 100},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
  OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 4 "$TETRA_BIN" --config "$dir/config.json" \
    >"$dir/out" 2>&1 || { echo "ep $ep: failed"; cat "$dir/out"; exit 1; }
  python3 - "$dir/metrics.jsonl" "dp4 ep$ep chunks $chunks" <<'PY'
import json, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "step" in j][1:]
def mean(f):
    return sum(f(s) for s in steps) / len(steps)
moe = lambda k: mean(lambda s: s["moe"][k])
ep = lambda k: mean(lambda s: s.get("comm", {}).get("ep", {}).get(k, 0.0))
ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
print(f"{sys.argv[2]:<18} {mean(lambda s: s['ms']):9.1f} {moe('expert_ms'):10.1f} {moe('dispatch_ms'):12.1f} "
      f"{moe('combine_ms'):11.1f} {(moe('dispatch_bytes') + moe('combine_bytes')) / 1e6:14.2f} "
      f"{ep('blocked_ms'):12.1f} {ep('sent_bytes') / 1e6:11.2f}{'' if ok else '  VOLUME MISMATCH'}")
PY
 done
done
