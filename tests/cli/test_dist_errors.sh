#!/usr/bin/env bash
# Bad parallel layouts under mpirun: a clear error printed once (by rank 0), exit code 2 from the
# whole job, no hang (each case runs under a timeout), nothing written. And a failure after
# start-up on every rank (a dataset that cannot be read) ends the job non-zero, not in a hang.
#
# Usage: test_dist_errors.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi

synthetic='{"synthetic": true}'
write_config() {  # write_config <path> <parallel section members> [data section] [ffn size]
  local data="${3:-$synthetic}" ffn="${4:-96}"
  cat >"$1" <<JSON
{
  "model": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 1, "hidden_size": 32, "num_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": $ffn},
  "parallel": {$2},
  "training": {"micro_batch_size": 2, "steps": 2, "threads": 1, "peak_gflops": 10},
  "data": $data,
  "logging": {"dir": "$scratch/$case/logs"}
}
JSON
}

# run_case <expected exit code | nonzero> <ranks> <parallel members> [data section] [ffn size]
run_case() {
  local expected="$1" np="$2"
  mkdir -p "$scratch/$case"
  write_config "$scratch/$case/config.json" "$3" "${4:-}" "${5:-}"
  err="$scratch/$case/stderr"
  timeout 120 "$mpirun" --oversubscribe -np "$np" "$tetra" --config "$scratch/$case/config.json" \
    >"$scratch/$case/stdout" 2>"$err"
  local rc=$?
  [[ $rc -ne 124 ]] || fail "the job hung (killed after 120 s)"
  if [[ "$expected" == nonzero ]]; then
    [[ $rc -ne 0 ]] || fail "exit code 0, expected a failure"
  else
    [[ $rc -eq $expected ]] || fail "exit code $rc, expected $expected; stderr: $(cat "$err")"
  fi
}

expect_once() {  # the message appears exactly once: rank 0 reports, the others stay silent
  local n
  n=$(grep -cF -- "$1" "$err")
  [[ $n -eq 1 ]] || fail "stderr has '$1' $n times, expected once; stderr: $(cat "$err")"
}

expect_no_logs() {
  [[ ! -e "$scratch/$case/logs" ]] || fail "logging.dir was created: $(ls -R "$scratch/$case/logs")"
}

case=world_size
run_case 2 3 '"dp": 2'
expect_once "world size 3 is not tp (1) x pp (1) x dp (2) = 2"
expect_no_logs

case=tp_heads
run_case 2 3 '"tp": 3'
expect_once "model.num_heads (4) must be a multiple of parallel.tp (3)"
expect_once "model.num_kv_heads (2) must be a multiple of parallel.tp (3)"
expect_no_logs

case=tp_kv_heads
run_case 2 4 '"tp": 4'
expect_once "model.num_kv_heads (2) must be a multiple of parallel.tp (4)"
expect_no_logs

case=tp_ffn
run_case 2 2 '"tp": 2' "" 97
expect_once "model.ffn_hidden_size (97) must be a multiple of parallel.tp (2)"
expect_no_logs

case=ep_divides_dp
run_case 2 4 '"dp": 4, "ep": 3'
expect_once "parallel.ep (3) must divide parallel.dp (4)"
expect_no_logs

case=cp_world_size
run_case 2 3 '"cp": 2'
expect_once "world size 3 is not tp (1) x cp (2) x pp (1) x dp (1) = 2"
expect_no_logs

case=cp_seq_len
run_case 2 3 '"cp": 3'
expect_once "must be a multiple of 2 x parallel.cp (6)"
expect_no_logs

case=sequence_parallel_without_tp
run_case 2 2 '"dp": 2, "sequence_parallel": true'
expect_once "needs parallel.tp > 1"

case=missing_dataset
run_case nonzero 2 '"dp": 2' "{\"train\": [{\"path\": \"$scratch/no/such/data\"}]}"
grep -qF "$scratch/no/such/data" "$err" || fail "stderr does not name the dataset; stderr: $(cat "$err")"
expect_no_logs

case=valid_tp2  # the configs above with a valid layout train: they failed for their own reason
run_case 0 2 '"tp": 2, "sequence_parallel": true'

finish "distributed bad-input cases"
