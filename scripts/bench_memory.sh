#!/usr/bin/env bash
# Activation recomputation on this machine: step time and memory per recompute mode, side by side
# in one run (these shared machines drift between runs, so only figures from the same run compare).
#
# Model: GPT-2 124M (12 layers, hidden 768, 12 heads, vocab 50304, tied, learned positions),
# T = 1024, micro-batch 1 (BENCH_MB), bf16 (BENCH_PRECISION), synthetic data, all cores on one
# rank. Modes: none; selective norm+act; selective core_attn; full uniform 1; and none with the
# output layer and loss unfused (training.loss_chunk_rows 0).
#
# For each mode it prints ms/step (the median of the steps after the first) and its ratio to
# `none`, the measured peak of the backend's allocations (metrics.jsonl's final "memory" event,
# written at the end of a run), the plan's peak for the same rank (planned_bytes), their ratio,
# and the activations the plan holds (the --dry-run line). This is a benchmark, not a test:
# nothing is asserted.
#
# BENCH_MODEL=moe instead: a Mixtral-style MoE (4 blocks, hidden 512, 8 SwiGLU experts of ffn 1024,
# top-2, gates renormalised, dropless, vocab 8192), one rank, with modes none, selective moe_act
# and selective norm+act+moe_act: what recomputing the experts' activation costs.
#
# Usage: scripts/bench_memory.sh
# Environment: TETRA_BIN (skip the build; default build-cpu/tetra if it exists), TETRA_BUILD_DIR
# (default build-release), BENCH_STEPS (5), BENCH_MB (1), BENCH_PRECISION (bf16), BENCH_SEQ (1024),
# BENCH_MODEL (gpt2 or moe).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${BENCH_STEPS:-5}
MB=${BENCH_MB:-1}
PRECISION=${BENCH_PRECISION:-bf16}
SEQ=${BENCH_SEQ:-1024}
MODEL=${BENCH_MODEL:-gpt2}
CORES=$(nproc)
PY=/usr/bin/python3

if [[ -z "${TETRA_BIN:-}" && -x "$REPO/build-cpu/tetra" ]]; then TETRA_BIN="$REPO/build-cpu/tetra"; fi
source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ "$MODEL" == moe ]]; then
  MODEL_JSON='{"vocab_size": 8192, "seq_len": '$SEQ', "num_layers": 4, "hidden_size": 512, "num_heads": 8,
           "num_kv_heads": 4, "ffn_hidden_size": 2048, "norm": "rmsnorm", "activation": "swiglu", "position": "rope",
           "tie_embeddings": false, "bias": false,
           "moe": {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 1024, "router_pre_softmax": false}}'
  DESCRIBED="a Mixtral-style MoE (4 blocks, hidden 512, 8 experts of ffn 1024, top-2)"
else
  MODEL_JSON='{"vocab_size": 50304, "seq_len": '$SEQ', "num_layers": 12, "hidden_size": 768, "num_heads": 12,
           "ffn_hidden_size": 3072, "norm": "layernorm", "activation": "gelu", "position": "learned",
           "tie_embeddings": true, "bias": true}'
  DESCRIBED="GPT-2 124M"
fi
echo "bench_memory: $(lscpu | sed -n 's/^Model name: *//p'), $CORES cores; $DESCRIBED, T $SEQ, micro-batch $MB," \
     "$PRECISION, $STEPS steps per mode ($(date -u +%Y-%m-%d))"

run_case() {  # name recompute-json-fragment
  local name="$1" rc="$2"
  local dir="$WORK/${name// /_}"
  mkdir -p "$dir"
  cat >"$dir/config.json" <<JSON
{"model": $MODEL_JSON,
 "training": {"precision": "$PRECISION", "micro_batch_size": $MB, "global_batch_size": $MB, "steps": $STEPS,
              "threads": $CORES, "peak_gflops": 100, "log_every": 1, $rc},
 "optimizer": {"lr": 6e-4, "warmup_steps": 1},
 "data": {"synthetic": true},
 "logging": {"dir": "$dir", "level": "warn"}}
JSON
  "$TETRA_BIN" train --config "$dir/config.json" --dry-run >"$dir/plan" 2>&1 \
    || { echo "$name: dry run failed:"; tail -20 "$dir/plan"; exit 1; }
  "$TETRA_BIN" train --config "$dir/config.json" >"$dir/out" 2>&1 \
    || { echo "$name failed:"; tail -20 "$dir/out"; exit 1; }
  echo "$name" >"$dir/name"
  echo "$dir" >>"$WORK/cases"
}

run_case "none" '"recompute": "none"'
if [[ "$MODEL" == moe ]]; then
  run_case "selective moe_act" '"recompute": "selective", "recompute_modules": ["moe_act"]'
  run_case "selective norm+act+moe_act" '"recompute": "selective", "recompute_modules": ["norm", "act", "moe_act"]'
  run_case "none again" '"recompute": "none"'
else
run_case "selective norm+act" '"recompute": "selective", "recompute_modules": ["norm", "act"]'
run_case "selective core_attn" '"recompute": "selective", "recompute_modules": ["core_attn"]'
run_case "full uniform 1" '"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1'
# The output layer and loss unfused (the whole logits kept for the backward), against `none`'s
# fused chunks of loss_chunk_rows (1024: one chunk per micro-batch at T 1024, micro-batch 1; set
# BENCH_MB=4 for four).
run_case "none, unfused loss" '"recompute": "none", "loss_chunk_rows": 0'
fi

"$PY" - "$WORK/cases" <<'PY'
import json, re, statistics, sys
MIB = 1048576.0
rows = []
for d in open(sys.argv[1]).read().split():
    name = open(f"{d}/name").read().strip()
    lines = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    steps = [l for l in lines if "step" in l and "ms" in l]
    mem = [l for l in lines if l.get("event") == "memory"]
    ms = statistics.median(s["ms"] for s in steps[1:]) if len(steps) > 1 else float("nan")
    r = mem[-1]["ranks"][0] if mem else {}
    plan = open(f"{d}/plan").read()
    m = re.search(r"^\s+activations\s+([0-9.]+) MiB", plan, re.M)
    act = float(m.group(1)) if m else float("nan")
    rows.append((name, ms, r.get("measured_peak_bytes", 0) / MIB, r.get("planned_bytes", 0) / MIB, act))
base = rows[0][1]
base_act = rows[0][4]
print()
print("| recompute | ms/step (median) | vs none | measured peak MiB | planned peak MiB | measured / plan "
      "| planned activations MiB | activations saved |")
print("|---|---|---|---|---|---|---|---|")
for name, ms, peak, planned, act in rows:
    ratio = peak / planned if planned else float("nan")
    saved = 1 - act / base_act if base_act else float("nan")
    print(f"| {name} | {ms:.0f} | {ms / base:.2f}x | {peak:.1f} | {planned:.1f} | {ratio:.3f} | {act:.1f} | {100 * saved:.1f}% |")
PY
