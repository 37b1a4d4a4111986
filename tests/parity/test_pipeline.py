"""Pipeline parallelism is invisible: every pipeline layout reproduces the single-rank run.

For a GPT-2-style (tied embeddings) and a Llama-style (untied) tiny config of 8 layers, Tetra trains
20 steps single-rank, then under `mpirun` with pp in {2, 4} and each schedule (gpipe, 1f1b,
interleaved with 2 virtual stages), combined with data and tensor parallelism (up to 8 ranks), and
with an explicit uneven split. Checks, per layout:
  - the loss and gradient norm of every step match the single-rank run (LOSS_RTOL, the tolerance
    of tests/parity/test_layouts.py, which explains it);
  - every parameter's step-0 gradient (dumped as the global tensor, gathered over stages and TP
    slices) matches the single-rank one (per tensor); the final weights too (tied embeddings: the
    first stage's and the last stage's copies were updated alike);
  - the most micro-batches each pipeline rank held between forward and backward equals the
    schedule's bound: gpipe m, 1f1b min(pp - r, m), interleaved Megatron's warm-up + 1;
  - each group's measured communication equals the prediction in every step, and the pp group
    (and, tied, the embedding group) did communicate;
  - the measured bubble is reported beside the analytic one;
  - the validation losses (forward-only pass through the stages) match too.
Then checkpoints across pipeline layouts: saved at step N on pp=2, resumed on pp=1 and pp=4; saved
on pp=1 (and pp=4), resumed on pp=2: the next steps match the uninterrupted single-rank run.
Guard against a vacuous pass: the single-rank loss must fall.

Usage: /usr/bin/python3 test_pipeline.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import os
import shutil
import sys

import numpy as np

import harness
from harness import Checks, read_safetensors, rel

LOSS_RTOL = 1e-5   # as tests/parity/test_layouts.py
GRAD_RTOL = 1e-5
# Final weights, per tensor: the difference from the single-rank run's, relative to how far that
# run moved the tensor from its initial value. Most differ by ~1e-6 of it; Adam turns rounding
# noise into full-size updates where the exact gradient is zero (the key bias: softmax ignores a
# constant added to every score), which brings GPT-2's qkv.bias to ~5e-4 (measured). A tensor
# written stale (never updated, or the tied copy not kept in step) is off by ~1 of its movement.
WEIGHT_MOVE_RTOL = 5e-2
BF16_RTOL = 2e-2    # as tests/parity/test_layouts.py

STEPS = 20
N = 10  # checkpoint step for the resume checks
MODELS = {
    "gpt2": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 8, "hidden_size": 64, "num_heads": 8,
             "ffn_hidden_size": 128},
    "llama": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 8, "hidden_size": 64, "num_heads": 8,
              "num_kv_heads": 4, "ffn_hidden_size": 96, "norm": "rmsnorm", "activation": "swiglu",
              "position": "rope", "tie_embeddings": False, "bias": False},
}
GLOBAL_BATCH, MICRO = 8, 2


def layout(pp, schedule="1f1b", vp=1, dp=1, tp=1, sp=False, dist_opt=False, stage_layers=None, zero=0, reshard=None):
    return {"pp": pp, "schedule": schedule, "virtual_stages": vp, "dp": dp, "tp": tp,
            "sequence_parallel": sp, "distributed_optimizer": dist_opt or zero >= 1, "zero_stage": zero,
            **({"stage_layers": stage_layers} if stage_layers else {}),
            **({"reshard_after_forward": reshard} if reshard is not None else {})}


LAYOUTS = {
    "gpt2": [layout(2, "gpipe"), layout(2), layout(4), layout(2, "interleaved", 2), layout(4, "interleaved", 2),
             layout(2, dp=2, tp=2, sp=True, dist_opt=True), layout(4, "gpipe", dp=2),
             layout(2, stage_layers=[3, 5]), layout(2, "interleaved", 2, tp=2), layout(2, dp=4),
             # ZeRO-2: the tied embedding's buckets wait for the stages' sum at the step's end;
             # interleaved, a bucket straddles two chunks written in turn.
             layout(2, dp=2, zero=2), layout(2, "interleaved", 2, dp=2, zero=2),
             # ZeRO-3: each rank gathers its stages' units in its schedule's order (chunks interleaved);
             # under pp > 1 they are kept from forward to backward unless reshard_after_forward.
             layout(2, dp=2, zero=3), layout(2, "interleaved", 2, dp=2, zero=3),
             layout(2, dp=2, zero=3, reshard=True)],
    "llama": [layout(2), layout(4, "gpipe"), layout(2, "interleaved", 2, dp=2, dist_opt=True),
              layout(2, "gpipe", dp=2, zero=2), layout(2, "gpipe", dp=2, zero=3),
              layout(4, tp=2, sp=True), layout(2, "interleaved", 2, stage_layers=[1, 3, 2, 2])],
}
# bf16 gradient reduction (parallel.grad_compression "bf16"): within the tolerance
# test_compression.py gives it against the fp32 reduction (bf16 rounding of each bucket before the
# sum), with its communication predicted (half the DP bytes).
COMPRESSION_RTOL = 5e-3
COMPRESSION_LAYOUTS = {"gpt2": [dict(layout(2, dp=2), grad_compression="bf16"),
                                dict(layout(2, dp=2, zero=2), grad_compression="bf16"),
                                dict(layout(2, dp=2, zero=3), grad_compression="bf16")],
                       "llama": [dict(layout(2, "interleaved", 2, dp=2, dist_opt=True), grad_compression="bf16")]}
BF16_LAYOUTS = {"gpt2": [layout(2), layout(2, dp=2, dist_opt=True)], "llama": [layout(2, "interleaved", 2)]}

checks = Checks()
check = checks.check


def name_of(model, par, precision="fp32"):
    n = f"{model}{'_bf16' if precision == 'bf16' else ''}_pp{par['pp']}_{par['schedule']}"
    if par["virtual_stages"] > 1:
        n += f"_v{par['virtual_stages']}"
    for k in ("dp", "tp"):
        if par[k] > 1:
            n += f"_{k}{par[k]}"
    if par["sequence_parallel"]:
        n += "_sp"
    if par["zero_stage"] >= 2:  # 1 is "_distopt"
        n += f"_zero{par['zero_stage']}"
    if "reshard_after_forward" in par:
        n += "_reshard" if par["reshard_after_forward"] else "_keep"
    elif par["distributed_optimizer"]:
        n += "_distopt"
    if "stage_layers" in par:
        n += "_layers" + "-".join(map(str, par["stage_layers"]))
    return n


def config(model, par, precision, out, exit_at=0, ckpt=None):
    cfg = {
        "model": MODELS[model],
        "training": {"micro_batch_size": MICRO, "global_batch_size": GLOBAL_BATCH, "steps": STEPS, "threads": 1,
                     "peak_gflops": 100, "precision": precision, "seed": 7, "exit_interval": exit_at,
                     "eval_every": 10, "eval_steps": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 3, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": dict(par, bucket_size=3000),
        "data": {"synthetic": True},
        "logging": {"level": "warn", "dir": out},
    }
    if ckpt:
        cfg["checkpoint"] = ckpt
    return cfg


def launch(args, out, cfg, dump=True):
    path = harness.write_config(out, cfg)
    p = cfg["parallel"]
    return harness.run_tetra(args, ["--config", path] + (["--dump-dir", os.path.join(out, "dump")] if dump else []),
                             p.get("pp", 1) * p.get("dp", 1) * p.get("tp", 1))


def run(args, name, cfg):
    out = os.path.join(args.workdir, name)
    r = launch(args, out, cfg)
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0]
    weights = read_safetensors(os.path.join(out, "model.safetensors"))[0]
    init = read_safetensors(os.path.join(out, "dump", "params_init.safetensors"))[0]
    return harness.step_records(out), grads, weights, init


def in_flight_bound(schedule, pp, vp, m, r):
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - r, m)
    total = m * vp
    warmup = total if m == pp else min((pp - r - 1) * 2 + (vp - 1) * pp, total)
    return min(warmup + 1, total)


def compare(name, model, par, ref, got, rtol):
    ref_steps, ref_grads, ref_weights, ref_init = ref
    steps, grads, weights, _ = got
    harness.check_loss_curve(checks, name, steps, ref_steps, STEPS, rtol)
    # The first step's gradient norm sums the same gradients (each stage's parameters counted once,
    # a tied embedding's copy not at all): 10x the loss tolerance, as test_layouts.py. Later steps
    # start from weights that drift apart by rounding (8 layers, 20 Adam steps: ~3e-5 relative in
    # the final weights, measured), and the gradient norm, a derivative, follows to ~1e-4: 100x.
    # Counting a stage's or the embedding's gradients twice moves the norm by > 1e-2 at step 1.
    vals = [(s["val_loss"], r.get("val_loss")) for s, r in zip(steps, ref_steps) if "val_loss" in s]
    worst_val = max((rel(a, b) for a, b in vals if b is not None), default=float("inf"))
    check(len(vals) == 2 and worst_val <= rtol,
          f"{name}: validation losses (forward-only schedule) within {rtol:g} ({len(vals)} evaluations, worst {worst_val:.2e})")
    first = rel(steps[0]["grad_norm"], ref_steps[0]["grad_norm"])
    check(first <= 10 * rtol, f"{name}: step-1 gradient norm within {10 * rtol:g} ({first:.2e})")
    worst_norm = harness.worst_step_rel(steps, ref_steps, "grad_norm")
    check(worst_norm <= 100 * rtol, f"{name}: gradient norms within {100 * rtol:g} (worst {worst_norm:.2e})")
    if rtol == LOSS_RTOL:
        check(sorted(grads) == sorted(ref_grads), f"{name}: the same {len(ref_grads)} gradient tensors")
        harness.check_gradients(checks, name, ref_grads, grads, GRAD_RTOL)
        check(sorted(weights) == sorted(ref_weights), f"{name}: the same {len(ref_weights)} final weight tensors")
        worst_w, worst_k = 0.0, ""
        for k, r in ref_weights.items():
            moved = float(np.linalg.norm(r - ref_init[k]))
            e = float(np.linalg.norm(weights[k] - r)) / max(moved, 1e-30) if k in weights else float("inf")
            if e > worst_w:
                worst_w, worst_k = e, k
        check(worst_w <= WEIGHT_MOVE_RTOL, f"{name}: final weights within {WEIGHT_MOVE_RTOL:g} of the single-rank "
                                           f"run's movement, every tensor (worst {worst_w:.2e}, {worst_k})")
    pp, vp = par["pp"], par["virtual_stages"]
    m = GLOBAL_BATCH // (MICRO * par["dp"])
    pipe = [s.get("pipeline") for s in steps]
    check(all(pipe), f"{name}: every step reports pipeline figures")
    if all(pipe):
        want = [in_flight_bound(par["schedule"], pp, vp, m, r) for r in range(pp)]
        got_peak = pipe[-1]["peak_in_flight"]
        check(all(p["peak_in_flight"] == want for p in pipe),
              f"{name}: micro-batches in flight per pipeline rank {got_peak} == the schedule's bound {want}")
        ideal = (pp - 1) / (m * vp + pp - 1)
        check(all(abs(p["ideal_bubble"] - ideal) < 1e-9 and 0.0 <= p["bubble"] < 1.0 for p in pipe),
              f"{name}: bubble measured {pipe[-1]['bubble']:.2f} beside the analytic {ideal:.2f}")
    bad, seen = harness.comm_mismatches(steps)
    # Global rank 0 (first stage) reports its groups of size > 1: with pp > 1 that includes the
    # embedding group (first + last stage), which moves the tied embedding's gradient, or nothing.
    expected = {g for g, n in (("tp", par["tp"]), ("dp", par["dp"]), ("pp", pp), ("embedding", pp)) if n > 1}
    check(not bad and seen == expected, f"{name}: measured communication equals the prediction in every step "
                                        f"(groups {sorted(seen)})")
    tied = MODELS[model].get("tie_embeddings", True)
    moved = [(s["comm"]["embedding"]["measured"] or {}).get("all_reduce", {}).get("calls", 0) for s in steps]
    check(all(n == (1 if tied else 0) for n in moved),
          f"{name}: the embedding group all-reduces the tied embedding's gradient once a step "
          f"({'tied' if tied else 'untied'}: {moved[0]} call(s))")


def resume_checks(args, ref_steps):
    """Checkpoints move between pipeline layouts: save at step N on one, resume on another."""
    model = "gpt2"
    ref = {s["step"]: s["loss"] for s in ref_steps}
    # ZeRO stages hold the same optimizer state: 1 -> 2 and 1 -> 3 on another dp, 2 -> 0 on one
    # rank, 3 -> 1 on another dp.
    for src, dsts in ((layout(2), [layout(1), layout(4)]), (layout(1), [layout(2)]),
                      (layout(4, "interleaved", 2), [layout(2)]),
                      (layout(1, dp=2, zero=1), [layout(1, dp=4, zero=2), layout(1, dp=4, zero=3)]),
                      (layout(2, dp=2, zero=2), [layout(1)]), (layout(1, dp=4, zero=3), [layout(1, dp=2, zero=1)])):
        ck = os.path.join(args.workdir, f"ckpt_{name_of(model, src)}")
        shutil.rmtree(ck, ignore_errors=True)
        out = os.path.join(args.workdir, f"save_{name_of(model, src)}")
        # Stopped after step N as if interrupted (the LR schedule is the 20-step run's).
        r = launch(args, out, config(model, src, "fp32", out, exit_at=N,
                                     ckpt={"dir": ck, "save_on_exit": True, "resume": "none"}), dump=False)
        check(r.returncode == 0 and os.path.exists(os.path.join(ck, "latest")),
              f"checkpoint saved at step {N} on {name_of(model, src)}")
        if r.returncode != 0:
            continue
        for dst in dsts:
            ck2 = ck + "_copy"
            shutil.rmtree(ck2, ignore_errors=True)
            shutil.copytree(ck, ck2)
            out2 = os.path.join(args.workdir, f"resume_{name_of(model, src)}_to_{name_of(model, dst)}")
            r2 = launch(args, out2, config(model, dst, "fp32", out2, ckpt={"dir": ck2, "resume": "auto"}), dump=False)
            steps = {s["step"]: s["loss"] for s in harness.step_records(out2)} if r2.returncode == 0 else {}
            worst = max((rel(steps[s], ref[s]) for s in steps), default=float("inf"))
            check(r2.returncode == 0 and sorted(steps) == list(range(N + 1, STEPS + 1)) and worst <= LOSS_RTOL,
                  f"saved on {name_of(model, src)}, resumed on {name_of(model, dst)}: steps "
                  f"{N + 1}..{STEPS} within {LOSS_RTOL:g} of the single-rank run (worst {worst:.2e})")


def main():
    args = harness.parse_args()
    single = layout(1)
    for model in MODELS:
        ref = run(args, f"{model}_single", config(model, single, "fp32", os.path.join(args.workdir, f"{model}_single")))
        if ref is None:
            continue
        harness.check_loss_falls(checks, f"{model} single-rank", [s["loss"] for s in ref[0]])
        for par in LAYOUTS[model]:
            name = name_of(model, par)
            got = run(args, name, config(model, par, "fp32", os.path.join(args.workdir, name)))
            if got is not None:
                compare(name, model, par, ref, got, LOSS_RTOL)
        for par in COMPRESSION_LAYOUTS[model]:
            name = name_of(model, par) + "_bf16grads"
            got = run(args, name, config(model, par, "fp32", os.path.join(args.workdir, name)))
            if got is not None:
                compare(name, model, par, ref, got, COMPRESSION_RTOL)
                # The same layout reducing in fp32: the gradient reduction moves exactly twice the bytes.
                twin_par = dict(par, grad_compression="none")
                twin = run(args, name + "_fp32grads", config(model, twin_par, "fp32",
                                                             os.path.join(args.workdir, name + "_fp32grads")))
                if twin is not None:
                    op = "reduce_scatter" if par["distributed_optimizer"] else "all_reduce"
                    loss_bytes = 0 if par["distributed_optimizer"] else 4  # the loss's all-reduce
                    a = got[0][1]["comm"]["dp"]["measured"][op]["payload_bytes"] - loss_bytes
                    b = twin[0][1]["comm"]["dp"]["measured"][op]["payload_bytes"] - loss_bytes
                    check(a > 0 and 2 * a == b, f"{name}: the gradient {op} moves {a} bytes, half of fp32's {b}")
        ref16 = run(args, f"{model}_single_bf16",
                    config(model, single, "bf16", os.path.join(args.workdir, f"{model}_single_bf16")))
        if ref16 is not None:
            for par in BF16_LAYOUTS[model]:
                name = name_of(model, par, "bf16")
                got = run(args, name, config(model, par, "bf16", os.path.join(args.workdir, name)))
                if got is not None:
                    compare(name, model, par, ref16, got, BF16_RTOL)
        if model == "gpt2":
            resume_checks(args, ref[0])
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
