"""Gradient compression (parallel.grad_compression): training, volume, accounting and resume.

  - Training: dp2 and dp4, with and without the distributed optimizer, and tp2 x dp2, each with
    none, bf16, onebit (onebit_warmup_steps 6 of 12 steps) and int8: every run trains (the loss
    falls), and its losses stay close to the uncompressed run of the same layout:
      bf16: every step within 5e-3 relative. The gradients are rounded to bf16 (8 mantissa bits,
        2^-9 relative) once before and once per combining step of the reduction; Adam's update
        passes such relative errors through about 1:1, and over these 12 steps the measured
        difference is <= 3e-3 (dp4; <= 1e-3 at dp2). The losses must also differ from none's somewhere (the rounding is
        really applied).
      onebit: the warm-up steps are exact Adam, so bitwise identical to none; afterwards every step
        within 5% and the last within 3%. The compressed phase updates along the sign-quantised
        momentum, which differs from exact Adam's every step; error feedback keeps that difference
        from accumulating (measured <= 2.4% per step and
        <= 1.1% at the last step on these runs). A broken exchange (no averaging, no
        error feedback, ranks out of step) drives the loss far off or up.
      int8: every step within 5%, the last within 3% (INT8_STEP_RTOL), and different from none.
  - Accounting: every step's measured DP (and TP) calls and payload equal the prediction
    (metrics.jsonl "match"), in every run.
  - Volume, against none on the same layout: plain data parallelism: the DP bytes sent per step
    fall by >= 45% with bf16, >= 90% with onebit after the warm-up, >= 70% with int8. With the distributed
    optimizer the updated weights are still all-gathered uncompressed (and the frozen variance once,
    in the first compressed step, which the averages leave out), so the check is on the gradient leg: the reduce-scatter payload halves with bf16, and onebit's all-to-all carries
    <= 10% of it (int8's <= 30%; and the total falls by >= 45% for onebit in fp32).
  - Resume in the compressed phase: 12 steps straight vs 9 steps (warm-up 6), checkpoint, resume:
    steps 10..12 bitwise identical, for dp2, dp2 with the distributed optimizer (bf16 precision),
    and tp2 x dp2 with sequence parallelism; the checkpoint holds the error-feedback tensors, and
    `tetra ckpt inspect` verifies it (every tensor covered exactly once).
  - Resume at another dp: a dp2 onebit checkpoint resumes under dp4: the worker errors start from
    zero with a warning, the server error is resharded, and the run continues within the onebit
    tolerance of the uninterrupted dp2 run.
  - Pipelines and experts (STACKED): a tied GPT-2 on pp 2 (1f1b) x dp 2, with and without the
    distributed optimizer, and its pp 1 twin; a MoE model on dp 4 = expert-DP 2 x ep 2 (with and
    without the distributed optimizer) and on pp 2 x dp 2 x ep 2 (expert-DP 1), each with none,
    onebit and int8: onebit's warm-up equals none's within 1e-5 (it is exact Adam on any layout),
    the compressed phase and int8 within the tolerances above, the DP and expert-DP bytes down as
    above, communication as predicted in every group; pp 2 onebit follows pp 1 onebit (PIPELINE_RTOL:
    the tied embedding is compressed in the same blocks on both layouts); a checkpoint taken in the
    compressed phase (onebit) or at step 9 (int8) resumes bitwise on pp 2 (both optimizer modes)
    and on the MoE layout, holding the tied piece's and the experts' error feedback.

Usage: /usr/bin/python3 test_compression.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import json
import os
import sys

import harness
from harness import Checks, rel

STEPS, WARMUP, STOP = 12, 6, 9
BF16_RTOL = 5e-3
ONEBIT_STEP_RTOL, ONEBIT_LAST_RTOL = 0.05, 0.03
# int8 (every step compressed: the stochastically rounded gradient, 127 levels per sign and block
# of 256, with error feedback; Adam and clipping unchanged): a perturbation of each step's
# gradient of up to half a level of its block's largest entry, which Adam's per-coordinate
# normalisation passes on in full to small entries; these short lr 1e-2 runs then separate like
# any perturbed trajectories (nearest instead of stochastic rounding, or blocks of 32 or 64,
# separate them as much). Measured <= 1.7% per step and at the last step, over these layouts.
INT8_STEP_RTOL, INT8_LAST_RTOL = 0.05, 0.03

# Pipelines (GPT-2 style, tied embeddings: the first and the last stage hold embedding.wte) and
# MoE models (experts over expert-DP): name -> (model, layout as LAYOUTS, further parallel settings).
GPT2 = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 4, "hidden_size": 64, "num_heads": 8, "ffn_hidden_size": 128}
GPT2_MOE = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
            "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}}
PP2 = {"pp": 2, "schedule": "1f1b"}
# One bucket per parameter group: the pp 1 and pp 2 runs then compress every parameter in the same
# blocks (the tied embedding in a piece of its own on both stages, its group's bucket at pp 1).
ONE_GROUP_BUCKETS = {"bucket_size": 1}
STACKED = {
    "gpt2_pp1_dp2": (GPT2, (2, 1, False, False, "fp32"), ONE_GROUP_BUCKETS),
    "gpt2_pp2_dp2": (GPT2, (2, 1, False, False, "fp32"), dict(PP2, **ONE_GROUP_BUCKETS)),
    "gpt2_pp2_dp2_distopt": (GPT2, (2, 1, False, True, "fp32"), PP2),
    "moe_dp4_ep2": (GPT2_MOE, (4, 1, False, False, "fp32"), {"ep": 2}),           # expert-DP 2
    "moe_dp4_ep2_distopt": (GPT2_MOE, (4, 1, False, True, "fp32"), {"ep": 2}),
    "moe_pp2_dp2_ep2": (GPT2_MOE, (2, 1, False, False, "fp32"), dict(PP2, ep=2)),  # expert-DP 1
}
RESUMED = [("gpt2_pp2_dp2", "onebit"), ("gpt2_pp2_dp2_distopt", "onebit"), ("moe_dp4_ep2", "onebit"),
           ("gpt2_pp2_dp2", "int8"), ("moe_dp4_ep2_distopt", "int8")]
# The warm-up is exact Adam on every layout: the same reductions as none (the layouts differ only
# in padding), so the losses agree to fp32 rounding of reordered sums (test_layouts.py's 1e-5).
WARMUP_RTOL = 1e-5
# pp 2 against pp 1, both onebit (tied embeddings, dp 2, ONE_GROUP_BUCKETS): the same compression
# blocks, so only fp32 rounding differs (the tied embedding's two gradients are summed over the
# embedding group instead of inside one stage). The sign compressor amplifies it wherever an
# entry near zero changes sign, by about 10x per compressed step: measured 5e-7 and 2e-6 after the
# first two compressed updates (steps 8, 9), 2e-5 at step 10, and 3e-3 at step 11, where the runs
# have become two realisations of the compression noise. So the comparison covers the losses up to
# step WARMUP + 3. Averaging the tied embedding exactly instead of compressing it (an earlier
# design) moved step 8 by 1.5e-3.
PIPELINE_RTOL = 1e-4
PIPELINE_STEPS = WARMUP + 3

checks = Checks()
check = checks.check


MODEL = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 64, "num_heads": 8,
         "num_kv_heads": 4, "ffn_hidden_size": 96, "norm": "rmsnorm", "activation": "swiglu",
         "position": "rope", "tie_embeddings": False, "bias": False}

# name: (dp, tp, sequence_parallel, distributed_optimizer, precision)
LAYOUTS = {"dp2": (2, 1, False, False, "fp32"), "dp2_distopt": (2, 1, False, True, "fp32"),
           "dp4": (4, 1, False, False, "fp32"), "dp4_distopt": (4, 1, False, True, "fp32"),
           "tp2dp2": (2, 2, True, False, "fp32")}


def config(workdir, name, layout, mode, ckpt_dir="", exit_at=0, resume="auto", model=MODEL, extra=None):
    """`extra`: further parallel settings (pp, ep, schedule)."""
    dp, tp, sp, dist_opt, precision = layout
    out = os.path.join(workdir, name)
    cfg = {
        "model": model,
        "parallel": {"dp": dp, "tp": tp, "sequence_parallel": sp, "distributed_optimizer": dist_opt,
                     "bucket_size": 3000, "grad_compression": mode, "onebit_warmup_steps": WARMUP, **(extra or {})},
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 1,
                     "peak_gflops": 100, "seed": 11, "precision": precision, "exit_interval": exit_at},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2},
        "data": {"synthetic": True},
        "checkpoint": {"dir": ckpt_dir, "keep": 2, "resume": resume, "save_on_exit": True},
        "logging": {"dir": out, "level": "info"},
    }
    return harness.write_config(out, cfg, fresh=False), out


def run(args, path, layout, pp=1):
    return harness.run_tetra(args, ["--config", path], layout[0] * layout[1] * pp, timeout=120)


def train(args, w, name, mode, lay, pp=1, **kw):
    """Trains STEPS steps with compression `mode` on layout `lay` (config's further settings in kw)
    in w/<name>_<mode>: its last_run, checked complete and with its communication as predicted in
    every step and group; None when it did not train every step."""
    path, out = config(w, f"{name}_{mode}", lay, mode, **kw)
    r = run(args, path, lay, pp)
    s = harness.last_run(out) if r.returncode == 0 else {}
    check(len(s) == STEPS, f"{name} {mode}: trains {STEPS} steps (logged {len(s)})")
    if len(s) != STEPS:
        return None
    mismatched = harness.comm_mismatches([rec for _, rec in s.values()], exact=False)[0]
    check(not mismatched, f"{name} {mode}: measured communication == predicted every step, every group "
                          f"(mismatched steps {mismatched})")
    return s


def dp_sent(rec):
    return rec["comm"]["dp"]["sent_bytes"]


def dp_payload(rec, op):
    return rec["comm"]["dp"]["measured"].get(op, {}).get("payload_bytes", 0)


def check_near_none(name, mode, got, none, first, step_rtol, last_rtol):
    """`mode`'s losses against none's on the same layout (last_run records), from step `first`: each
    within step_rtol, the last within last_rtol."""
    L = lambda s, k: s[k][1]["loss"]
    worst = max(rel(L(got, k), L(none, k)) for k in range(first, STEPS + 1))
    last = rel(L(got, STEPS), L(none, STEPS))
    check(worst <= step_rtol and last <= last_rtol,
          f"{name}: {mode} losses within {step_rtol} of none (worst {worst:.2e}), last within {last_rtol} ({last:.2e})")


def check_int8(name, lay, none, int8, expert_groups=()):
    """int8 against none on the same layout (INT8_STEP_RTOL): losses, and the bytes on the wire."""
    if not (none and int8):
        return
    check_near_none(name, "int8", int8, none, 1, INT8_STEP_RTOL, INT8_LAST_RTOL)
    check(any(int8[k][0] != none[k][0] for k in range(2, STEPS + 1)), f"{name}: int8 quantisation changes the losses")
    steps = range(2, STEPS + 1)
    for group in ("dp",) + tuple(expert_groups):
        if group not in none[STEPS][1]["comm"]:  # expert-DP of 1
            continue
        mean = lambda s, f: sum(f(s[k][1]["comm"][group]) for k in steps) / len(steps)
        payload = lambda op: lambda c: c["measured"].get(op, {}).get("payload_bytes", 0)
        if not lay[3]:
            n, q = mean(none, lambda c: c["sent_bytes"]), mean(int8, lambda c: c["sent_bytes"])
            check(q <= 0.30 * n, f"{name}: int8 {group} bytes per step {q:.0f} vs none {n:.0f} "
                                 f"({100 * (1 - q / n):.1f}% less, >= 70%)")
        else:  # the gradient leg: the all-to-all replaces the reduce-scatter
            n, q = mean(none, payload("reduce_scatter")), mean(int8, payload("all_to_all"))
            check(0 < q <= 0.30 * n and mean(int8, payload("reduce_scatter")) == 0,
                  f"{name}: int8's {group} all-to-all {q:.0f} bytes replace the reduce-scatter's {n:.0f} "
                  f"({100 * (1 - q / n):.1f}% less, >= 70%)")


def checkpoint_tensors(ck, step):
    manifest = os.path.join(ck, f"step_{step:08d}", "manifest.json")
    return list(json.load(open(manifest))["tensors"].keys()) if os.path.exists(manifest) else []


def pipelines_and_experts(args, w):
    """onebit on pipelines (tied embeddings) and MoE models: see STACKED."""
    results = {}
    for name, (model, lay, extra) in STACKED.items():
        pp = extra.get("pp", 1)
        for mode in ("none", "onebit", "int8"):
            s = train(args, w, name, mode, lay, pp, model=model, extra=extra)
            if s is not None:
                results[(name, mode)] = s
        none, onebit = results.get((name, "none")), results.get((name, "onebit"))
        check_int8(name, lay, none, results.get((name, "int8")), ("edp",) if "ep" in extra else ())
        if not (none and onebit):
            continue
        L = lambda s, k: s[k][1]["loss"]
        harness.check_loss_falls(checks, f"{name} onebit", [L(onebit, 1), L(onebit, STEPS)])
        worst = max(rel(L(onebit, k), L(none, k)) for k in range(1, WARMUP + 1))
        bitwise = all(onebit[k][0] == none[k][0] for k in range(1, WARMUP + 1))
        check(worst <= WARMUP_RTOL, f"{name}: onebit's {WARMUP} warm-up steps equal none's within {WARMUP_RTOL} "
                                    f"(worst {worst:.1e}{', bitwise' if bitwise else ''})")
        check_near_none(name, "onebit", onebit, none, WARMUP + 1, ONEBIT_STEP_RTOL, ONEBIT_LAST_RTOL)
        # Global rank 0's bytes (first pipeline stage; DP and, for experts, expert-DP), from the
        # second compressed step (the distributed optimizer's first one also gathers the variance).
        after = range(WARMUP + 2, STEPS + 1)
        for group in ("dp", "edp"):
            if group not in none[STEPS][1]["comm"]:
                continue
            sent = lambda s: sum(s[k][1]["comm"][group]["sent_bytes"] for k in after) / len(after)
            payload = lambda s, op: sum(s[k][1]["comm"][group]["measured"].get(op, {}).get("payload_bytes", 0)
                                        for k in after) / len(after)
            if not lay[3]:
                check(sent(onebit) <= 0.10 * sent(none), f"{name}: onebit {group} bytes per step {sent(onebit):.0f} vs "
                      f"none {sent(none):.0f} ({100 * (1 - sent(onebit) / sent(none)):.1f}% less, >= 90%)")
            else:  # the gradient leg: the all-to-all (and a tied piece's all-gather) vs the reduce-scatter
                n_rs, o_a2a = payload(none, "reduce_scatter"), payload(onebit, "all_to_all")
                check(0 < o_a2a <= 0.10 * n_rs and payload(onebit, "reduce_scatter") == 0,
                      f"{name}: onebit's {group} all-to-all {o_a2a:.0f} bytes replace the reduce-scatter's {n_rs:.0f} "
                      f"({100 * (1 - o_a2a / n_rs):.1f}% less, >= 90%)")
    # The pipeline's tied embedding is compressed like the single stage's: the pp 2 run follows
    # the pp 1 run of the same dp.
    one, two = results.get(("gpt2_pp1_dp2", "onebit")), results.get(("gpt2_pp2_dp2", "onebit"))
    if one and two:
        worst = max(rel(two[k][1]["loss"], one[k][1]["loss"]) for k in range(1, PIPELINE_STEPS + 1))
        check(worst <= PIPELINE_RTOL, f"gpt2 pp2 onebit within {PIPELINE_RTOL} of pp1 onebit up to step "
                                      f"{PIPELINE_STEPS} (worst {worst:.2e})")

    # Resume in the compressed phase on the same layout: bitwise. A checkpoint holds the first
    # stage's embedding only (the last stage's copy loads from it), so this also shows the copies
    # were identical.
    for name, mode in RESUMED:
        model, lay, extra = STACKED[name]
        pp = extra.get("pp", 1)
        ref = results.get((name, mode), {})
        ck = os.path.join(w, f"ck_{name}_{mode}")
        name = f"{name} {mode}"
        p1, _ = config(w, f"resume_{name}_a".replace(" ", "_"), lay, mode, ck, exit_at=STOP, model=model, extra=extra)
        r1 = run(args, p1, lay, pp)
        check(r1.returncode == 0 and os.path.exists(os.path.join(ck, "latest")),
              f"{name}: {STOP} steps{f' (compressed from step {WARMUP + 1})' if mode == 'onebit' else ''}, "
              f"checkpoint saved")
        keys = checkpoint_tensors(ck, STOP)
        suffix = "_sharded" if lay[3] and mode == "onebit" else ""
        want = [f"optim/{mode}_worker_error/dp0of"]
        if not lay[3]:
            want.append(f"optim/{mode}_server_error/")
        if pp > 1:  # the tied piece's (first stage)
            want.append(f"optim/{mode}_server_error{suffix}/embedding.wte")
        if "ep" in extra and lay[0] // extra["ep"] > 1:
            want.append(f"optim/{mode}_worker_error/edp0of{lay[0] // extra['ep']}_ep{extra['ep']}")
        missing = [k for k in want if not any(key.startswith(k) for key in keys)]
        check(not missing, f"{name}: the checkpoint holds the error-feedback state (missing {missing})")
        verified, err = harness.inspect_checkpoint(args, os.path.join(ck, f"step_{STOP:08d}"))
        check(verified, f"{name}: tetra ckpt inspect verifies it, error-feedback tensors included {err}")
        p2, o2 = config(w, f"resume_{name}_b".replace(" ", "_"), lay, mode, ck, model=model, extra=extra)
        r2 = run(args, p2, lay, pp)
        resumed = harness.last_run(o2) if r2.returncode == 0 else {}
        check(sorted(resumed) == list(range(STOP + 1, STEPS + 1)), f"{name}: resumes at step {STOP + 1}")
        same = all(resumed.get(k, ("",))[0] == ref.get(k, (None,))[0] for k in range(STOP + 1, STEPS + 1))
        check(same, f"{name}: steps {STOP + 1}..{STEPS} after the resume bitwise identical to the uninterrupted run")


def main():
    args = harness.parse_args()
    w = args.workdir

    results = {}
    for lname, lay in LAYOUTS.items():
        for mode in ("none", "bf16", "onebit", "int8"):
            s = train(args, w, lname, mode, lay)
            if s is not None:
                results[(lname, mode)] = s
                harness.check_loss_falls(checks, f"{lname} {mode}", [s[1][1]["loss"], s[STEPS][1]["loss"]], by=0.3)

    for lname, lay in LAYOUTS.items():
        none, bf16, onebit = (results.get((lname, m)) for m in ("none", "bf16", "onebit"))
        check_int8(lname, lay, none, results.get((lname, "int8")))
        if not (none and bf16 and onebit):
            continue
        L = lambda s, k: s[k][1]["loss"]
        worst = max(rel(L(bf16, k), L(none, k)) for k in range(1, STEPS + 1))
        check(worst <= BF16_RTOL, f"{lname}: bf16 losses within {BF16_RTOL} of none (worst {worst:.2e})")
        check(any(bf16[k][0] != none[k][0] for k in range(2, STEPS + 1)), f"{lname}: bf16 rounding changes the losses")
        same_warmup = all(onebit[k][0] == none[k][0] for k in range(1, WARMUP + 1))
        check(same_warmup, f"{lname}: onebit's {WARMUP} warm-up steps are exact Adam (bitwise equal to none)")
        check_near_none(lname, "onebit", onebit, none, WARMUP + 1, ONEBIT_STEP_RTOL, ONEBIT_LAST_RTOL)

        # From the second compressed step: with the distributed optimizer the first one also
        # all-gathers the frozen variance, once (predicted, and checked above with every step).
        after = range(WARMUP + 2, STEPS + 1)
        mean = lambda s, f: sum(f(s[k][1]) for k in after) / len(after)
        n_sent, b_sent, o_sent = (mean(s, dp_sent) for s in (none, bf16, onebit))
        if not lay[3]:
            check(b_sent <= 0.55 * n_sent, f"{lname}: bf16 DP bytes per step {b_sent:.0f} vs none {n_sent:.0f} "
                                            f"({100 * (1 - b_sent / n_sent):.1f}% less, >= 45%)")
            check(o_sent <= 0.10 * n_sent, f"{lname}: onebit DP bytes per step {o_sent:.0f} vs none {n_sent:.0f} "
                                            f"({100 * (1 - o_sent / n_sent):.1f}% less, >= 90%)")
        else:
            rs = lambda rec: dp_payload(rec, "reduce_scatter")
            a2a = lambda rec: dp_payload(rec, "all_to_all")
            n_rs, b_rs, o_a2a = mean(none, rs), mean(bf16, rs), mean(onebit, a2a)
            check(b_rs == n_rs / 2, f"{lname}: bf16 reduce-scatter payload {b_rs:.0f} = half of none's {n_rs:.0f}")
            check(0 < o_a2a <= 0.10 * n_rs and mean(onebit, rs) == 0,
                  f"{lname}: onebit's all-to-all {o_a2a:.0f} bytes replace the reduce-scatter's {n_rs:.0f} "
                  f"({100 * (1 - o_a2a / n_rs):.1f}% less, >= 90%)")
            check(o_sent <= 0.55 * n_sent, f"{lname}: onebit DP bytes per step {o_sent:.0f} vs none {n_sent:.0f} "
                                            f"({100 * (1 - o_sent / n_sent):.1f}% less with the weights' "
                                            f"all-gather, >= 45%)")

    # Resume in the compressed phase, same layout: bitwise.
    resume_layouts = {"dp2": LAYOUTS["dp2"], "dp2_distopt_bf16": (2, 1, False, True, "bf16"),
                      "tp2dp2": LAYOUTS["tp2dp2"]}
    for lname, lay in resume_layouts.items():
        ref = results.get((lname, "onebit"))
        if ref is None:
            path, out = config(w, f"resume_{lname}_ref", lay, "onebit")
            run(args, path, lay)
            ref = harness.last_run(out)
        ck = os.path.join(w, f"ck_{lname}")
        p1, _ = config(w, f"resume_{lname}_a", lay, "onebit", ck, exit_at=STOP)
        r1 = run(args, p1, lay)
        check(r1.returncode == 0 and os.path.exists(os.path.join(ck, "latest")),
              f"{lname}: {STOP} steps (compressed from step {WARMUP + 1}), checkpoint saved")
        keys = checkpoint_tensors(ck, STOP)
        worker = [k for k in keys if k.startswith("optim/onebit_worker_error/")]
        server = [k for k in keys if k.startswith("optim/onebit_server_error/")]
        check(worker and (lay[3] or server), f"{lname}: the checkpoint holds the error-feedback state "
                                             f"({len(worker)} worker, {len(server)} server tensors)")
        verified, err = harness.inspect_checkpoint(args, os.path.join(ck, f"step_{STOP:08d}"))
        check(verified, f"{lname}: tetra ckpt inspect verifies it, error-feedback tensors included" +
              ("" if verified else ": " + err))
        p2, o2 = config(w, f"resume_{lname}_b", lay, "onebit", ck)
        r2 = run(args, p2, lay)
        resumed = harness.last_run(o2) if r2.returncode == 0 else {}
        check(sorted(resumed) == list(range(STOP + 1, STEPS + 1)), f"{lname}: resumes at step {STOP + 1}")
        same = all(resumed.get(k, ("",))[0] == ref.get(k, (None,))[0] for k in range(STOP + 1, STEPS + 1))
        check(same, f"{lname}: steps {STOP + 1}..{STEPS} after the resume bitwise identical to the uninterrupted run")

    # Resume at another dp.
    ref = results.get(("dp2", "onebit"))
    if ref:
        saved = os.path.join(w, "ck_dp2", f"step_{STOP:08d}")
        p3, o3 = config(w, "reshard_dp4", LAYOUTS["dp4"], "onebit", os.path.join(w, "ck_reshard"), resume=saved)
        r3 = run(args, p3, LAYOUTS["dp4"])
        s = harness.last_run(o3) if r3.returncode == 0 else {}
        check(sorted(s) == list(range(STOP + 1, STEPS + 1)), f"dp2 -> dp4: resumes at step {STOP + 1}")
        check("onebit_worker_error/dp0of4" in r3.stdout + r3.stderr and "starts from zero" in r3.stdout + r3.stderr,
              "dp2 -> dp4: the worker errors start from zero, with a warning")
        worst = max((rel(s[k][1]["loss"], ref[k][1]["loss"]) for k in s), default=1.0)
        check(worst <= ONEBIT_STEP_RTOL, f"dp2 -> dp4: losses within {ONEBIT_STEP_RTOL} of the dp2 run (worst {worst:.2e})")

    pipelines_and_experts(args, w)

    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
