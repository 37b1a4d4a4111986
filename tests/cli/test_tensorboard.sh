#!/usr/bin/env bash
# TensorBoard event files (trainer/train/tensorboard.h) read back by a reader written here, apart
# from the writer: the TFRecord framing with its masked CRC-32C of the length and of the data
# (CRC-32C computed bit by bit below, not with the writer's table), the protocol-buffer wire format
# decoded field by field. Checked on a dp 2 run with evaluation (reference_llama, synthetic data):
#   - the first record is the file_version event "brain.Event:2"; every CRC is valid;
#   - every step of metrics.jsonl has one event at its step with its loss, lr, grad norm, clip,
#     step ms, tokens/s, MFU, consumed samples, val loss (on evaluation steps) and each group's
#     sent bytes and wait, equal to metrics.jsonl's numbers in float32;
#   - the memory event's planned and measured peak bytes of rank 0 are in the file;
#   - with logging.tensorboard false no event file is written.
#
# Usage: test_tensorboard.sh <tetra binary> <source dir> <scratch dir>
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
with_mpi

case="dp 2 run"
run="$scratch/run"
if timeout 300 "$mpirun" --oversubscribe -np 2 "$tetra" --config "$src/configs/reference_llama.json" \
    --set training.steps=4 --set training.threads=1 --set parallel.dp=2 --set training.eval_every=2 \
    --set training.eval_steps=1 --set "logging.dir=$run" >"$scratch/run.txt" 2>&1; then
  $py - "$run" <<'PY' || fail "the event file: see above"
import glob, json, math, struct, sys

run = sys.argv[1]
files = glob.glob(f"{run}/tensorboard/events.out.tfevents.*")
problems = []
if len(files) != 1:
    print(f"{len(files)} event files in {run}/tensorboard, not 1"); sys.exit(1)

def crc32c(data):  # bit by bit, reflected polynomial 0x82F63B78
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF

def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

def varint(b, i):
    v = shift = 0
    while True:
        x = b[i]; i += 1
        v |= (x & 0x7F) << shift; shift += 7
        if x < 0x80: return v, i

def fields(b):  # {number: [values]} of one message
    out, i = {}, 0
    while i < len(b):
        k, i = varint(b, i)
        num, wt = k >> 3, k & 7
        if wt == 0: v, i = varint(b, i)
        elif wt == 1: v = b[i:i + 8]; i += 8
        elif wt == 5: v = b[i:i + 4]; i += 4
        elif wt == 2:
            n, i = varint(b, i); v = b[i:i + n]; i += n
        else: raise ValueError(f"wire type {wt}")
        out.setdefault(num, []).append(v)
    return out

data = open(files[0], "rb").read()
events, i = [], 0
while i < len(data):
    header = data[i:i + 8]
    (length,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", data[i + 8:i + 12])
    body = data[i + 12:i + 12 + length]
    (bcrc,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
    if hcrc != masked(header): problems.append(f"record at byte {i}: bad length CRC")
    if bcrc != masked(body): problems.append(f"record at byte {i}: bad data CRC")
    events.append(fields(body))
    i += 16 + length

if events[0].get(3) != [b"brain.Event:2"]: problems.append(f"first event {events[0]}")
scalars = {}  # step -> {tag: value}
for e in events[1:]:
    step = e[2][0] if 2 in e else 0
    if 1 not in e or not math.isfinite(struct.unpack("<d", e[1][0])[0]): problems.append(f"event without wall_time")
    for summary in e.get(5, []):
        for value in fields(summary).get(1, []):
            f = fields(value)
            tag = f[1][0].decode()
            scalars.setdefault(step, {})[tag] = struct.unpack("<f", f[2][0])[0]

def same(tag, got, want):
    f32 = struct.unpack("<f", struct.pack("<f", want))[0]
    if got is None: problems.append(f"{tag}: missing")
    elif not (got == f32 or abs(got - f32) <= 1e-6 * abs(f32)): problems.append(f"{tag}: {got} != {want}")

steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"step"' in l]
steps = [s for s in steps if "step" in s]
if len(steps) != 4: problems.append(f"{len(steps)} steps in metrics.jsonl")
for s in steps:
    got = scalars.get(s["step"], {})
    for tag, key in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("train/clip", "clip"),
                     ("train/step_ms", "ms"), ("train/tokens_per_s", "tokens_per_s"), ("train/mfu", "mfu"),
                     ("train/consumed_samples", "consumed_samples"), ("val/loss", "val_loss")]:
        if key in s: same(f"step {s['step']} {tag}", got.get(tag), s[key])
    if ("val/loss" in got) != ("val_loss" in s): problems.append(f"step {s['step']}: val/loss where metrics.jsonl has none")
    if not s.get("comm"): problems.append(f"step {s['step']}: no comm in metrics.jsonl")
    for g, c in s.get("comm", {}).items():
        same(f"step {s['step']} comm/{g}/sent_bytes", got.get(f"comm/{g}/sent_bytes"), c["sent_bytes"])
        same(f"step {s['step']} comm/{g}/blocked_ms", got.get(f"comm/{g}/blocked_ms"), c["blocked_ms"])
memory = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"memory"' in l]
if memory:
    r0 = memory[0]["ranks"][0]
    same("memory/planned_bytes", scalars.get(4, {}).get("memory/planned_bytes"), r0["planned_bytes"])
    same("memory/measured_peak_bytes", scalars.get(4, {}).get("memory/measured_peak_bytes"), r0["measured_peak_bytes"])
else:
    problems.append("no memory event in metrics.jsonl")
for p in problems: print(p)
print(f"{len(events)} events, {sum(len(v) for v in scalars.values())} scalars read")
sys.exit(1 if problems else 0)
PY
else
  fail "training failed: $(tail -5 "$scratch/run.txt")"
fi

case="logging.tensorboard false"
"$tetra" --config "$src/configs/reference_llama.json" --set training.steps=1 --set logging.tensorboard=false \
  --set "logging.dir=$scratch/off" >"$scratch/off.txt" 2>&1 || fail "training failed: $(tail -3 "$scratch/off.txt")"
[[ ! -e "$scratch/off/tensorboard" ]] || fail "an event file was written: $(ls "$scratch/off/tensorboard")"
[[ -f "$scratch/off/metrics.jsonl" ]] || fail "no metrics.jsonl"

finish "TensorBoard checks"
