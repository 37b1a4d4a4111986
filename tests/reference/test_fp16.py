"""fp16 training (training.precision fp16, dynamic loss scaling) on the tiny GPT-2 and Llama configs.

For each config in configs/reference_{gpt2,llama}.json:
  (a) an fp16 run follows Tetra's fp32 loss curve (FP16_LOSS_RTOL) without being the fp32 run in
      disguise, reports its loss scale (65536, no overflow) on every step, and its step-0
      gradients, unscaled, match the float64 PyTorch reference (FP16_GRAD_RTOL);
  (b) an fp16 run started at initial_loss_scale 2^40 overflows on its first steps: metrics.jsonl
      and the log say so step by step, the scale is kept once (hysteresis 2) and then halves on
      every overflow, the LR schedule does not advance; the checkpoint after the last skipped step
      holds exactly the initial weights and zero Adam moments (bitwise: the skipped steps changed
      nothing) and the scaler's state; a run started from that checkpoint at the settled scale S
      (static loss_scale S: the same weights, data position and LR position, and S from its first
      step) reproduces the 2^40 run's losses bit for bit until the 2^40 run's next overflow; and
      the 2^40 run trains (its loss falls after the skips);
  (c) resuming the 2^40 run from a checkpoint taken in the middle of its skipped steps (scale and
      hysteresis mid-way) and from one after them continues bit for bit: every later metrics row
      (loss, lr, grad_norm, loss_scale, overflow, skipped) is the uninterrupted run's.

Usage: /usr/bin/python3 test_fp16.py --tetra BIN --workdir DIR [--only gpt2|llama]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from safetensors_io import read_safetensors  # noqa: E402
from checkpoint_io import read_checkpoint  # noqa: E402
from checks import Checks, rel  # noqa: E402
import torch_model as tm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
CONFIGS = {"gpt2": os.path.join(REPO, "configs", "reference_gpt2.json"),
           "llama": os.path.join(REPO, "configs", "reference_llama.json")}

# ---- tolerances ---------------------------------------------------------------------------------
# fp16 against fp32 (Tetra's own fp32 run): relative 5e-3 per step.
# fp16 keeps 11 significant bits: each rounding of a weight or activation is a relative error of
# up to 2^-11 = 4.9e-4, 8x less than bf16's 2^-8, for which test_parity.py allows 2e-2 (measured
# there: 2.4e-3). The same argument (fp32 reductions, independent roundings that partly cancel,
# the loss a mean over 64 tokens) scales by 1/8: 2.5e-3; 5e-3 leaves a margin of 2x over that
# estimate and ~10x over what is measured here (< 5e-4), while a broken fp16 path misses it by far:
# a lost unscale multiplies every update's gradient by 65536 (Adam normalises most of that away, but
# clipping then never triggers and the curve moves by > 1e-2), bf16 rounding instead of fp16 gives
# ~8x the error, a gradient flushed to zero (no loss scaling) stops a parameter from training.
# Loss scaling itself adds no error where nothing overflows or underflows: scaling by a power of
# two is exact, and so is the unscale.
FP16_LOSS_RTOL = 5e-3
# fp16 step-0 gradients (unscaled by the trainer's dump) against the float64 reference: relative
# 1e-2 per tensor: bf16's 5e-2 (measured 7e-3) over the 8x finer rounding, with a margin of ~4x.
FP16_GRAD_RTOL = 1e-2
STEPS = 10          # the configs' training.steps: the (a) comparison
OVERFLOW_STEPS = 40  # the 2^40 run of (b) and (c)
HUGE_SCALE = 2.0 ** 40


def run_tetra(tetra, config_path, out_dir, overrides=(), dump_dir=None):
    """Runs Tetra; returns (metrics step rows, the same rows with numbers as raw strings, log)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    log_dir = os.path.join(out_dir, "logs")
    cmd = [tetra, "--config", config_path, "--set", f"logging.dir={log_dir}"]
    for o in overrides:
        cmd += ["--set", o]
    if dump_dir:
        cmd += ["--dump-dir", dump_dir]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    with open(os.path.join(out_dir, "tetra.log"), "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"tetra exited with {proc.returncode}; last output:\n" + proc.stdout[-3000:])
    rows, raw = [], []
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "loss" in r:
                rows.append(r)
                raw.append(json.loads(line, parse_float=str, parse_int=str))
    return rows, raw, proc.stdout


def compare_grads(model, grads, rtol, checks, label):
    worst, bad = 0.0, []
    for name, p in model.named_parameters():
        g_r = p.grad.detach().numpy()
        if name not in grads:
            bad.append(f"{name}: missing")
            continue
        diff = float(np.linalg.norm(grads[name].astype(np.float64) - g_r))
        r = diff / max(float(np.linalg.norm(g_r)), 1e-30)
        worst = max(worst, r)
        if r >= rtol:
            bad.append(f"{name}: {r:.3g}")
    checks.check(not bad, f"{label}: every gradient within {rtol:g} of the float64 reference "
                 f"(worst {worst:.2e}) {bad}")


def part_a(name, args, checks, work, cfg):
    """fp16 against fp32 and the PyTorch reference."""
    config_path = CONFIGS[name]
    spec = tm.ModelSpec.from_config(cfg)
    mbs = int(cfg["training"]["micro_batch_size"])
    fp32_dump = os.path.join(work, "fp32", "dump")
    rows32, raw32, _ = run_tetra(args.tetra, config_path, os.path.join(work, "fp32"), [], fp32_dump)
    fp16_dump = os.path.join(work, "fp16", "dump")
    rows16, raw16, log16 = run_tetra(args.tetra, config_path, os.path.join(work, "fp16"),
                                     ["training.precision=fp16"], fp16_dump)
    checks.check(len(rows16) == STEPS and len(rows32) == STEPS, f"(a) both runs report {STEPS} steps")
    checks.check(all(r.get("loss_scale") == 65536.0 and r.get("overflow") is False for r in rows16),
                 "(a) every fp16 step reports loss_scale 65536 and overflow false")
    checks.check(all("loss_scale" not in r and "overflow" not in r for r in rows32),
                 "(a) fp32 steps carry no loss-scaling fields")
    checks.check("loss scale 65536" in log16, "(a) the fp16 log lines show the loss scale")
    print(f"  fp16 vs fp32 losses (rel < {FP16_LOSS_RTOL:g})")
    worst = 0.0
    for s in range(STEPS):
        e = rel(rows16[s]["loss"], rows32[s]["loss"])
        worst = max(worst, e)
        print(f"    {s + 1:4d} {rows32[s]['loss']:11.7f} {rows16[s]['loss']:11.7f} {e:9.2e}")
    checks.check(worst < FP16_LOSS_RTOL, f"(a) fp16 losses within {FP16_LOSS_RTOL:g} of fp32 (worst {worst:.2e})")
    checks.check(any(raw16[s]["loss"] != raw32[s]["loss"] for s in range(STEPS)),
                 "(a) the fp16 run differs from the fp32 run (the precision setting took effect)")
    checks.check(rows16[-1]["loss"] < rows16[0]["loss"] - 0.05,
                 f"(a) the fp16 loss falls ({rows16[0]['loss']:.4f} -> {rows16[-1]['loss']:.4f})")
    params, _ = read_safetensors(os.path.join(fp16_dump, "params_init.safetensors"))
    grads, _ = read_safetensors(os.path.join(fp16_dump, "grads_step0.safetensors"))
    batches, _ = read_safetensors(os.path.join(fp16_dump, "batches.safetensors"))
    model = tm.Model(spec).double()
    model.load_arrays(params)
    tm.accumulate_grads(model, torch.from_numpy(batches["step_0"]).long(), mbs)
    compare_grads(model, grads, FP16_GRAD_RTOL, checks, "(a) fp16 step-0 gradients (unscaled)")


def part_bc(name, args, checks, work):
    """The 2^40 start: skips, halving, nothing changed by them, a run at the settled scale, resume."""
    config_path = CONFIGS[name]
    ckpt = os.path.join(work, "huge_ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    common = ["training.precision=fp16", f"training.steps={OVERFLOW_STEPS}"]
    init_dump = os.path.join(work, "huge", "dump")
    rows, raw, log = run_tetra(args.tetra, config_path, os.path.join(work, "huge"),
                               common + [f"training.initial_loss_scale={HUGE_SCALE:.0f}",
                                         f"checkpoint.dir={ckpt}", "checkpoint.every=1", "checkpoint.keep=0"],
                               init_dump)
    if not checks.check(len(rows) == OVERFLOW_STEPS, f"(b) the 2^40 run reports {OVERFLOW_STEPS} steps"):
        return
    k = 0
    while k < len(rows) and rows[k]["overflow"]:
        k += 1
    checks.check(10 <= k < OVERFLOW_STEPS - 10,
                 f"(b) the first {k} steps overflow, then training proceeds ({OVERFLOW_STEPS - k} steps left)")
    if not 2 <= k < OVERFLOW_STEPS - 4:
        return
    settled = rows[k]["loss_scale"]
    want_scales = [HUGE_SCALE, HUGE_SCALE] + [HUGE_SCALE / 2 ** i for i in range(1, k - 1)]
    checks.check([r["loss_scale"] for r in rows[:k]] == want_scales and settled == HUGE_SCALE / 2 ** (k - 1),
                 f"(b) loss_scale: 2^40 kept once (hysteresis 2), then halved on every overflow, settling at "
                 f"2^{np.log2(settled):.0f}")
    checks.check(all("fp16 gradient overflow" in r.get("skipped", "") for r in rows[:k]),
                 "(b) metrics.jsonl marks each overflow step skipped, with the reason")
    checks.check(all(f"step {s}: update skipped: fp16 gradient overflow" in log for s in range(1, k + 1)),
                 "(b) the log says so for each of them")
    checks.check(all(r["grad_norm"] is None for r in rows[:k]), "(b) their gradient norm is not finite (null)")
    checks.check(len({r["lr"] for r in rows[:k + 1]}) == 1,
                 "(b) the LR schedule does not advance over skipped steps (steps 1..k+1 share the first lr)")
    later = [s + 1 for s in range(k, OVERFLOW_STEPS) if rows[s]["overflow"]]
    checks.check(min(r["loss"] for r in rows[-5:]) < rows[k]["loss"] - 0.05,
                 f"(b) the run trains after the skips ({rows[k]['loss']:.4f} at step {k + 1} -> "
                 f"{rows[-1]['loss']:.4f}); later overflows at steps {later}")

    # Nothing changed during the skips: the checkpoint of step k holds the initial weights bitwise.
    state, manifest = read_checkpoint(os.path.join(ckpt, f"step_{k:08d}"))
    params, _ = read_safetensors(os.path.join(init_dump, "params_init.safetensors"))
    same = [n for n in params if np.array_equal(state[f"model/{n}"], params[n])]
    checks.check(len(same) == len(params) > 0,
                 f"(b) after {k} skipped steps the weights are the initial ones, bit for bit "
                 f"({len(same)} of {len(params)} tensors)")
    moments = [key for key in state if key.startswith("optim/")]
    checks.check(moments and all(not np.any(state[key]) for key in moments),
                 f"(b) and Adam's moments are still zero ({len(moments)} tensors)")
    ls = manifest.get("loss_scaler", {})
    checks.check(ls.get("scale") == settled and ls.get("skipped_steps") == k and ls.get("growth_tracker") == 0
                 and ls.get("hysteresis_tracker") == 2 - k,
                 f"(b) the checkpoint holds the scaler's state {ls}")

    # A run at the settled scale from there (static loss_scale S: S from its first step), until
    # the 2^40 run's next overflow (there the static scale stays and the dynamic one halves; the
    # same training.steps keeps the LR schedule, training.exit_interval stops the run).
    until = later[0] if later else OVERFLOW_STEPS
    rows_s, raw_s, _ = run_tetra(args.tetra, config_path, os.path.join(work, "settled"),
                                 common + [f"training.loss_scale={settled:.0f}", f"training.exit_interval={until}",
                                           f"checkpoint.dir={os.path.join(work, 'settled_ckpt')}",
                                           f"checkpoint.resume={os.path.join(ckpt, f'step_{k:08d}')}"])
    got = [r["loss"] for r in raw_s[:until - k]]
    want = [r["loss"] for r in raw[k:until]]
    checks.check(len(got) >= 2 and got == want,
                 f"(b) the run at the settled scale {settled:.0f} reproduces steps {k + 1}..{until} of the 2^40 "
                 f"run bit for bit ({len(got)} steps)")

    # (c) resume from a checkpoint inside the skips (scale and hysteresis mid-way) and after them.
    fields = ("loss", "lr", "grad_norm", "loss_scale", "overflow", "skipped")
    for at in (min(5, k - 1), k + 3):
        rows_r, raw_r, log_r = run_tetra(args.tetra, config_path, os.path.join(work, f"resume_{at}"),
                                         common + [f"training.initial_loss_scale={HUGE_SCALE:.0f}",
                                                   f"checkpoint.dir={os.path.join(work, f'resume_{at}_ckpt')}",
                                                   f"checkpoint.resume={os.path.join(ckpt, f'step_{at:08d}')}"])
        diff = [at + 1 + i for i, (a, b) in enumerate(zip(raw_r, raw[at:]))
                if any(a.get(f) != b.get(f) for f in fields)]
        checks.check(len(raw_r) == OVERFLOW_STEPS - at and not diff,
                     f"(c) resumed at step {at}: steps {at + 1}..{OVERFLOW_STEPS} identical to the uninterrupted "
                     f"run in {', '.join(fields)} (differing steps {diff})")
        checks.check(f"resumed from" in log_r, f"(c) the run resumed at step {at} says it resumed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tetra", required=True, help="path of the tetra binary")
    ap.add_argument("--workdir", required=True, help="scratch directory (recreated)")
    ap.add_argument("--only", choices=sorted(CONFIGS), help="run one config only")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    os.makedirs(args.workdir, exist_ok=True)
    checks = Checks()
    for name in ([args.only] if args.only else sorted(CONFIGS)):
        print(f"\n=== {name}")
        with open(CONFIGS[name]) as f:
            cfg = json.load(f)
        if int(cfg["training"]["steps"]) != STEPS:
            checks.check(False, f"{name}: training.steps {cfg['training']['steps']}, the test expects {STEPS}")
            continue
        work = os.path.join(args.workdir, name)
        try:
            part_a(name, args, checks, work, cfg)
            part_bc(name, args, checks, work)
        except (RuntimeError, ValueError, OSError, KeyError, subprocess.TimeoutExpired) as e:
            checks.check(False, f"{name}: {type(e).__name__}: {e}")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
