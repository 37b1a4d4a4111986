#!/usr/bin/env bash
# The timeline (training.profile_steps, trainer/train/step_trace.h) and the straggler line
# (trainer/train/straggler.h), read back by checks written here:
#   - a dp 2 x pp 2 run profiling steps 3 and 4, each rank's clock skewed by 0.5 s per rank
#     (TETRA_TEST_CLOCK_SKEW_MS): one file per rank, valid JSON in the Chrome trace format
#     (metadata names every process and thread; complete events with ts and dur; asynchronous
#     begin/end pairs matched); on every thread spans nest; each profiled step's span lasts what
#     metrics.jsonl says the step took, and its direct children (the step's phases) cover it
#     within 5%; there are op spans (GEMMs with their shape), pipeline slots, waits and collectives
#     naming their group and bytes, p2p transfers, the optimizer and the checkpoint save;
#   - the ranks share one clock: every collective of a group (the same operation on each member's
#     worker thread, in order) has an instant common to all its members' spans (no rank finishes
#     an all-reduce before every rank has started it), which the 0.5 s skews would break;
#   - `tetra trace merge`: one file with every rank's events, asynchronous ids unique; --svg draws
#     one lane per rank and thread, --step only that step's spans; refusals (exit 2): no rank files,
#     a file of another profiling window or time axis, a missing rank, a file that is not JSON,
#     --step without --svg, an existing output without --force;
#   - the config's refusals: profile_steps without logging.dir, reversed, beyond training.steps;
#   - straggler: a dp 2 run whose rank 1 sleeps 300 ms in every step (TETRA_TEST_SLOW_RANK) names
#     rank 1 as the straggler (window 3), with its coordinates, in the log and in metrics.jsonl (not
#     as a step record), and no other rank; the same run without the hook names none (window 5).
#     Both at factor 2.5, not the default 1.25: on a 2-core machine running other tests at once, a
#     rank that shares its core is 1.25x slower for five steps now and then (a real straggler, but
#     not the one under test); the slow rank runs ~10x its peer.
#
# Usage: test_trace.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi

case="profiled run"
run="$scratch/run"
if TETRA_TEST_CLOCK_SKEW_MS=500 timeout 300 "$mpirun" --oversubscribe -np 4 "$tetra" \
    --config "$src/configs/reference_llama.json" --set parallel.dp=2 --set parallel.pp=2 \
    --set model.seq_len=128 --set model.hidden_size=128 --set model.ffn_hidden_size=256 \
    --set training.global_batch_size=8 --set training.threads=1 --set training.steps=6 \
    --set 'training.profile_steps=[3,4]' --set logging.straggler_window=0 --set "logging.dir=$run" \
    --set "checkpoint.dir=$scratch/ckpt" --set checkpoint.every=4 >"$scratch/run.txt" 2>&1; then
  $py - "$run" <<'PY' || fail "the timelines: see above"
import json, sys
run = sys.argv[1]
problems = []
metrics = {j["step"]: j for j in map(json.loads, open(f"{run}/metrics.jsonl")) if "step" in j}
files = {}
for r in range(4):
    try:
        files[r] = json.load(open(f"{run}/trace/rank_{r}.json"))
    except Exception as e:
        problems.append(f"rank {r}: {e}")
if problems:
    print("\n".join(problems)); sys.exit(1)
EPS = 0.002  # µs: the files' rounding
worker_ops = {}  # (group, member coords) -> [(t0, t1)] per rank
for r, doc in files.items():
    other = doc["otherData"]
    ev = doc["traceEvents"]
    if other["rank"] != r or other["profile_steps"] != [3, 4]:
        problems.append(f"rank {r}: otherData {other}")
    meta = {(e["name"], e["tid"]): e["args"] for e in ev if e["ph"] == "M"}
    if ("process_name", 0) not in meta or f"r{r}]" not in meta[("process_name", 0)]["name"]:
        problems.append(f"rank {r}: process name {meta.get(('process_name', 0))}")
    threads = {tid: a["name"] for (n, tid), a in meta.items() if n == "thread_name"}
    X = [e for e in ev if e["ph"] == "X"]
    for e in X:
        if e["pid"] != r or e["dur"] < 0 or e["tid"] not in threads:
            problems.append(f"rank {r}: bad event {e}"); break
    # asynchronous pairs
    b = {e["id"]: e for e in ev if e["ph"] == "b"}
    en = {e["id"]: e for e in ev if e["ph"] == "e"}
    if set(b) != set(en) or any(en[i]["ts"] < b[i]["ts"] for i in b):
        problems.append(f"rank {r}: unmatched async begin/end pairs")
    # nesting, per thread
    by_tid = {}
    for e in X:
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, spans in by_tid.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in spans:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + EPS:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + EPS:
                problems.append(f"rank {r} {threads[tid]}: {e['name']} overlaps {stack[-1]['name']} without nesting")
                break
            e["parent"] = stack[-1]["name"] if stack else None
            e["depth"] = len(stack)
            stack.append(e)
    main = [t for t, n in threads.items() if n == "main"][0]
    for step in (3, 4):
        spans = [e for e in by_tid[main] if e["cat"] == "step" and e["name"] == f"step {step}"]
        if len(spans) != 1:
            problems.append(f"rank {r}: {len(spans)} spans of step {step}"); continue
        s = spans[0]
        ms = metrics[step]["ms"] if r == 0 else [x["ms"] for x in other["steps"] if x["step"] == step][0]
        if abs(s["dur"] / 1e3 - ms) > 0.01 * ms + 0.01:
            problems.append(f"rank {r} step {step}: span {s['dur'] / 1e3:.3f} ms, measured {ms:.3f} ms")
        kids = [e for e in by_tid[main] if e.get("depth") == s["depth"] + 1 and e["ts"] >= s["ts"] - EPS
                and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + EPS]
        cover = sum(k["dur"] for k in kids) / s["dur"]
        if not 0.95 <= cover <= 1.0 + 1e-6:
            problems.append(f"rank {r} step {step}: its phases sum to {cover:.3f} of it")
        names = {k["name"] for k in kids}
        for want in ("data", "forward-backward", "gradient reduction", "loss", "optimizer"):
            if want not in names:
                problems.append(f"rank {r} step {step}: no phase {want} ({sorted(names)})")
    cats = {e["cat"] for e in X}
    for want in ("op", "pipeline", "wait", "collective", "optimizer", "checkpoint", "phase", "step"):
        if want not in cats:
            problems.append(f"rank {r}: no {want} span")
    gemms = [e for e in X if e["cat"] == "op" and e["name"] == "gemm"]
    if not gemms or any(not all(k in e["args"] for k in ("M", "N", "K", "flops")) for e in gemms):
        problems.append(f"rank {r}: GEMM spans without their shape")
    if not any(e["cat"] == "op" and e["parent"] and e["parent"].startswith(("forward", "backward")) for e in X):
        problems.append(f"rank {r}: no op inside a pipeline slot")
    waits = [e for e in X if e["cat"] == "wait"]
    if any("group" not in e["args"] for e in waits):
        problems.append(f"rank {r}: a wait without its group")
    colls = [e for e in X if e["cat"] == "collective"]
    if not any(e["args"].get("group") == "dp" and e["args"].get("bytes", 0) > 0 for e in colls):
        problems.append(f"rank {r}: no dp collective with its bytes")
    p2p = [e for e in ev if e["ph"] == "b" and e["cat"] == "p2p"]
    if not p2p or any(e["args"].get("group") != "pp" or e["args"].get("bytes", 0) <= 0 for e in p2p):
        problems.append(f"rank {r}: p2p transfers {len(p2p)}, or without group pp and bytes")
    # collectives per group, on the group's worker thread, in order
    coords = (other["tp"], other["pp"], other["dp"])
    for tid, name in threads.items():
        if not name.startswith("comm "): continue
        group = name[5:]
        ops = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in by_tid.get(tid, []) if e["cat"] == "collective"]
        key = (group, coords[1] if group == "dp" else coords[2] if group == "pp" else None)
        worker_ops.setdefault(key, {})[r] = ops
# clock alignment: every collective's spans on its members share an instant
uncert = max(f["otherData"]["clock_uncertainty_ms"] for f in files.values()) * 1e3
offsets = [files[r]["otherData"]["clock_offset_ms"] for r in range(4)]
if any(abs(offsets[r] - 500 * r) > 50 for r in range(4)):
    problems.append(f"clock offsets {offsets} ms, skews 0, 500, 1000, 1500 ms")
checked = 0
for (group, _), per_rank in worker_ops.items():
    if group == "world" or len(per_rank) < 2: continue
    lists = list(per_rank.values())
    if len({len(l) for l in lists}) != 1:
        problems.append(f"group {group}: members ran {[len(l) for l in lists]} collectives"); continue
    for i in range(len(lists[0])):
        start = max(l[i][0] for l in lists)
        end = min(l[i][1] for l in lists)
        checked += 1
        if start > end + 2 * uncert + 200:  # µs
            problems.append(f"group {group} collective {i} ({lists[0][i][2]}): the last member starts "
                            f"{(start - end) / 1e3:.3f} ms after the first one ends")
            break
if checked < 4:
    problems.append(f"only {checked} collectives compared across ranks")
for p in problems: print(p)
sys.exit(1 if problems else 0)
PY
else
  fail "training failed: $(tail -3 "$scratch/run.txt")"
fi

case="merge"
if "$tetra" trace merge "$run" --svg "$scratch/timeline.svg" >"$scratch/merge.txt" 2>&1; then
  grep -q "^$run/trace/merged.json (4 ranks" "$scratch/merge.txt" || fail "output line: $(cat "$scratch/merge.txt")"
  $py - "$run/trace" "$scratch/timeline.svg" <<'PY' || fail "the merged trace: see above"
import json, sys, xml.etree.ElementTree as ET
d, svg = sys.argv[1:]
merged = json.load(open(f"{d}/merged.json"))
ranks = [json.load(open(f"{d}/rank_{r}.json")) for r in range(4)]
problems = []
if len(merged["traceEvents"]) != sum(len(r["traceEvents"]) for r in ranks):
    problems.append("events lost or added")
if {e["pid"] for e in merged["traceEvents"]} != {0, 1, 2, 3}:
    problems.append("not every rank is a process")
ids = [e["id"] for e in merged["traceEvents"] if e["ph"] == "b"]
if len(ids) != len(set(ids)):
    problems.append("asynchronous ids repeat across ranks")
ns = {"s": "http://www.w3.org/2000/svg"}
root = ET.parse(svg).getroot()
lanes = {(g.get("data-pid"), g.get("data-tid")) for g in root.findall("s:g[@class='lane']", ns)}
want = {(str(e["pid"]), str(e["tid"])) for e in merged["traceEvents"] if e["ph"] == "X"}
if lanes != want:
    problems.append(f"lanes {sorted(lanes)} != threads with spans {sorted(want)}")
rects = root.findall("s:g[@class='lane']/s:rect[@class='span']", ns)
if len(rects) != sum(e["ph"] == "X" for e in merged["traceEvents"]):
    problems.append(f"{len(rects)} boxes drawn for the spans")
for p in problems: print(p)
sys.exit(1 if problems else 0)
PY
else
  fail "tetra trace merge failed: $(cat "$scratch/merge.txt")"
fi

"$tetra" trace merge "$run" --svg "$scratch/step4.svg" --step 4 --out "$scratch/m4.json" >/dev/null 2>&1 ||
  fail "merge --step 4 failed"
$py - "$scratch/step4.svg" <<'PY' || fail "the picture of step 4: see above"
import sys, xml.etree.ElementTree as ET
ns = {"s": "http://www.w3.org/2000/svg"}
names = [t.text for t in ET.parse(sys.argv[1]).getroot().findall(".//s:rect[@class='span']/s:title", ns)]
steps = sorted({n.split(" (")[0] for n in names if n.startswith("step ") and n.split(" (")[0][5:].isdigit()})
if steps != ["step 4"]: print(f"--step 4 draws {steps}"); sys.exit(1)
PY

case="merge refusals"
refuse() {  # refuse <what> <expected message part> <args...>
  local what="$1" want="$2"; shift 2
  "$tetra" trace merge "$@" >"$scratch/refuse.txt" 2>&1
  local rc=$?
  [[ $rc -eq 2 ]] || fail "$what: exit $rc, not 2: $(cat "$scratch/refuse.txt")"
  grep -q -- "$want" "$scratch/refuse.txt" || fail "$what: message lacks '$want': $(cat "$scratch/refuse.txt")"
}
mkdir -p "$scratch/empty"
refuse "no rank files" "no rank_R.json" "$scratch/empty"
refuse "existing output" "pass --force" "$run"
mkdir -p "$scratch/other/trace"
other_run() {  # other_run <python edit of rank 1's file, d its JSON>: the run's four files, rank 1's edited
  cp "$run"/trace/rank_[0-3].json "$scratch/other/trace/"
  $py - "$scratch/other/trace/rank_1.json" "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); exec(sys.argv[2]); json.dump(d, open(sys.argv[1], "w"))
PY
}
other_run 'd["otherData"]["profile_steps"] = [2, 4]'
refuse "another window" "different runs" "$scratch/other"
other_run 'd["otherData"]["epoch_s"] += 5'
refuse "another time axis" "different runs" "$scratch/other"
other_run 'pass'
rm "$scratch/other/trace/rank_2.json"
refuse "a missing rank" "3 rank file(s) of a run of 4 ranks: rank_2.json is missing" "$scratch/other"
rm "$scratch/other/trace/rank_0.json"
refuse "two missing ranks" "rank_0.json, rank_2.json are missing" "$scratch/other"
other_run 'pass'
$py -c 'import json, sys; d = json.load(open(sys.argv[1])); d["otherData"]["rank"] = 7; json.dump(d, open(sys.argv[2], "w"))' \
  "$scratch/other/trace/rank_3.json" "$scratch/other/trace/rank_7.json"
refuse "a rank beyond the run's" "rank_7.json: rank 7's file in a run of 4 ranks" "$scratch/other"
rm "$scratch/other/trace/rank_7.json"
other_run 'pass'
refuse "--step without --svg" "give --svg too" "$scratch/other" --step 3
echo "{ not json" >"$scratch/other/trace/rank_1.json"
refuse "not JSON" "rank_1.json:1:4: invalid JSON" "$scratch/other"
other_run 'd["otherData"]["rank"] = "1"'
refuse "a rank of another type" 'rank_1.json: otherData.rank: must be an integer, got the string "1"' "$scratch/other"
other_run 'd["traceEvents"] = [{"ph": "X", "name": "x", "pid": 1, "tid": 0, "ts": 1}]'
refuse "a span without its duration" "rank_1.json: traceEvents\\[0\\].dur: missing" "$scratch/other"
other_run 'pass'
echo '{}' >"$scratch/other/trace/rank_99999999999.json"
refuse "a rank number beyond any run" "rank 99999999999 is beyond any run's" "$scratch/other"
rm "$scratch/other/trace/rank_99999999999.json"
rm "$scratch/other/trace/rank_1.json" && mkfifo "$scratch/other/trace/rank_1.json"
timeout -s KILL 20 "$tetra" trace merge "$scratch/other" >"$scratch/refuse.txt" 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -qF "rank_1.json is a named pipe (FIFO)" "$scratch/refuse.txt" ||
  fail "a named pipe as a rank file: exit $rc: $(cat "$scratch/refuse.txt")"
rm "$scratch/other/trace/rank_1.json"
other_run 'pass'
cp "$scratch/other/trace/rank_1.json" "$scratch/other/trace/rank_0001.json"
refuse "two files of one rank" "both hold rank 1's timeline" "$scratch/other"
rm "$scratch/other/trace/rank_0001.json"
other_run 'd["traceEvents"][0].update({"ph": "X", "ts": 1e308, "dur": 1e308})'
refuse "a time beyond any run" "is outside \\[" "$scratch/other" --svg "$scratch/huge.svg"
other_run 'pass'
refuse "--svg onto --out" "is the --out file too" "$scratch/other" --out "$scratch/same.json" --svg "$scratch/same.json"
refuse "--out onto a rank file" "is also an input" "$scratch/other" --out "$scratch/other/trace/rank_0.json" --force
[[ -e "$scratch/other/trace/merged.json" ]] && fail "a refused merge wrote merged.json"

case="config refusals"
config_refuse() {  # config_refuse <what> <message part> <--set args...>
  local what="$1" want="$2"; shift 2
  "$tetra" --config "$src/configs/reference_llama.json" --dry-run "$@" >"$scratch/cfg.txt" 2>&1
  local rc=$?
  [[ $rc -eq 2 ]] || fail "$what: exit $rc, not 2: $(tail -2 "$scratch/cfg.txt")"
  grep -q -- "$want" "$scratch/cfg.txt" || fail "$what: message lacks '$want': $(cat "$scratch/cfg.txt")"
}
config_refuse "no logging.dir" "training.profile_steps.*needs logging.dir" --set 'training.profile_steps=[1,2]'
config_refuse "reversed" "training.profile_steps.*1 <= first <= last" --set 'training.profile_steps=[3,2]' \
  --set "logging.dir=$scratch/x"
config_refuse "beyond the run" "training.profile_steps.*beyond training.steps" \
  --set 'training.profile_steps=[2,11]' --set "logging.dir=$scratch/x"
config_refuse "factor" "logging.straggler_factor" --set logging.straggler_factor=0.5
config_refuse "window" "logging.straggler_window" --set logging.straggler_window=20000

case="straggler"
for hook in slow none; do
  env_hook=(env)
  [[ $hook == slow ]] && env_hook=(env TETRA_TEST_SLOW_RANK=1 TETRA_TEST_SLOW_MS=300)
  window=$([[ $hook == slow ]] && echo 3 || echo 5)
  if "${env_hook[@]}" timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$src/configs/reference_llama.json" \
      --set parallel.dp=2 --set model.seq_len=128 --set model.hidden_size=128 --set model.ffn_hidden_size=256 \
      --set training.threads=1 --set training.steps=8 --set "logging.straggler_window=$window" \
      --set logging.straggler_factor=2.5 \
      --set "logging.dir=$scratch/$hook" >"$scratch/$hook.txt" 2>&1; then
    named=$(grep -o "straggler: rank [0-9]* \[[^]]*\]" "$scratch/$hook.txt" | sort -u)
    events=$($py -c "import json,sys; print(sorted({j['rank'] for j in map(json.loads, open(sys.argv[1])) if j.get('event') == 'straggler' and j['slow']}))" "$scratch/$hook/metrics.jsonl")
    if [[ $hook == slow ]]; then
      [[ "$named" == "straggler: rank 1 [tp0 pp0 dp1 ep0 | r1]" ]] || fail "slow rank 1: named '$named'"
      [[ "$events" == "[1]" ]] || fail "slow rank 1: metrics.jsonl straggler events for ranks $events"
      steps=$($py -c "import json,sys; print(sum('step' in j for j in map(json.loads, open(sys.argv[1]))))" "$scratch/$hook/metrics.jsonl")
      [[ "$steps" == 8 ]] || fail "metrics.jsonl holds $steps step records, not 8"
      grep -q "straggler: rank 1 .*x the median" "$scratch/$hook.txt" || fail "the line lacks the ratio"
    else
      [[ -z "$named" && "$events" == "[]" ]] || fail "no slow rank, yet named: '$named' $events"
    fi
  else
    fail "training ($hook) failed: $(tail -3 "$scratch/$hook.txt")"
  fi
done

finish "timeline and straggler checks"
