#!/usr/bin/env bash
# `tetra data` end to end: a SentencePiece model trained on the fly, text and JSONL corpora
# tokenized with it (same tokens both ways, same files for every thread count, a train/valid
# split), a text tokenized with a hand-made Hugging Face tokenizer.json, an llm.c shard converted, and bad input refused with exit code 2, a message naming the
# file and line, and no dataset left behind.
#
# Usage: test_tetra_data.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"


# A corpus of 12 files: lines of words drawn from a small list, some of them not ASCII.
$py - "$scratch/corpus" <<'PY'
import os, random, sys
out = sys.argv[1]
os.makedirs(out)
words = ("the of and to in a is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there one all we their been has when who "
         "will more no if out so said what up its about into than them can only other new some "
         "could time these two may then do first any my now such like our over man me even most "
         "café naïve über señor coöperate 東京 ☃").split()
for i in range(12):
    rng = random.Random(i)
    lines = []
    for _ in range(40):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + ".")
    with open(os.path.join(out, f"doc{i:02d}.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
PY

# read_docs <prefix>: prints the documents of a dataset, one line of ids each.
read_docs() {
  $py - "$src/tools" "$1" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import indexed_dataset
for d in indexed_dataset.read(sys.argv[2]):
    print(" ".join(str(int(t)) for t in d))
PY
}

# no_dataset <prefix>: fails the case if anything was written at the prefix.
no_dataset() {
  local f
  for f in "$1".bin "$1".idx "$1".bin.tmp "$1".idx.tmp; do
    [[ ! -e "$f" ]] || fail "$f was left behind"
  done
}

# ---- train-tokenizer -------------------------------------------------------------------------
case=train_tokenizer
"$tetra" data train-tokenizer --input "$scratch/corpus" --vocab-size 300 --output "$scratch/spm" \
  >"$scratch/train.out" 2>"$scratch/train.err" || fail "exit $?: $(cat "$scratch/train.err")"
[[ -s "$scratch/spm.model" && -s "$scratch/spm.vocab" ]] || fail "no spm.model / spm.vocab"
grep -q "vocabulary 300" "$scratch/train.out" || fail "summary: $(cat "$scratch/train.out")"
spm="sentencepiece:$scratch/spm.model"

# ---- tokenize text files ---------------------------------------------------------------------
case=tokenize_text
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus" --output "$scratch/text" \
  --threads 1 >"$scratch/text.out" 2>"$scratch/text.err" ||
  fail "exit $?: $(cat "$scratch/text.err")"
grep -q "^documents: *12$" "$scratch/text.out" || fail "summary: $(cat "$scratch/text.out")"
grep -q "^tokens per byte: " "$scratch/text.out" ||
  fail "no tokens per byte: $(cat "$scratch/text.out")"
read_docs "$scratch/text" >"$scratch/text.docs" || fail "the dataset does not read back"
tokens=$(sed -n 's/^tokens: *\([0-9,]*\) .*/\1/p' "$scratch/text.out" | tr -d ,)
$py - "$scratch/text.docs" "$tokens" <<'PY' || fail "documents do not end in the end-of-document id"
import sys
docs = [list(map(int, l.split())) for l in open(sys.argv[1])]
assert len(docs) == 12, len(docs)
assert sum(len(d) for d in docs) == int(sys.argv[2]), "summary token count"
eod = docs[0][-1]
# Every document ends in the same id and it occurs nowhere else: the tokenizer's EOD, appended.
assert all(d[-1] == eod for d in docs)
assert all(eod not in d[:-1] for d in docs)
assert all(len(d) > 100 for d in docs)  # 40 lines of words each, a 300-piece vocabulary
PY

case=existing_outputs  # a dataset or tokenizer is replaced only with --force
md5=$(md5sum <"$scratch/text.bin")
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus/doc00.txt" --output "$scratch/text" \
  >/dev/null 2>"$scratch/exists.err" && fail "an existing dataset was replaced without --force"
grep -qF "$scratch/text.bin: the file exists (pass --force to replace it)" "$scratch/exists.err" ||
  fail "message: $(cat "$scratch/exists.err")"
[[ "$(md5sum <"$scratch/text.bin")" == "$md5" ]] || fail "the refused run changed text.bin"
"$tetra" data train-tokenizer --input "$scratch/corpus" --vocab-size 300 --output "$scratch/spm" \
  >/dev/null 2>"$scratch/exists.err" && fail "an existing tokenizer was replaced without --force"
grep -qF "$scratch/spm.model: the file exists (pass --force" "$scratch/exists.err" || fail "message: $(cat "$scratch/exists.err")"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus/doc00.txt" --output "$scratch/textf" \
  >/dev/null 2>&1 || fail "a new output refused"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus" --output "$scratch/textf" --force \
  >/dev/null 2>&1 || fail "--force did not replace the dataset"
cmp -s "$scratch/text.bin" "$scratch/textf.bin" || fail "the replaced dataset is not the new one"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus/doc00.txt" --output "$scratch/" \
  >/dev/null 2>"$scratch/exists.err" && fail "a prefix ending in / was accepted"
grep -qF "names a directory, not a prefix" "$scratch/exists.err" || fail "message: $(cat "$scratch/exists.err")"

case=output_is_input  # even with --force, an output that is an input is refused (it would destroy it)
cp "$scratch/corpus/doc00.txt" "$scratch/self.bin"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/self.bin" --output "$scratch/self" --force \
  >/dev/null 2>"$scratch/self.err" && fail "tokenize over its own input was accepted"
grep -qF "is also an input" "$scratch/self.err" || fail "message: $(cat "$scratch/self.err")"
cmp -s "$scratch/corpus/doc00.txt" "$scratch/self.bin" || fail "the input was changed"
ln -sf "$scratch/nowhere" "$scratch/link.bin"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus/doc00.txt" --output "$scratch/link" \
  >/dev/null 2>"$scratch/self.err" && fail "a dangling symbolic link was replaced without --force"
grep -qF "is a symbolic link (pass --force" "$scratch/self.err" || fail "message: $(cat "$scratch/self.err")"

case=foreign_tmp_files  # a file of the temporary names is someone's: never truncated or removed
echo precious >"$scratch/textg.bin.tmp"
echo precious >"$scratch/textg.idx.tmp"
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus" --output "$scratch/textg" >/dev/null 2>&1 ||
  fail "tokenize beside foreign .tmp files failed"
cmp -s "$scratch/text.bin" "$scratch/textg.bin" || fail "the dataset written beside them differs"
[[ "$(cat "$scratch/textg.bin.tmp")" == precious && "$(cat "$scratch/textg.idx.tmp")" == precious ]] ||
  fail "a foreign .tmp file was changed"
ls "$scratch"/textg.*.tmp.* >/dev/null 2>&1 && fail "temporary files left: $(ls "$scratch"/textg.*)"

case=threads
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus" --output "$scratch/text2" \
  --threads 2 >/dev/null 2>&1 || fail "exit $?"
cmp -s "$scratch/text.bin" "$scratch/text2.bin" || fail ".bin differs between 1 and 2 threads"
cmp -s "$scratch/text.idx" "$scratch/text2.idx" || fail ".idx differs between 1 and 2 threads"

# ---- the same texts as JSON lines, split 3,1 ---------------------------------------------------
case=jsonl_split
$py - "$scratch/corpus" "$scratch/corpus.jsonl" <<'PY'
import json, os, sys
d = sys.argv[1]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    for name in sorted(os.listdir(d)):
        text = open(os.path.join(d, name), encoding="utf-8").read()
        f.write(json.dumps({"id": name, "content": text}) + "\n")
PY
"$tetra" data tokenize --tokenizer "$spm" --input "$scratch/corpus.jsonl" --jsonl --json-key content \
  --output "$scratch/js" --split 3,1 >"$scratch/js.out" 2>"$scratch/js.err" ||
  fail "exit $?: $(cat "$scratch/js.err")"
no_dataset "$scratch/js"
read_docs "$scratch/js_train" >"$scratch/js_train.docs" || fail "no js_train"
read_docs "$scratch/js_valid" >"$scratch/js_valid.docs" || fail "no js_valid"
# Weights 3,1 deal train, train, valid, train, ...: valid gets documents 2, 6, 10 (0-based), and
# each is tokenized exactly as from its text file.
$py - "$scratch/text.docs" "$scratch/js_train.docs" "$scratch/js_valid.docs" <<'PY' || fail "split"
import sys
text, train, valid = (open(p).read().splitlines() for p in sys.argv[1:])
assert valid == [text[i] for i in (2, 6, 10)], "valid part"
assert train == [text[i] for i in range(12) if i not in (2, 6, 10)], "train part"
PY

# ---- a Hugging Face tokenizer.json (hf:<dir>) ------------------------------------------------
case=tokenize_hf
write_hf_tokenizer "$scratch/hf"
mkdir -p "$scratch/hf_digits"
$py - "$scratch/hf" "$scratch/hf_digits" <<'PY'
import json, sys
tok = json.load(open(sys.argv[1] + "/tokenizer.json"))
tok["pre_tokenizer"] = {"type": "Digits", "individual_digits": True}
json.dump(tok, open(sys.argv[2] + "/tokenizer.json", "w"))
PY
"$tetra" data tokenize --tokenizer "hf:$scratch/hf" --input "$scratch/corpus/doc00.txt" \
  --output "$scratch/hf_out" >"$scratch/hf.out" 2>"$scratch/hf.err" ||
  fail "exit $?: $(cat "$scratch/hf.err")"
read_docs "$scratch/hf_out" >"$scratch/hf.docs" || fail "the hf dataset does not read back"
$py - "$scratch/hf.docs" "$scratch/corpus/doc00.txt" <<'PY' || fail "hf ids are not the text's bytes (th merged) + <|end|>"
import sys
docs = [list(map(int, l.split())) for l in open(sys.argv[1])]
want = []
data = open(sys.argv[2], "rb").read()
i = 0
while i < len(data):
    if data[i:i + 2] == b"th":
        want.append(256)
        i += 2
    else:
        want.append(data[i])
        i += 1
assert docs == [want + [257]], (docs[0][:20], want[:20])
PY
# ---- from-llmc -------------------------------------------------------------------------------
case=from_llmc
# Two gpt-2 shards by llm.c's dev/data/data_common.py rules, a document continuing across them.
$py - "$scratch" <<'PY'
import sys
import numpy as np
def write_datafile(filename, toks):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(toks)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=np.uint16).tobytes())
E = 50256
write_datafile(sys.argv[1] + "/shard_000000.bin", [E, 10, 11, 12, E, 20, 21])
write_datafile(sys.argv[1] + "/shard_000001.bin", [22, E, 30])
PY
"$tetra" data from-llmc --input "$scratch/shard_000000.bin" "$scratch/shard_000001.bin" \
  --output "$scratch/llmc" >"$scratch/llmc.out" 2>"$scratch/llmc.err" ||
  fail "exit $?: $(cat "$scratch/llmc.err")"
printf '10 11 12 50256\n20 21 22 50256\n30 50256\n' >"$scratch/llmc.want"
read_docs "$scratch/llmc" | cmp -s - "$scratch/llmc.want" ||
  fail "documents: $(read_docs "$scratch/llmc" | tr '\n' '|')"

# ---- bad input: exit 2, the file (and line) named, nothing written ------------------------------
# bad <case> <expected text on stderr> <output prefix> -- <tetra data args...>
bad() {
  case="$1"
  local text="$2" prefix="$3"
  shift 4
  # timeout: an input that blocks (a named pipe) fails the case instead of hanging the test.
  timeout 120 "$tetra" data "$@" >"$scratch/$case.out" 2>"$scratch/$case.err"
  local rc=$?
  [[ $rc -eq 2 ]] || fail "exit code $rc, expected 2; stderr: $(cat "$scratch/$case.err")"
  grep -qF -- "$text" "$scratch/$case.err" ||
    fail "stderr lacks '$text': $(cat "$scratch/$case.err")"
  no_dataset "$prefix"
}
out="$scratch/bad_out"
mkdir -p "$scratch/bad"
printf 'fine\nalso fine\nthis is \xff not UTF-8\n' >"$scratch/bad/latin1.txt"
bad bad_utf8 "latin1.txt:3: invalid UTF-8 at byte 23" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/corpus" "$scratch/bad/latin1.txt" --output "$out"

: >"$scratch/bad/empty.txt"
bad empty_file "empty.txt: the file is empty" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/bad/empty.txt" --output "$out"

printf '{"text": "ok"}\n{"body": "no text"}\n' >"$scratch/bad/nokey.jsonl"
bad jsonl_no_key 'nokey.jsonl:2: the object has no "text" field' "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/bad/nokey.jsonl" --jsonl --output "$out"

printf '{"text": "ok"}\n{"text": "ok"}\n{"text": \n' >"$scratch/bad/broken.jsonl"
bad jsonl_not_json "broken.jsonl:3:10: the line is not JSON (syntax error" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/bad/broken.jsonl" --jsonl --output "$out"

# A number beyond a double's range: nlohmann's out_of_range, mapped to exit 2 and file:line:col.
printf '{"text": "ok"}\n{"text": "a", "x": 1e999}\n' >"$scratch/bad/huge.jsonl"
bad jsonl_number_overflow "huge.jsonl:2:20: the number 1e999 is too large for a double" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/bad/huge.jsonl" --jsonl --output "$out"

printf '{"text": ["a", "list"]}\n' >"$scratch/bad/list.jsonl"
bad jsonl_not_string 'list.jsonl:1: field "text" is a JSON array, not a string' "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/bad/list.jsonl" --jsonl --output "$out"

bad unwritable_output "does not exist" "$scratch/no/such/dir/out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/corpus" --output "$scratch/no/such/dir/out"

bad missing_input "nowhere.txt does not exist" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/nowhere.txt" --output "$out"

# Inputs that are not regular files are refused without reading them (a named pipe blocked).
mkfifo "$scratch/bad/pipe.txt"
bad fifo_input "input $scratch/bad/pipe.txt is a named pipe (FIFO), not a regular file or a directory" \
  "$out" -- tokenize --tokenizer "$spm" --input "$scratch/bad/pipe.txt" --output "$out"
mkdir -p "$scratch/bad/gpt2_fifo"
mkfifo "$scratch/bad/gpt2_fifo/encoder.json"
bad gpt2_fifo "encoder.json is a named pipe (FIFO), not a regular file" "$out" -- \
  tokenize --tokenizer "gpt2:$scratch/bad/gpt2_fifo" --input "$scratch/corpus" --output "$out"
mkfifo "$scratch/bad/pipe.model"
bad spm_fifo "pipe.model is a named pipe (FIFO), not a regular file" "$out" -- \
  tokenize --tokenizer "sentencepiece:$scratch/bad/pipe.model" --input "$scratch/corpus" \
  --output "$out"

bad bad_tokenizer "nowhere.model" "$out" -- \
  tokenize --tokenizer "sentencepiece:$scratch/nowhere.model" --input "$scratch/corpus" \
  --output "$out"
bad hf_unsupported "hf_digits/tokenizer.json: pre_tokenizer.type \"Digits\" is not supported" "$out" -- \
  tokenize --tokenizer "hf:$scratch/hf_digits" --input "$scratch/corpus" --output "$out"
bad hf_missing "nowhere/tokenizer.json: cannot open" "$out" -- \
  tokenize --tokenizer "hf:$scratch/nowhere" --input "$scratch/corpus" --output "$out"

bad too_small_split "valid part got none" "$scratch/small" -- \
  tokenize --tokenizer "$spm" --input "$scratch/corpus/doc00.txt" --split 98,2 \
  --output "$scratch/small"
no_dataset "$scratch/small_train"
no_dataset "$scratch/small_valid"

bad bad_split "--split 98:" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/corpus" --split 98 --output "$out"

head -c 2048 /dev/zero >"$scratch/bad/zeros.bin"
bad llmc_bad_magic "zeros.bin: byte 0: bad magic 0" "$out" -- \
  from-llmc --input "$scratch/bad/zeros.bin" --output "$out"

head -c 1030 "$scratch/shard_000000.bin" >"$scratch/bad/cut.bin"
bad llmc_cut "cut.bin: byte 8: the header promises 7 tokens" "$out" -- \
  from-llmc --input "$scratch/bad/cut.bin" --output "$out"

bad no_subcommand "subcommand" "$out" --
bad missing_output "--output" "$out" -- tokenize --tokenizer "$spm" --input "$scratch/corpus"
bad json_key_needs_jsonl "--jsonl" "$out" -- \
  tokenize --tokenizer "$spm" --input "$scratch/corpus" --json-key body --output "$out"

# --eot: a negative id is refused (it used to mean the default), as is one past the shards' token type.
bad llmc_negative_eot "--eot: -7: a token id is at least 0" "$out" -- \
  from-llmc --input "$scratch/shard_000000.bin" --output "$out" --eot -7
bad llmc_negative_eot_equals "--eot: -1: a token id is at least 0" "$out" -- \
  from-llmc --input "$scratch/shard_000000.bin" --output "$out" --eot=-1
bad llmc_eot_past_uint16 "--eot 70000 cannot occur in gpt-2 shards (tokens up to 65535)" "$out" -- \
  from-llmc --input "$scratch/shard_000000.bin" --output "$out" --eot 70000

finish "tetra data cases"
