#!/usr/bin/env bash
# Bad token files are refused by the real binary: exit code 2, the file named on stderr, nothing
# written into logging.dir. A good dataset in the same place trains (the control).
#
# Usage: test_data_errors.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# A dataset of 40 documents of 50 tokens (ids < 64), written by the numpy tool.
/usr/bin/python3 - "$src/tools" "$scratch/good" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import indexed_dataset
rng = np.random.default_rng(0)
indexed_dataset.write(sys.argv[2], [rng.integers(0, 64, 50) for _ in range(40)], "uint16")
PY

config() {  # config <train prefix> <logging dir>
  cat <<JSON
{
  "model": {"vocab_size": 64, "seq_len": 16, "num_layers": 1, "hidden_size": 32, "num_heads": 4},
  "training": {"micro_batch_size": 2, "steps": 2},
  "data": {"train": ["$1"]},
  "logging": {"dir": "$2"}
}
JSON
}

# run_case <name> <prefix> <expected exit> <text expected on stderr>
run_case() {
  case="$1"
  local prefix="$2" expected="$3" text="$4" dir="$scratch/$1"
  mkdir -p "$dir"
  config "$prefix" "$dir/logs" >"$dir/config.json"
  # timeout: a file that blocks the run (a named pipe) fails the case instead of hanging the test.
  timeout 120 "$tetra" --config "$dir/config.json" >"$dir/stdout" 2>"$dir/stderr"
  local rc=$?
  [[ $rc -eq $expected ]] || fail "exit code $rc, expected $expected; stderr: $(cat "$dir/stderr")"
  grep -qF -- "$text" "$dir/stderr" || fail "stderr lacks '$text': $(cat "$dir/stderr")"
  if [[ $expected -ne 0 && -e "$dir/logs" ]]; then fail "logging.dir was written"; fi
}

# Control: the good dataset trains.
case=control
mkdir -p "$scratch/control"
config "$scratch/good" "$scratch/control/logs" >"$scratch/control/config.json"
"$tetra" --config "$scratch/control/config.json" >"$scratch/control/stdout" 2>&1 ||
  fail "the good dataset did not train: $(tail -5 "$scratch/control/stdout")"
grep -q '"step":2' "$scratch/control/logs/metrics.jsonl" 2>/dev/null || fail "no step 2 in metrics.jsonl"

# Missing files.
run_case missing "$scratch/nowhere" 2 "nowhere"
cp "$scratch/good.idx" "$scratch/only_idx.idx"
run_case missing_bin "$scratch/only_idx" 2 "only_idx.bin"

# A truncated .bin: the .idx no longer matches it.
cp "$scratch/good.idx" "$scratch/short.idx"
head -c 1000 "$scratch/good.bin" >"$scratch/short.bin"
run_case truncated_bin "$scratch/short" 2 "short.bin"

# A truncated .idx.
head -c 40 "$scratch/good.idx" >"$scratch/cut.idx"
cp "$scratch/good.bin" "$scratch/cut.bin"
run_case truncated_idx "$scratch/cut" 2 "cut.idx"

# Not regular files: a named pipe must not block the run (it did, forever), a directory must not
# fail as "No such device".
mkfifo "$scratch/fifo.idx"
cp "$scratch/good.bin" "$scratch/fifo.bin"
run_case fifo_idx "$scratch/fifo" 2 "fifo.idx is a named pipe (FIFO), not a regular file"
cp "$scratch/good.idx" "$scratch/fifo_bin.idx"
mkfifo "$scratch/fifo_bin.bin"
run_case fifo_bin "$scratch/fifo_bin" 2 "fifo_bin.bin is a named pipe (FIFO), not a regular file"
cp "$scratch/good.idx" "$scratch/dir.idx"
mkdir "$scratch/dir.bin"
run_case dir_bin "$scratch/dir" 2 "dir.bin is a directory, not a regular file"
mkdir "$scratch/dir_idx.idx"
cp "$scratch/good.bin" "$scratch/dir_idx.bin"
run_case dir_idx "$scratch/dir_idx" 2 "dir_idx.idx is a directory, not a regular file"

# An .idx that belongs to another .bin (more tokens than this .bin holds).
/usr/bin/python3 - "$src/tools" "$scratch/other" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import indexed_dataset
indexed_dataset.write(sys.argv[2], [np.arange(60) % 64 for _ in range(40)], "uint16")
PY
cp "$scratch/other.idx" "$scratch/mixed.idx"
cp "$scratch/good.bin" "$scratch/mixed.bin"
run_case idx_mismatch "$scratch/mixed" 2 "mixed"

# Token ids beyond the model's vocabulary.
/usr/bin/python3 - "$src/tools" "$scratch/big_ids" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import indexed_dataset
indexed_dataset.write(sys.argv[2], [np.arange(100) for _ in range(5)], "uint16")
PY
run_case token_out_of_range "$scratch/big_ids" 2 "vocab"

finish "data error cases"
