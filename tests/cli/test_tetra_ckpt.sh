#!/usr/bin/env bash
# `tetra ckpt` end to end on checkpoints the trainer writes (configs/reference_{llama,gpt2}.json,
# synthetic data, a few steps):
#   inspect   exit 0 with the step, the consumed samples, the layout, the parameter count and every
#             tensor (shape, slices, bytes) as computed here from the config; single rank, dp = 2
#             with the distributed optimizer (two rank files, sharded slices) and tp = 2;
#   damage    a flipped byte, a truncated file, a deleted rank file, a slice removed from or
#             repeated in the manifest: exit 2, the message naming the file, the tensor and the
#             slice (export-hf too, where the damage is in a model/ tensor);
#   export-hf from the sharded checkpoints: bit for bit the trainer's final weights once mapped
#             back; a tied Llama has no lm_head.weight; a model with no Hugging Face equivalent
#             is refused with exit 2 naming the config keys, writing nothing.
#
# Usage: test_tetra_ckpt.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi
STEPS=4
step_dir=$(printf "step_%08d" "$STEPS")

# train <name> <ranks> <llama|gpt2> [--set k=v ...]: STEPS steps, a checkpoint at the end, under
# $scratch/<name>/{ckpt,logs}. Fails the case (and returns 1) if training fails.
train() {
  local name="$1" np="$2" base="$3"
  shift 3
  local cmd=("$tetra" --config "$src/configs/reference_$base.json" --set "training.steps=$STEPS"
             --set training.threads=1 --set "checkpoint.dir=$scratch/$name/ckpt"
             --set "logging.dir=$scratch/$name/logs" "$@")
  mkdir -p "$scratch/$name"
  if [[ $np -gt 1 ]]; then
    timeout 300 "$mpirun" --oversubscribe -np "$np" "${cmd[@]}" >"$scratch/$name/train.log" 2>&1
  else
    timeout 300 "${cmd[@]}" >"$scratch/$name/train.log" 2>&1
  fi || { fail "training $name failed: $(tail -5 "$scratch/$name/train.log")"; return 1; }
  [[ -f "$scratch/$name/ckpt/$step_dir/manifest.json" ]] ||
    { fail "training $name wrote no $step_dir: $(ls -R "$scratch/$name/ckpt" 2>&1)"; return 1; }
}

# check_inspect <stdout> <llama|gpt2> <model overrides JSON> <world> <tp> <dp> <distributed optimizer>
# The summary lines, and the table against the parameter shapes of the specification
# (tests/reference/torch_model.py) for the three kinds; each element stored once.
check_inspect() {
  $py - "$src" "$@" "$STEPS" <<'PY'
import json, re, sys
src, out, base, overrides, world, tp, dp, dopt, steps = sys.argv[1:]
sys.path.insert(0, f"{src}/tests/reference")
import torch_model as tm
cfg = json.load(open(f"{src}/configs/reference_{base}.json"))
cfg["model"].update(json.loads(overrides))
spec = tm.ModelSpec.from_config(cfg)
shapes = tm.expected_param_shapes(spec)
params = sum(int(__import__("math").prod(s)) for s in shapes.values())
text = open(out).read()
problems = []
def line(key):
    m = re.search(rf"^{key}: +(.*)$", text, re.M)
    if not m:
        problems.append(f"no '{key}:' line")
        return ""
    return m.group(1)
gbs = int(cfg["training"]["global_batch_size"])
want = {"step": steps, "consumed samples": str(int(steps) * gbs),
        "parameters": f"{params:,}", "tensors": f"{3 * len(shapes)} (",
        "total bytes": f"{3 * 4 * params:,}",
        "layout": f"world {world}: tp {tp}, cp 1, pp 1, dp {dp}, ep 1, order tp-cp-dp-pp, "
                  f"sequence_parallel false, distributed_optimizer {dopt}"}
for k, v in want.items():
    got = line(k)
    if not got.startswith(v):
        problems.append(f"'{k}: {got}', expected '{v}...'")
if not re.search(r"^verified: .*every checksum matches", text, re.M):
    problems.append("no 'verified:' line")
rows = {}
for m in re.finditer(r"^(\S+/\S+) +\[([\d, ]*)\] +(\d+) +([\d,]+)$", text, re.M):
    rows[m.group(1)] = (tuple(int(x) for x in m.group(2).split(",")), int(m.group(3)),
                        int(m.group(4).replace(",", "")))
for kind in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
    for name, shape in shapes.items():
        key = f"{kind}/{name}"
        if key not in rows:
            problems.append(f"no row for {key}")
            continue
        got_shape, slices, nbytes = rows.pop(key)
        numel = int(__import__("math").prod(shape))
        if got_shape != shape or nbytes != 4 * numel or slices < 1:
            problems.append(f"{key}: {got_shape} {slices} slices {nbytes} bytes, expected "
                            f"{shape}, {4 * numel} bytes")
if rows:
    problems.append(f"unexpected rows {sorted(rows)}")
if problems:
    print("\n".join(problems))
    sys.exit(1)
PY
}

# check_export <export dir> <final weights> <llama|gpt2> <model overrides JSON>: the export mapped
# back to Tetra's names is the final weights bit for bit.
check_export() {
  $py - "$src" "$@" <<'PY'
import json, sys
import numpy as np
src, out, final, base, overrides = sys.argv[1:]
sys.path.insert(0, f"{src}/tests/reference")
from safetensors_io import read_safetensors
import test_hf_export as hx
cfg = json.load(open(f"{src}/configs/reference_{base}.json"))
cfg["model"].update(json.loads(overrides))
m = cfg["model"]
hf, meta = read_safetensors(f"{out}/model.safetensors")
hf_cfg = json.load(open(f"{out}/config.json"))
weights, _ = read_safetensors(final)
tied = m.get("tie_embeddings", True)
assert meta.get("format") == "pt", meta
assert hf_cfg["tie_word_embeddings"] == tied, hf_cfg
assert ("lm_head.weight" in hf) == (not tied), sorted(hf)
back = hx.hf_to_tetra(hf, base, int(m["num_layers"]), tied)
assert set(back) == set(weights), sorted(set(back) ^ set(weights))
bad = [n for n in weights if not np.array_equal(back[n], weights[n])]
assert not bad, f"differing tensors {bad}"
PY
}

# first_model_entry <safetensors file>: the name of its first "model/" tensor.
first_model_entry() {
  $py - "$1" <<'PY'
import json, struct, sys
blob = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n])
print(next(k for k in header if k.startswith("model/")))
PY
}

# flip_byte <safetensors file> <entry>: inverts one byte in the middle of the entry's data.
flip_byte() {
  $py - "$1" "$2" <<'PY'
import json, struct, sys
path, entry = sys.argv[1:]
with open(path, "r+b") as f:
    blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    begin, end = json.loads(blob[8:8 + n])[entry]["data_offsets"]
    at = 8 + n + (begin + end) // 2
    f.seek(at)
    f.write(bytes([blob[at] ^ 0xFF]))
PY
}

# edit_slices <manifest> <tensor key> <drop|repeat>: removes the tensor's last slice, or repeats
# its first.
edit_slices() {
  $py - "$@" <<'PY'
import json, sys
path, key, how = sys.argv[1:]
m = json.load(open(path))
slices = m["tensors"][key]["slices"]
if how == "drop":
    slices.pop()
else:
    slices.append(dict(slices[0]))
json.dump(m, open(path, "w"), indent=1)
PY
}

# expect_refusal <command...>: exit 2; the message in $scratch/$case.err names what $names lists.
expect_refusal() {
  "$@" >"$scratch/$case.out" 2>"$scratch/$case.err"
  local rc=$?
  [[ $rc -eq 2 ]] || fail "exit code $rc, expected 2; stderr: $(cat "$scratch/$case.err")"
  local n
  for n in "${names[@]}"; do
    grep -qF -- "$n" "$scratch/$case.err" || fail "the message does not name '$n': $(cat "$scratch/$case.err")"
  done
}

# damaged <name>: a fresh copy of <name>'s checkpoint to damage; prints its step directory.
damaged() {
  rm -rf "$scratch/damaged/$case"
  mkdir -p "$scratch/damaged/$case"
  cp -r "$scratch/$1/ckpt/$step_dir" "$scratch/damaged/$case/"
  echo "$scratch/damaged/$case/$step_dir"
}

# edit_manifest <step dir> <python statement on m, the manifest>: rewrites its manifest.json.
edit_manifest() {
  $py - "$1/manifest.json" "$2" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
exec(sys.argv[2])
json.dump(m, open(sys.argv[1], "w"), indent=1)
PY
}

# ---- single rank: both styles ------------------------------------------------------------------
for style in llama gpt2; do
  case="inspect_$style"
  if train "$style" 1 "$style"; then
    # The checkpoint directory (through `latest`) and the step directory itself.
    "$tetra" ckpt inspect "$scratch/$style/ckpt" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
      fail "exit $?: $(cat "$scratch/$case.err")"
    check_inspect "$scratch/$case.out" "$style" '{}' 1 1 1 false || fail "inspect output"
    "$tetra" ckpt inspect "$scratch/$style/ckpt/$step_dir" >"$scratch/$case.step.out" 2>&1 ||
      fail "inspect of the step directory: exit $?"
    cmp -s <(grep -v '^checkpoint:' "$scratch/$case.out") <(grep -v '^checkpoint:' "$scratch/$case.step.out") ||
      fail "inspect DIR and inspect DIR/step_* differ"

    case="export_$style"
    "$tetra" ckpt export-hf "$scratch/$style/ckpt" "$scratch/$style/hf" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
      fail "exit $?: $(cat "$scratch/$case.err")"
    check_export "$scratch/$style/hf" "$scratch/$style/logs/model.safetensors" "$style" '{}' ||
      fail "the export is not the final weights"
  fi
done

# ---- export-hf's OUT: new or empty, a non-empty one only with --force, checked before any work --
if [[ -f "$scratch/llama/ckpt/$step_dir/manifest.json" ]]; then
  llama="$scratch/llama/ckpt"
  case=export_out_not_empty
  out="$scratch/out/full"
  mkdir -p "$out"
  echo "someone's weights" >"$out/model.safetensors"
  echo '{"mine": true}' >"$out/config.json"
  echo "notes" >"$out/README.md"
  names=("$out" "not empty" "--force" "empty")
  expect_refusal "$tetra" ckpt export-hf "$llama" "$out"
  [[ "$(cat "$out/model.safetensors")" == "someone's weights" ]] || fail "model.safetensors was overwritten"
  [[ "$(cat "$out/config.json")" == '{"mine": true}' ]] || fail "config.json was overwritten"
  [[ ! -e "$out/model.safetensors.tmp" ]] || fail "model.safetensors.tmp written"

  case=export_out_other_files
  mkdir -p "$scratch/out/other"
  echo "notes" >"$scratch/out/other/notes.txt"
  names=("$scratch/out/other" "not empty" "notes.txt" "--force")
  expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/other"
  [[ $(ls "$scratch/out/other") == notes.txt ]] || fail "wrote into OUT: $(ls "$scratch/out/other")"

  case=import_out_not_empty  # import-hf has no --force: its message does not offer one
  names=("$scratch/out/other" "not empty" "choose an empty or new directory")
  expect_refusal "$tetra" ckpt import-hf "$out" "$scratch/out/other"
  grep -qF -- "--force" "$scratch/$case.err" && fail "import-hf offers --force, which it does not have"

  case=export_shard_size_out_of_range  # no overflow to a shard per tensor, no zero-byte limit
  for size in 1e20 0.5B infGB; do
    names=("--max-shard-size $size")
    expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/shards_$size" --max-shard-size "$size"
    [[ ! -e "$scratch/out/shards_$size" ]] || fail "--max-shard-size $size: OUT was created"
  done

  case=export_out_force
  "$tetra" ckpt export-hf "$llama" "$out" --force >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  check_export "$out" "$scratch/llama/logs/model.safetensors" llama '{}' || fail "the forced export is wrong"
  [[ "$(cat "$out/README.md")" == notes ]] || fail "--force touched another file of OUT"

  case=export_out_empty_dir
  mkdir -p "$scratch/out/empty"
  "$tetra" ckpt export-hf "$llama" "$scratch/out/empty" --dtype fp16 >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  [[ -s "$scratch/out/empty/model.safetensors" && -s "$scratch/out/empty/config.json" ]] || fail "nothing written"
  grep -q "^exported as: .*float16$" "$scratch/$case.out" || fail "not reported as float16: $(cat "$scratch/$case.out")"
  grep -q '"torch_dtype": "float16"' "$scratch/out/empty/config.json" || fail "config.json: not float16"

  case=export_out_is_file
  echo "a file" >"$scratch/out/file"
  for force in "" --force; do
    names=("$scratch/out/file" "not a directory")
    expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/file" $force
    [[ "$(cat "$scratch/out/file")" == "a file" ]] || fail "the file was changed ($force)"
  done

  case=export_out_under_file
  names=("$scratch/out/file/hf" "$scratch/out/file is a regular file, not a directory")
  expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/file/hf"

  case=export_out_dangling_link
  ln -sfn "$scratch/out/nowhere" "$scratch/out/link"
  names=("$scratch/out/link" "symbolic link to nothing")
  expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/link"
  [[ ! -e "$scratch/out/nowhere" ]] || fail "created the link's target"

  case=export_out_force_dir_entry  # --force replaces files, never a directory in their place
  mkdir -p "$scratch/out/dir_entry/config.json"
  names=("$scratch/out/dir_entry/config.json" "a directory" "regular files only")
  expect_refusal "$tetra" ckpt export-hf "$llama" "$scratch/out/dir_entry" --force
  [[ ! -e "$scratch/out/dir_entry/model.safetensors" ]] || fail "wrote model.safetensors"

  case=export_out_unwritable  # root writes anywhere: as root, the check runs as nobody
  as_user=()
  [[ $(id -u) -eq 0 ]] && as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
  if [[ ${#as_user[@]} -eq 0 ]] || "${as_user[@]}" test -r "$llama/$step_dir/manifest.json" 2>/dev/null; then
    mkdir -p "$scratch/out/locked"
    chmod 555 "$scratch/out/locked"
    names=("$scratch/out/locked/hf" "$scratch/out/locked is not writable")
    expect_refusal "${as_user[@]}" "$tetra" ckpt export-hf "$llama" "$scratch/out/locked/hf"
    names=("$scratch/out/locked" "the output directory is not writable")
    expect_refusal "${as_user[@]}" "$tetra" ckpt export-hf "$llama" "$scratch/out/locked"
    chmod 755 "$scratch/out/locked"
    [[ -z "$(ls "$scratch/out/locked")" ]] || fail "wrote into the locked directory"
  else
    echo "note [$case]: skipped (cannot run as another user here)"
  fi

  # Before any work: OUT is refused before DIR is read (which is not a checkpoint here).
  case=export_out_checked_first
  mkdir -p "$scratch/out/not_a_checkpoint"
  names=("$scratch/out/file" "not a directory")
  expect_refusal "$tetra" ckpt export-hf "$scratch/out/not_a_checkpoint" "$scratch/out/file"
  grep -q "not a checkpoint" "$scratch/$case.err" && fail "read DIR before checking OUT"
fi

# ---- dp = 2 with the distributed optimizer: two rank files of sharded slices -------------------
case=inspect_dp2
dp2=(--set parallel.dp=2 --set parallel.distributed_optimizer=true)
if train dp2 2 llama "${dp2[@]}"; then
  ls "$scratch/dp2/ckpt/$step_dir"/rank_0000{0,1}.safetensors >/dev/null ||
    fail "expected two rank files: $(ls "$scratch/dp2/ckpt/$step_dir")"
  "$tetra" ckpt inspect "$scratch/dp2/ckpt" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  check_inspect "$scratch/$case.out" llama '{}' 2 1 2 true || fail "inspect output"
  # Each DP rank wrote its shard: some tensor of each kind has slices in both files.
  $py - "$scratch/dp2/ckpt/$step_dir/manifest.json" <<'PY' || fail "no tensor is split between the rank files"
import json, sys
tensors = json.load(open(sys.argv[1]))["tensors"]
for kind in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/"):
    assert any(len({s["file"] for s in t["slices"]}) == 2
               for k, t in tensors.items() if k.startswith(kind)), kind
PY

  case=export_dp2
  "$tetra" ckpt export-hf "$scratch/dp2/ckpt" "$scratch/dp2/hf" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  check_export "$scratch/dp2/hf" "$scratch/dp2/logs/model.safetensors" llama '{}' ||
    fail "the export is not the final weights"

  case=corrupt_byte
  dir=$(damaged dp2)
  entry=$(first_model_entry "$dir/rank_00001.safetensors")
  flip_byte "$dir/rank_00001.safetensors" "$entry"
  names=("rank_00001.safetensors" "tensor ${entry%%#*}, slice " "\"$entry\"" "checksum")
  expect_refusal "$tetra" ckpt inspect "$dir"
  expect_refusal "$tetra" ckpt export-hf "$dir" "$scratch/damaged/$case/hf"
  [[ ! -e "$scratch/damaged/$case/hf/model.safetensors" ]] || fail "export-hf wrote a model from a corrupt checkpoint"

  case=truncated_file
  dir=$(damaged dp2)
  truncate -s -100 "$dir/rank_00001.safetensors"
  names=("rank_00001.safetensors" "tensor " ", slice ")
  expect_refusal "$tetra" ckpt inspect "$dir"

  case=missing_rank_file
  dir=$(damaged dp2)
  rm "$dir/rank_00000.safetensors"
  names=("rank_00000.safetensors" "tensor model/" ", slice 1 of " "missing")
  expect_refusal "$tetra" ckpt inspect "$dir"
  expect_refusal "$tetra" ckpt export-hf "$dir" "$scratch/damaged/$case/hf"

  case=slice_dropped
  dir=$(damaged dp2)
  edit_slices "$dir/manifest.json" optim/exp_avg_sq/layers.1.mlp.fc.weight drop
  names=("manifest.json" "tensor optim/exp_avg_sq/layers.1.mlp.fc.weight" "not fully covered")
  expect_refusal "$tetra" ckpt inspect "$dir"

  case=slice_repeated
  dir=$(damaged dp2)
  edit_slices "$dir/manifest.json" model/layers.0.attn.qkv.weight repeat
  names=("tensor model/layers.0.attn.qkv.weight" "overlaps slice 1" "held twice")
  expect_refusal "$tetra" ckpt inspect "$dir"
fi

# ---- tp = 2, GPT-2: Conv1D transposes of assembled row and column slices -----------------------
case=export_tp2
if train tp2 2 gpt2 --set parallel.tp=2 --set model.vocab_size=98 --set model.make_vocab_size_divisible_by=32; then
  "$tetra" ckpt inspect "$scratch/tp2/ckpt" >"$scratch/$case.inspect" 2>&1 || fail "inspect: exit $?"
  check_inspect "$scratch/$case.inspect" gpt2 '{"vocab_size": 98}' 2 2 1 false || fail "inspect output"
  "$tetra" ckpt export-hf "$scratch/tp2/ckpt" "$scratch/tp2/hf" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  check_export "$scratch/tp2/hf" "$scratch/tp2/logs/model.safetensors" gpt2 '{"vocab_size": 98}' ||
    fail "the export is not the final weights"
fi

# ---- tied Llama: no lm_head.weight -------------------------------------------------------------
case=export_tied_llama
if train tied 1 llama --set model.tie_embeddings=true; then
  "$tetra" ckpt export-hf "$scratch/tied/ckpt" "$scratch/tied/hf" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
    fail "exit $?: $(cat "$scratch/$case.err")"
  check_export "$scratch/tied/hf" "$scratch/tied/logs/model.safetensors" llama '{"tie_embeddings": true}' ||
    fail "the tied export is wrong"
fi

# ---- models with no Hugging Face equivalent ----------------------------------------------------
case=no_hf_rope_layernorm
if train mixed1 1 llama --set model.norm=layernorm; then
  names=("model.norm" "layernorm" "Llama")
  expect_refusal "$tetra" ckpt export-hf "$scratch/mixed1/ckpt" "$scratch/mixed1/hf"
  [[ ! -e "$scratch/mixed1/hf" ]] || fail "export-hf created $scratch/mixed1/hf"
fi
case=no_hf_learned_swiglu
if train mixed2 1 llama --set model.position=learned; then
  names=("model.norm" "model.activation" "model.bias false" "model.num_kv_heads 2" "GPT-2")
  expect_refusal "$tetra" ckpt export-hf "$scratch/mixed2/ckpt" "$scratch/mixed2/hf"
  [[ ! -e "$scratch/mixed2/hf" ]] || fail "export-hf created $scratch/mixed2/hf"
fi

# ---- not a checkpoint --------------------------------------------------------------------------
case=not_a_checkpoint
mkdir -p "$scratch/empty"
names=("$scratch/empty" "not a checkpoint")
expect_refusal "$tetra" ckpt inspect "$scratch/empty"

# ---- filesystem and JSON errors: "error: <file>: <what>", exit 2, never the library's raw text ---
case=path_too_long
long="$scratch/$(printf 'x%.0s' {1..300})"
names=("error: $long" "File name too long")
expect_refusal "$tetra" ckpt inspect "$long"
grep -q "filesystem error" "$scratch/$case.err" && fail "the raw exception: $(cat "$scratch/$case.err")"

if [[ -f "$scratch/llama/ckpt/$step_dir/manifest.json" ]]; then
  case=manifest_value_of_another_type  # config.data a number: export-hf reads data.tokenizer from it
  dir=$(damaged llama)
  edit_manifest "$dir" 'm["config"]["data"] = 5'
  names=("error: $dir/manifest.json: field config.data is 5, not a data section")
  expect_refusal "$tetra" ckpt export-hf "$dir" "$scratch/damaged/$case/hf"
  [[ ! -e "$scratch/damaged/$case/hf" ]] || fail "export-hf created $scratch/damaged/$case/hf"

  case=manifest_layout_degree_zero  # the layout that wrote it is checked like the rest
  dir=$(damaged llama)
  edit_manifest "$dir" 'm["layout"]["tp"] = 0'
  names=("error: $dir/manifest.json: field layout.tp is 0, outside [1, 1048576]")
  expect_refusal "$tetra" ckpt inspect "$dir"

  case=rank_file_named_pipe  # refused without blocking on it
  dir=$(damaged llama)
  rank_file=$(ls "$dir"/rank_*.safetensors | head -1)
  rm "$rank_file" && mkfifo "$rank_file"
  names=("$rank_file" "named pipe (FIFO)")
  expect_refusal timeout -s KILL 20 "$tetra" ckpt inspect "$dir"

  case=unreadable_checkpoint  # a directory the user may not enter (as root: checked as nobody)
  dir=$(damaged llama)
  as_user=()
  [[ $(id -u) -eq 0 ]] && as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
  if [[ ${#as_user[@]} -eq 0 ]] || "${as_user[@]}" test -x "$tetra" 2>/dev/null; then
    chmod 700 "$dir"
    [[ $(id -u) -ne 0 ]] && chmod 000 "$dir"
    names=("error: $dir" "Permission denied")
    expect_refusal "${as_user[@]}" "$tetra" ckpt inspect "$dir"
    grep -q "filesystem error" "$scratch/$case.err" && fail "the raw exception: $(cat "$scratch/$case.err")"
    chmod 755 "$dir"
  else
    echo "note [$case]: skipped (cannot run as another user here)"
  fi
fi

finish "tetra ckpt checks"
