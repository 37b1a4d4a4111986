#!/usr/bin/env bash
# `tetra plot` on two short runs of reference_llama (two learning rates, evaluation every 3 steps):
#   - the SVG parses as XML; it has the six panels (loss against steps and tokens, validation loss,
#     learning rate, gradient norm, tokens/s) and in each one curve per run, named after the run,
#     with one point per step of that run's metrics.jsonl (per evaluation for validation loss);
#     its x extremes are the runs' first and last steps;
#   - --out as .png: a PNG where rsvg-convert or convert is installed, else exit 2 naming them;
#   - refusals (exit 2, naming the problem, nothing written): a directory without metrics.jsonl,
#     an existing output without --force, an output that is neither .svg nor .png, a damaged line
#     (a value of another type, a line that is not an object, a step below 1);
#   - a line cut short by an unfinished write is read past with a warning naming it.
#
# Usage: test_plot.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

case="runs"
for lr in 0.01 0.003; do
  "$tetra" --config "$src/configs/reference_llama.json" --set training.steps=7 --set training.threads=1 \
    --set training.eval_every=3 --set training.eval_steps=1 --set "optimizer.lr=$lr" \
    --set "logging.dir=$scratch/lr$lr" >"$scratch/lr$lr.txt" 2>&1 || fail "training lr $lr: $(tail -3 "$scratch/lr$lr.txt")"
done

case="svg"
if "$tetra" plot "$scratch/lr0.01" "$scratch/lr0.003" --out "$scratch/cmp.svg" >"$scratch/plot.txt" 2>&1; then
  grep -qx "$scratch/cmp.svg" "$scratch/plot.txt" || fail "the output path is not printed: $(cat "$scratch/plot.txt")"
  $py - "$scratch/cmp.svg" "$scratch" <<'PY' || fail "the SVG: see above"
import json, sys, xml.etree.ElementTree as ET
svg, scratch = sys.argv[1:]
ns = {"s": "http://www.w3.org/2000/svg"}
root = ET.parse(svg).getroot()
problems = []
panels = {p.get("data-series"): p for p in root.findall("s:g[@class='panel']", ns)}
want = ["loss", "loss_tokens", "val_loss", "lr", "grad_norm", "tokens_per_s"]
if sorted(panels) != sorted(want): problems.append(f"panels {sorted(panels)}")
for run in ["lr0.01", "lr0.003"]:
    steps = [json.loads(l) for l in open(f"{scratch}/{run}/metrics.jsonl") if '"step"' in l]
    steps = [s for s in steps if "step" in s]
    counts = {"loss": len(steps), "loss_tokens": len(steps), "lr": len(steps), "grad_norm": len(steps),
              "tokens_per_s": len(steps), "val_loss": sum("val_loss" in s for s in steps)}
    if counts["val_loss"] != 3: problems.append(f"{run}: {counts['val_loss']} evaluations in metrics.jsonl, not 3")
    for key, panel in panels.items():
        lines = [l for l in panel.findall("s:polyline[@class='series']", ns) if l.get("data-run") == run]
        if len(lines) != 1:
            problems.append(f"{key}: {len(lines)} curves for {run}"); continue
        points = lines[0].get("points").split()
        if len(points) != counts[key]: problems.append(f"{key} {run}: {len(points)} points, {counts[key]} values")
for key, panel in panels.items():
    texts = [t.text for t in panel.findall("s:text", ns)]
    if key not in ("loss_tokens", "val_loss") and not ("1" in texts and "7" in texts):
        problems.append(f"{key}: x extremes 1 and 7 not labelled: {texts}")
legend = [t.text for t in root.findall("s:g[@class='legend']/s:text", ns)]
if legend != ["lr0.01", "lr0.003"]: problems.append(f"legend {legend}")
for p in problems: print(p)
sys.exit(1 if problems else 0)
PY
else
  fail "tetra plot failed: $(tail -3 "$scratch/plot.txt")"
fi

case="png"
"$tetra" plot "$scratch/lr0.01" --out "$scratch/one.png" >"$scratch/png.txt" 2>&1
rc=$?
if command -v rsvg-convert >/dev/null 2>&1 || { command -v convert >/dev/null 2>&1 && convert -version 2>/dev/null | grep -q ImageMagick; }; then
  [[ $rc -eq 0 ]] || fail "exit $rc with a converter installed: $(tail -3 "$scratch/png.txt")"
  [[ "$(head -c 8 "$scratch/one.png" | od -An -tx1 | tr -d ' \n')" == 89504e470d0a1a0a ]] || fail "not a PNG"
  [[ ! -e "$scratch/one.png.svg.tmp" ]] || fail "the intermediate SVG was left behind"
else
  [[ $rc -eq 2 ]] || fail "exit $rc without a converter, not 2"
  grep -q "rsvg-convert" "$scratch/png.txt" || fail "the refusal does not name the converters"
fi

# expect_refusal <case> <pattern> <args...>: exit 2, the pattern on stderr.
expect_refusal() {
  case="$1"
  local pattern="$2"
  shift 2
  "$tetra" plot "$@" >"$scratch/out.txt" 2>"$scratch/err.txt"
  local rc=$?
  [[ $rc -eq 2 ]] || fail "exit $rc, not 2"
  grep -qF -- "$pattern" "$scratch/err.txt" || fail "stderr lacks '$pattern': $(cat "$scratch/err.txt")"
}
mkdir -p "$scratch/empty"
expect_refusal "no metrics.jsonl" "$scratch/empty: no metrics.jsonl" "$scratch/empty" --out "$scratch/x.svg"
[[ ! -e "$scratch/x.svg" ]] || fail "a plot was written"
expect_refusal "existing output" "the file exists (pass --force" "$scratch/lr0.01" --out "$scratch/cmp.svg"
expect_refusal "not svg or png" "the picture is .svg or .png" "$scratch/lr0.01" --out "$scratch/cmp.pdf"
mkdir -p "$scratch/bad_step" "$scratch/big_loss"
printf '{"step":1,"loss":2.0}\n{"step":"abc","loss":2.0}\n' >"$scratch/bad_step/metrics.jsonl"
expect_refusal "a step of another type" 'bad_step/metrics.jsonl:2: step: must be an integer, got the string "abc"' \
  "$scratch/bad_step" --out "$scratch/x.svg"
printf '{"step":1,"loss":1e400}\n' >"$scratch/big_loss/metrics.jsonl"
expect_refusal "a number beyond a double" "big_loss/metrics.jsonl:1:22: invalid JSON: number overflow" \
  "$scratch/big_loss" --out "$scratch/x.svg"
mkdir -p "$scratch/dir.svg"
expect_refusal "a directory as the output" "--out $scratch/dir.svg: is a directory; give a file name" \
  "$scratch/lr0.01" --out "$scratch/dir.svg" --force
mkdir -p "$scratch/fifo_run" && mkfifo "$scratch/fifo_run/metrics.jsonl"
case="a named pipe as metrics.jsonl"
timeout -s KILL 20 "$tetra" plot "$scratch/fifo_run" --out "$scratch/x.svg" >/dev/null 2>"$scratch/err.txt"
rc=$?
[[ $rc -eq 2 ]] && grep -qF "metrics.jsonl is a named pipe (FIFO)" "$scratch/err.txt" || fail "exit $rc: $(cat "$scratch/err.txt")"
mkdir -p "$scratch/dup_key"
printf '{"step":1,"loss":2.0}\n{"step":2,"loss":2.0,"loss":3}\n' >"$scratch/dup_key/metrics.jsonl"
expect_refusal "a key twice on a line" "dup_key/metrics.jsonl:2: loss: duplicate key" "$scratch/dup_key" --out "$scratch/x.svg"
# Values of another type, a line that is not an object, a step below 1: refused, not dropped.
mkdir -p "$scratch/loss_string" "$scratch/array_line" "$scratch/negative_step"
printf '{"step":1,"loss":2.0}\n{"step":2,"loss":"1.5"}\n' >"$scratch/loss_string/metrics.jsonl"
expect_refusal "a loss that is a string" 'loss_string/metrics.jsonl:2: loss: must be a number, got the string "1.5"' \
  "$scratch/loss_string" --out "$scratch/x.svg"
printf '{"step":1,"loss":2.0}\n[1,2,3]\n' >"$scratch/array_line/metrics.jsonl"
expect_refusal "a line that is an array" 'array_line/metrics.jsonl:2: each line of metrics.jsonl is a JSON object, this one is an array' \
  "$scratch/array_line" --out "$scratch/x.svg"
printf '{"step":-5,"loss":2.0}\n{"step":1,"loss":2.0}\n' >"$scratch/negative_step/metrics.jsonl"
expect_refusal "a negative step" 'negative_step/metrics.jsonl:1: step: -5 is not a step (steps count from 1)' \
  "$scratch/negative_step" --out "$scratch/x.svg"
[[ ! -e "$scratch/x.svg" ]] || fail "a plot was written"
printf '{"step":1,"loss":null,"lr":0.1}\n' >"$scratch/negative_step/metrics.jsonl"
case="a non-finite loss (null) is not a refusal"
"$tetra" plot "$scratch/negative_step" --out "$scratch/null.svg" >/dev/null 2>"$scratch/err.txt" ||
  fail "refused: $(cat "$scratch/err.txt")"

# A line cut short by a write that did not finish (a full disk) is read past with a warning naming
# it: the last line without its newline, one before a later run's start event, one that event was
# glued to (as a run appended before the writer started a new line). A damaged line elsewhere is
# still refused.
# expect_cut <case> <dir> <line>: plotted (exit 0) with a warning naming <dir>/metrics.jsonl:<line>.
expect_cut() {
  case="$1"
  "$tetra" plot "$2" --out "$scratch/cut.svg" --force >"$scratch/out.txt" 2>"$scratch/err.txt"
  local rc=$?
  [[ $rc -eq 0 ]] || fail "exit $rc, not 0: $(cat "$scratch/err.txt")"
  grep -qF "warning: $2/metrics.jsonl:$3: the line is cut short" "$scratch/err.txt" ||
    fail "no warning naming line $3: $(cat "$scratch/err.txt")"
}
start_event='{"event":"start","params":1000}'
mkdir -p "$scratch/cut_last" "$scratch/cut_before_start" "$scratch/cut_glued" "$scratch/cut_middle"
lines=$(wc -l <"$scratch/lr0.01/metrics.jsonl")
head -c -40 "$scratch/lr0.01/metrics.jsonl" >"$scratch/cut_last/metrics.jsonl"
expect_cut "a cut last line" "$scratch/cut_last" "$lines"
{ head -c -40 "$scratch/lr0.01/metrics.jsonl"; printf '\n%s\n{"step":9,"loss":1.0}\n' "$start_event"; } \
  >"$scratch/cut_before_start/metrics.jsonl"
expect_cut "a cut line before a later run's start" "$scratch/cut_before_start" "$lines"
{ head -c -40 "$scratch/lr0.01/metrics.jsonl"; printf '%s\n{"step":9,"loss":1.0}\n' "$start_event"; } \
  >"$scratch/cut_glued/metrics.jsonl"
expect_cut "a later run's start glued to a cut line" "$scratch/cut_glued" "$lines"
{ head -c -40 "$scratch/lr0.01/metrics.jsonl"; printf '\n{"step":9,"loss":1.0}\n'; } >"$scratch/cut_middle/metrics.jsonl"
expect_refusal "a cut line in the middle" "cut_middle/metrics.jsonl:$lines:" "$scratch/cut_middle" --out "$scratch/x.svg"
# A run in a logging.dir whose metrics.jsonl was cut: its lines start on a new line.
case="a run after a cut line"
cp -r "$scratch/cut_last" "$scratch/cut_then_run"
"$tetra" --config "$src/configs/reference_llama.json" --set training.steps=2 --set training.threads=1 \
  --set "logging.dir=$scratch/cut_then_run" >"$scratch/cut_then_run.txt" 2>&1 || fail "training: $(tail -3 "$scratch/cut_then_run.txt")"
grep -qF "metrics.jsonl: the last line is cut short" "$scratch/cut_then_run.txt" || fail "no warning of the cut line"
sed -n "$((lines + 1))p" "$scratch/cut_then_run/metrics.jsonl" | grep -q '^{"event":"start"' ||
  fail "the run's start event is not on a line of its own"
expect_cut "a run after a cut line" "$scratch/cut_then_run" "$lines"

case="--force"
"$tetra" plot "$scratch/lr0.01" --out "$scratch/cmp.svg" --force >/dev/null 2>&1 || fail "--force did not replace it"
case="default output"
"$tetra" plot "$scratch/lr0.01" >/dev/null 2>&1 && [[ -f "$scratch/lr0.01/plot.svg" ]] || fail "no plot.svg in the run directory"

finish "tetra plot checks"
