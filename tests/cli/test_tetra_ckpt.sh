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
#             is refused with exit 2 naming the config keys, writing nothing; a write that fails
#             (a file-size limit, a filesystem out of inodes) is exit 1 naming the file, and
#             leaves no half export;
#   import-hf of Hugging Face directories that lie (shifted or overlapping tensors, weights that
#             are not finite, RoPE scaling that would be read as plain RoPE, a config.json far
#             larger than its tensors, a model beyond the memory limit): exit 2 naming the file,
#             tensor or key, OUT not created; a failed write leaves OUT as it was.
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

  # A write that fails: exit 1 naming the file and the reason, and no half export left in OUT
  # (weights without their config.json, or the reverse). A file-size limit (EFBIG) stops the weights.
  case=export_write_fails
  (trap '' XFSZ; ulimit -f 64; exec "$tetra" ckpt export-hf "$llama" "$scratch/out/limited") \
    >"$scratch/$case.out" 2>"$scratch/$case.err"
  rc=$?
  [[ $rc -eq 1 ]] || fail "exit code $rc, expected 1: $(cat "$scratch/$case.err")"
  grep -q "model.safetensors.*File too large" "$scratch/$case.err" || fail "message: $(cat "$scratch/$case.err")"
  [[ ! -e "$scratch/out/limited" ]] || fail "OUT left behind: $(ls -A "$scratch/out/limited")"
  # A filesystem out of inodes (a tmpfs in a mount namespace of its own): with room for one file,
  # config.json is written and the weights are not; with none, config.json fails.
  case=export_out_of_inodes
  if unshare -Urm true 2>/dev/null; then
    for inodes in 2 3; do
      mnt="$scratch/out/inodes_$inodes"
      mkdir -p "$mnt"
      unshare -Urm bash -c 'mount -t tmpfs -o size=64m,nr_inodes=$3 tmpfs "$2" || exit 99
                            "$1" ckpt export-hf "$4" "$2/hf"; rc=$?; ls -A "$2" >"$5.left"; exit $rc' \
        _ "$tetra" "$mnt" "$inodes" "$llama" "$scratch/$case.$inodes" \
        >"$scratch/$case.$inodes.out" 2>"$scratch/$case.$inodes.err"
      rc=$?
      [[ $rc -eq 1 ]] || fail "$inodes inodes: exit code $rc, expected 1: $(cat "$scratch/$case.$inodes.err")"
      want=$([[ $inodes -eq 2 ]] && echo config.json || echo model.safetensors)
      grep -q "$want.*No space left on device" "$scratch/$case.$inodes.err" ||
        fail "$inodes inodes: the message does not name $want and the reason: $(cat "$scratch/$case.$inodes.err")"
      [[ ! -s "$scratch/$case.$inodes.left" ]] ||
        fail "$inodes inodes: OUT left behind: $(cat "$scratch/$case.$inodes.left")"
    done
  else
    echo "note [$case]: skipped (no mount namespace here)"
  fi
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

# ---- import-hf: Hugging Face directories that lie, checked from the headers before a weight is read --
# write_hf <dir> [kind]: a 2-layer Llama in Hugging Face's layout (config.json + F32 model.safetensors),
# damaged as `kind` says: short (the header length less the header's padding spaces: the JSON
# still parses), overlap (v_proj's data_offsets are k_proj's), nan / inf / bf16nan / tiednan (a
# weight that is not a number), f64 (model.norm.weight stored as F64), rope5 / ropeboth /
# ropeagree (rope_scaling shapes), maxpos0, huge (config.json of a 2.8e9-parameter model beside
# the small tensors), big (a consistent model of 117M parameters whose weights are a sparse file
# of zeros), index_empty (a shard index with a weight_map entry "").
write_hf() {
  $py - "$@" <<'PY'
import json, os, struct, sys
import numpy as np
d, kind = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
big = kind == "big"
V, C, F, L, NH, NKV = (32000, 1024, 2816, 4, 8, 8) if big else (96, 48, 80, 2, 4, 2)
hd = C // NH
shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
for i in range(L):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                   p + "self_attn.q_proj.weight": (NH * hd, C), p + "self_attn.k_proj.weight": (NKV * hd, C),
                   p + "self_attn.v_proj.weight": (NKV * hd, C), p + "self_attn.o_proj.weight": (C, NH * hd),
                   p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                   p + "mlp.down_proj.weight": (C, F)})
cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
       "num_attention_heads": NH, "num_key_value_heads": NKV, "hidden_act": "silu", "max_position_embeddings": 64,
       "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": kind == "tiednan"}
rng = np.random.default_rng(7)
sd = {} if big else {n: (rng.standard_normal(s) * 0.08).astype(np.float32) for n, s in shapes.items()}
if kind == "tiednan":
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # the tied copy, bit for bit
if kind in ("nan", "tiednan"):
    sd["model.embed_tokens.weight"][3, 5] = np.nan
if kind == "inf":
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = np.inf
llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
if kind == "rope5":
    cfg["rope_scaling"] = {"rope_type": 5, "factor": 8.0}
if kind == "ropeboth":
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["rope_scaling"] = llama3
if kind == "ropeagree":
    cfg["rope_parameters"] = dict(llama3, rope_theta=10000.0)
    cfg["rope_scaling"] = llama3
if kind == "huge":
    cfg.update({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 16,
                "num_key_value_heads": 8, "vocab_size": 32000})
if kind == "maxpos0":
    cfg["max_position_embeddings"] = 0
os.makedirs(d, exist_ok=True)
json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
header, chunks, off = {}, [], 0
for name in sorted(shapes):
    dtype = "F64" if kind == "f64" and name == "model.norm.weight" else "BF16" if kind == "bf16nan" else "F32"
    size = int(np.prod(shapes[name])) * {"F64": 8, "BF16": 2, "F32": 4}[dtype]
    if not big:
        a = sd[name]
        if dtype == "F64":
            raw = a.astype("<f8").tobytes()
        elif dtype == "BF16":
            bits = (a.astype("<f4").view("<u4") >> 16).astype("<u2")
            if name == "model.embed_tokens.weight":
                bits[3, 5] = 0x7FC1  # a NaN
            raw = bits.tobytes()
        else:
            raw = a.astype("<f4").tobytes()
        chunks.append(raw)
    header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [off, off + size]}
    off += size
if kind == "overlap":
    header["model.layers.0.self_attn.v_proj.weight"]["data_offsets"] = \
        header["model.layers.0.self_attn.k_proj.weight"]["data_offsets"]
h = json.dumps(header, separators=(",", ":")).encode()
pad = -len(h) % 8 or 8  # at least one space, so that "short" can leave them out
n = len(h) + (0 if kind == "short" else pad)
with open(os.path.join(d, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", n) + h + b" " * pad + b"".join(chunks))
    if big:
        f.truncate(8 + len(h) + pad + off)  # zeros, on no disk
if kind == "index_empty":
    wm = {k: "model.safetensors" for k in shapes}
    wm["model.norm.weight"] = ""
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
PY
}

# import_refused <kind> <names...>: write_hf <kind>, then import-hf is refused (exit 2, the message
# naming each of <names>) and writes nothing.
import_refused() {
  local kind="$1"
  shift
  case="import_$kind"
  names=("$@")
  write_hf "$scratch/hf/$kind" "$kind" || { fail "write_hf $kind"; return; }
  expect_refusal "$tetra" ckpt import-hf "$scratch/hf/$kind" "$scratch/imp/$kind"
  [[ ! -e "$scratch/imp/$kind" ]] || fail "OUT was written: $(ls -a "$scratch/imp/$kind")"
}

# limited_to <KiB> <command...>: the command under an address-space limit (ulimit -v).
limited_to() { (ulimit -v "$1" && shift && exec "$@"); }

case=import_good
write_hf "$scratch/hf/good" || fail "write_hf"
"$tetra" ckpt import-hf "$scratch/hf/good" "$scratch/imp/good" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
  fail "exit $?: $(cat "$scratch/$case.err")"

# Tensors that do not lie end to end in the data section: every value would be read from the
# wrong bytes.
import_refused short "$scratch/hf/short/model.safetensors" "the header's tensors cover bytes [0, " \
  "of a data section of"
import_refused overlap "$scratch/hf/overlap/model.safetensors" "tensor model.layers.0.self_attn." "overlap tensor"
# Weights that are not numbers: the file, the tensor and the index (a tied copy too: not "differs").
import_refused nan "$scratch/hf/nan/model.safetensors" "tensor model.embed_tokens.weight holds NaN at [3, 5]"
import_refused inf "tensor model.layers.1.mlp.up_proj.weight holds inf at [0, 0]"
import_refused bf16nan "tensor model.embed_tokens.weight holds NaN at [3, 5]"
import_refused tiednan "tensor model.embed_tokens.weight holds NaN at [3, 5]"
grep -q "differs" "$scratch/$case.err" && fail "a NaN made the tied copies differ: $(cat "$scratch/$case.err")"
# RoPE scaling that would be read as plain RoPE.
import_refused rope5 "config.json: rope_scaling.rope_type: 5 is not a string"
import_refused ropeboth "rope_parameters and rope_scaling disagree" "llama3" "default"
case=import_ropeagree  # both keys, the same scaling: imported with it
write_hf "$scratch/hf/ropeagree" ropeagree
"$tetra" ckpt import-hf "$scratch/hf/ropeagree" "$scratch/imp/ropeagree" >"$scratch/$case.out" 2>"$scratch/$case.err" ||
  fail "exit $?: $(cat "$scratch/$case.err")"
grep -q '"llama3"' "$scratch/imp/ropeagree/model.json" || fail "no llama3 scaling: $(cat "$scratch/imp/ropeagree/model.json")"
# Messages that name the culprit.
import_refused f64 "$scratch/hf/f64/model.safetensors: tensor model.norm.weight: unsupported safetensors dtype \"F64\""
import_refused maxpos0 "config.json: max_position_embeddings: 0: must be at least 1" "--seq-len"
import_refused index_empty "model.safetensors.index.json: weight_map.model.norm.weight: \"\" is not a file"
# A config.json far larger than its tensors: the first wrong shape, from the headers, before the
# 11 GB of weights it describes are allocated (under a limit that allocation would exceed).
case=import_huge
write_hf "$scratch/hf/huge" huge
names=("tensor model.embed_tokens.weight has shape [96, 48], config.json implies [32000, 2048]")
expect_refusal limited_to 4000000 "$tetra" ckpt import-hf "$scratch/hf/huge" "$scratch/imp/huge"
[[ ! -e "$scratch/imp/huge" ]] || fail "OUT was written"
# A consistent model larger than the memory the process may use: refused with both numbers.
case=import_memory
write_hf "$scratch/hf/big" big
names=("GiB of host memory but the process's address-space limit (ulimit -v" "$scratch/hf/big" "116,925,440")
if limited_to 600000 "$tetra" --help >/dev/null 2>&1; then
  expect_refusal limited_to 600000 "$tetra" ckpt import-hf "$scratch/hf/big" "$scratch/imp/big"
  [[ ! -e "$scratch/imp/big" ]] || fail "OUT was written"
else
  echo "note [$case]: skipped (the binary does not start in 600 MB of address space here)"
fi
# A write that fails halfway (a file-size limit: EFBIG) leaves nothing in OUT, and the retry succeeds.
case=import_write_fails
(trap '' XFSZ; ulimit -f 64; exec "$tetra" ckpt import-hf "$scratch/hf/good" "$scratch/imp/limited") \
  >"$scratch/$case.out" 2>"$scratch/$case.err"
rc=$?
[[ $rc -eq 1 ]] || fail "exit code $rc, expected 1: $(cat "$scratch/$case.err")"
grep -q "File too large" "$scratch/$case.err" || fail "the reason is not said: $(cat "$scratch/$case.err")"
[[ ! -e "$scratch/imp/limited" ]] || fail "OUT left behind: $(ls -a "$scratch/imp/limited")"
"$tetra" ckpt import-hf "$scratch/hf/good" "$scratch/imp/limited" >"$scratch/$case.retry" 2>&1 ||
  fail "the retry: exit $?: $(cat "$scratch/$case.retry")"

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

  case=manifest_expert_bias_of_no_moe_block  # MoE expert biases are checked against the model
  dir=$(damaged llama)
  edit_manifest "$dir" 'm["moe_expert_bias"] = {"0": [0.5, 0.25]}'
  names=("error: $dir/manifest.json: field moe_expert_bias.0 holds 2 values, but the model has no MoE block of that number")
  expect_refusal "$tetra" ckpt inspect "$dir"

  case=manifest_expert_bias_not_a_number
  dir=$(damaged llama)
  edit_manifest "$dir" 'm["moe_expert_bias"] = {"0": ["x"]}'
  names=("error: $dir/manifest.json: field moe_expert_bias.0 holds \"x\", not a finite number")
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
