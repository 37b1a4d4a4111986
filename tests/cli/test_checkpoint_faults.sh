#!/usr/bin/env bash
# What a run writes, and what it resumes from, when its input or its checkpoint directory is not
# what it should be (one process, a tiny Llama-style model on synthetic data). Each case is a fault
# a user can make or a crash can leave; each expects exit 2 before step 1 (the key or file named,
# nothing written) or the documented recovery:
#  - checkpoint.dir an existing file, or below one; --dump-dir below a file: exit 2 before step 1;
#  - `latest` missing beside complete step_* directories: resume from the newest, say so, rotate
#    nothing away; `latest` naming a directory outside checkpoint.dir: exit 2;
#  - checkpoint.resume "none" into a directory that holds checkpoints: exit 2, nothing touched;
#  - a checkpoint.dir that another run holds (its .lock): exit 2 naming it; free, the run goes on;
#  - manifest fields of the wrong type, a step that disagrees with the directory's name, a slice
#    outside its tensor: exit 2 naming manifest and field, from tetra train and tetra ckpt alike;
#  - a checkpoint problem found at resume writes no logging.dir;
#  - config: a number beyond a double (1e999) names file:line:col; a named pipe as --config is
#    refused at once; a NUL in a key is printed escaped; a NUL in logging.dir is refused and
#    nothing is created; schedule interleaved with pp 1 is a config error.
#
# Usage: test_checkpoint_faults.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# config <dir> <steps> [checkpoint members] [extra top-level members]: writes $dir/config.json.
config() {
  local d="$1" steps="$2" ck="${3:-}" extra="${4:-}"
  mkdir -p "$d"
  cat >"$d/config.json" <<JSON
{
  "model": {"vocab_size": 64, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": 64},
  "training": {"micro_batch_size": 2, "global_batch_size": 4, "steps": $steps, "threads": 1,
               "peak_gflops": 10},
  "data": {"synthetic": true},
  "checkpoint": {"dir": "$d/ckpt", "every": 2, "keep": 2 ${ck:+, $ck}},
  "logging": {"dir": "$d/logs"} ${extra:+, $extra}
}
JSON
}
# train <dir> [args...]: runs tetra on $dir/config.json; sets $rc, output in $dir/out, $dir/err.
train() {
  local d="$1"
  shift
  timeout 60 "$tetra" --config "$d/config.json" "$@" >"$d/out" 2>"$d/err"
  rc=$?
}
expect_input_error() {  # expect_input_error <dir> <pattern>: exit 2, the pattern in stderr, no step
  [[ $rc -eq 2 ]] || fail "exit $rc, expected 2; stderr: $(tail -3 "$1/err")"
  grep -q -- "$2" "$1/err" || fail "stderr lacks '$2': $(tail -3 "$1/err")"
  grep -q "step *1[ /:]" "$1/out" && fail "it trained before refusing"
  return 0
}
digest() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum) | sha256sum; }

# A run of 6 steps whose checkpoints (steps 4 and 6, keep 2) the cases below copy.
base="$scratch/base"
config "$base" 6
train "$base"
[[ $rc -eq 0 && -d "$base/ckpt/step_00000006" && -d "$base/ckpt/step_00000004" ]] ||
  { echo "FAIL: the base run: exit $rc; $(tail -3 "$base/err")"; exit 1; }

case="checkpoint.dir is a file"
d="$scratch/ckfile"
config "$d" 4
: >"$d/ckpt"
train "$d"
expect_input_error "$d" "checkpoint.dir: .*exists and is not a directory"
[[ -e "$d/logs" ]] && fail "logging.dir was created"

case="checkpoint.dir below a file"
d="$scratch/ckbelow"
config "$d" 4
sed -i "s|\"dir\": \"$d/ckpt\"|\"dir\": \"$d/afile/ckpt\"|" "$d/config.json"
: >"$d/afile"
train "$d"
expect_input_error "$d" "checkpoint.dir: cannot create .*afile is not a directory"

case="--dump-dir below a file"
d="$scratch/dumpbelow"
config "$d" 2
: >"$d/afile"
train "$d" --dump-dir "$d/afile/dump"
expect_input_error "$d" "\-\-dump-dir: cannot create .*afile is not a directory"
[[ -e "$d/logs" ]] && fail "logging.dir was created"

case="latest missing beside complete checkpoints"
d="$scratch/nolatest"
config "$d" 8 '"resume": "auto"'
cp -r "$base/ckpt" "$d/ckpt"
rm "$d/ckpt/latest"
train "$d"
[[ $rc -eq 0 ]] || fail "exit $rc; $(tail -3 "$d/err")"
grep -q "latest is missing; resuming from the newest complete checkpoint, .*step_00000006" "$d/out" ||
  fail "the log does not say it resumed from step_00000006: $(grep -i resum "$d/out")"
grep -q "checkpoint .*step_00000006 loaded" "$d/out" || fail "step_00000006 was not loaded"
[[ "$(cat "$d/ckpt/latest")" == step_00000008 ]] || fail "latest is $(cat "$d/ckpt/latest")"

case="latest pointing outside checkpoint.dir"
d="$scratch/latestout"
config "$d" 8 '"resume": "auto"'
cp -r "$base/ckpt" "$d/ckpt"
echo "../../base/ckpt/step_00000004" >"$d/ckpt/latest"
before=$(digest "$d/ckpt")
train "$d"
expect_input_error "$d" "latest names \"../../base/ckpt/step_00000004\", which is not a checkpoint directory of"
[[ "$(digest "$d/ckpt")" == "$before" ]] || fail "the checkpoint directory changed"
[[ -e "$d/logs" ]] && fail "logging.dir was created"

case="resume none into a directory with checkpoints"
d="$scratch/resumenone"
config "$d" 4 '"resume": "none"'
cp -r "$base/ckpt" "$d/ckpt"
before=$(digest "$d/ckpt")
train "$d"
expect_input_error "$d" "already holds 2 checkpoint(s) .*checkpoint.resume is \"none\""
[[ "$(digest "$d/ckpt")" == "$before" ]] || fail "the checkpoint directory changed"

# manifest_case <name> <python statement on m (the manifest)> <pattern>: the edited manifest is
# refused by the trainer (exit 2, no logging.dir) and by tetra ckpt inspect (exit 2).
manifest_case() {
  case="manifest: $1"
  d="$scratch/manifest_$(echo "$1" | tr -c 'a-z0-9' _)"
  config "$d" 8 '"resume": "auto"'
  cp -r "$base/ckpt" "$d/ckpt"
  "$py" - "$d/ckpt/step_00000006/manifest.json" <<PY
import json, sys
m = json.load(open(sys.argv[1]))
$2
json.dump(m, open(sys.argv[1], "w"))
PY
  before=$(digest "$d/ckpt")
  train "$d"
  expect_input_error "$d" "$3"
  [[ -e "$d/logs" ]] && fail "logging.dir was written for a checkpoint problem"
  [[ "$(digest "$d/ckpt")" == "$before" ]] || fail "the checkpoint directory changed"
  "$tetra" ckpt inspect "$d/ckpt/step_00000006" >"$d/inspect.out" 2>"$d/inspect.err"
  local irc=$?
  [[ $irc -eq 2 ]] && grep -q -- "$3" "$d/inspect.err" ||
    fail "tetra ckpt inspect: exit $irc, stderr: $(cat "$d/inspect.err")"
}
manifest_case "step a string" 'm["step"] = "6"' 'manifest.json: field step is "6", not an integer'
manifest_case "crc32 a string" \
  'k = next(iter(m["tensors"])); m["tensors"][k]["slices"][0]["crc32"] = "abc"' \
  'manifest.json: field tensors\[".*"\].slices\[0\].crc32 is "abc", not an integer'
manifest_case "step of another directory" 'm["step"] = 4; m["consumed_samples"] = 16' \
  'field step is 4, but the directory step_00000006 holds step 6'
manifest_case "slice outside its tensor" \
  'k = "model/final_norm.weight"; m["tensors"][k]["slices"][0]["region"][0] = 5' \
  'lies outside the tensor'
manifest_case "slice file outside the checkpoint" \
  'k = next(iter(m["tensors"])); m["tensors"][k]["slices"][0]["file"] = "../x.safetensors"' \
  'is not a file of the checkpoint'

case="two runs on one checkpoint.dir"
d="$scratch/locked"
config "$d" 8 '"resume": "auto"'
cp -r "$base/ckpt" "$d/ckpt"
exec 9>"$d/ckpt/.lock"  # another run holds the directory: this shell, on descriptor 9
flock -n 9 || fail "the test could not take the lock itself"
train "$d"
exec 9>&-
expect_input_error "$d" "checkpoint.dir .* is in use by another run"
[[ "$(cat "$d/ckpt/latest")" == step_00000006 ]] || fail "latest changed to $(cat "$d/ckpt/latest")"
train "$d"  # once it is free, the run goes on
[[ $rc -eq 0 ]] || fail "with the lock free: exit $rc; $(tail -3 "$d/err")"

case="checkpoint of another model writes no logging.dir"
d="$scratch/othermodel"
config "$d" 8 '"resume": "auto"'
cp -r "$base/ckpt" "$d/ckpt"
sed -i 's/"num_layers": 2/"num_layers": 3/' "$d/config.json"
train "$d"
expect_input_error "$d" "the checkpoint holds another model (model.num_layers: checkpoint 2, config 3)"
[[ -e "$d/logs" ]] && fail "logging.dir was created"

case="a number beyond a double"
d="$scratch/overflow"
config "$d" 2 "" '"optimizer": {"lr": 1e999}'
train "$d"
expect_input_error "$d" "config.json:8:[0-9]*: invalid JSON: number overflow parsing '1e999'"
config "$d" 2 "" '"optimizer": {"lr": -1e999}'
train "$d"
expect_input_error "$d" "config.json:8:[0-9]*: invalid JSON: number overflow parsing '-1e999'"

case="a named pipe as --config"
d="$scratch/fifo"
mkdir -p "$d"
mkfifo "$d/config.json"
train "$d"
[[ $rc -eq 124 ]] && fail "tetra blocked on the named pipe"
expect_input_error "$d" "config.json is a named pipe (FIFO), not a regular file; give a JSON file"

case="a NUL in a config key"
d="$scratch/nulkey"
config "$d" 2 "" '"training2\u0000x": 1'
train "$d"
expect_input_error "$d" 'training2\\u0000x: the key contains a NUL character'

case="a NUL in logging.dir"
d="$scratch/nuldir"
config "$d" 2
sed -i "s|\"dir\": \"$d/logs\"|\"dir\": \"$d/lo\\\\u0000gs\"|" "$d/config.json"
train "$d"
expect_input_error "$d" 'logging.dir: the string contains a NUL character'
[[ -e "$d/lo" ]] && fail "a directory was created for the path cut at the NUL"

case="schedule interleaved with pp 1"
d="$scratch/interleaved"
config "$d" 2 "" '"parallel": {"schedule": "interleaved", "virtual_stages": 2}'
train "$d"
expect_input_error "$d" "parallel.schedule: \"interleaved\": the interleaved schedule .* needs parallel.pp >= 2"

finish "checkpoint and output fault cases"
