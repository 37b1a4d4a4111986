#!/usr/bin/env bash
# Convergence and volume of gradient compression: the demo model (configs/demo.json) on the demo
# corpus, trained with parallel.grad_compression none, bf16 and onebit under the same data-parallel
# layout, from the same seed and data; then, per mode, the final training loss (the mean of the
# last 20 steps, and the last step's), the final validation loss, each against none's, and the DP
# bytes this rank sent per step (after onebit's warm-up, the same steps for every mode; with
# experts (model.moe), the expert-DP bytes included).
#
# The corpus and tokenizer must have been prepared by scripts/run.sh (it writes them under
# ${TETRA_DATA_DIR:-~/.cache/tetra}/sotu-bpe4096/). Targets: bf16 within 1% of none, onebit within 3%.
#
# Usage: scripts/bench_compression.sh [--set section.key=value ...]   (passed to every run, e.g. a
#        smaller model on a small machine: --set model.num_layers=2)
# Environment: TETRA_BIN (skip the build), TETRA_BUILD_DIR (default build-release), BENCH_DP (4),
# BENCH_PP (1; pipeline stages, dp x pp ranks, 1f1b),
# BENCH_STEPS (300), BENCH_WARMUP (onebit_warmup_steps, default 30% of the steps),
# BENCH_MODES ("none bf16 onebit"), BENCH_OUT (keep the runs there; default a temporary directory),
# BENCH_REUSE=1 (with BENCH_OUT: keep a mode's finished run of BENCH_STEPS steps instead of rerunning it).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DP=${BENCH_DP:-4}
PP=${BENCH_PP:-1}
STEPS=${BENCH_STEPS:-300}
WARMUP=${BENCH_WARMUP:-$((STEPS * 3 / 10))}
MODES=${BENCH_MODES:-"none bf16 onebit"}
CORES=$(nproc)
THREADS=$((CORES / (DP * PP))); [[ $THREADS -ge 1 ]] || THREADS=1

source "$REPO/scripts/bench_lib.sh"
bench_prepare "$REPO"
if [[ -n "${BENCH_OUT:-}" ]]; then
  WORK=$BENCH_OUT
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
fi

echo "bench_compression: dp $DP, pp $PP, $STEPS steps, onebit warm-up $WARMUP, $THREADS thread(s) per rank on $CORES cores;" \
     "extra settings: ${*:-none}"
for mode in $MODES; do
  dir="$WORK/$mode"
  if [[ "${BENCH_REUSE:-0}" == 1 && -f "$dir/metrics.jsonl" ]] &&
     [[ $(grep -c '"step"' "$dir/metrics.jsonl") == "$STEPS" ]]; then
    echo "  $mode: reused ($dir)"
    continue
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  # The demo's global batch (16 sequences) over dp ranks; no sampling, one evaluation at the end.
  OMP_NUM_THREADS=$THREADS mpirun --oversubscribe -np $((DP * PP)) "$TETRA_BIN" --config "$REPO/configs/demo.json" \
    --set parallel.dp="$DP" --set parallel.pp="$PP" --set training.micro_batch_size=$((16 / DP)) --set training.steps="$STEPS" \
    --set training.threads="$THREADS" --set training.eval_every=0 --set training.log_every=50 \
    --set sample.prompt= --set parallel.grad_compression="$mode" --set parallel.onebit_warmup_steps="$WARMUP" \
    --set logging.dir="$dir" "$@" >"$dir/out" 2>&1 || { echo "$mode: failed"; tail -20 "$dir/out"; exit 1; }
  echo "  $mode: done ($(grep -c '"step"' "$dir/metrics.jsonl") steps)"
done

python3 - "$WORK" "$WARMUP" $MODES <<'PY'
import json, os, sys
work, warmup, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
for mode in modes:
    steps = [j for j in map(json.loads, open(os.path.join(work, mode, "metrics.jsonl"))) if "step" in j]
    train = sum(s["loss"] for s in steps[-20:]) / len(steps[-20:])
    val = next((s["val_loss"] for s in reversed(steps) if "val_loss" in s), float("nan"))
    after = [s for s in steps if s["step"] > warmup]
    sent = sum(s["comm"]["dp"]["sent_bytes"] + s["comm"].get("edp", {}).get("sent_bytes", 0) for s in after) / len(after)
    ok = all(c["match"] for s in steps for c in s.get("comm", {}).values())
    rows[mode] = (train, steps[-1]["loss"], val, sent, ok)
base = rows.get("none")
print(f"{'mode':<8} {'train (last 20)':>16} {'last step':>10} {'val':>8} {'vs none':>9} {'val vs none':>12} "
      f"{'DP MB/step':>11} {'saved':>7}  volume")
for mode, (train, last, val, sent, ok) in rows.items():
    r = f"{100 * (train / base[0] - 1):+.2f}%" if base else "-"
    rv = f"{100 * (val / base[2] - 1):+.2f}%" if base else "-"
    saved = f"{100 * (1 - sent / base[3]):.1f}%" if base else "-"
    print(f"{mode:<8} {train:16.4f} {last:10.4f} {val:8.4f} {r:>9} {rv:>12} {sent / 1e6:11.3f} {saved:>7}  "
          f"{'== predicted' if ok else 'MISMATCH'}")
PY
