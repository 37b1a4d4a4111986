"""Parallelism is invisible: every layout reproduces the single-rank run.

For a GPT-2-style and a Llama-style (GQA, RoPE, SwiGLU, untied) tiny config, Tetra trains 20
steps single-rank, then under `mpirun` on layouts over dp in {1,2,4} and tp in {1,2,4}, with and
without sequence parallelism, with ZeRO stage 0, 1 (the distributed optimizer) and 2 (gradients
sharded too, each micro-batch's reduce-scattered as backward makes it) and 3 (the compute weights
sharded too, each parameter group all-gathered before it is read), with gradient accumulation (global
batch 8 of micro-batches of 2: 4, 2 or 1 micro-batches per DP rank) and small gradient buckets (so
several buckets overlap backward). Checks, per layout:
  - the loss of every step matches the single-rank run (LOSS_RTOL), and so do the gradient norms;
  - every parameter's step-0 gradient (dumped as the global tensor, the TP slices gathered)
    matches the single-rank gradient (GRAD_RTOL, per tensor);
  - in every step, each group's measured communication equals the layout's prediction exactly
    (metrics.jsonl "comm": calls and payload bytes per operation), and a group of size > 1 did
    communicate;
  - in bf16, a few layouts against the single-rank bf16 run (BF16_RTOL).
Guard against a vacuous pass: the single-rank loss must fall, and the layouts must really be
parallel (metrics report communication for tp and dp groups of size > 1).

Usage: /usr/bin/python3 test_layouts.py --tetra BIN --workdir DIR [--quick]
"""
import json
import os
import sys

import harness
from harness import Checks, read_safetensors

# ---- tolerances ---------------------------------------------------------------------------------
# A parallel layout computes the same sums in a different order: the vocab-parallel softmax adds
# per-slice partial sums, row-parallel GEMMs add per-rank partial products, data parallelism adds
# per-rank partial gradients. Each reordering changes a result by a few fp32 roundings
# (u = 6e-8) relative to its magnitude; through ~30 ops of two blocks the loss moves by ~1e-7 and
# a gradient tensor by ~1e-6 relative (measured: ~1e-7 and ~3e-7). Over 20 Adam steps a relative
# gradient difference e changes each update by ~e * lr, and the losses stay within ~1e-6
# (measured). 1e-5 leaves a margin of 10x; real mistakes sit far above it: a bias added on every
# TP rank instead of one, a missing all-reduce of sequence-parallel norm gradients, or a DP shard
# updated twice each move the loss by >1e-3 within a few steps.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
# bf16: activations and weights are rounded to 8 bits of mantissa (u = 2^-9 = 2e-3), and the
# layouts round at different points (a row-parallel all-reduce sums bf16 partial products), so
# the curves may separate by a few units of bf16 rounding of the loss: 2e-2 relative over 20
# steps (measured: < 5e-3).
BF16_RTOL = 2e-2

STEPS = 20
MODELS = {
    "gpt2": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 64, "num_heads": 8,
             "ffn_hidden_size": 128},
    "llama": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 64, "num_heads": 8,
              "num_kv_heads": 4, "ffn_hidden_size": 96, "norm": "rmsnorm", "activation": "swiglu",
              "position": "rope", "tie_embeddings": False, "bias": False},
}
# (dp, tp, sequence_parallel, parallel.zero_stage)
LAYOUTS = [
    (1, 2, False, 0), (1, 4, False, 0), (1, 2, True, 0), (1, 4, True, 0),
    (2, 1, False, 0), (4, 1, False, 0), (2, 1, False, 1), (4, 1, False, 1),
    (2, 2, False, 0), (2, 2, True, 1), (4, 2, False, 1), (2, 4, True, 1),
    (2, 1, False, 2), (4, 1, False, 2), (2, 2, True, 2),
    (2, 1, False, 3), (4, 1, False, 3), (2, 2, True, 3),
]
QUICK_LAYOUTS = [(1, 2, True, 0), (2, 1, False, 1), (2, 2, True, 1), (2, 2, True, 2), (2, 2, True, 3)]
BF16_LAYOUTS = [(1, 2, True, 0), (2, 1, False, 1), (2, 2, True, 1), (2, 2, True, 2), (2, 2, True, 3)]


def layout_name(layout):
    dp, tp, sp, zero = layout
    return f"dp{dp}_tp{tp}{'_sp' if sp else ''}{f'_zero{zero}' if zero else ''}"

checks = Checks()
check = checks.check


def config(model, precision):
    return {
        "model": MODELS[model],
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 1,
                     "peak_gflops": 100, "precision": precision, "seed": 7},
        "optimizer": {"lr": 1e-2, "warmup_steps": 3, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": {"bucket_size": 3000},
        "data": {"synthetic": True},
        "logging": {"level": "warn"},
    }


def run(args, name, cfg, layout):
    dp, tp, sp, zero = layout
    out = os.path.join(args.workdir, name)
    cfg = json.loads(json.dumps(cfg))
    cfg["parallel"].update({"dp": dp, "tp": tp, "sequence_parallel": sp, "zero_stage": zero})
    cfg["logging"]["dir"] = out
    path = harness.write_config(out, cfg)
    r = harness.run_tetra(args, ["--config", path, "--dump-dir", os.path.join(out, "dump")], dp * tp)
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    start = [j for _, j in harness.metrics_lines(out) if j.get("event") == "start"][-1]
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0]
    return harness.step_records(out), grads, start


def compare(name, ref, got, layout, rtol, grads=True):
    ref_steps, ref_grads, ref_start = ref
    steps, g, start = got
    # Memory: each rank holds 1/tp of the parameters, and with the distributed optimizer 1/dp of
    # the optimizer state, plus padding: every tensor slice is padded to 16 elements and every
    # group to 16 dp, which on these tiny models (norms of 64 elements split 4 ways) adds up to
    # 8% at tp 4, 0.1% on GPT-2 124M. In bf16 the sharded optimizer also holds the fp32 master
    # weights' shard (3 fp32 values per owned parameter instead of Adam's 2).
    expect = ref_start["optimizer_state_bytes"] / layout[1] / (layout[0] if layout[3] >= 1 else 1)
    if layout[3] and layout[0] > 1 and ("bf16" in name or layout[3] == 3):  # ZeRO-3 shards fp32 master weights too
        expect *= 1.5
    got_bytes = start["optimizer_state_bytes"]
    check(expect <= got_bytes <= 1.10 * expect,
          f"{name}: optimizer state {got_bytes} bytes per rank, expected ~{expect:.0f}")
    harness.check_loss_curve(checks, name, steps, ref_steps, STEPS, rtol, norm_rtol=10 * rtol)
    if grads:
        check(sorted(g) == sorted(ref_grads), f"{name}: the same {len(ref_grads)} gradient tensors")
        harness.check_gradients(checks, name, ref_grads, g, rtol)
    dp, tp = layout[0], layout[1]
    bad, seen = harness.comm_mismatches(steps)
    expected = {g for g, n in (("tp", tp), ("dp", dp)) if n > 1}
    check(not bad and seen == expected, f"{name}: measured communication equals the prediction in every "
                                        f"step (groups {sorted(seen)})")


def main():
    args = harness.parse_args(flags=("--quick",))
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    for model in MODELS:
        ref = run(args, f"{model}_single", config(model, "fp32"), (1, 1, False, 0))
        if ref is None:
            continue
        harness.check_loss_falls(checks, f"{model} single-rank", [s["loss"] for s in ref[0]])
        for layout in layouts:
            name = f"{model}_{layout_name(layout)}"
            got = run(args, name, config(model, "fp32"), layout)
            if got is not None:
                compare(name, ref, got, layout, LOSS_RTOL)
        ref16 = run(args, f"{model}_single_bf16", config(model, "bf16"), (1, 1, False, 0))
        if ref16 is None:
            continue
        gap = harness.worst_step_rel(ref16[0], ref[0])
        check(gap > 0, f"{model}: the bf16 run differs from fp32 (max {gap:.2e}): it really is bf16")
        for layout in BF16_LAYOUTS:
            name = f"{model}_bf16_{layout_name(layout)}"
            got = run(args, name, config(model, "bf16"), layout)
            if got is not None:
                compare(name, ref16, got, layout, BF16_RTOL, grads=False)
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
