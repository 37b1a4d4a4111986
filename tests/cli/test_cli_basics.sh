#!/usr/bin/env bash
# The command line as a user meets it: --help, --print-config, --dry-run, --set, a bad flag, the
# demo config's validity, and a short training run (a small model on the synthetic, learnable
# stream) whose loss must fall and whose metrics file must be complete.
#
# Usage: test_cli_basics.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# A small GPT-2-style config on synthetic data (needs no prepared dataset).
cat >"$scratch/small.json" <<'JSON'
{"model": {"vocab_size": 512, "seq_len": 128, "num_layers": 4, "hidden_size": 256, "num_heads": 4},
 "training": {"micro_batch_size": 8, "global_batch_size": 16, "steps": 200, "eval_every": 50,
              "eval_steps": 4, "log_every": 10},
 "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20},
 "data": {"synthetic": true}, "logging": {"dir": "runs/small"}}
JSON
small="$scratch/small.json"

case=demo_config_valid
"$tetra" --config "$src/configs/demo.json" --dry-run >"$scratch/demo_dry" 2>&1 ||
  fail "configs/demo.json does not validate: $(cat "$scratch/demo_dry")"

case=help
"$tetra" --help >"$scratch/help" 2>&1 || fail "--help exited non-zero"
grep -q -- "--dry-run" "$scratch/help" || fail "--help does not list --dry-run"

case=bad_flag
"$tetra" --config "$small" --no-such-flag >/dev/null 2>&1
rc=$?
[[ $rc -eq 2 ]] || fail "unknown flag: exit code $rc, expected 2"

case=print_config
"$tetra" --config "$small" --set model.num_layers=3 --set optimizer.lr=0.01 \
  --print-config >"$scratch/resolved.json" || fail "--print-config exited non-zero"
/usr/bin/python3 - "$scratch/resolved.json" <<'PY' || fail "resolved config is wrong"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["model"]["num_layers"] == 3, c["model"]["num_layers"]          # --set applied
assert c["optimizer"]["lr"] == 0.01
assert c["model"]["num_kv_heads"] == c["model"]["num_heads"]            # derived value filled in
assert c["model"]["ffn_hidden_size"] == 4 * c["model"]["hidden_size"]
assert set(c) == {"model", "parallel", "training", "optimizer", "data", "sample", "checkpoint", "logging"}, set(c)
PY

case=dry_run_gpt2
cat >"$scratch/gpt2.json" <<'JSON'
{"model": {"vocab_size": 50257, "seq_len": 1024, "num_layers": 12, "hidden_size": 768, "num_heads": 12},
 "training": {"micro_batch_size": 4, "steps": 1}, "data": {"synthetic": true}}
JSON
"$tetra" --config "$scratch/gpt2.json" --dry-run >"$scratch/dry" 2>&1 || fail "--dry-run exited non-zero"
# GPT-2 124M: the published parameter count. FLOPs/token = 6 * matmul params + 12 L C T.
grep -q "124439808" "$scratch/dry" || fail "parameter count: $(cat "$scratch/dry")"
/usr/bin/python3 - "$scratch/dry" <<'PY' || fail "dry-run figures"
import re, sys
text = open(sys.argv[1]).read()
matmul = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) + 50257 * 768
flops = 6 * matmul + 12 * 12 * 768 * 1024
m = re.search(r"FLOPs per token:\s+([0-9.]+)([KMBT]?)", text)
scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2)]
assert abs(float(m.group(1)) * scale - flops) / flops < 0.01, (m.group(0), flops)
assert re.search(r"memory per rank:\s+[0-9.]+ MiB", text)
PY

case=dry_run_distributed
# A layout's dry run: per-rank memory (TP slices, distributed optimizer shards) and the analytic
# communication per step. Plain DP vs the distributed optimizer: the moments shrink by dp.
for opt in false true; do
  "$tetra" --config "$scratch/gpt2.json" --set model.vocab_size=50304 --set parallel.tp=2 \
    --set parallel.dp=4 --set parallel.sequence_parallel=true --set parallel.distributed_optimizer=$opt \
    --dry-run >"$scratch/dry_$opt" 2>&1 || fail "--dry-run (distributed_optimizer $opt) exited non-zero"
done
/usr/bin/python3 - "$scratch/dry_false" "$scratch/dry_true" <<'PY' || fail "distributed dry-run figures"
import re, sys
plain, dist = (open(p).read() for p in sys.argv[1:3])
def mib(text, what):
    return float(re.search(what + r"\s+([0-9.]+) MiB", text).group(1))
assert "8 ranks = tp 2 x pp 1 x dp 4" in dist, dist
# Adam moments: 8 bytes per parameter of this rank's TP slice, a quarter of them when sharded.
ratio = mib(plain, "optimizer") / mib(dist, "optimizer")
assert abs(ratio - 4) < 0.01, ratio
saved = float(re.search(r"distributed optimizer saves ([0-9.]+) MiB", dist).group(1))
assert abs(saved - (mib(plain, "memory per rank:") - mib(dist, "memory per rank:"))) < 0.2, saved
assert "distributed optimizer saves" not in plain
# Sequence parallel: reduce-scatters and all-gathers of (N, C) = 4 * 1024 * 768 fp32 values: 50
# of each (2 per layer forward and backward, the embedding's, the output layer's), and 24 more
# gathers of the 24 norm outputs kept on their shards, again in backward.
m = re.search(r"tp \(2 ranks\)\s+(.*)", dist).group(1)
assert "reduce_scatter 50 x" in m and "all_gather 74 x" in m, m
assert "all_reduce" in re.search(r"dp \(4 ranks\)\s+(.*)", plain).group(1)
assert "reduce_scatter" in re.search(r"dp \(4 ranks\)\s+(.*)", dist).group(1)
PY
[[ ! -e "$scratch/runs" ]] || fail "--dry-run wrote files"

case=too_big
# Activations alone: 100000 x 128 tokens x 4 layers x ~16 KB kept per token and layer (fp32,
# hidden 256) = 0.8 TB, more than any machine running this test has: refused before anything is
# allocated or written.
"$tetra" --config "$small" --set training.micro_batch_size=100000 \
  --set training.global_batch_size=100000 --set model.vocab_size=50257 \
  --set logging.dir="$scratch/too_big" >/dev/null 2>"$scratch/too_big.err"
rc=$?
[[ $rc -eq 2 ]] || fail "exit code $rc, expected 2: $(cat "$scratch/too_big.err")"
grep -q "training.micro_batch_size" "$scratch/too_big.err" || fail "message: $(cat "$scratch/too_big.err")"
[[ ! -e "$scratch/too_big" ]] || fail "logging.dir was written"

case=unwritable_logging_dir
"$tetra" --config "$small" --set logging.dir=/proc/tetra-cannot-write-here \
  --set training.steps=1 >/dev/null 2>"$scratch/unwritable.err"
rc=$?
[[ $rc -eq 2 ]] || fail "exit code $rc, expected 2: $(cat "$scratch/unwritable.err")"
grep -q "logging.dir" "$scratch/unwritable.err" || fail "message: $(cat "$scratch/unwritable.err")"

case=demo_run
(cd "$scratch" && "$tetra" --config "$small" --set training.steps=40 \
  --set training.eval_every=20 --set logging.dir="$scratch/demo" >"$scratch/demo.out" 2>&1) ||
  fail "demo run failed: $(tail -5 "$scratch/demo.out")"
grep -q "step 40/40 | loss" "$scratch/demo.out" || fail "no final step line"
/usr/bin/python3 - "$scratch/demo/metrics.jsonl" <<'PY' || fail "metrics.jsonl"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert lines[0]["event"] == "start"
steps = [l for l in lines if "step" in l]
assert [s["step"] for s in steps] == list(range(1, 41))
for s in steps:
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "ms"):
        assert math.isfinite(s[key]), (key, s)
assert [s["step"] for s in steps if "val_loss" in s] == [20, 40]
# The synthetic stream has ln(4) = 1.39 nats of entropy; from ln(512) = 6.24 the model must
# have learned a good part of it in 40 steps.
assert steps[0]["loss"] > 6.0 and steps[-1]["loss"] < 3.5, (steps[0]["loss"], steps[-1]["loss"])
PY

finish "command-line cases"
