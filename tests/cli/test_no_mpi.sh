#!/usr/bin/env bash
# A build without MPI (cmake -DTETRA_MPI=OFF; registered only in such a build): it trains as one
# process like any build, plans multi-rank layouts with --dry-run, and refuses, with a message
# that says "built without MPI", both a config that needs several processes (exit 2) and a launch
# as one of several processes by mpirun or srun, recognised by their environment variables
# (exit 1, every rank). A plain run inside a Slurm batch script (SLURM_* set, but no task of a
# multi-task step) is not refused.
#
# Usage: test_no_mpi.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

cfg="$src/configs/reference_gpt2.json"

case=single_process_trains
"$tetra" --config "$cfg" --set training.steps=3 --set training.threads=1 --set "logging.dir=$scratch/run" \
  >"$scratch/train.out" 2>&1 || fail "a single-process run failed: $(tail -5 "$scratch/train.out")"
[[ $(grep -c '"tokens_per_s"' "$scratch/run/metrics.jsonl" 2>/dev/null) -eq 3 ]] ||
  fail "expected 3 steps in metrics.jsonl"

case=dry_run_plans_layouts
"$tetra" --config "$cfg" --set parallel.tp=2 --set parallel.dp=2 --set model.vocab_size=98 --set model.make_vocab_size_divisible_by=1 --dry-run \
  >"$scratch/dry" 2>&1 ||
  fail "--dry-run of tp 2 x dp 2 failed: $(cat "$scratch/dry")"

for layout in parallel.tp=2 parallel.dp=2 parallel.pp=2; do
  case="refuses_$layout"
  # (vocab 98: a valid tp 2 layout otherwise, so the refusal is the build's, not the config's)
  "$tetra" --config "$cfg" --set "$layout" --set model.vocab_size=98 --set model.make_vocab_size_divisible_by=1 >"$scratch/out" 2>&1
  rc=$?
  [[ $rc -eq 2 ]] || fail "exit code $rc, expected 2"
  grep -q "built without MPI" "$scratch/out" || fail "message: $(cat "$scratch/out")"
  grep -q "parallel.tp, pp, dp and ep to 1" "$scratch/out" || fail "no fix suggested: $(cat "$scratch/out")"
done

check_launch_refused() {  # <launcher named in the message> <env assignments...>
  local who=$1
  shift
  env "$@" "$tetra" --config "$cfg" --print-config >"$scratch/out" 2>&1
  rc=$?
  [[ $rc -eq 1 ]] || fail "exit code $rc, expected 1"
  grep -q "built without MPI" "$scratch/out" && grep -q "$who" "$scratch/out" ||
    fail "message does not name the cause: $(cat "$scratch/out")"
}
case=refuses_mpirun
check_launch_refused "mpirun (OMPI_COMM_WORLD_SIZE=4)" OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_RANK=1
case=refuses_srun
check_launch_refused "srun (SLURM_STEP_NUM_TASKS=2)" SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0
case=refuses_pmi
check_launch_refused "PMI_SIZE=8" PMI_SIZE=8 PMI_RANK=3

case=batch_script_runs
env SLURM_NTASKS=4 SLURM_JOB_ID=7 "$tetra" --config "$cfg" --print-config >"$scratch/out" 2>&1 ||
  fail "a plain run in a batch allocation was refused: $(cat "$scratch/out")"
case=one_task_step_runs
env SLURM_STEP_NUM_TASKS=1 SLURM_PROCID=0 OMPI_COMM_WORLD_SIZE=1 "$tetra" --config "$cfg" --print-config \
  >"$scratch/out" 2>&1 || fail "a one-task launch was refused: $(cat "$scratch/out")"

finish "no-MPI build checks"
