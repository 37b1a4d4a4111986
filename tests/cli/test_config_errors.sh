#!/usr/bin/env bash
# Bad configurations are refused by the real binary before it does anything: exit code 2, a message
# on stderr that names the offending key (or file), and nothing written into the run's logging.dir.
#
# Usage: test_config_errors.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# A small valid config whose logging.dir is $scratch/<case>/logs; extra JSON members for the
# "model" section come as $2.
write_config() {
  local path="$1" model_extra="$2"
  cat >"$path" <<EOF
{
  "model": {"vocab_size": 64, "seq_len": 16, "num_layers": 1, "hidden_size": 32,
            "num_heads": 4${model_extra}},
  "training": {"micro_batch_size": 2, "steps": 2},
  "data": {"synthetic": true},
  "logging": {"dir": "$scratch/$case/logs"}
}
EOF
}

# run_case <expected exit code> <config path> [tetra arguments...]: runs tetra in $scratch/$case,
# leaves its stdout and stderr in $out and $err.
run_case() {
  local expected="$1" config="$2"
  shift 2
  out="$scratch/$case/stdout"
  err="$scratch/$case/stderr"
  (cd "$scratch/$case" && "$tetra" --config "$config" "$@" >"$out" 2>"$err")
  local rc=$?
  [[ $rc -eq $expected ]] || fail "exit code $rc, expected $expected; stderr: $(cat "$err")"
}

expect_stderr() {
  grep -qF -- "$1" "$err" || fail "stderr lacks '$1'; stderr: $(cat "$err")"
}

# Nothing may have been created in the run's logging.dir (not even the directory).
expect_no_output_files() {
  local logs="$scratch/$case/logs"
  if [[ -e "$logs" ]]; then
    fail "logging.dir was written: $(find "$logs" | head -5 | tr '\n' ' ')"
  fi
}

start_case() {
  case="$1"
  mkdir -p "$scratch/$case"
  echo "--- $case"
}

# Control: the valid config is accepted, so each refusal below comes from what that case changes.
start_case valid
write_config "$scratch/valid/config.json" ""
run_case 0 "$scratch/valid/config.json" --print-config
grep -qF '"hidden_size": 32' "$out" || fail "--print-config did not print the config"
expect_no_output_files

start_case malformed_json
config="$scratch/malformed_json/config.json"
write_config "$config" ","  # a trailing comma in "model" (line 3)
run_case 2 "$config"
expect_stderr "error: $config:3:"
expect_stderr "invalid JSON"
expect_no_output_files

start_case unknown_key
write_config "$scratch/unknown_key/config.json" ', "hiden_size": 64'
run_case 2 "$scratch/unknown_key/config.json"
expect_stderr 'model.hiden_size: unknown key; did you mean "model.hidden_size"?'
expect_no_output_files

start_case wrong_type
write_config "$scratch/wrong_type/config.json" ', "num_kv_heads": "2"'
run_case 2 "$scratch/wrong_type/config.json"
expect_stderr 'model.num_kv_heads: "2": expected an integer, got a string'
expect_no_output_files

start_case cross_field_rule
write_config "$scratch/cross_field_rule/config.json" ', "num_kv_heads": 3'
run_case 2 "$scratch/cross_field_rule/config.json"
expect_stderr 'model.num_kv_heads: 3: must divide model.num_heads (4)'
expect_no_output_files

start_case missing_file
run_case 2 "$scratch/missing_file/no_such_config.json"
expect_stderr "error: cannot open config file $scratch/missing_file/no_such_config.json: No such file or directory"
expect_no_output_files

# training.device "cuda" without a usable GPU: refused before anything is written, naming the
# reason (a build without the CUDA backend, or no visible device). Skipped where a GPU is present
# (there the run would train).
if ! nvidia-smi -L >/dev/null 2>&1; then
  start_case cuda_without_gpu
  write_config "$scratch/cuda_without_gpu/config.json" ""
  run_case 2 "$scratch/cuda_without_gpu/config.json" --set training.device=cuda
  expect_stderr 'training.device: "cuda": '
  if ! grep -qF 'built without the CUDA backend' "$err"; then
    expect_stderr 'no CUDA device is visible to this process'
  fi
  expect_no_output_files
fi

# Overrides go through the same checks, and every problem is reported at once.
start_case override_errors
write_config "$scratch/override_errors/config.json" ""
run_case 2 "$scratch/override_errors/config.json" \
  --set training.steps=0 --set training.device=tpu --set model.hidden_size
expect_stderr 'training.steps: 0: must be >= 1'
expect_stderr 'training.device: "tpu"'
expect_stderr 'override "model.hidden_size": expected section.key=value'
expect_no_output_files

# A pipeline layout that would build another model than the config says: refused with the
# arithmetic (30 layers on pp=4 is not 28 or 32 layers), and an uneven split given explicitly works.
start_case pipeline_layout
write_config "$scratch/pipeline_layout/config.json" ""
run_case 2 "$scratch/pipeline_layout/config.json" --set model.num_layers=30 --set parallel.pp=4 \
  --set parallel.virtual_stages=2
expect_stderr 'parallel.virtual_stages: 2: virtual stages need parallel.schedule "interleaved"'
run_case 2 "$scratch/pipeline_layout/config.json" --set model.num_layers=30 --set parallel.pp=4
expect_stderr 'model.num_layers: 30: does not split evenly over parallel.pp (4) x parallel.virtual_stages (1) = 4 stages'
expect_stderr 'parallel.stage_layers = [8, 8, 7, 7]'
run_case 2 "$scratch/pipeline_layout/config.json" --set model.num_layers=30 --set parallel.pp=4 \
  --set 'parallel.stage_layers=[8, 8, 7, 6]'
expect_stderr 'parallel.stage_layers: [8,8,7,6]: adds up to 29 layers, but model.num_layers is 30'
expect_no_output_files
run_case 0 "$scratch/pipeline_layout/config.json" --set model.num_layers=30 --set parallel.pp=4 \
  --set 'parallel.stage_layers=[8, 8, 7, 7]' --dry-run

# fp16 loss scaling: its keys outside fp16 (and the dynamic ones with a static scale), a floor above
# the start, and the error-feedback compressions with fp16 are refused, each naming the key, the
# value and the rule; every problem of one run at once. The valid fp16 combinations pass --dry-run.
start_case loss_scaling
write_config "$scratch/loss_scaling/config.json" ""
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=bf16 --set training.initial_loss_scale=1024 \
  --set training.hysteresis=3
expect_stderr 'training.initial_loss_scale: 1024.0: loss scaling applies to training.precision "fp16" only (it is "bf16"'
expect_stderr 'training.hysteresis: 3: loss scaling applies to training.precision "fp16" only'
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set training.loss_scale=512 \
  --set training.loss_scale_window=10
expect_stderr 'training.loss_scale_window: 10: applies to dynamic loss scaling only, but training.loss_scale is 512.0'
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set training.initial_loss_scale=8 \
  --set training.min_loss_scale=16 --set training.hysteresis=0
expect_stderr 'training.min_loss_scale: 16.0: must be <= training.initial_loss_scale (8.0)'
expect_stderr 'training.hysteresis: 0: must be >= 1'
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set training.loss_scale=-1
expect_stderr 'training.loss_scale: -1.0: must be >= 0'
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set parallel.dp=2 \
  --set parallel.grad_compression=onebit
expect_stderr 'parallel.grad_compression: "onebit": cannot be combined with training.precision "fp16"'
run_case 2 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set parallel.dp=2 \
  --set parallel.grad_compression=int8
expect_stderr 'parallel.grad_compression: "int8": cannot be combined with training.precision "fp16"'
expect_no_output_files
run_case 0 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set training.initial_loss_scale=1024 \
  --set training.min_loss_scale=2 --dry-run
run_case 0 "$scratch/loss_scaling/config.json" --set training.precision=fp16 --set training.loss_scale=4096 --dry-run

# Out-of-range counts are refused before any arithmetic on them: no overflow, divide by zero, huge
# message or silent truncation; the limits are the documented ones.
start_case huge_values
write_config "$scratch/huge_values/config.json" ""
run_case 2 "$scratch/huge_values/config.json" --set parallel.tp=144115188075855872 --print-config
expect_stderr 'parallel.tp: 144115188075855872: must be <= 1048576 (2^20)'
run_case 2 "$scratch/huge_values/config.json" --set parallel.dp=1024 --set parallel.tp=1024 --set parallel.pp=1024 \
  --set parallel.cp=1024 --dry-run
expect_stderr 'parallel.tp x parallel.cp x parallel.pp x parallel.dp = 1024 x 1024 x 1024 x 1024 ranks; a run has at most 1048576'
run_case 2 "$scratch/huge_values/config.json" --set parallel.pp=1000000 --dry-run
expect_stderr 'give the split explicitly, parallel.stage_layers with 1000000 entries adding up to 1'
[[ $(wc -c <"$err") -lt 2000 ]] || fail "the uneven-stages message is $(wc -c <"$err") bytes"
run_case 2 "$scratch/huge_values/config.json" --set model.num_layers=1000000 --set model.moe.num_experts=2147483648 \
  --set training.threads=4294967298 --set training.eval_steps=9223372036854775807 --dry-run
expect_stderr 'model.num_layers: 1000000: must be <= 65536'
expect_stderr 'model.moe.num_experts: 2147483648: must be <= 2147483647'
expect_stderr 'training.threads: 4294967298: must be <= 65536'
expect_stderr 'training.eval_steps: 9223372036854775807: must be <= 2147483647'
run_case 2 "$scratch/huge_values/config.json" --set model.moe.num_experts=2147483647 --set model.hidden_size=65536 \
  --set sample.max_tokens=9223372036854775807 --set training.global_batch_size=1073741824 --dry-run
expect_stderr 'model.hidden_size: 65536: with these sizes the model has about'
expect_stderr 'sample.max_tokens: 9223372036854775807: must be <= 1048576'
expect_stderr 'pipeline slots; a step has at most 4194304 (2^22)'
run_case 2 "$scratch/huge_values/config.json" --set training.steps=1e400 --dry-run
expect_stderr 'override "training.steps=1e400": invalid JSON: number overflow'
expect_no_output_files

# A directory where the final weights go is found before training, not at the end.
start_case weights_dir
write_config "$scratch/weights_dir/config.json" ""
mkdir -p "$scratch/weights_dir/logs/model.safetensors"
run_case 2 "$scratch/weights_dir/config.json"
expect_stderr "logs/model.safetensors is a directory, not a file: the run writes its final weights there"
[[ ! -e "$scratch/weights_dir/logs/train.log" && ! -e "$scratch/weights_dir/logs/metrics.jsonl" ]] ||
  fail "the refused run wrote into logging.dir"

# What logging.dir's appended files and TensorBoard's directory must be is found before train.log
# is written.
for what in tensorboard metrics.jsonl train.log; do
  start_case "logs_$what"
  write_config "$scratch/$case/config.json" ""
  mkdir -p "$scratch/$case/logs"
  if [[ $what == tensorboard ]]; then echo x >"$scratch/$case/logs/tensorboard"; else mkdir "$scratch/$case/logs/$what"; fi
  run_case 2 "$scratch/$case/config.json"
  if [[ $what == tensorboard ]]; then
    expect_stderr "logs/tensorboard exists and is not a directory"
  else
    expect_stderr "logs/$what is a directory, not a regular file: the run appends to it"
  fi
  [[ $(ls "$scratch/$case/logs") == "$what" ]] || fail "the refused run wrote into logging.dir: $(ls "$scratch/$case/logs")"
done

# checkpoint.init that is checkpoint.dir (or inside it): the run would resume the import as its own
# checkpoint and rotate it away. Refused; the checkpoint is untouched.
start_case init_is_dir
write_config "$scratch/$case/config.json" ""
run_case 0 "$scratch/$case/config.json" --set "checkpoint.dir=$scratch/$case/base" --set checkpoint.every=2 \
  --set "logging.dir=$scratch/$case/first"
[[ -d "$scratch/$case/base/step_00000002" ]] || fail "no checkpoint to start from"
for init in base base/ ./base/step_00000002; do
  run_case 2 "$scratch/$case/config.json" --set "checkpoint.init=$init" --set "checkpoint.dir=$scratch/$case/base" \
    --set checkpoint.every=1 --set checkpoint.keep=1 --set training.steps=4
  expect_stderr "checkpoint.init: "
  expect_stderr "is checkpoint.dir ($scratch/$case/base) or inside it"
done
[[ $(ls "$scratch/$case/base") == "$(printf 'latest\nstep_00000002')" ]] || fail "checkpoint.dir changed: $(ls "$scratch/$case/base")"
expect_no_output_files

finish "config error checks"
