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
# time and bytes as its communicator counted them.
#
# Usage: scripts/bench_moe.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6),
# BENCH_EPS (default "1 2 4").
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
EPS=${BENCH_EPS:-"1 2 4"}

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "bench_moe: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(mpirun --version | head -1)"
printf "%-10s %9s %10s %12s %11s %14s %12s %11s\n" layout ms/step "expert ms" "dispatch ms" "combine ms" \
  "tokens MB sent" "ep wait ms" "ep MB sent"
for ep in $EPS; do
  dir="$WORK/ep$ep"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": {"vocab_size": 8192, "seq_len": 256, "num_layers": 4, "hidden_size": 256, "num_heads": 4,
           "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 512}},
 "parallel": {"dp": 4, "ep": $ep},
 "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": $STEPS, "threads": 1, "peak_gflops": 100},
 "data": {"synthetic": true}, "logging": {"dir": "$dir", "level": "warn"}}
JSON
  OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 4 "$TETRA_BIN" --config "$dir/config.json" \
    >"$dir/out" 2>&1 || { echo "ep $ep: failed"; cat "$dir/out"; exit 1; }
  python3 - "$dir/metrics.jsonl" "dp4 ep$ep" <<'PY'
import json, sys
steps = [j for j in map(json.loads, open(sys.argv[1])) if "step" in j][1:]
def mean(f):
    return sum(f(s) for s in steps) / len(steps)
moe = lambda k: mean(lambda s: s["moe"][k])
ep = lambda k: mean(lambda s: s.get("comm", {}).get("ep", {}).get(k, 0.0))
ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
print(f"{sys.argv[2]:<10} {mean(lambda s: s['ms']):9.1f} {moe('expert_ms'):10.1f} {moe('dispatch_ms'):12.1f} "
      f"{moe('combine_ms'):11.1f} {(moe('dispatch_bytes') + moe('combine_bytes')) / 1e6:14.2f} "
      f"{ep('blocked_ms'):12.1f} {ep('sent_bytes') / 1e6:11.2f}{'' if ok else '  VOLUME MISMATCH'}")
PY
done
