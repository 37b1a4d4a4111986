"""Context parallelism is invisible: every cp layout reproduces the single-rank run.

For a Llama-style (GQA, RoPE, SwiGLU, untied), a GPT-2-style (learned positions, MHA, tied) and a
MoE (4 experts, top-2, dropless, load-balancing and z-losses) tiny config (and the MoE with a
capacity factor that drops assignments: cp 2, cp 4, cp 2 x dp 2 x ep 2, cp 2 x tp 2 + SP drop the
same ones as one rank), Tetra trains 20 steps single-rank, then under
`mpirun` with parallel.cp on: cp 2 and cp 4 (p2p ring and all_gather), cp 2 x tp 2 with sequence
parallelism, cp 2 x pp 2, cp 2 x dp 2 with the distributed optimizer and with ZeRO-3, full and
selective recomputation, and MoE cp 2 x dp 2 x ep 2. Per layout:
  - the loss and gradient norm of every step match the single-rank run (LOSS_RTOL);
  - every parameter's step-0 gradient (the global tensor) matches (GRAD_RTOL, per tensor);
  - each group's measured communication equals the prediction exactly in every step, and the cp
    group did communicate;
  - in bf16, cp 2 against the single-rank bf16 run (BF16_RTOL).
Checkpoints reshard across cp: a cp 2 run's step-10 checkpoint resumed on cp 1, and the
single-rank run's on cp 2 x dp 2, continue the reference curve. Guard against a vacuous pass:
the single-rank loss falls, and the cp group communicates in every cp layout
(test_kernels_attention_block checks the blocks and the ring's plan themselves).

Usage: /usr/bin/python3 test_context_parallel.py --tetra BIN --workdir DIR
"""
import json
import os
import sys

import harness
from harness import Checks, read_safetensors

# The same orders of magnitude as test_layouts.py: a layout reorders fp32 sums (here also the
# log-sum-exp merge of attention blocks), a few roundings per op; measured worst ~2e-7.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
BF16_RTOL = 2e-2
STEPS = 20

BASE = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 32, "num_layers": 2, "hidden_size": 64,
        "num_heads": 8}
MODELS = {
    "llama": dict(BASE, num_kv_heads=4, ffn_hidden_size=96, norm="rmsnorm", activation="swiglu", position="rope",
                  tie_embeddings=False, bias=False),
    "gpt2": dict(BASE, ffn_hidden_size=128),
    "moe": dict(BASE, num_kv_heads=2, ffn_hidden_size=96, norm="rmsnorm", activation="swiglu", position="rope",
                tie_embeddings=False, bias=False,
                moe={"num_experts": 4, "top_k": 2, "every": 1, "ffn_hidden_size": 48, "capacity_factor": None,
                     "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}),
}
# A capacity factor that drops assignments: the capacity is the whole sequence's and the
# assignments each expert keeps are its first in the sequence's order, over the CP ranks' chunks.
MODELS["moe_capacity"] = dict(MODELS["moe"], moe=dict(MODELS["moe"]["moe"], capacity_factor=1.0))
# DeepSeek-V3's router: sigmoid scores and an expert bias moved after every step from the tokens of
# every CP (and DP) rank: the same biases, so the same routing, as the whole sequence on one rank.
MODELS["moe_bias"] = dict(MODELS["moe"], moe=dict(MODELS["moe"]["moe"], z_loss_coeff=0.0, router_score_function="sigmoid",
                                                router_enable_expert_bias=True, router_bias_update_rate=0.001))
# (name, parallel overrides, training overrides)
LAYOUTS = {
    "llama": [
        ("cp2", {"cp": 2}, {}),
        ("cp4", {"cp": 4}, {}),
        ("cp2_allgather", {"cp": 2, "cp_comm": "all_gather"}, {}),
        ("cp4_allgather", {"cp": 4, "cp_comm": "all_gather"}, {}),
        ("cp2_tp2_sp", {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
        ("cp2_pp2", {"cp": 2, "pp": 2}, {}),
        ("cp2_dp2_zero1", {"cp": 2, "dp": 2, "zero_stage": 1}, {}),
        ("cp2_dp2_zero3", {"cp": 2, "dp": 2, "zero_stage": 3}, {}),
        ("cp2_full_recompute", {"cp": 2}, {"recompute": "full"}),
        ("cp2_selective_recompute", {"cp": 2}, {"recompute": "selective"}),
        ("cp2_allgather_full_recompute", {"cp": 2, "cp_comm": "all_gather"}, {"recompute": "full"}),
    ],
    "gpt2": [
        ("cp2", {"cp": 2}, {}),
        ("cp4_allgather", {"cp": 4, "cp_comm": "all_gather"}, {}),
        ("cp2_tp2_sp", {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    ],
    "moe": [
        ("cp2", {"cp": 2}, {}),
        ("cp2_dp2_ep2", {"cp": 2, "dp": 2, "ep": 2}, {}),
        ("cp2_dp2_ep2_zero1", {"cp": 2, "dp": 2, "ep": 2, "zero_stage": 1}, {}),
    ],
    "moe_bias": [
        ("cp2", {"cp": 2}, {}),
        ("cp4_allgather", {"cp": 4, "cp_comm": "all_gather"}, {}),
        ("cp2_dp2_ep2", {"cp": 2, "dp": 2, "ep": 2}, {}),
    ],
    "moe_capacity": [
        ("cp2", {"cp": 2}, {}),
        ("cp4_allgather", {"cp": 4, "cp_comm": "all_gather"}, {}),
        ("cp2_dp2_ep2", {"cp": 2, "dp": 2, "ep": 2}, {}),
        ("cp2_tp2_sp", {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    ],
}

checks = Checks()
check = checks.check


def config(model, precision="fp32"):
    return {
        "model": MODELS[model],
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 1,
                     "peak_gflops": 100, "precision": precision, "seed": 7},
        "optimizer": {"lr": 1e-2, "warmup_steps": 3, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": {"bucket_size": 3000},
        "data": {"synthetic": True},
        "logging": {"level": "warn"},
    }


def world_of(par):
    return par.get("cp", 1) * par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)


def run(args, name, cfg, par=None, train=None, dump=True, extra=()):
    out = os.path.join(args.workdir, name)
    cfg = json.loads(json.dumps(cfg))
    cfg["parallel"].update(par or {})
    cfg["training"].update(train or {})
    cfg["logging"]["dir"] = out
    path = harness.write_config(out, cfg)
    tetra_args = ["--config", path] + (["--dump-dir", os.path.join(out, "dump")] if dump else []) + list(extra)
    r = harness.run_tetra(args, tetra_args, world_of(cfg["parallel"]))
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0] if dump else None
    return harness.step_records(out), grads


def compare(name, ref, got, par, rtol, grads=True):
    ref_steps, ref_grads = ref
    steps, g = got
    harness.check_loss_curve(checks, name, steps, ref_steps, STEPS, rtol, norm_rtol=10 * rtol)
    if grads:
        check(sorted(g) == sorted(ref_grads), f"{name}: the same {len(ref_grads)} gradient tensors")
        harness.check_gradients(checks, name, ref_grads, g, rtol)
    bad, seen = harness.comm_mismatches(steps, exact="ep" not in par)
    check(not bad and "cp" in seen, f"{name}: measured communication equals the prediction in every step "
                                     f"(groups {sorted(seen)}, cp among them)")


def check_resharding(args):
    """Checkpoints move across cp: cp 2 -> cp 1 and cp 1 -> cp 2 x dp 2, from step 10 on."""
    cfg = config("llama")
    cfg["checkpoint"] = {"every": 10}
    saved = {}
    for name, par in (("ckpt_single", {}), ("ckpt_cp2", {"cp": 2})):
        c = json.loads(json.dumps(cfg))
        c["checkpoint"]["dir"] = os.path.join(args.workdir, name + "_ckpt")
        got = run(args, name, c, par, dump=False)
        if got is None:
            return
        saved[name] = (got[0], os.path.join(c["checkpoint"]["dir"], "step_00000010"))
    ref_steps = saved["ckpt_single"][0]
    for name, src, par in (("resume_cp2_on_cp1", "ckpt_cp2", {}),
                           ("resume_cp1_on_cp2_dp2", "ckpt_single", {"cp": 2, "dp": 2, "zero_stage": 1})):
        c = json.loads(json.dumps(config("llama")))
        c["checkpoint"] = {"resume": saved[src][1]}
        got = run(args, name, c, par, dump=False)
        if got is None:
            continue
        steps = got[0]
        tail = [s for s in steps if s["step"] > 10]
        check(len(tail) == STEPS - 10 and steps[0]["step"] == 11, f"{name}: resumed at step 11 ({len(steps)} steps)")
        worst = harness.worst_step_rel(tail, ref_steps[10:])
        check(worst <= LOSS_RTOL, f"{name}: steps 11..{STEPS} continue the single-rank curve within {LOSS_RTOL:g} "
                                  f"(worst {worst:.2e})")


def main():
    args = harness.parse_args()
    for model, layouts in LAYOUTS.items():
        ref = run(args, f"{model}_single", config(model))
        if ref is None:
            continue
        harness.check_loss_falls(checks, f"{model} single-rank", [s["loss"] for s in ref[0]])
        if model == "moe_capacity":
            dropped = sum(l["dropped"] for s in ref[0] for l in s["moe"]["layers"])
            check(dropped > 0, f"capacity factor 1.0: the single-rank run drops assignments ({dropped} in {STEPS} steps)")
        for name, par, train in layouts:
            got = run(args, f"{model}_{name}", config(model), par, train)
            if got is not None:
                compare(f"{model}_{name}", ref, got, par, LOSS_RTOL)
    ref16 = run(args, "llama_single_bf16", config("llama", "bf16"), dump=False)
    got16 = run(args, "llama_bf16_cp2", config("llama", "bf16"), {"cp": 2}, dump=False)
    if ref16 and got16:
        compare("llama_bf16_cp2", ref16, got16, {"cp": 2}, BF16_RTOL, grads=False)
    check_resharding(args)
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
