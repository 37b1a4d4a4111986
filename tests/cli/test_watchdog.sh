#!/usr/bin/env bash
# No silent hangs, under mpirun with 4 ranks (dp 2 x tp 2):
#  - hang: one rank sleeps at the start of a step (test-only TETRA_TEST_HANG_RANK/STEP, see
#    trainer/comm/watchdog.h); the watchdog ends the job with exit code 3 within the timeout plus a
#    margin, the hung rank reports that it is stuck in its own work, and a waiting rank names the
#    collective and group it waits in.
#  - kill: kill -9 one rank mid-run; the job exits non-zero within the timeout plus a margin with a
#    message naming the dead rank (mpirun's) or a waiting one (the watchdog's). Then a rerun with
#    checkpoint.resume auto continues from the last complete checkpoint and finishes.
#
# Usage: test_watchdog.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi
timeout_s=4
# Margin over the timeout: the watchdog polls at timeout/10, waits a grace period (<= 2 s) so every
# stuck rank reports, then MPI_Abort tears down 4 processes; start-up (MPI_Init of 4 ranks on 2
# cores, ~2 s) is included in the measured time, so the margin is generous.
margin_s=15

write_config() {  # write_config <dir> <steps> [extra training members]
  cat >"$1/config.json" <<JSON
{
  "model": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 1, "hidden_size": 32, "num_heads": 4,
            "num_kv_heads": 2, "ffn_hidden_size": 96},
  "parallel": {"dp": 2, "tp": 2},
  "training": {"micro_batch_size": 2, "steps": $2, "threads": 1, "peak_gflops": 10,
               "log_every": 100, "collective_timeout_s": $timeout_s},
  "data": {"synthetic": true},
  "checkpoint": {"dir": "$1/ckpt", "every": 20},
  "logging": {"dir": "$1/logs"}
}
JSON
}

now() { date +%s.%N; }
elapsed_ok() {  # elapsed_ok <start> <limit>: fails when more than <limit> seconds have passed
  local took
  took=$(awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  echo "[$case] the job ended after $took s (limit $2 s)"
  awk -v t="$took" -v l="$2" 'BEGIN { exit !(t <= l) }' || fail "the job took $took s, more than $2 s"
}

case=hang
dir="$scratch/$case"
mkdir -p "$dir"
write_config "$dir" 50
t0=$(now)
TETRA_TEST_HANG_RANK=2 TETRA_TEST_HANG_STEP=3 timeout 120 "$mpirun" --oversubscribe -np 4 "$tetra" \
  --config "$dir/config.json" >"$dir/stdout" 2>"$dir/stderr"
rc=$?
elapsed_ok "$t0" $((timeout_s + margin_s))
[[ $rc -eq 3 ]] || fail "exit code $rc, expected 3 (the watchdog's); stderr: $(cat "$dir/stderr")"
grep -q "watchdog: rank 2 \[tp0 pp0 dp1 ep0 | r2\] has been in step 3 .*not waiting in any collective" \
  "$dir/stderr" || fail "no report naming rank 2 as stuck in its own work; stderr: $(cat "$dir/stderr")"
# Rank 3 (tp partner of rank 2) waits in a tp collective, rank 0 (its dp partner) in a dp one;
# at least one waiting rank's report must have reached stderr before the abort.
grep -Eq "watchdog: rank [013] .* waiting [0-9.]+ s in [a-z_]+ on group '(tp|dp)' \(global ranks \[[0-9, ]+\]\)" \
  "$dir/stderr" || fail "no report naming a waiting rank's collective and group; stderr: $(cat "$dir/stderr")"

case=kill
dir="$scratch/$case"
mkdir -p "$dir"
write_config "$dir" 1000000
"$mpirun" --oversubscribe -np 4 "$tetra" --config "$dir/config.json" >"$dir/stdout" 2>"$dir/stderr" &
job=$!
# Wait (at most 60 s) until a checkpoint is committed and the run has gone well beyond it.
for _ in $(seq 600); do
  if [[ -f "$dir/ckpt/latest" ]] && [[ "$(cat "$dir/ckpt/latest")" != step_00000020 ]]; then break; fi
  sleep 0.1
done
victim=""
for pid in $(pgrep -P "$job"); do
  if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then victim=$pid; fi
done
if [[ -z "$victim" || ! -f "$dir/ckpt/latest" ]]; then
  fail "no checkpoint within 60 s or rank 1 not found (children of mpirun: $(pgrep -P "$job" | tr '\n' ' '))"
  kill "$job" 2>/dev/null
  wait "$job"
else
  t0=$(now)
  kill -9 "$victim"
  # Bounded wait for the job: a hang here is the failure under test.
  for _ in $(seq $(((timeout_s + margin_s) * 10 + 100))); do kill -0 "$job" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$job" 2>/dev/null; then
    fail "the job still runs $((timeout_s + margin_s + 10)) s after rank 1 was killed"
    kill -9 "$job"
  fi
  wait "$job"
  rc=$?
  elapsed_ok "$t0" $((timeout_s + margin_s))
  [[ $rc -ne 0 ]] || fail "exit code 0 after a rank was killed"
  grep -Eq "process rank 1 .*(signal 9|Killed)|watchdog: rank [0-9]+ " "$dir/stdout" "$dir/stderr" ||
    fail "no message naming the dead or a waiting rank; stderr: $(cat "$dir/stderr")"

  # The last complete checkpoint (latest is replaced only after a checkpoint is committed).
  last=$(cat "$dir/ckpt/latest")
  step=$((10#${last#step_}))
  timeout 120 "$mpirun" --oversubscribe -np 4 "$tetra" --config "$dir/config.json" \
    --set training.steps=$((step + 5)) >"$dir/resume.stdout" 2>"$dir/resume.stderr"
  rc=$?
  [[ $rc -eq 0 ]] || fail "the resumed run exited $rc; stderr: $(cat "$dir/resume.stderr")"
  grep -q "checkpoint $dir/ckpt/$last loaded" "$dir/resume.stdout" ||
    fail "the rerun did not load $last; stdout: $(head -20 "$dir/resume.stdout")"
  first=$(grep '"step"' "$dir/logs/metrics.jsonl" | tail -5 | head -1 | sed 's/.*"step": *\([0-9]*\).*/\1/')
  [[ "$first" == "$((step + 1))" ]] || fail "the rerun's first step is '$first', expected $((step + 1))"
  grep -q "done: $((step + 5)) steps" "$dir/resume.stdout" || fail "the rerun did not finish: $(tail -3 "$dir/resume.stdout")"
fi

finish "watchdog cases"
