#!/usr/bin/env bash
# `tetra plan` end to end:
#   search      Llama-3 70B (configs/published) on 8 nodes of h100-80gb: exit 0; --json lists
#               layouts ranked by predicted tokens/s, each over all 64 GPUs, each fitting the usable
#               memory, each a layout the trainer itself accepts (written with --write-config and
#               dry-run by `tetra train`, whose memory plan is the one the planner printed);
#   explain     the config's own layout itemised: the step's parts add up to the step, the groups
#               of its layout are named, the same numbers as the search's entry for that layout;
#   refusals    a cluster file with a missing, unknown, mistyped or out-of-range key, a file that is
#               not JSON, a name that is neither a preset nor a file, too few GPUs for --explain,
#               no layout that fits, --write-config onto an existing file: exit 2 naming the key,
#               file or fix, the existing file untouched.
#
# Usage: test_plan.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cfg70="$src/configs/published/llama3_70b_tp4_pp8_vp5_dp2.json"

case="search"
if timeout 300 "$tetra" plan --config "$cfg70" --cluster h100-80gb --nodes 8 --top 8 --json \
    --write-config "$scratch/best.json" >"$scratch/search.json" 2>"$scratch/search.err"; then
  $py - "$scratch/search.json" <<'PY' || fail "the search's JSON: see above"
import json, sys
j = json.load(open(sys.argv[1]))
usable = j["cluster"]["gpu"]["memory_gib"] - j["cluster"]["gpu"]["reserved_gib"]
layouts = j["layouts"]
problems = []
if not 1 <= len(layouts) <= 8: problems.append(f"{len(layouts)} layouts printed for --top 8")
if j["fitting"] < len(layouts): problems.append("more layouts printed than fit")
if j["candidates"] != j["refused"] + j["too_big"] + j["fitting"] + j["dominated"]:
    problems.append(f"candidates {j['candidates']} != refused + too big + fitting + dominated")
rates = [l["tokens_per_s_per_gpu"] for l in layouts]
if rates != sorted(rates, reverse=True): problems.append(f"not ranked by tokens/s: {rates}")
for l in layouts:
    p = l["parallel"]
    if p["tp"] * p["cp"] * p["pp"] * p["dp"] != 64: problems.append(f"{l['layout']}: not 64 GPUs")
    if l["memory_gib"] > usable + 1e-9 or not l["fits"]: problems.append(f"{l['layout']}: over {usable} GiB")
    parts = l["compute_s"] + l["bubble_s"] + l["optimizer_s"] + l["exposed_comm_s"]
    if abs(parts - l["step_s"]) > 1e-6 * l["step_s"]:
        problems.append(f"{l['layout']}: parts {parts} != step {l['step_s']}")
    tokens = 128 * 8192 / l["step_s"] / 64
    if abs(tokens / l["tokens_per_s_per_gpu"] - 1) > 1e-9: problems.append(f"{l['layout']}: tokens/s inconsistent")
for p in problems: print(p)
sys.exit(1 if problems else 0)
PY
  # The written layout is one the trainer accepts, and its dry run plans the memory the planner printed.
  if "$tetra" train --config "$scratch/best.json" --dry-run >"$scratch/dry.txt" 2>&1; then
    best_gib=$($py -c "import json,sys; print(json.load(open(sys.argv[1]))['layouts'][0]['memory_gib'])" "$scratch/search.json")
    dry_mib=$(sed -n 's/^memory per rank: *\([0-9.]*\) MiB at the peak.*/\1/p' "$scratch/dry.txt")
    $py -c "import sys; g, m = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if abs(g * 1024 - m) <= 0.1 else 1)" \
      "$best_gib" "${dry_mib:-0}" || fail "planned $best_gib GiB, the dry run of the written config ${dry_mib:-nothing} MiB"
  else
    fail "the written best layout is refused by tetra train: $(tail -3 "$scratch/dry.txt")"
  fi
  # The table form names the same best layout.
  "$tetra" plan --config "$cfg70" --cluster h100-80gb --nodes 8 --top 3 >"$scratch/table.txt" 2>&1 ||
    fail "table form failed: $(tail -3 "$scratch/table.txt")"
  best=$($py -c "import json,sys; print(json.load(open(sys.argv[1]))['layouts'][0]['layout'])" "$scratch/search.json")
  grep -qF "$best" "$scratch/table.txt" || fail "the table does not show the best layout '$best'"
else
  fail "tetra plan exited $?: $(tail -5 "$scratch/search.err")"
fi

case="explain"
if "$tetra" plan --config "$cfg70" --cluster h100-80gb --nodes 8 --explain >"$scratch/explain.txt" 2>&1 &&
   "$tetra" plan --config "$cfg70" --cluster h100-80gb --nodes 8 --explain --json >"$scratch/explain.json" 2>&1; then
  for want in "tp 4 cp 1 pp 8 (interleaved x5) dp 2 zero 1" "fits" "bubble" "tp " "dp " "pp " "qkv" "attention"; do
    grep -qF "$want" "$scratch/explain.txt" || fail "--explain lacks '$want'"
  done
  $py - "$scratch/explain.json" "$scratch/search.json" <<'PY' || fail "--explain's JSON: see above"
import json, sys
e = json.load(open(sys.argv[1]))
problems = []
parts = e["compute_s"] + e["bubble_s"] + e["optimizer_s"] + e["exposed_comm_s"]
if abs(parts - e["step_s"]) > 1e-6 * e["step_s"]: problems.append(f"parts {parts} != step {e['step_s']}")
if set(e["groups"]) != {"tp", "pp", "dp"}: problems.append(f"groups {sorted(e['groups'])}")
if e["groups"]["tp"]["size"] != 4 or e["groups"]["tp"]["link"] != "intra_node": problems.append(f"tp {e['groups']['tp']}")
# order tp-cp-dp-pp: tp 4 x dp 2 fill a node of 8, each pipeline stage on its own node
if e["groups"]["dp"]["link"] != "intra_node": problems.append(f"dp {e['groups']['dp']}")
if e["groups"]["pp"]["link"] != "inter_node": problems.append(f"pp {e['groups']['pp']}")
try:
    for l in json.load(open(sys.argv[2]))["layouts"]:
        if l["layout"] == e["layout"] and abs(l["step_s"] / e["step_s"] - 1) > 1e-12:
            problems.append(f"the search says {l['step_s']} s for this layout, --explain {e['step_s']}")
except (OSError, ValueError):
    pass
for p in problems: print(p)
sys.exit(1 if problems else 0)
PY
else
  fail "--explain failed: $(tail -5 "$scratch/explain.txt")"
fi

# expect_refusal <case> <pattern> <tetra args...>: exit 2 and the pattern on stderr.
expect_refusal() {
  case="$1"
  local pattern="$2"
  shift 2
  "$tetra" "$@" >"$scratch/out.txt" 2>"$scratch/err.txt"
  local rc=$?
  [[ $rc -eq 2 ]] || fail "exit $rc, not 2: $(tail -3 "$scratch/err.txt")"
  grep -qF -- "$pattern" "$scratch/err.txt" || fail "stderr lacks '$pattern': $(tail -3 "$scratch/err.txt")"
}

# Cluster files, each with one fault.
$py - "$scratch" <<'PY'
import json, os, sys
d = sys.argv[1]
good = {"name": "mine", "nodes": 8, "gpus_per_node": 8,
        "gpu": {"memory_gib": 79.6, "reserved_gib": 1, "sms": 132, "gemm_tile": [128, 256],
                "peak_tflops": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, "gemm_efficiency": 0.8,
                "hbm_gbps": 3350, "hbm_efficiency": 0.9, "attention_efficiency": {"forward": 0.6, "backward": 0.45},
                "kernel_overhead_us": 4, "gemm_latency_us": 12},
        "intra_node": {"bandwidth_gbps": 370, "latency_us": 5}, "inter_node": {"bandwidth_gbps": 45, "latency_us": 12}}
def write(name, j):
    with open(os.path.join(d, name), "w") as f:
        f.write(j if isinstance(j, str) else json.dumps(j))
write("good.json", good)
b = json.loads(json.dumps(good)); del b["gpu"]["hbm_gbps"]; write("missing.json", b)
b = json.loads(json.dumps(good)); b["inter_node"]["bandwith_gbps"] = 40; write("unknown.json", b)
b = json.loads(json.dumps(good)); b["gpu"]["peak_tflops"]["bf16"] = "fast"; write("mistyped.json", b)
b = json.loads(json.dumps(good)); b["gpus_per_node"] = 0; write("range.json", b)
b = json.loads(json.dumps(good)); b["gpu"]["memory_gib"] = 1; b["gpu"]["reserved_gib"] = 0.5; write("small.json", b)
write("broken.json", '{"nodes": 8,')
write("dupkey.json", json.dumps(good).replace('"nodes": 8', '"nodes": 1, "nodes": 8'))
write("overflow.json", json.dumps(good).replace('"nodes": 8', '"nodes": 1e400'))
PY
case="good cluster file"
"$tetra" plan --config "$cfg70" --cluster "$scratch/good.json" --top 1 >"$scratch/good.txt" 2>&1 ||
  fail "a good cluster file refused: $(tail -3 "$scratch/good.txt")"
grep -q "^cluster: mine (8 nodes x 8 GPUs" "$scratch/good.txt" || fail "the file's cluster not named: $(head -1 "$scratch/good.txt")"
expect_refusal "missing key" "missing.json: gpu.hbm_gbps: missing" plan --config "$cfg70" --cluster "$scratch/missing.json"
expect_refusal "unknown key" "unknown.json: inter_node.bandwith_gbps: unknown key" plan --config "$cfg70" --cluster "$scratch/unknown.json"
expect_refusal "mistyped key" "gpu.peak_tflops.bf16: \"fast\" is not a number" plan --config "$cfg70" --cluster "$scratch/mistyped.json"
expect_refusal "out of range" "gpus_per_node: 0 is outside" plan --config "$cfg70" --cluster "$scratch/range.json"
expect_refusal "not JSON" "broken.json:1:13: invalid JSON" plan --config "$cfg70" --cluster "$scratch/broken.json"
expect_refusal "duplicate key" "dupkey.json: nodes: duplicate key" plan --config "$cfg70" --cluster "$scratch/dupkey.json"
expect_refusal "number beyond a double" "overflow.json:1:" plan --config "$cfg70" --cluster "$scratch/overflow.json"
mkfifo "$scratch/fifo.json"
timeout 20 "$tetra" plan --config "$cfg70" --cluster "$scratch/fifo.json" >"$scratch/out.txt" 2>"$scratch/err.txt"
[[ $? -eq 2 ]] && grep -qF "fifo.json is a named pipe (FIFO)" "$scratch/err.txt" ||
  fail "a named pipe as the cluster file: $(tail -2 "$scratch/err.txt")"
expect_refusal "no such cluster" "--cluster h100: neither a preset" plan --config "$cfg70" --cluster h100
expect_refusal "too few GPUs" "give --nodes 8" plan --config "$cfg70" --cluster h100-80gb --explain
expect_refusal "nothing fits" "no layout of this model fits" plan --config "$cfg70" --cluster "$scratch/small.json"
expect_refusal "more GPUs than the batch can use" "no layout of this model spans 100 x 8 GPUs" \
  plan --config "$src/configs/reference_llama.json" --cluster h100-80gb --nodes 100
expect_refusal "--nodes 0" "--nodes: 0: must be a whole number from 1 to 1048576" plan --config "$cfg70" \
  --cluster h100-80gb --nodes 0
mkdir -p "$scratch/a_dir"
expect_refusal "--write-config onto a directory" "--write-config $scratch/a_dir: is a directory" plan --config "$cfg70" \
  --cluster h100-80gb --nodes 8 --write-config "$scratch/a_dir" --force
[[ -z "$(ls -A "$scratch/a_dir")" && ! -e "$scratch/a_dir.tmp" ]] || fail "something was written for --write-config a_dir"
expect_refusal "no global batch" "training.global_batch_size" plan --config "$cfg70" --set training.global_batch_size=0 \
  --cluster h100-80gb

case="write-config onto an existing file"
echo keep >"$scratch/exists.json"
expect_refusal "$case" "--write-config $scratch/exists.json: the file exists (pass --force" plan --config "$cfg70" \
  --cluster h100-80gb --nodes 8 --write-config "$scratch/exists.json"
[[ "$(cat "$scratch/exists.json")" == keep ]] || fail "the existing file was changed"
"$tetra" plan --config "$cfg70" --cluster h100-80gb --nodes 8 --explain --write-config "$scratch/exists.json" --force \
  >/dev/null 2>&1 || fail "--force did not replace it"
grep -q '"virtual_stages": 5' "$scratch/exists.json" || fail "--explain --write-config did not write the config's layout"

case="the training log's planned step"
# (peak_gflops 0: measured, as in a real run; the reference configs set it to skip measuring)
if "$tetra" --config "$src/configs/reference_llama.json" --set training.steps=2 --set training.threads=1 \
    --set training.peak_gflops=0 --set "logging.dir=$scratch/run" >"$scratch/run.txt" 2>&1; then
  grep -q "planned step: .* ms on cpu-local (compute" "$scratch/run.txt" || fail "no 'planned step:' line at start-up"
  grep -q "step 2/2 | .* ms (planned [0-9.]*) |" "$scratch/run.txt" || fail "no planned time beside the step's"
  $py - "$scratch/run/metrics.jsonl" <<'PY' || fail "metrics.jsonl: see above"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
start = [r for r in rows if r.get("event") == "start"]
steps = [r for r in rows if "step" in r]
ok = start and start[0].get("planned_step_ms", 0) > 0 and len(steps) == 2 and \
    all(s.get("planned_ms") == start[0]["planned_step_ms"] for s in steps)
if not ok: print("planned_step_ms / planned_ms missing or different:", start, steps)
sys.exit(0 if ok else 1)
PY
else
  fail "training failed: $(tail -3 "$scratch/run.txt")"
fi
"$tetra" --config "$src/configs/reference_llama.json" --set training.steps=1 >"$scratch/given.txt" 2>&1 ||
  fail "training with a given peak failed: $(tail -3 "$scratch/given.txt")"
grep -q "planned step: not predicted, this machine's rates are not measured when training.peak_gflops is set" \
  "$scratch/given.txt" || fail "a given peak does not say why the step is not predicted"

finish "tetra plan checks"
