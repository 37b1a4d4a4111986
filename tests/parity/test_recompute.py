"""Activation recomputation changes memory, never the numbers.

training.recompute (trainer/params/recompute.h) trades kept activations for forward work in
backward; a recomputed forward runs the same kernels on the same values as the first one, so a run
with any recomputation must be bitwise the run without it. For tiny GPT-2-style (GELU, tied), Llama
(SwiGLU, RoPE, GQA) and Llama-style MoE configs, on each layout kind — one rank (fp32, bf16, fp16),
tp2 with and without sequence parallelism, pp2 interleaved, pp2 1f1b x tp2 with sequence
parallelism, dp2 with the distributed optimizer, ZeRO-2 and ZeRO-3, ep2 MoE — Tetra trains STEPS steps with
recompute "none", then with
  selective  norm + act + core_attn (+ moe_act on MoE models)
  full       uniform units of 2 layers, and block with 2 layers (each recomputed alone: a block of
             one layer and one micro-batch in flight saves nothing, its scratch is one layer)
and checks, against the "none" run of the same layout:
  - every step's loss, gradient norm and validation loss as metrics.jsonl writes them (equal
    strings: equal bits);
  - every parameter's step-0 gradient (--dump-dir), bitwise;
  - each group's measured communication equals the prediction in every step (recomputation under
    tensor parallelism repeats the forward's exchanges, and the prediction counts them);
  - the planned activations (the start event's activation_plan_bytes) are fewer than without
    recomputation (the peak need not be: a tiny ZeRO-1 run peaks while the whole fp32 weights are
    gathered, with the activations freed).
Guard against a vacuous pass: the loss falls in every "none" run.

Usage: /usr/bin/python3 test_recompute.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import os
import sys

import numpy as np

import harness
from harness import Checks, read_safetensors

STEPS = 4
GPT2 = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 4, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64}
LLAMA = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 4, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 48, "norm": "rmsnorm", "activation": "swiglu", "position": "rope",
         "tie_embeddings": False, "bias": False}
MOE = dict(LLAMA, moe={"num_experts": 4, "top_k": 2, "every": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.01,
                       "z_loss_coeff": 0.001})

# (name, model, parallel, precision)
LAYOUTS = [
    ("gpt2_1", GPT2, {}, "fp32"),
    ("llama_1_bf16", LLAMA, {}, "bf16"),
    ("gpt2_1_fp16", GPT2, {}, "fp16"),
    ("gpt2_tp2_sp", GPT2, {"tp": 2, "sequence_parallel": True}, "fp32"),
    ("llama_tp2_bf16", LLAMA, {"tp": 2}, "bf16"),
    ("llama_pp2_interleaved", LLAMA, {"pp": 2, "schedule": "interleaved", "virtual_stages": 2}, "fp32"),
    ("llama_pp2_tp2_sp", LLAMA, {"pp": 2, "tp": 2, "sequence_parallel": True}, "bf16"),
    ("gpt2_dp2_distopt_bf16", GPT2, {"dp": 2, "distributed_optimizer": True}, "bf16"),
    ("moe_ep2", MOE, {"dp": 2, "ep": 2}, "fp32"),
    ("gpt2_dp2_zero2", GPT2, {"dp": 2, "zero_stage": 2}, "fp32"),
    # ZeRO-3: a recomputed block is gathered again for its recomputation (two units held).
    ("llama_dp2_zero3_bf16", LLAMA, {"dp": 2, "zero_stage": 3}, "bf16"),
]
MODES = {
    "selective": {"recompute": "selective", "recompute_modules": ["norm", "act", "core_attn"]},
    "full_uniform2": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full_block2": {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 2},
}

checks = Checks()
check = checks.check


def config(model, par, precision, out, mode):
    training = {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 1, "peak_gflops": 100,
                "precision": precision, "seed": 11, "eval_every": 2, "eval_steps": 1, **mode}
    if precision == "fp16":
        training["initial_loss_scale"] = 1024.0
    return {
        "model": model,
        "training": training,
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "parallel": dict(par, bucket_size=2000),
        "data": {"synthetic": True},
        "logging": {"level": "warn", "dir": out},
    }


def run(args, name, model, par, precision, mode):
    out = os.path.join(args.workdir, name)
    path = harness.write_config(out, config(model, par, precision, out, mode))
    world = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
    r = harness.run_tetra(args, ["--config", path, "--dump-dir", os.path.join(out, "dump")], world)
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    lines = harness.metrics_lines(out)
    steps = [(harness.raw_field(line, "loss"), harness.raw_field(line, "grad_norm"),
              harness.raw_field(line, "val_loss") if '"val_loss":' in line else None, j)
             for line, j in lines if "step" in j]
    start = [j for _, j in lines if j.get("event") == "start"][-1]
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0]
    return steps, grads, start["activation_plan_bytes"]


def main():
    args = harness.parse_args()
    for name, model, par, precision in LAYOUTS:
        ref = run(args, f"{name}_none", model, par, precision, {"recompute": "none"})
        if ref is None:
            continue
        ref_steps, ref_grads, ref_plan = ref
        losses = [float(s[0]) for s in ref_steps]
        check(len(ref_steps) == STEPS and losses[-1] < losses[0] - 0.02,
              f"{name}: {len(ref_steps)} steps without recomputation, the loss falls "
              f"({losses[0]:.4f} -> {losses[-1]:.4f})")
        modes = dict(MODES)
        if "moe" in model:
            modes["selective"] = dict(modes["selective"], recompute_modules=["norm", "act", "core_attn", "moe_act"])
        for mode_name, mode in modes.items():
            label = f"{name}_{mode_name}"
            got = run(args, label, model, par, precision, mode)
            if got is None:
                continue
            steps, grads, plan = got
            same = [s[:3] == r[:3] for s, r in zip(steps, ref_steps)]
            check(len(steps) == len(ref_steps) and all(same),
                  f"{label}: losses, gradient norms and validation losses of {len(steps)} steps bitwise those "
                  f"without recomputation" + ("" if all(same) else f" (first difference at step {same.index(False) + 1}: "
                                               f"{steps[same.index(False)][:3]} vs {ref_steps[same.index(False)][:3]})"))
            differ = [k for k in ref_grads if k not in grads or not np.array_equal(grads[k], ref_grads[k])]
            check(sorted(grads) == sorted(ref_grads) and not differ,
                  f"{label}: all {len(ref_grads)} step-0 gradient tensors bitwise equal"
                  + (f" (differ: {differ[:4]})" if differ else ""))
            bad, seen = harness.comm_mismatches([s[3] for s in steps])
            check(not bad, f"{label}: measured communication equals the prediction in every step "
                           f"(groups {sorted(seen)})")
            check(plan < ref_plan, f"{label}: planned activations {plan} bytes < {ref_plan} without recomputation")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
