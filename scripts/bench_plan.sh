#!/usr/bin/env bash
# `tetra plan` held against this machine: for a dozen small layouts (one rank; dp with ZeRO 0/1/3;
# tp + SP; pp under 1f1b, gpipe and interleaved; cp; MoE with ep; recomputation; micro-batch
# sizes), the step time `tetra plan --cluster cpu-local --explain` predicts beside the step time
# the same config measures when it trains, one core and one thread per rank (the cpu-local
# cluster's "GPU" is one core). Prints the table, each row's error, the Spearman rank correlation
# of predicted and measured times, and the verdict against the targets (every row within 25%,
# Spearman >= 0.8). Exit 1 when a target is missed.
#
# Usage: scripts/bench_plan.sh
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_STEPS (6;
# the measured time is the median of the steps after the first two), BENCH_CASES (names of the
# cases to run, space-separated; default all).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-6}
CORES=$(nproc)
source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# name | ranks | model (dense|moe) | parallel JSON | training JSON (besides the common keys)
CASES=(
  "1 rank mbs 8|1|dense|{}|{\"micro_batch_size\": 8}"
  "1 rank mbs 2|1|dense|{}|{\"micro_batch_size\": 2}"
  "1 rank full recompute|1|dense|{}|{\"micro_batch_size\": 4, \"recompute\": \"full\"}"
  "dp 2|2|dense|{\"dp\": 2}|{\"micro_batch_size\": 4}"
  "dp 2 zero 1|2|dense|{\"dp\": 2, \"zero_stage\": 1}|{\"micro_batch_size\": 4}"
  "dp 2 zero 3|2|dense|{\"dp\": 2, \"zero_stage\": 3}|{\"micro_batch_size\": 2}"
  "tp 2 sp|2|dense|{\"tp\": 2, \"sequence_parallel\": true}|{\"micro_batch_size\": 4}"
  "pp 2 1f1b|2|dense|{\"pp\": 2, \"schedule\": \"1f1b\"}|{\"micro_batch_size\": 1}"
  "pp 2 gpipe|2|dense|{\"pp\": 2, \"schedule\": \"gpipe\"}|{\"micro_batch_size\": 2}"
  "pp 2 interleaved x2|2|dense|{\"pp\": 2, \"schedule\": \"interleaved\", \"virtual_stages\": 2}|{\"micro_batch_size\": 1}"
  "cp 2|2|dense|{\"cp\": 2}|{\"micro_batch_size\": 4}"
  "moe 1 rank|1|moe|{}|{\"micro_batch_size\": 4}"
  "moe dp 2 ep 2|2|moe|{\"dp\": 2, \"ep\": 2}|{\"micro_batch_size\": 4}"
)

dense='"vocab_size": 8192, "seq_len": 256, "num_layers": 4, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4,
       "ffn_hidden_size": 704, "norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": false'
moe="$dense"', "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 352}'

echo "bench_plan: $(lscpu | sed -n 's/^Model name: *//p'), $CORES cores; $(mpirun --version | head -1)"
echo "every rank one core, one thread; $STEPS steps, the median of steps 3..$STEPS; global batch 8 x 256 tokens, fp32"
printf "%-24s %6s %12s %12s %9s %12s\n" layout ranks "planned ms" "measured ms" error "log's plan"
rows="$WORK/rows.tsv"
: >"$rows"
for spec in "${CASES[@]}"; do
  IFS='|' read -r name ranks kind parallel training <<<"$spec"
  if [[ -n "${BENCH_CASES:-}" && " $BENCH_CASES " != *" $name "* ]]; then continue; fi
  if [[ $ranks -gt $CORES ]]; then echo "$name: needs $ranks cores, skipped"; continue; fi
  dir="$WORK/$(echo "$name" | tr ' ' '_')"
  mkdir -p "$dir"
  model=$dense; [[ $kind == moe ]] && model=$moe
  python3 - "$dir/config.json" "$model" "$parallel" "$training" "$STEPS" "$dir" <<'PY'
import json, sys
path, model, parallel, training, steps, d = sys.argv[1:]
t = {"precision": "fp32", "global_batch_size": 8, "steps": int(steps), "threads": 1, "log_every": 1}
t.update(json.loads(training))
cfg = {"model": json.loads("{" + model + "}"), "parallel": json.loads(parallel), "training": t,
       "optimizer": {"lr": 3e-4, "warmup_steps": 1}, "data": {"synthetic": True},
       "logging": {"dir": d, "level": "info"}}
json.dump(cfg, open(path, "w"), indent=1)
PY
  "$TETRA_BIN" plan --config "$dir/config.json" --cluster cpu-local --explain --json >"$dir/plan.json" 2>"$dir/plan.err" ||
    { echo "$name: tetra plan failed: $(tail -3 "$dir/plan.err")"; exit 1; }
  cmd=("$TETRA_BIN" --config "$dir/config.json")
  if [[ $ranks -gt 1 ]]; then cmd=(mpirun --bind-to core -np "$ranks" "${cmd[@]}"); fi
  OMP_NUM_THREADS=1 "${cmd[@]}" >"$dir/out" 2>&1 || { echo "$name: training failed"; tail -5 "$dir/out"; exit 1; }
  python3 - "$dir/plan.json" "$dir/metrics.jsonl" "$name" "$ranks" "$rows" <<'PY'
import json, statistics, sys
plan, metrics, name, ranks, rows = sys.argv[1:]
planned = json.load(open(plan))["step_s"] * 1e3
steps = [j for j in map(json.loads, open(metrics)) if "step" in j]
measured = statistics.median(s["ms"] for s in steps[2:])
logged = steps[-1].get("planned_ms")
err = planned / measured - 1
print(f"{name:<24} {ranks:>6} {planned:12.1f} {measured:12.1f} {100 * err:+8.1f}% "
      f"{'' if logged is None else f'{logged:12.1f}'}")
open(rows, "a").write(f"{name}\t{planned}\t{measured}\n")
PY
done
python3 - "$rows" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
planned = [float(r[1]) for r in rows]
measured = [float(r[2]) for r in rows]
def ranks(xs):  # average ranks for ties
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r
def pearson(a, b):
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a) ** 0.5
    vb = sum((y - mb) ** 2 for y in b) ** 0.5
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")
n = len(rows)
rho = pearson(ranks(planned), ranks(measured)) if n >= 2 else float("nan")
within = sum(abs(p / m - 1) <= 0.25 for p, m in zip(planned, measured))
worst = max(abs(p / m - 1) for p, m in zip(planned, measured)) if n else 0
print(f"{within} of {n} layouts within 25% of the measured step (worst {100 * worst:.1f}%); "
      f"Spearman rank correlation {rho:.3f}")
ok = n >= 8 and within == n and rho >= 0.8
print("targets (>= 8 layouts, every one within 25%, Spearman >= 0.8): " + ("met" if ok else "MISSED"))
sys.exit(0 if ok else 1)
PY
