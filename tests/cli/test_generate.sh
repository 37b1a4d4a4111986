#!/usr/bin/env bash
# Text generation end to end: a SentencePiece tokenizer trained by `tetra data`, a small corpus
# tokenized with it and split into train / valid datasets by tools/indexed_dataset.py, a tiny
# model trained a few steps with a sample at each evaluation; then model.safetensors is there,
# `tetra generate` reproduces the last sample and is deterministic per seed, bad weights exit 2
# with a message, and under mpirun with tp = 2 (with and without sequence parallelism) training
# writes the same greedy samples as tp = 1 and exports weights that generate the same text; a MoE
# model trained with expert parallelism (ep = 2: every rank of the EP group runs each forward of
# the sample) writes the samples of its ep = 1 run, and its weights and a checkpoint it saved
# (experts as global tensors) generate them on one process.
#
# Usage: test_generate.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi

# ---- data: 12 documents of simple sentences, a 400-piece tokenizer, train (10) / valid (2) ----
$py - "$scratch/corpus" <<'PY'
import os, random, sys
out = sys.argv[1]
os.makedirs(out)
subjects = "the cat|the dog|a bird|my friend|the old man|a child".split("|")
verbs = "sat on|looked at|ran to|walked past|jumped over|slept by".split("|")
objects = "the mat|the door|a tree|the river|the house|a red box".split("|")
for i in range(12):
    rng = random.Random(i)
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(60)]
    with open(os.path.join(out, f"doc{i:02d}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
PY
case=prepare_data
"$tetra" data train-tokenizer --input "$scratch/corpus" --vocab-size 400 --output "$scratch/spm" \
  >"$scratch/spm.out" 2>&1 || fail "train-tokenizer: $(cat "$scratch/spm.out")"
"$tetra" data tokenize --tokenizer "sentencepiece:$scratch/spm.model" --input "$scratch/corpus" \
  --output "$scratch/all" --threads 1 >"$scratch/tok.out" 2>&1 || fail "tokenize: $(cat "$scratch/tok.out")"
$py - "$src/tools" "$scratch" <<'PY' || fail "indexed_dataset.py split"
import sys
sys.path.insert(0, sys.argv[1])
import indexed_dataset
d = sys.argv[2]
docs = indexed_dataset.read(d + "/all")
assert len(docs) == 12, len(docs)
indexed_dataset.write(d + "/train", docs[:10], "uint16")
indexed_dataset.write(d + "/valid", docs[10:], "uint16")
assert [list(x) for x in indexed_dataset.read(d + "/valid")] == [list(x) for x in docs[10:]]
PY

# The model's vocabulary (448) is padded beyond the tokenizer's (400): ids >= 400 are never sampled.
write_config() {  # write_config <path> <logging dir> <parallel members> [precision] [model members]
  cat >"$1" <<JSON
{
  "model": {"vocab_size": 448, "seq_len": 32, "num_layers": 2, "hidden_size": 64, "num_heads": 4,
            "ffn_hidden_size": 128${5:+, $5}},
  "parallel": {$3},
  "training": {"precision": "${4:-fp32}", "micro_batch_size": 4, "steps": 100, "eval_every": 50, "eval_steps": 1, "threads": 1,
               "peak_gflops": 10, "seed": 5},
  "optimizer": {"lr": 3e-3, "warmup_steps": 2},
  "data": {"train": ["$scratch/train"], "valid": ["$scratch/valid"],
           "tokenizer": "sentencepiece:$scratch/spm.model"},
  "sample": {"prompt": "the cat", "max_tokens": 24, "temperature": 0, "seed": 3},
  "logging": {"dir": "$2"}
}
JSON
}

# samples <train.log>: the continuations of its sample lines, one per line (still escaped).
samples() { sed -n 's/.*sample: "the cat" -> "\(.*\)"$/\1/p' "$1"; }

# ---- training with samples at each evaluation, tp = 1 --------------------------------------------
case=train_tp1
run1="$scratch/run_tp1"
write_config "$scratch/tp1.json" "$run1" '"tp": 1'
"$tetra" --config "$scratch/tp1.json" >"$scratch/tp1.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/tp1.out")"
[[ -s "$run1/model.safetensors" ]] || fail "no model.safetensors"
[[ ! -e "$run1/model.safetensors.tmp" ]] || fail "model.safetensors.tmp left behind"
grep -q "final weights: $run1/model.safetensors" "$run1/train.log" || fail "the log does not name the weights file"
samples "$run1/train.log" >"$scratch/tp1.samples"
[[ $(wc -l <"$scratch/tp1.samples") -eq 2 ]] ||
  fail "expected a sample at each of the 2 evaluations: $(grep sample "$run1/train.log")"
grep -q "val loss" "$run1/train.log" || fail "no evaluation"
[[ -n "$(tail -1 "$scratch/tp1.samples")" ]] || fail "the last sample is empty"
$py - "$run1/model.safetensors" <<'PY' || fail "model.safetensors contents"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack_from("<Q", raw, 0)
h = json.loads(raw[8:8 + n])
h.pop("__metadata__", None)
assert h["embedding.wte"]["shape"] == [448, 64], h["embedding.wte"]
assert h["layers.1.mlp.fc.weight"]["shape"] == [128, 64], h["layers.1.mlp.fc.weight"]
assert all(v["dtype"] == "F32" for v in h.values())
assert "lm_head.weight" not in h  # tied embeddings
PY

# ---- tetra generate -----------------------------------------------------------------------------
case=generate_reproduces_last_sample
# Same weights, same config (greedy), same threads: the text of the last evaluation.
"$tetra" generate --config "$scratch/tp1.json" >"$scratch/gen_greedy.out" 2>"$scratch/gen_greedy.err" ||
  fail "exit $?: $(cat "$scratch/gen_greedy.err")"
$py - "$scratch/gen_greedy.out" "$scratch/tp1.samples" <<'PY' || fail "generate does not print the last sample"
import sys
out = open(sys.argv[1], encoding="utf-8").read()
assert out.startswith("the cat") and out.endswith("\n"), repr(out)
continuation = out[len("the cat"):-1]  # stdout: prompt, continuation, newline
escaped = "".join({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c)
                  or (c if ord(c) >= 32 and ord(c) != 127 else "\\x%02x" % ord(c)) for c in continuation)
last = open(sys.argv[2], encoding="utf-8").read().splitlines()[-1]
assert escaped == last, (escaped, last)
PY

case=generate_deterministic
gen() {  # gen <output> <args...>
  local out="$1"
  shift
  "$tetra" generate --config "$scratch/tp1.json" --prompt "the dog" --temperature 1.0 --top-k 50 \
    --max-tokens 32 "$@" >"$out" 2>"$out.err" || fail "exit $? ($*): $(cat "$out.err")"
}
gen "$scratch/seed7a" --seed 7
gen "$scratch/seed7b" --seed 7
gen "$scratch/seed8" --seed 8
[[ "$(head -c 7 "$scratch/seed7a")" == "the dog" ]] || fail "stdout: $(cat "$scratch/seed7a")"
[[ $(wc -c <"$scratch/seed7a") -gt 9 ]] || fail "nothing generated: $(cat "$scratch/seed7a")"
cmp -s "$scratch/seed7a" "$scratch/seed7b" ||
  fail "same seed, different text: '$(cat "$scratch/seed7a")' vs '$(cat "$scratch/seed7b")'"
! cmp -s "$scratch/seed7a" "$scratch/seed8" || fail "seeds 7 and 8 gave the same text: $(cat "$scratch/seed8")"
[[ ! -s "$scratch/seed7a.err" ]] || fail "stderr: $(cat "$scratch/seed7a.err")"

case=generate_weights_option
cp "$run1/model.safetensors" "$scratch/copy.safetensors"
"$tetra" generate --config "$scratch/tp1.json" --set logging.dir="$scratch/nowhere" \
  --weights "$scratch/copy.safetensors" >"$scratch/gen_copy.out" 2>&1 || fail "exit $?: $(cat "$scratch/gen_copy.out")"
cmp -s "$scratch/gen_copy.out" "$scratch/gen_greedy.out" || fail "--weights: $(cat "$scratch/gen_copy.out")"

case=generate_logits_out  # an existing file is replaced only with --force, and refused before any work
echo keep >"$scratch/keep.safetensors"
"$tetra" generate --config "$scratch/tp1.json" --prompt-ids 1,2 --max-tokens 1 --logits-out "$scratch/keep.safetensors" \
  >/dev/null 2>"$scratch/logits.err" && fail "an existing --logits-out was replaced without --force"
grep -qF "$scratch/keep.safetensors: the file exists (pass --force to replace it)" "$scratch/logits.err" ||
  fail "message: $(cat "$scratch/logits.err")"
[[ "$(cat "$scratch/keep.safetensors")" == keep ]] || fail "the refused run changed the file"
"$tetra" generate --config "$scratch/tp1.json" --prompt-ids 1,2 --max-tokens 1 --logits-out "$scratch/keep.safetensors" \
  --force >/dev/null 2>"$scratch/logits.err" || fail "--force: $(cat "$scratch/logits.err")"
[[ "$(head -c 4 "$scratch/keep.safetensors")" != keep ]] || fail "--force did not write the logits"
md5=$(md5sum <"$run1/model.safetensors")
"$tetra" generate --config "$scratch/tp1.json" --prompt-ids 1,2 --max-tokens 1 --logits-out "$run1/model.safetensors" \
  --force >/dev/null 2>"$scratch/logits.err" && fail "--logits-out onto the weights it reads was accepted"
grep -qF "is also an input" "$scratch/logits.err" || fail "message: $(cat "$scratch/logits.err")"
[[ "$(md5sum <"$run1/model.safetensors")" == "$md5" ]] || fail "the weights were changed"

case=generate_hf_tokenizer
# The same weights through a Hugging Face tokenizer.json (data.tokenizer "hf:<dir>"): its 258 ids
# are within the model's 448, and only they are sampled.
write_hf_tokenizer "$scratch/hf"
"$tetra" generate --config "$scratch/tp1.json" --set data.tokenizer="hf:$scratch/hf" \
  --prompt "the cat" --max-tokens 8 >"$scratch/gen_hf.out" 2>"$scratch/gen_hf.err" ||
  fail "exit $?: $(cat "$scratch/gen_hf.err")"
[[ "$(head -c 7 "$scratch/gen_hf.out")" == "the cat" ]] || fail "stdout: $(cat "$scratch/gen_hf.out")"

# ---- bad weights: exit 2, a message, nothing on stdout ------------------------------------------
bad() {  # bad <case> <expected text on stderr> <generate args...>
  case="$1"
  local text="$2"
  shift 2
  "$tetra" generate --config "$scratch/tp1.json" "$@" >"$scratch/$case.out" 2>"$scratch/$case.err"
  local rc=$?
  [[ $rc -eq 2 ]] || fail "exit code $rc, expected 2; stderr: $(cat "$scratch/$case.err")"
  grep -qF -- "$text" "$scratch/$case.err" || fail "stderr lacks '$text': $(cat "$scratch/$case.err")"
  [[ ! -s "$scratch/$case.out" ]] || fail "stdout: $(cat "$scratch/$case.out")"
}
bad missing_default "train first" --set logging.dir="$scratch/untrained"
grep -qF -- "--weights" "$scratch/missing_default.err" || fail "no mention of --weights: $(cat "$scratch/missing_default.err")"
bad missing_file "$scratch/nothing.safetensors: no such file" --weights "$scratch/nothing.safetensors"
head -c 100 /dev/urandom >"$scratch/garbage.safetensors"
bad garbage "garbage.safetensors: not a safetensors file" --weights "$scratch/garbage.safetensors"
bad other_shape 'tensor "embedding.wte" has shape [448, 64] but the config'"'"'s model needs [448, 32]' \
  --set model.hidden_size=32
bad untied 'no tensor "lm_head.weight"' --set model.tie_embeddings=false
bad extra_tensor "is not a parameter of the config's model" --set model.num_layers=1
grep -qF 'tensor "layers.1.' "$scratch/extra_tensor.err" || fail "no layers.1 tensor named: $(cat "$scratch/extra_tensor.err")"
bad no_tokenizer "data.tokenizer" --set data.tokenizer= --set sample.prompt=
mkdir -p "$scratch/hf_bad"
$py -c "import json; t = json.load(open('$scratch/hf/tokenizer.json')); t['model']['type'] = 'WordPiece'; \
json.dump(t, open('$scratch/hf_bad/tokenizer.json', 'w'))"
bad hf_unsupported 'hf_bad/tokenizer.json: model.type "WordPiece" is not supported' \
  --set data.tokenizer="hf:$scratch/hf_bad"
bad bad_option "--max-tokens" --max-tokens 0

# Numeric options under the config's rules: a negative seed does not wrap, no inf / nan, whole
# numbers that fit.
bad seed_negative "--seed: -1: must be at least 0" --seed -1
bad seed_negative_equals "--seed: -1: must be at least 0" --seed=-1
bad seed_too_big "--seed: 18446744073709551616: out of range" --seed 18446744073709551616
bad temperature_inf "--temperature: inf: must be a finite number" --temperature inf
bad temperature_nan "--temperature: nan: must be a finite number" --temperature nan
bad temperature_overflow "--temperature: 1e400: must be a finite number" --temperature 1e400
bad temperature_negative "--temperature: -0.5: must be at least 0" --temperature -0.5
bad top_k_huge "--top-k: 99999999999999999999: out of range" --top-k 99999999999999999999
bad top_k_fraction "--top-k: 1.5: not a whole number" --top-k 1.5
bad top_k_negative "--top-k: -1: must be at least 0" --top-k -1
bad max_tokens_huge "--max-tokens: 99999999999999999999: out of range" --max-tokens 99999999999999999999
bad max_tokens_negative "--max-tokens: -5: must be at least 1" --max-tokens -5
bad max_tokens_exponent "--max-tokens: 1e30: not a whole number" --max-tokens 1e30

# --weights that is no safetensors file: named, and said what it is, before anything is opened.
bad weights_directory "$run1: is a directory; the weights are a .safetensors file" --weights "$run1"
grep -qF -- "--weights $run1/model.safetensors" "$scratch/weights_directory.err" ||
  fail "no hint of the file inside: $(cat "$scratch/weights_directory.err")"
bad weights_directory_without "$scratch/corpus: is a directory" --weights "$scratch/corpus"
mkdir -p "$scratch/dir_as_weights/model.safetensors"
bad default_weights_directory "$scratch/dir_as_weights/model.safetensors: is a directory" \
  --set logging.dir="$scratch/dir_as_weights"
: >"$scratch/empty.safetensors"
bad weights_empty "$scratch/empty.safetensors: the file is empty (0 bytes)" --weights "$scratch/empty.safetensors"
bad weights_device "/dev/null: is a character device, not a regular file" --weights /dev/null
case=weights_fifo  # opening a FIFO would wait for a writer forever
mkfifo "$scratch/fifo.safetensors"
timeout 60 "$tetra" generate --config "$scratch/tp1.json" --weights "$scratch/fifo.safetensors" \
  >"$scratch/$case.out" 2>"$scratch/$case.err"
rc=$?
[[ $rc -eq 2 ]] || fail "exit code $rc, expected 2 (124: it blocked); stderr: $(cat "$scratch/$case.err")"
grep -qF -- "$scratch/fifo.safetensors: is a FIFO, not a regular file" "$scratch/$case.err" ||
  fail "stderr: $(cat "$scratch/$case.err")"

# Weights files that lie: tensors that do not lie end to end (the header length less its padding:
# every value read from the wrong bytes), a weight that is NaN; refused naming the file and the tensor.
$py - "$run1/model.safetensors" "$scratch" <<'PY' || fail "damaged copies of the weights"
import json, struct, sys
import numpy as np
raw = open(sys.argv[1], "rb").read()
(n,) = struct.unpack_from("<Q", raw, 0)
header, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
h = json.dumps(header, separators=(",", ":")).encode()
pad = -len(h) % 8 or 8
open(sys.argv[2] + "/short.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b" " * pad + data)
begin = header["layers.0.mlp.fc.weight"]["data_offsets"][0]
data[begin:begin + 4] = np.array([np.nan], "<f4").tobytes()
open(sys.argv[2] + "/nan.safetensors", "wb").write(raw[:8 + n] + data)
PY
bad weights_header_short "$scratch/short.safetensors: the header's tensors cover bytes [0, " \
  --weights "$scratch/short.safetensors"
bad weights_nan "$scratch/nan.safetensors: tensor layers.0.mlp.fc.weight holds NaN at [0, 0]" \
  --weights "$scratch/nan.safetensors"
# --prompt-ids given empty is no prompt of ids (not "no --prompt-ids": the text prompt).
bad prompt_ids_empty '--prompt-ids: "": no token ids' --prompt-ids ''
# --logits-out where no file can be created: refused before the weights are read.
bad logits_out_proc "--logits-out /proc/x.safetensors: cannot create a file in /proc" \
  --prompt-ids 1,2 --logits-out /proc/x.safetensors
# A GPT-2 directory of another length: the config's model.seq_len is named, not a --seq-len that
# generate does not have.
mkdir -p "$scratch/hf_gpt2"
echo '{"model_type": "gpt2", "n_positions": 16, "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 448}' \
  >"$scratch/hf_gpt2/config.json"
bad gpt2_seq_len "model.seq_len 32: GPT-2's learned position table has n_positions = 16 rows" \
  --prompt-ids 1 --weights "$scratch/hf_gpt2"
grep -qF -- "--seq-len" "$scratch/gpt2_seq_len.err" && fail "names --seq-len: $(cat "$scratch/gpt2_seq_len.err")"

case=generate_under_mpirun
timeout 120 "$mpirun" --oversubscribe -np 2 "$tetra" generate --config "$scratch/tp1.json" \
  >"$scratch/mpi_gen.out" 2>"$scratch/mpi_gen.err"
rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "exit code $rc, expected a refusal"
[[ $(grep -c "runs as one process" "$scratch/mpi_gen.err") -eq 1 ]] ||
  fail "expected the message once: $(cat "$scratch/mpi_gen.err")"

# ---- tp = 2: the same greedy samples, and weights that generate them with tp = 1 ----------------
for sp in false true; do
  case=train_tp2_sp_$sp
  run2="$scratch/run_tp2_$sp"
  write_config "$scratch/tp2_$sp.json" "$run2" "\"tp\": 2, \"sequence_parallel\": $sp"
  timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$scratch/tp2_$sp.json" \
    >"$scratch/tp2_$sp.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/tp2_$sp.out")"
  samples "$run2/train.log" >"$scratch/tp2_$sp.samples"
  # The layouts' logits differ by rounding only (summation order of the split GEMMs); greedy
  # choices agree unless two logits tie within it, which this run does not have.
  cmp -s "$scratch/tp1.samples" "$scratch/tp2_$sp.samples" ||
    fail "tp 2 samples differ: $(cat "$scratch/tp2_$sp.samples") vs tp 1: $(cat "$scratch/tp1.samples")"
  [[ $(grep -c "sample: " "$scratch/tp2_$sp.out") -eq 2 ]] ||
    fail "sample lines are not printed once each (rank 0): $(grep "sample: " "$scratch/tp2_$sp.out")"
  # The exported global tensors, loaded with tp = 1 whatever the config says.
  "$tetra" generate --config "$scratch/tp2_$sp.json" >"$scratch/gen_tp2_$sp.out" 2>&1 ||
    fail "generate from tp 2 weights: exit $?: $(cat "$scratch/gen_tp2_$sp.out")"
  cmp -s "$scratch/gen_tp2_$sp.out" "$scratch/gen_greedy.out" ||
    fail "generate from tp 2 weights: $(cat "$scratch/gen_tp2_$sp.out") vs $(cat "$scratch/gen_greedy.out")"
done

# dp2_run <name> <parallel members>: trains on dp 2 in bf16 with samples, then checks that
# `generate` (which rounds the exported fp32 master weights to bf16: exactly the weights the last
# sample was computed with, if every shard was gathered into the file) prints the last sample.
dp2_run() {
  local name="$1" run="$scratch/run_$1"
  write_config "$scratch/$name.json" "$run" "$2" bf16
  timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$scratch/$name.json" \
    >"$scratch/$name.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/$name.out")"
  samples "$run/train.log" >"$scratch/$name.samples"
  [[ $(wc -l <"$scratch/$name.samples") -eq 2 ]] || fail "samples: $(cat "$scratch/$name.samples")"
  "$tetra" generate --config "$scratch/$name.json" >"$scratch/gen_$name.out" 2>&1 ||
    fail "exit $?: $(cat "$scratch/gen_$name.out")"
  $py - "$scratch/gen_$name.out" "$scratch/$name.samples" <<'PY' || fail "generate does not print the last sample"
import sys
out = open(sys.argv[1], encoding="utf-8").read()
last = open(sys.argv[2], encoding="utf-8").read().splitlines()[-1]
assert out.startswith("the cat") and out[len("the cat"):-1].replace("\n", "\\n") == last, (out, last)
PY
}

# ---- bf16 with the distributed optimizer: the fp32 master weights live in 2 DP shards ------------
case=train_dp2_bf16_distributed_optimizer
dp2_run dp2 '"dp": 2, "distributed_optimizer": true'

# ---- bf16 under ZeRO-3: the samples read the compute shards gathered whole ------------------------
case=train_dp2_bf16_zero3
dp2_run dp2_zero3 '"dp": 2, "zero_stage": 3'

# ---- fp16: samples and generate compute in fp16 from the fp16 copy of the master weights ----------
case=train_fp16
run4="$scratch/run_fp16"
write_config "$scratch/fp16.json" "$run4" '"dp": 1' fp16
timeout 300 "$tetra" --config "$scratch/fp16.json" >"$scratch/fp16.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/fp16.out")"
grep -q "loss scale 65536" "$run4/train.log" || fail "the fp16 log shows no loss scale"
samples "$run4/train.log" >"$scratch/fp16.samples"
[[ $(wc -l <"$scratch/fp16.samples") -eq 2 ]] || fail "samples: $(cat "$scratch/fp16.samples")"
"$tetra" generate --config "$scratch/fp16.json" >"$scratch/gen_fp16.out" 2>&1 || fail "exit $?: $(cat "$scratch/gen_fp16.out")"
$py - "$scratch/gen_fp16.out" "$scratch/fp16.samples" <<'PY' || fail "fp16 generate does not print the last sample"
import sys
out = open(sys.argv[1], encoding="utf-8").read()
last = open(sys.argv[2], encoding="utf-8").read().splitlines()[-1]
assert out.startswith("the cat") and out[len("the cat"):-1].replace("\n", "\\n") == last, (out, last)
PY

# ---- MoE with expert parallelism: the samples of ep = 1, and one-process generate from ep = 2 -----
moe_model='"moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64, "aux_loss_coeff": 0.01}'
for ep in 1 2; do
  case=train_moe_dp2_ep$ep
  run5="$scratch/run_moe_ep$ep"
  write_config "$scratch/moe_ep$ep.json" "$run5" "\"dp\": 2, \"ep\": $ep" fp32 "$moe_model"
  [[ $ep -eq 2 ]] && $py - "$scratch/moe_ep2.json" "$scratch/ckpt_moe_ep2" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["checkpoint"] = {"dir": sys.argv[2], "every": 100}
json.dump(c, open(sys.argv[1], "w"))
PY
  timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$scratch/moe_ep$ep.json" \
    >"$scratch/moe_ep$ep.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/moe_ep$ep.out")"
  samples "$run5/train.log" >"$scratch/moe_ep$ep.samples"
  [[ $(wc -l <"$scratch/moe_ep$ep.samples") -eq 2 && -n "$(tail -1 "$scratch/moe_ep$ep.samples")" ]] ||
    fail "expected a sample at each of the 2 evaluations: $(cat "$scratch/moe_ep$ep.samples")"
  [[ $(grep -c "sample: " "$scratch/moe_ep$ep.out") -eq 2 ]] ||
    fail "sample lines are not printed once each (rank 0): $(grep "sample: " "$scratch/moe_ep$ep.out")"
done
case=train_moe_ep2_samples_equal_ep1
# The layouts reproduce each other's weights (fp32 sums reordered); greedy choices agree.
cmp -s "$scratch/moe_ep1.samples" "$scratch/moe_ep2.samples" ||
  fail "ep 2 samples differ: $(cat "$scratch/moe_ep2.samples") vs ep 1: $(cat "$scratch/moe_ep1.samples")"
case=generate_moe_from_ep2
"$tetra" generate --config "$scratch/moe_ep1.json" >"$scratch/gen_moe_ep1.out" 2>&1 ||
  fail "exit $?: $(cat "$scratch/gen_moe_ep1.out")"
"$tetra" generate --config "$scratch/moe_ep2.json" >"$scratch/gen_moe_ep2.out" 2>&1 ||
  fail "from the ep 2 run's weights: exit $?: $(cat "$scratch/gen_moe_ep2.out")"
"$tetra" generate --config "$scratch/moe_ep2.json" --weights "$scratch/ckpt_moe_ep2/step_00000100" \
  >"$scratch/gen_moe_ckpt.out" 2>"$scratch/gen_moe_ckpt.err" ||
  fail "from the ep 2 checkpoint: exit $?: $(cat "$scratch/gen_moe_ckpt.err")"
cmp -s "$scratch/gen_moe_ep2.out" "$scratch/gen_moe_ep1.out" ||
  fail "ep 2 weights: $(cat "$scratch/gen_moe_ep2.out") vs ep 1: $(cat "$scratch/gen_moe_ep1.out")"
cmp -s "$scratch/gen_moe_ckpt.out" "$scratch/gen_moe_ep2.out" ||
  fail "the ep 2 checkpoint: $(cat "$scratch/gen_moe_ckpt.out") vs its weights: $(cat "$scratch/gen_moe_ep2.out")"
$py - "$scratch/gen_moe_ep2.out" "$scratch/moe_ep2.samples" <<'PY' || fail "generate does not print the ep 2 run's last sample"
import sys
out = open(sys.argv[1], encoding="utf-8").read()
last = open(sys.argv[2], encoding="utf-8").read().splitlines()[-1]
assert out.startswith("the cat") and out[len("the cat"):-1].replace("\n", "\\n") == last, (out, last)
PY

# ---- MoE with an expert bias (sigmoid router): the biases are routing state a checkpoint keeps --
# generate from the checkpoint prints the run's last sample (the biases set, as the sampler had
# them); a weights file, which holds no biases, is refused.
case=train_moe_expert_bias
bias_model='"moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64, "aux_loss_coeff": 0.0, "router_score_function": "sigmoid", "router_enable_expert_bias": true, "router_bias_update_rate": 0.05}'
run6="$scratch/run_moe_bias"
write_config "$scratch/moe_bias.json" "$run6" '"dp": 2, "ep": 2' fp32 "$bias_model"
$py - "$scratch/moe_bias.json" "$scratch/ckpt_moe_bias" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["checkpoint"] = {"dir": sys.argv[2], "every": 100}
json.dump(c, open(sys.argv[1], "w"))
PY
timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$scratch/moe_bias.json" \
  >"$scratch/moe_bias.out" 2>&1 || fail "exit $?: $(tail -5 "$scratch/moe_bias.out")"
samples "$run6/train.log" >"$scratch/moe_bias.samples"
case=generate_moe_expert_bias_from_checkpoint
"$tetra" generate --config "$scratch/moe_bias.json" --weights "$scratch/ckpt_moe_bias/step_00000100" \
  >"$scratch/gen_moe_bias.out" 2>"$scratch/gen_moe_bias.err" || fail "exit $?: $(cat "$scratch/gen_moe_bias.err")"
$py - "$scratch/gen_moe_bias.out" "$scratch/moe_bias.samples" <<'PY' || fail "generate does not print the run's last sample"
import sys
out = open(sys.argv[1], encoding="utf-8").read()
last = open(sys.argv[2], encoding="utf-8").read().splitlines()[-1]
assert out.startswith("the cat") and out[len("the cat"):-1].replace("\n", "\\n") == last, (out, last)
PY
case=generate_moe_expert_bias_weights_file_refused
"$tetra" generate --config "$scratch/moe_bias.json" >"$scratch/gen_moe_bias_file.out" 2>"$scratch/gen_moe_bias_file.err"
rc=$?
[[ $rc -eq 2 ]] && grep -q "router_enable_expert_bias" "$scratch/gen_moe_bias_file.err" ||
  fail "exit $rc, expected 2 naming router_enable_expert_bias: $(cat "$scratch/gen_moe_bias_file.err")"

finish "generation cases"
