"""Mixture of Experts under expert parallelism reproduces the single-rank run.

Two tiny MoE configs (GPT-2 style, top-2 over 4 experts in every block; Llama style, SwiGLU,
top-1 over 4 experts in every other block, no biases), dropless, train 20 steps single-rank, then
under `mpirun` with dp = 4 and ep in {1, 2, 4} (expert parallelism carved out of data
parallelism; also with the distributed optimizer), with the experts split over tp = 2 (with
and without sequence parallelism, combined with ep = 2), and one run with a capacity factor (drops are decided on each rank's own tokens,
so they do not depend on ep either). Checks, per layout:
  - the loss of every step matches the single-rank run (LOSS_RTOL, test_layouts.py's tolerance and
    argument: the layouts only reorder fp32 sums), and so do the gradient norms;
  - every parameter's step-0 gradient, the experts gathered from their EP ranks into the global
    (E, ., .) tensors, matches the single-rank gradient (GRAD_RTOL, per tensor);
  - the groups that must communicate did (tp, dp, edp when dp / ep > 1, ep when ep > 1) and each
    group's measured volume equals the prediction (the routed tokens' all-to-all payload is
    data-dependent: its calls are predicted, its bytes measured);
  - the routing statistics are logged (tokens per expert, dropped, aux and z losses).
Pipelines too: pp = 2 with ep = 2 (gpipe and 1f1b, with dp 2 or 4, and with tp 2), where several
micro-batches are in flight on a stage, each with its own routing state.
bf16: two layouts against the single-rank bf16 run (BF16_RTOL).
Checkpoints: a run saved at ep = 2 resumes at ep = 1, at ep = 4 and on a single rank, and the
resumed steps' losses match the uninterrupted ep = 2 run's (experts are stored as global tensors).
Shared experts: DeepSeek's plain one and Qwen2-MoE's gated one go through the same layouts; saved
at ep = 2, they are verified by `tetra ckpt inspect` and resume at tp = 2 (with and without
sequence parallelism, with biases too) and on one rank.
SwiGLU experts with biases: tp 2 (with and without sequence parallelism) and tp 2 x ep 2 against
one rank, and a checkpoint saved at tp 2 x ep 2 resumed on one rank.
Guard against a vacuous pass: the single-rank loss falls, the capacity run really drops tokens.

Usage: /usr/bin/python3 test_moe.py --tetra BIN --workdir DIR
"""
import json
import os
import sys

import harness
from harness import Checks, read_safetensors, rel

# See test_layouts.py: reordered fp32 sums move the loss by ~1e-7 over 20 steps; real mistakes
# (an expert's gradient reduced over the wrong group, a token combined with the wrong gate or
# sent to the wrong rank) move it by > 1e-3 within a few steps.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
# bf16 (test_layouts.py's argument): layouts round at different points, so the curves may
# separate by a few units of bf16 rounding of the loss over 20 steps.
BF16_RTOL = 2e-2
BF16_LAYOUTS = [(4, 1, 2, False, False), (2, 2, 2, True, False)]

STEPS = 20
MODELS = {
    "gpt2_moe": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                 "ffn_hidden_size": 64,
                 "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "aux_loss_coeff": 0.01,
                         "z_loss_coeff": 0.001}},
    "llama_moe": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                  "num_kv_heads": 2, "ffn_hidden_size": 48, "norm": "rmsnorm", "activation": "swiglu",
                  "position": "rope", "tie_embeddings": False, "bias": False,
                  "moe": {"num_experts": 4, "top_k": 1, "every": 2, "ffn_hidden_size": 24,
                          "aux_loss_coeff": 0.01}},
    # Today's routers: Mixtral's gates renormalised over the top-2; DeepSeek-style scaled
    # renormalised gates over the top-3 with the first block dense.
    "mixtral_moe": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2,
                    "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48, "norm": "rmsnorm",
                    "activation": "swiglu", "position": "rope", "tie_embeddings": False, "bias": False,
                    "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.01,
                            "router_pre_softmax": False}},
    "deepseek_moe": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 4,
                     "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48, "norm": "rmsnorm",
                     "activation": "swiglu", "position": "rope", "tie_embeddings": False, "bias": False,
                     "moe": {"num_experts": 8, "top_k": 3, "ffn_hidden_size": 16, "aux_loss_coeff": 0.001,
                             "router_score_function": "sigmoid", "router_enable_expert_bias": True,
                             "router_bias_update_rate": 0.002, "router_topk_scaling_factor": 2.5,
                             "first_k_dense_replace": 1, "shared_expert_ffn_hidden_size": 32}},
    # Shared experts: Qwen2-MoE's, gated per token by sigmoid(h . w) (DeepSeek's above, plain).
    "qwen2_moe": {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2,
                  "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48, "norm": "rmsnorm",
                  "activation": "swiglu", "position": "rope", "tie_embeddings": False, "bias": False,
                  "qkv_bias": True,
                  "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16, "aux_loss_coeff": 0.01,
                          "shared_expert_ffn_hidden_size": 40, "shared_expert_gate": True}},
}
# (dp, tp, ep, sequence_parallel, distributed_optimizer). With tp > 1 the experts are split over
# TP like the dense MLP; the distributed optimizer shards the experts over expert-DP and the rest
# over DP. distributed_optimizer 2 is ZeRO-2 (parallel.zero_stage 2): the gradients sharded the
# same way, reduce-scattered per micro-batch (at ep 4 expert-DP is 1: the experts' gradient is the
# rank's own, never reduced); 3 is ZeRO-3, the expert weights gathered over expert-DP per block.
LAYOUTS = {
    "gpt2_moe": [(4, 1, 1, False, False), (4, 1, 2, False, False), (4, 1, 4, False, False),
                 (4, 1, 1, False, True), (4, 1, 2, False, True), (4, 1, 4, False, True),
                 (1, 2, 1, False, False), (1, 2, 1, True, False), (2, 2, 2, False, False),
                 (2, 2, 2, True, True), (4, 1, 2, False, 2), (4, 1, 4, False, 2), (4, 1, 2, False, 3),
                 (4, 1, 4, False, 3)],
    "llama_moe": [(4, 1, 1, False, False), (4, 1, 2, False, False), (4, 1, 4, False, False),
                  (2, 2, 2, True, False), (4, 1, 2, False, 2), (4, 1, 2, False, 3)],
    "mixtral_moe": [(4, 1, 2, False, False), (4, 1, 4, False, True), (2, 2, 2, True, False), (4, 1, 2, False, 2),
                    (4, 1, 4, False, 3)],
    "deepseek_moe": [(4, 1, 2, False, False), (4, 1, 4, False, True), (2, 2, 2, True, False), (4, 1, 2, False, 2),
                     (4, 1, 4, False, 3)],
    "qwen2_moe": [(4, 1, 2, False, False), (4, 1, 4, False, True), (2, 2, 2, True, False), (4, 1, 2, False, 2),
                  (4, 1, 4, False, 3)],
}


# Pipelines: (dp, tp, ep, pp, schedule). Several micro-batches in flight per stage (gpipe keeps all
# of them): each keeps its own routing state between its forward and backward.
PP_LAYOUTS = [(2, 1, 2, 2, "gpipe"), (2, 1, 2, 2, "1f1b"), (4, 1, 2, 2, "1f1b"), (2, 2, 2, 2, "1f1b")]


def layout_name(dp, tp, ep, sp, dist_opt):
    zero = {False: "", True: "_distopt"}.get(dist_opt, f"_zero{int(dist_opt)}")
    return f"dp{dp}_tp{tp}_ep{ep}{'_sp' if sp else ''}{zero}"


checks = Checks()
check = checks.check


def config(model, capacity=None, precision="fp32"):
    m = json.loads(json.dumps(MODELS[model]))
    if capacity is not None:
        m["moe"]["capacity_factor"] = capacity
    return {
        "model": m,
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 1,
                     "peak_gflops": 100, "seed": 7, "precision": precision},
        "optimizer": {"lr": 1e-2, "warmup_steps": 3, "grad_clip": 1.0, "weight_decay": 0.1},
        "parallel": {"bucket_size": 2000},
        "data": {"synthetic": True},
        "logging": {"level": "warn"},
    }


def run(args, name, cfg, dp, ep, checkpoint=None, dump=True, dist_opt=False, tp=1, sp=False, pp=1, schedule="1f1b",
        env=None):
    out = os.path.join(args.workdir, name)
    cfg = json.loads(json.dumps(cfg))
    cfg["parallel"].update({"dp": dp, "ep": ep, "tp": tp, "sequence_parallel": sp,
                            "distributed_optimizer": bool(dist_opt), "zero_stage": int(dist_opt),
                            "pp": pp, "schedule": schedule})
    cfg["logging"]["dir"] = out
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    path = harness.write_config(out, cfg)
    r = harness.run_tetra(args, ["--config", path] + (["--dump-dir", os.path.join(out, "dump")] if dump else []),
                          dp * tp * pp, env=env)
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    steps = harness.step_records(out)
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0] if dump else None
    return steps, grads


def compare(name, ref, got, dp, ep, tp=1, pp=1, rtol=LOSS_RTOL):
    ref_steps, ref_grads = ref
    steps, g = got
    harness.check_loss_curve(checks, name, steps, ref_steps, STEPS, rtol, norm_rtol=10 * rtol)
    check(sorted(g) == sorted(ref_grads), f"{name}: the same {len(ref_grads)} gradient tensors")
    # Step-0 gradients per tensor: when the layout only reorders fp32 sums (not with a bf16
    # reduction, whose rounding the loss tolerance above covers).
    if rtol == LOSS_RTOL:
        harness.check_gradients(checks, name, ref_grads, g, GRAD_RTOL)
    # The routed tokens' all-to-all payload is data-dependent: the record's verdict matches it on
    # its calls only.
    bad, seen = harness.comm_mismatches(steps, exact=False)
    expected = {grp for grp, n in (("tp", tp), ("dp", dp), ("edp", dp // ep), ("ep", ep), ("pp", pp), ("embedding", pp))
                if n > 1}
    check(not bad and seen == expected, f"{name}: communication as predicted in every step (groups {sorted(seen)}, "
                                        f"expected {sorted(expected)})")
    if ep > 1:
        moved = sum(s["moe"]["dispatch_bytes"] + s["moe"]["combine_bytes"] for s in steps)
        check(moved > 0, f"{name}: tokens crossed EP ranks ({moved} bytes over {STEPS} steps)")


def main():
    args = harness.parse_args()
    for model in MODELS:
        ref = run(args, f"{model}_single", config(model), 1, 1)
        if ref is None:
            continue
        harness.check_loss_falls(checks, f"{model} single-rank", [s["loss"] for s in ref[0]])
        layers = ref[0][0].get("moe", {}).get("layers", [])
        moe = MODELS[model]["moe"]
        blocks = [b for b in range(MODELS[model]["num_layers"])
                  if b % moe.get("every", 1) == 0 and b >= moe.get("first_k_dense_replace", 0)]
        check([l["layer"] for l in layers] == blocks and all(l["aux_loss"] > 0 and l["tokens_per_expert"]["max"] > 0
                                                             for l in layers),
              f"{model}: routing statistics of MoE blocks {blocks} logged ({layers})")
        for dp, tp, ep, sp, dist_opt in LAYOUTS[model]:
            name = f"{model}_{layout_name(dp, tp, ep, sp, dist_opt)}"
            got = run(args, name, config(model), dp, ep, dist_opt=dist_opt, tp=tp, sp=sp)
            if got is not None:
                compare(name, ref, got, dp, ep, tp)
        for dp, tp, ep, pp, schedule in PP_LAYOUTS:
            name = f"{model}_{layout_name(dp, tp, ep, False, False)}_pp{pp}_{schedule}"
            got = run(args, name, config(model), dp, ep, tp=tp, pp=pp, schedule=schedule)
            if got is not None:
                compare(name, ref, got, dp, ep, tp, pp)
    # Dense gradients reduced in bf16 (parallel.grad_compression "bf16"; the experts' stay fp32):
    # within test_compression.py's tolerance for it, communication as predicted.
    cfg = config("gpt2_moe")
    cfg["parallel"]["grad_compression"] = "bf16"
    ref = run(args, "gpt2_moe_single_again", config("gpt2_moe"), 1, 1)
    got = run(args, "gpt2_moe_dp4_ep2_bf16grads", cfg, 4, 2)
    if ref and got:
        compare("gpt2_moe_dp4_ep2_bf16grads", ref, got, 4, 2, rtol=5e-3)

    # bf16: the all-to-alls carry bf16 rows, the router stays fp32.
    ref16 = run(args, "bf16_single", config("gpt2_moe", precision="bf16"), 1, 1, dump=False)
    ref32 = run(args, "fp32_single", config("gpt2_moe"), 1, 1, dump=False)
    if ref16 and ref32:
        gap = harness.worst_step_rel(ref16[0], ref32[0])
        check(gap > 0, f"bf16: the bf16 run differs from fp32 (max {gap:.2e}): it really is bf16")
        for dp, tp, ep, sp, dist_opt in BF16_LAYOUTS:
            name = f"bf16_{layout_name(dp, tp, ep, sp, dist_opt)}"
            got = run(args, name, config("gpt2_moe", precision="bf16"), dp, ep, dump=False, dist_opt=dist_opt,
                      tp=tp, sp=sp)
            if got:
                worst = harness.worst_step_rel(got[0], ref16[0])
                check(len(got[0]) == STEPS and worst <= BF16_RTOL,
                      f"{name}: losses of {STEPS} steps within {BF16_RTOL:g} of the single-rank bf16 run "
                      f"(worst {worst:.2e})")

    # A capacity factor: drops are per rank and micro-batch, the same under any ep.
    ref = run(args, "capacity_single", config("gpt2_moe", 1.0), 1, 1)
    got = run(args, "capacity_dp4_ep2", config("gpt2_moe", 1.0), 4, 2)
    if ref and got:
        dropped = sum(l["dropped"] for s in ref[0] for l in s["moe"]["layers"])
        check(dropped > 0, f"capacity factor 1.0: the single-rank run drops tokens ({dropped} over {STEPS} steps)")
        compare("capacity_dp4_ep2", ref, got, 4, 2)

    # DeepSeek-style auxiliary-loss-free balancing: the expert biases (moved after every step from
    # the tokens of every DP and CP rank) are state the checkpoint keeps: saved at dp 4 x ep 2 after
    # 10 steps, resumed at tp 2 x ep 2 + SP and on one rank, the remaining steps match the
    # uninterrupted run; the manifest holds a bias per MoE block, and they have moved.
    ck = os.path.join(args.workdir, "ckpt_bias")
    base = run(args, "bias_save_dp4_ep2", config("deepseek_moe"), 4, 2, checkpoint={"dir": ck, "every": 10}, dump=False)
    step10 = os.path.join(ck, "step_00000010")
    if base and os.path.isdir(step10):
        with open(os.path.join(step10, "manifest.json")) as f:
            biases = json.load(f).get("moe_expert_bias", {})
        moved = sum(abs(v) for b in biases.values() for v in b)
        check(sorted(biases) == ["1", "2", "3"] and all(len(b) == 8 for b in biases.values()) and moved > 0,
              f"the checkpoint holds the expert bias of MoE blocks 1..3 (blocks {sorted(biases)}, sum |bias| {moved:.3f})")
        ref_losses = {s["step"]: s["loss"] for s in base[0]}
        for dp, tp, ep, sp in [(2, 2, 2, True), (1, 1, 1, False)]:
            name = f"bias_resume_{layout_name(dp, tp, ep, sp, False)}"
            got = run(args, name, config("deepseek_moe"), dp, ep, checkpoint={"resume": step10}, dump=False, tp=tp, sp=sp)
            if got is None:
                continue
            resumed = {s["step"]: s["loss"] for s in got[0]}
            worst = max((rel(resumed[s], ref_losses[s]) for s in resumed), default=1.0)
            check(sorted(resumed) == list(range(11, STEPS + 1)) and worst <= LOSS_RTOL,
                  f"{name}: steps 11..{STEPS} match the uninterrupted run within {LOSS_RTOL:g} (worst {worst:.2e})")
    else:
        check(False, "the expert-bias run saved step_00000010")

    # Rows over the bound: with model.moe.max_load_factor 1 and the router forced to favour expert 0
    # (skew) or to send every token to experts 0..top_k-1 (one: every row to EP rank 0), the blocks
    # whose rows exceed what a slot keeps run in passes and recompute their experts' hidden rows in
    # backward. The curve and step-0 gradients still match the single-rank run (whose rows never
    # exceed: a rank's experts see its own tokens), and the events are counted and warned of.
    for route in ("skew", "one"):
        env = {"TETRA_TEST_MOE_ROUTE": route}
        for model in ("gpt2_moe", "llama_moe"):
            cfg = config(model)
            cfg["model"]["moe"]["max_load_factor"] = 1.0
            ref = run(args, f"bound_{route}_{model}_single", cfg, 1, 1, env=env)
            for dp, tp, ep, pp in [(4, 1, 2, 1), (4, 1, 4, 1), (2, 1, 2, 2), (2, 2, 2, 1)]:
                name = f"bound_{route}_{model}_dp{dp}_tp{tp}_ep{ep}_pp{pp}"
                got = run(args, name, cfg, dp, ep, tp=tp, pp=pp, env=env)
                if ref is None or got is None:
                    continue
                compare(name, ref, got, dp, ep, tp, pp)
                over = sum(s["moe"]["over_bound"] for s in got[0])
                check(over > 0, f"{name}: blocks over the row bound counted in metrics.jsonl ({over})")
                log = open(os.path.join(args.workdir, name, "train.log")).read()
                check("received more rows than the" in log, f"{name}: the log warns of the blocks over the bound")
            if ref:
                over = sum(s["moe"]["over_bound"] for s in ref[0])
                check(over == 0, f"bound_{route}_{model}_single: one rank's experts never exceed their rows ({over})")

    # Checkpoints: saved at ep = 2 (step 10), resumed at ep = 1, ep = 4 (with the distributed
    # optimizer: its moments resharded too), at tp = 2 x ep = 2 and on one rank.
    ck = os.path.join(args.workdir, "ckpt_ep2")
    base = run(args, "ckpt_save_ep2", config("gpt2_moe"), 4, 2, checkpoint={"dir": ck, "every": 10}, dump=False)
    step10 = os.path.join(ck, "step_00000010")
    check(os.path.isdir(step10), "ep=2 run saved step_00000010")
    if os.path.isdir(step10):
        verified, err = harness.inspect_checkpoint(args, step10)
        check(verified, f"tetra ckpt inspect verifies the ep=2 checkpoint's 3-D expert tensors ({err[-200:]})")
    if base and os.path.isdir(step10):
        ref_losses = {s["step"]: s["loss"] for s in base[0]}
        for dp, tp, ep, dist_opt in [(4, 1, 1, False), (4, 1, 4, False), (4, 1, 4, True), (2, 2, 2, False),
                                     (1, 1, 1, False)]:
            name = f"ckpt_resume_{layout_name(dp, tp, ep, False, dist_opt)}"
            got = run(args, name, config("gpt2_moe"), dp, ep, checkpoint={"resume": step10}, dump=False,
                      dist_opt=dist_opt, tp=tp)
            if got is None:
                continue
            resumed = {s["step"]: s["loss"] for s in got[0]}
            check(sorted(resumed) == list(range(11, STEPS + 1)), f"{name}: continues at step 11 ({sorted(resumed)})")
            worst = max((rel(resumed[s], ref_losses[s]) for s in resumed), default=1.0)
            check(worst <= LOSS_RTOL, f"{name}: steps 11..{STEPS} match the uninterrupted ep=2 run within "
                                      f"{LOSS_RTOL:g} (worst {worst:.2e})")
    shared_expert_checkpoints(args)
    swiglu_biased_experts(args)
    return checks.report()


def swiglu_biased_experts(args):
    """SwiGLU experts with biases under tensor parallelism: each expert's fc bias is [gate | up], and
    a TP rank holds its slice of both halves (two column ranges of the global (E, 2F) tensor), as its
    fc weight rows. The GPT-2 style model with swiglu reproduces the single-rank curve and step-0
    gradients on tp 2 (with and without sequence parallelism) and tp 2 x ep 2, and a checkpoint
    saved at tp 2 x ep 2 resumes on one rank."""
    cfg = config("gpt2_moe")
    cfg["model"]["activation"] = "swiglu"
    ref = run(args, "swiglu_bias_single", cfg, 1, 1)
    if ref is None:
        return
    bias = ref[1].get("layers.0.mlp.experts.fc.bias")
    check(bias is not None and bias.shape == (4, 64) and (bias[:, :32] != 0).any() and (bias[:, 32:] != 0).any(),
          "swiglu_bias: the experts' fc bias (E, [gate | up]) has a gradient in both halves")
    for dp, tp, ep, sp in [(1, 2, 1, False), (1, 2, 1, True), (2, 2, 2, False), (2, 2, 2, True)]:
        name = f"swiglu_bias_{layout_name(dp, tp, ep, sp, False)}"
        got = run(args, name, cfg, dp, ep, tp=tp, sp=sp)
        if got is not None:
            compare(name, ref, got, dp, ep, tp)
    ck = os.path.join(args.workdir, "ckpt_swiglu_bias")
    base = run(args, "swiglu_bias_save_dp2_tp2_ep2", cfg, 2, 2, tp=2, checkpoint={"dir": ck, "every": 10}, dump=False)
    step10 = os.path.join(ck, "step_00000010")
    if not (base and os.path.isdir(step10)):
        check(False, "swiglu_bias: the tp 2 x ep 2 run saved step_00000010")
        return
    ref_losses = {s["step"]: s["loss"] for s in base[0]}
    got = run(args, "swiglu_bias_resume_single", cfg, 1, 1, checkpoint={"resume": step10}, dump=False)
    if got is not None:
        resumed = {s["step"]: s["loss"] for s in got[0]}
        worst = max((rel(resumed[s], ref_losses[s]) for s in resumed), default=1.0)
        check(sorted(resumed) == list(range(11, STEPS + 1)) and worst <= LOSS_RTOL,
              f"swiglu_bias_resume_single: steps 11..{STEPS} match the tp 2 x ep 2 run (worst {worst:.2e})")


def shared_expert_checkpoints(args):
    """Shared experts in checkpoints: saved at dp 4 x ep 2 (step 10), `tetra ckpt inspect` verifies
    them, and the run resumes at tp 2 (their fc rows and proj columns resharded; with biases on the
    GPT-2 style model, the proj bias added on TP rank 0 only) and on one rank, matching the
    uninterrupted run's steps 11..20."""
    for model, shared in (("qwen2_moe", None), ("gpt2_moe", {"shared_expert_ffn_hidden_size": 32,
                                                            "shared_expert_gate": True})):
        cfg = config(model)
        if shared:
            cfg["model"]["moe"].update(shared)
        tag = f"shared_{model}"
        ck = os.path.join(args.workdir, f"ckpt_{tag}")
        base = run(args, f"ckpt_save_{tag}", cfg, 4, 2, checkpoint={"dir": ck, "every": 10}, dump=False)
        step10 = os.path.join(ck, "step_00000010")
        check(os.path.isdir(step10), f"{tag}: the dp4 ep2 run saved step_00000010")
        if not (base and os.path.isdir(step10)):
            continue
        verified, err = harness.inspect_checkpoint(args, step10)
        check(verified, f"{tag}: tetra ckpt inspect verifies the checkpoint with shared experts ({err[-200:]})")
        with open(os.path.join(step10, "manifest.json")) as f:
            keys = json.load(f)["tensors"]
        names = [k for k in keys if k.startswith("model/") and "shared_expert" in k]
        check(sorted(names) == sorted(f"model/layers.{l}.mlp.{t}" for l in range(MODELS[model]["num_layers"])
                                      for t in ["shared_expert.fc.weight", "shared_expert.proj.weight",
                                                "shared_expert_gate.weight"] +
                                      (["shared_expert.fc.bias", "shared_expert.proj.bias"]
                                       if MODELS[model].get("bias", True) else [])),
              f"{tag}: the checkpoint holds the shared experts' tensors ({sorted(names)})")
        ref_losses = {s["step"]: s["loss"] for s in base[0]}
        for dp, tp, ep, sp in [(2, 2, 2, False), (4, 2, 1, True), (1, 1, 1, False)]:
            name = f"ckpt_resume_{tag}_{layout_name(dp, tp, ep, sp, False)}"
            got = run(args, name, cfg, dp, ep, checkpoint={"resume": step10}, dump=False, tp=tp, sp=sp)
            if got is None:
                continue
            resumed = {s["step"]: s["loss"] for s in got[0]}
            check(sorted(resumed) == list(range(11, STEPS + 1)), f"{name}: continues at step 11 ({sorted(resumed)})")
            worst = max((rel(resumed[s], ref_losses[s]) for s in resumed), default=1.0)
            check(worst <= LOSS_RTOL, f"{name}: steps 11..{STEPS} match the uninterrupted run within "
                                      f"{LOSS_RTOL:g} (worst {worst:.2e})")


if __name__ == "__main__":
    sys.exit(main())
