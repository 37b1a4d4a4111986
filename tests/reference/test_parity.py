"""Tetra against an independent PyTorch model, on two tiny configs (GPT-2-like and Llama-like).

For each config in configs/reference_{gpt2,llama}.json, Tetra runs 10 steps in fp32 with
--dump-dir, then:
  (a) the PyTorch model (torch_model.py) on the dumped initial parameters and step-0 batches gives
      the same loss as metrics.jsonl's step 1 and the same gradient for every parameter;
  (b) 10 steps of torch's AdamW on the dumped batches give the same losses, learning rates and
      gradient norms as metrics.jsonl;
  (c) a bf16 run stays close to the fp32 loss curve (and is not the fp32 run in disguise);
  (d) a second fp32 run writes bitwise-identical loss strings (determinism).
Guards against a vacuous pass: the loss must fall over the 10 steps, and gradient clipping must
trigger on some steps but not all. The dumped initial parameters are checked against the
specification's initialisation (names, shapes, means and standard deviations), and, where
metrics.jsonl reports them, the FLOPs per token (6 N + 12 L T C) and each step's clip factor.

Usage: /usr/bin/python3 test_parity.py --tetra BIN --workdir DIR [--only gpt2|llama]
Exit status 0 when every check passes, 1 otherwise; each check is printed.

The PyTorch reference runs in float64, so its own rounding (~1e-16) is negligible and every
difference measured is Tetra's fp32 (or bf16) error.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from safetensors_io import read_safetensors  # noqa: E402
from checks import Checks, reference_args, rel, run_each, run_logged  # noqa: E402
import torch_model as tm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
CONFIGS = {"gpt2": os.path.join(REPO, "configs", "reference_gpt2.json"),
           "llama": os.path.join(REPO, "configs", "reference_llama.json")}

# ---- tolerances ---------------------------------------------------------------------------------
# fp32 gradients and losses against the float64 reference: relative 1e-4.
# Tetra computes in fp32 (unit roundoff u = 2^-24 = 6e-8). Each value here comes out of a chain of
# roughly 30 ops (2 blocks of norm, matmul, softmax, activation, forward and backward), each a
# reduction of length K <= 128 (64 rows of the global batch for weight gradients, C = 32,
# F or 2F = 128, V = 97). A length-K fp32 reduction has relative error ~sqrt(K)*u ~ 7e-7 for
# random rounding (at worst K*u = 8e-6), and errors of successive ops add, so the error is below
# ~30 * 7e-7 = 2e-5 and typically far smaller: Tetra and a float32 PyTorch model both measure
# ~4e-7 against float64 on these configs. The per-tensor error ||g_t - g_r|| / ||g_r|| averages
# over all elements, so elements whose gradient is tiny (the key bias: softmax is invariant to
# it, its exact gradient is 0) do not dominate. 1e-4 leaves a margin of 5x over the pessimistic
# estimate, and real mistakes sit far above it: RoPE pairing interleaved elements instead of
# halves gives ~1e-2, a GQA head mapping h % NKV instead of h // (NH/NKV) gives order 1.
GRAD_RTOL = 1e-4
# The 10-step trajectory: per-step loss and grad_norm relative 1e-4. Adam divides each gradient
# by its running RMS, so a relative gradient error e ~ 1e-6 moves each update by ~e * lr; after
# 10 steps of lr <= 1e-2 the weights differ by ~1e-7 absolute, far below what moves the loss at
# 1e-4 (measured: ~1e-7 for losses, ~1e-6 for grad_norm). Elements whose exact gradient is 0
# (the key bias) get noise-driven Adam updates that differ between the two, but the loss does
# not depend on them. Mistakes in the optimizer show up well above the bound on these configs:
# no clipping moves grad_norm by ~4e-2, decaying embedding.wpe by ~2e-3, an lr off by one step
# by ~1e-1.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-4
# lr is a closed-form function of the step; Tetra may evaluate it in fp32 (u = 6e-8).
LR_RTOL = 1e-6
# bf16 against fp32 (Tetra's own fp32 run): relative 2e-2 per step.
# bf16 keeps 8 significant bits: each rounding of a weight or activation is a relative error of
# up to 2^-8 = 3.9e-3 (about 1e-3 on average). Reductions stay in fp32, so the roundings are
# independent and partly cancel inside each dot product; the loss is a mean over the 64 tokens
# of a step, which averages further. Across ~10 rounding points per block and 2 blocks, the logits
# move by ~1e-2 relative at most, and the cross-entropy (~4.5 nats, d loss / d logit <= 1 per
# token) by less than that: 2e-2 relative is about 0.09 nats, a bound a correct bf16 path meets
# with room (measured: 2.4e-3 at worst), while a broken one (bf16 accumulation, a lost cast)
# misses it.
BF16_LOSS_RTOL = 2e-2
# bf16 step-0 gradients against the float64 reference: relative 5e-2 per tensor. Gradients pass
# through ~2x as many rounded tensors as the loss (the forward activations are saved in bf16 and
# the backward rounds its outputs again), so a relative error of ~1e-2 is expected (measured:
# 7e-3 at worst); 5e-2 is still far below the order-1 errors of a real bug.
BF16_GRAD_RTOL = 5e-2
STEPS = 10


def run_tetra(tetra, config_path, out_dir, dump_dir=None, overrides=()):
    """Runs Tetra; returns (metrics rows as dicts, the same rows with numbers as raw strings)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    log_dir = os.path.join(out_dir, "logs")
    cmd = [tetra, "--config", config_path, "--set", f"logging.dir={log_dir}"]
    for o in overrides:
        cmd += ["--set", o]
    if dump_dir:
        cmd += ["--dump-dir", dump_dir]
    run_logged(cmd, os.path.join(out_dir, "tetra.log"))
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise RuntimeError(f"tetra wrote no {path}")
    rows, raw = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                raw.append(json.loads(line, parse_float=str, parse_int=str))
    return rows, raw


def train_rows(rows, raw, checks, label):
    """The rows of steps 1..STEPS (eval-only rows, if any, are skipped), checked complete."""
    by_step, raw_by_step = {}, {}
    for r, s in zip(rows, raw):
        if "loss" in r:
            by_step[int(r["step"])], raw_by_step[int(r["step"])] = r, s
    ok = checks.check(sorted(by_step) == list(range(1, STEPS + 1)),
                      f"{label}: metrics.jsonl has training rows for steps 1..{STEPS} "
                      f"(found {sorted(by_step)})")
    if not ok:
        raise RuntimeError(f"{label}: incomplete metrics.jsonl")
    return ([by_step[s] for s in range(1, STEPS + 1)],
            [raw_by_step[s] for s in range(1, STEPS + 1)])


def check_init(params, spec, checks):
    """Names and shapes exactly as the specification's table; values as its initialisation."""
    expected = tm.expected_param_shapes(spec)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    checks.check(not missing and not extra,
                 f"params_init names = specification (missing {missing}, unexpected {extra})")
    bad = [f"{n}: {list(params[n].shape)} != {list(s)}" for n, s in expected.items()
           if n in params and tuple(params[n].shape) != s]
    checks.check(not bad, f"params_init shapes = specification {bad if bad else ''}")
    bad = []
    scaled = spec.init_std / math.sqrt(2 * spec.num_layers)
    for name, arr in params.items():
        a = arr.astype(np.float64)
        if not np.all(np.isfinite(a)):
            bad.append(f"{name}: not finite")
        elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or \
                name == "final_norm.weight":
            if not np.all(a == 1.0):
                bad.append(f"{name}: not all ones")
        elif name.endswith(".bias"):
            if not np.all(a == 0.0):
                bad.append(f"{name}: not all zeros")
        else:
            std = scaled if name.endswith("attn.proj.weight") or \
                name.endswith("mlp.proj.weight") else spec.init_std
            # Sample statistics of n normal draws: the mean has sd std/sqrt(n), the sample sd has
            # relative sd 1/sqrt(2n). 5 sigma: a correct initialisation fails 1 time in 1.7 million.
            n = a.size
            if abs(a.mean()) > 5 * std / math.sqrt(n) or \
                    abs(a.std() / std - 1) > 5 / math.sqrt(2 * n):
                bad.append(f"{name}: mean {a.mean():.3g} sd {a.std():.4g}, "
                           f"expected N(0, {std:.4g})")
    checks.check(not bad, f"params_init values follow the specification's initialisation {bad}")


def check_flops(rows, spec, checks):
    """Where metrics.jsonl announces FLOPs per token, they are 6 N + 12 L T C (N = parameters of
    matrix multiplies, the output projection included once, tied or not)."""
    start = [r for r in rows if r.get("event") == "start" and "flops_per_token" in r]
    if not start:
        return
    c, f, hs = spec.hidden_size, spec.ffn_hidden_size, spec.head_size
    fc_rows = 2 * f if spec.activation == "swiglu" else f
    per_layer = (spec.num_heads + 2 * spec.num_kv_heads) * hs * c + c * spec.num_heads * hs \
        + fc_rows * c + c * f
    n = spec.num_layers * per_layer + spec.vocab_size * c
    expected = 6 * n + 12 * spec.num_layers * spec.seq_len * c
    got = start[0]["flops_per_token"]
    checks.check(rel(got, expected) < 1e-9, f"flops_per_token {got:g} = 6 N + 12 L T C = "
                 f"{expected} (N = {n})")


def check_batches(batches, cfg, spec, checks):
    gbs, t = int(cfg["training"]["global_batch_size"]), spec.seq_len
    names = [f"step_{s}" for s in range(STEPS)]
    missing = [n for n in names if n not in batches]
    checks.check(not missing, f"batches holds step_0..step_{STEPS - 1} (missing {missing})")
    bad = [f"{n}: {b.dtype} {list(b.shape)}" for n, b in batches.items()
           if b.dtype != np.int32 or b.shape != (gbs, t + 1)]
    checks.check(not bad, f"batches are I32 ({gbs}, {t + 1}) {bad}")
    lo = min(int(b.min()) for b in batches.values())
    hi = max(int(b.max()) for b in batches.values())
    checks.check(0 <= lo and hi < spec.vocab_size,
                 f"batch tokens within [0, {spec.vocab_size}) (found [{lo}, {hi}])")


def compare_grads(model, grads, rtol, checks, label):
    """Per-tensor table of ||g_t - g_r|| / ||g_r||; returns the worst relative error."""
    print(f"  {label}: per-tensor gradient comparison (relative error bound {rtol:g})")
    print(f"    {'tensor':34s} {'shape':>12s} {'|g_ref|':>10s} {'|g_t-g_ref|':>11s} "
          f"{'rel':>9s}")
    worst, bad = 0.0, []
    ref = {n: p.grad.detach().numpy() for n, p in model.named_parameters()}
    for name, g_r in ref.items():
        if name not in grads:
            bad.append(f"{name}: missing")
            continue
        g_t = grads[name].astype(np.float64)
        if g_t.shape != g_r.shape:
            bad.append(f"{name}: shape {list(g_t.shape)} != {list(g_r.shape)}")
            continue
        norm_r = float(np.linalg.norm(g_r))
        diff = float(np.linalg.norm(g_t - g_r))
        r = diff / max(norm_r, 1e-30)
        worst = max(worst, r)
        flag = "" if r < rtol else "  <-- FAIL"
        if r >= rtol:
            bad.append(f"{name}: {r:.3g}")
        print(f"    {name:34s} {str(list(g_r.shape)):>12s} {norm_r:10.4g} {diff:11.4g} "
              f"{r:9.2e}{flag}")
    extra = sorted(set(grads) - set(ref))
    if extra:
        bad.append(f"unexpected tensors {extra}")
    checks.check(not bad, f"{label}: every gradient within {rtol:g} (worst {worst:.2e}) {bad}")
    return worst


def reference_model(spec, params):
    model = tm.Model(spec).double()
    model.load_arrays(params)
    return model


def run_config(name, args, checks):
    config_path = CONFIGS[name]
    with open(config_path) as f:
        cfg = json.load(f)
    spec = tm.ModelSpec.from_config(cfg)
    opt = cfg["optimizer"]
    mbs = int(cfg["training"]["micro_batch_size"])
    grad_clip = float(opt.get("grad_clip", 1.0))
    if int(cfg["training"]["steps"]) != STEPS:
        raise RuntimeError(f"{config_path}: training.steps {cfg['training']['steps']}, the test "
                           f"expects {STEPS}")
    work = os.path.join(args.workdir, name)
    print(f"\n=== {name}: {config_path}")

    fp32_dump = os.path.join(work, "fp32", "dump")
    rows, raw = run_tetra(args.tetra, config_path, os.path.join(work, "fp32"), fp32_dump,
                          ["training.precision=fp32"])
    rows_all = rows
    rows, raw = train_rows(rows, raw, checks, "fp32 run")
    params, _ = read_safetensors(os.path.join(fp32_dump, "params_init.safetensors"))
    grads, _ = read_safetensors(os.path.join(fp32_dump, "grads_step0.safetensors"))
    batches, _ = read_safetensors(os.path.join(fp32_dump, "batches.safetensors"))
    check_init(params, spec, checks)
    check_flops(rows_all, spec, checks)
    check_batches(batches, cfg, spec, checks)

    # (a) step 0: loss and every gradient.
    model = reference_model(spec, params)
    loss0 = tm.accumulate_grads(model, torch.from_numpy(batches["step_0"]).long(), mbs)
    checks.check(rel(rows[0]["loss"], loss0) < LOSS_RTOL,
                 f"step-1 loss: tetra {rows[0]['loss']:.7f} vs reference {loss0:.7f} "
                 f"(rel {rel(rows[0]['loss'], loss0):.2e} < {LOSS_RTOL:g})")
    compare_grads(model, grads, GRAD_RTOL, checks, "fp32 step-0 gradients")

    # (b) 10 optimizer steps on the dumped batches.
    model = reference_model(spec, params)
    optimizer = tm.make_adamw(model, opt)
    print(f"  10-step trajectory (loss/grad_norm rel < {LOSS_RTOL:g}, lr rel < {LR_RTOL:g}; "
          f"grad_clip {grad_clip:g})")
    print(f"    {'step':>4s} {'loss tetra':>11s} {'loss ref':>11s} {'rel':>9s} {'lr tetra':>11s} "
          f"{'lr ref':>11s} {'gnorm tetra':>11s} {'gnorm ref':>11s} {'rel':>9s} clipped")
    ref_losses, worst = [], {"loss": 0.0, "lr": 0.0, "grad_norm": 0.0}
    for s in range(STEPS):
        lr = tm.lr_at(s, opt, STEPS)
        loss, gnorm = tm.train_step(model, optimizer, torch.from_numpy(batches[f"step_{s}"]).long(),
                                    mbs, lr, grad_clip)
        ref_losses.append(loss)
        r = rows[s]
        errs = {"loss": rel(r["loss"], loss), "lr": rel(r["lr"], lr),
                "grad_norm": rel(r["grad_norm"], gnorm)}
        for k in worst:
            worst[k] = max(worst[k], errs[k])
        print(f"    {s + 1:4d} {r['loss']:11.7f} {loss:11.7f} {errs['loss']:9.2e} {r['lr']:11.4e} "
              f"{lr:11.4e} {r['grad_norm']:11.6f} {gnorm:11.6f} {errs['grad_norm']:9.2e} "
              f"{'yes' if gnorm > grad_clip else 'no'}")
    if all("clip" in r for r in rows):
        # The applied clip factor, where metrics.jsonl reports it: min(1, clip / (norm + 1e-6)).
        err = max(rel(r["clip"], min(1.0, grad_clip / (r["grad_norm"] + 1e-6))) for r in rows)
        checks.check(err < GRAD_NORM_RTOL, f"reported clip factors = min(1, grad_clip / "
                     f"(grad_norm + 1e-6)) (worst rel {err:.2e})")
    checks.check(worst["loss"] < LOSS_RTOL, f"10-step losses match (worst rel {worst['loss']:.2e})")
    checks.check(worst["lr"] < LR_RTOL, f"10-step lr matches (worst rel {worst['lr']:.2e})")
    checks.check(worst["grad_norm"] < GRAD_NORM_RTOL,
                 f"10-step grad_norm matches (worst rel {worst['grad_norm']:.2e})")
    # Guards: the comparison above means something only if training moved and clipping acted.
    losses = [r["loss"] for r in rows]
    checks.check(losses[-1] < losses[0] - 0.05,
                 f"loss fell noticeably over {STEPS} steps ({losses[0]:.4f} -> {losses[-1]:.4f}, "
                 f"needs > 0.05 nats)")
    # Both branches of min(1, clip / norm): when every step is clipped, AdamW's invariance to a
    # gradient's scale hides most of the clipping's effect; a mix makes a wrong clip visible.
    clipped = sum(r["grad_norm"] > grad_clip for r in rows)
    checks.check(1 <= clipped < STEPS, f"gradient clipping triggered on some steps, not all "
                 f"({clipped} of {STEPS} steps have grad_norm > {grad_clip:g})")

    # (d) determinism: a second fp32 run writes the same loss strings, bit for bit.
    rows2, raw2 = run_tetra(args.tetra, config_path, os.path.join(work, "fp32_again"), None,
                            ["training.precision=fp32"])
    _, raw2 = train_rows(rows2, raw2, checks, "second fp32 run")
    diff = [s + 1 for s in range(STEPS) if raw2[s]["loss"] != raw[s]["loss"]]
    checks.check(not diff, f"determinism: second fp32 run has identical loss strings "
                 f"(differing steps {diff})")

    # (c) bf16: close to fp32, but not identical to it.
    bf16_dump = os.path.join(work, "bf16", "dump")
    rows_b, raw_b = run_tetra(args.tetra, config_path, os.path.join(work, "bf16"), bf16_dump,
                              ["training.precision=bf16"])
    rows_b, raw_b = train_rows(rows_b, raw_b, checks, "bf16 run")
    print(f"  bf16 vs fp32 losses (rel < {BF16_LOSS_RTOL:g})")
    print(f"    {'step':>4s} {'fp32':>11s} {'bf16':>11s} {'rel':>9s}")
    worst_b = 0.0
    for s in range(STEPS):
        e = rel(rows_b[s]["loss"], rows[s]["loss"])
        worst_b = max(worst_b, e)
        print(f"    {s + 1:4d} {rows[s]['loss']:11.7f} {rows_b[s]['loss']:11.7f} {e:9.2e}")
    checks.check(worst_b < BF16_LOSS_RTOL,
                 f"bf16 losses within {BF16_LOSS_RTOL:g} of fp32 (worst rel {worst_b:.2e})")
    checks.check(any(raw_b[s]["loss"] != raw[s]["loss"] for s in range(STEPS)),
                 "bf16 run differs from the fp32 run (the precision setting took effect)")
    grads_b, _ = read_safetensors(os.path.join(bf16_dump, "grads_step0.safetensors"))
    model = reference_model(spec, params)
    tm.accumulate_grads(model, torch.from_numpy(batches["step_0"]).long(), mbs)
    compare_grads(model, grads_b, BF16_GRAD_RTOL, checks, "bf16 step-0 gradients")


def main():
    args = reference_args(__doc__, CONFIGS)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    checks = Checks()
    run_each([args.only] if args.only else sorted(CONFIGS), lambda name: run_config(name, args, checks), checks,
             (RuntimeError, ValueError, OSError, KeyError, subprocess.TimeoutExpired))
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
