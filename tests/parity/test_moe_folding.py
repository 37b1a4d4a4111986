"""Folded experts (Megatron-Core's MoE parallel folding) reproduce the single-rank run.

parallel.etp sets the experts' own tensor parallelism, a divisor of tp; with etp < tp the tp / etp
shares of each TP group route different rows of the micro-batch and expert parallelism spans the
shares and DP (rank_grid.h, moe.h). Layouts (world <= 8), each against the single-rank run:
  tp 2, etp 1, ep 2 + SP          every expert whole, EP over the two TP ranks (Bridge's Moonlight
                                  layout, attention TP 2 x experts ETP 1 x EP 8, in miniature)
  tp 2, etp 1, ep 4, dp 2 + SP    EP over TP x DP
  tp 2, etp 1, ep 1, dp 2         no EP: the shares alone (the router's gradient a TP partial sum,
                                  the experts replicated over expert-DP 4), without SP
  tp 4, etp 2, ep 2 + SP          1 < etp < tp: the ETP group's partial sums
  tp 2, etp 1, ep 2, dp 2 ZeRO-1 / ZeRO-2 / ZeRO-3, pp 2, cp 2
and the routers of today's models (DeepSeek-style sigmoid scores, expert bias, shared expert, dense
first block; Qwen2-MoE's gated shared expert) and a capacity factor (the shares' assignments
counted in the micro-batch's order: the same drops as on one rank). Per layout, as test_moe.py:
the loss and gradient norm of every step, every step-0 gradient tensor, and the communication of
every group as predicted (etp and eshare included).
Checkpoints reshard between foldings: saved at tp 2 x etp 1 x ep 2 x dp 2, resumed unfolded at
tp 2 x ep 2 and on one rank; saved unfolded at dp 4 x ep 2, resumed folded; the resumed steps
match the uninterrupted run. Bad layouts are refused naming the key.
Overlapped exchanges (parallel.ep_overlap_chunks): the expert-parallel exchanges split into chunks
of local experts, each in flight while the previous chunk's experts compute; the same rows, the
same GEMMs: the curve is bit for bit the unchunked run's (folded and not, gpt2 with 2 local experts,
DeepSeek-style with 4 in 3 uneven chunks), the all-to-alls counted 1 + 4 chunks per block.

Usage: /usr/bin/python3 test_moe_folding.py --tetra BIN --workdir DIR
"""
import json
import os
import sys

import harness
from harness import Checks, read_safetensors, rel
from test_moe import GRAD_RTOL, LOSS_RTOL, MODELS, STEPS, config

checks = Checks()
check = checks.check


def name_of(L):
    parts = [f"tp{L['tp']}", f"etp{L.get('etp', L['tp'])}", f"ep{L.get('ep', 1)}", f"dp{L.get('dp', 1)}"]
    for key in ("pp", "cp"):
        if L.get(key, 1) > 1:
            parts.append(f"{key}{L[key]}")
    if L.get("sp"):
        parts.append("sp")
    if L.get("zero"):
        parts.append(f"zero{L['zero']}")
    if L.get("chunks", 1) > 1:
        parts.append(f"chunks{L['chunks']}")
    return "_".join(parts)


def run(args, name, cfg, L, checkpoint=None, dump=True, expect=0):
    out = os.path.join(args.workdir, name)
    cfg = json.loads(json.dumps(cfg))
    par = cfg["parallel"]
    par.update({"tp": L["tp"], "dp": L.get("dp", 1), "ep": L.get("ep", 1), "pp": L.get("pp", 1),
                "ep_overlap_chunks": L.get("chunks", 1),
                "cp": L.get("cp", 1), "sequence_parallel": bool(L.get("sp")),
                "distributed_optimizer": bool(L.get("zero")), "zero_stage": L.get("zero", 0)})
    if "etp" in L:
        par["etp"] = L["etp"]
    cfg["logging"]["dir"] = out
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    path = harness.write_config(out, cfg)
    world = L["tp"] * L.get("dp", 1) * L.get("pp", 1) * L.get("cp", 1)
    r = harness.run_tetra(args, ["--config", path] + (["--dump-dir", os.path.join(out, "dump")] if dump else []),
                          world, expect=expect)
    if expect != 0:
        return r
    if r.returncode != 0:
        check(False, f"{name}: exit code {r.returncode}")
        return None
    steps = harness.step_records(out)
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0] if dump else None
    return steps, grads


def expected_groups(L):
    tp, dp, pp, cp, ep = L["tp"], L.get("dp", 1), L.get("pp", 1), L.get("cp", 1), L.get("ep", 1)
    etp = L.get("etp", tp)
    shares = tp // etp
    edp = shares * dp // ep * cp
    sizes = {"tp": tp, "dp": dp * cp, "pp": pp, "embedding": pp, "cp": cp, "ep": ep, "edp": edp,
             "etp": etp if shares > 1 else 1, "eshare": shares}
    return {g for g, n in sizes.items() if n > 1}


def compare(name, ref, got, L):
    ref_steps, ref_grads = ref
    steps, g = got
    harness.check_loss_curve(checks, name, steps, ref_steps, STEPS, LOSS_RTOL, norm_rtol=10 * LOSS_RTOL)
    check(sorted(g) == sorted(ref_grads), f"{name}: the same {len(ref_grads)} gradient tensors")
    harness.check_gradients(checks, name, ref_grads, g, GRAD_RTOL)
    bad, seen = harness.comm_mismatches(steps, exact=False)
    expected = expected_groups(L)
    check(not bad and seen == expected, f"{name}: communication as predicted in every step (groups {sorted(seen)}, "
                                        f"expected {sorted(expected)})")
    if L.get("ep", 1) > 1:
        moved = sum(s["moe"]["dispatch_bytes"] + s["moe"]["combine_bytes"] for s in steps)
        check(moved > 0, f"{name}: tokens crossed EP ranks ({moved} bytes over {STEPS} steps)")


LAYOUTS = {
    "gpt2_moe": [{"tp": 2, "etp": 1, "ep": 2, "sp": True},
                 {"tp": 2, "etp": 1, "ep": 4, "dp": 2, "sp": True},
                 {"tp": 2, "etp": 1, "ep": 1, "dp": 2},
                 {"tp": 4, "etp": 2, "ep": 2, "sp": True},
                 {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True, "zero": 1},
                 {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True, "zero": 2},
                 {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True, "zero": 3},
                 {"tp": 2, "etp": 1, "ep": 2, "pp": 2, "sp": True},
                 {"tp": 2, "etp": 1, "ep": 2, "cp": 2, "sp": True}],
    "mixtral_moe": [{"tp": 2, "etp": 1, "ep": 4, "dp": 2, "sp": True},
                    {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True, "zero": 2}],
    "deepseek_moe": [{"tp": 2, "etp": 1, "ep": 2, "sp": True},
                     {"tp": 2, "etp": 1, "ep": 4, "dp": 2, "sp": True, "zero": 1}],
    "qwen2_moe": [{"tp": 2, "etp": 1, "ep": 2, "sp": True},
                  {"tp": 2, "etp": 1, "ep": 1, "dp": 2}],
}


def resumes(args):
    """Checkpoints reshard between foldings."""
    for model, saved, resumed_on in [
            ("deepseek_moe", {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True},
             [{"tp": 2, "ep": 2, "dp": 2, "sp": True}, {"tp": 1}]),
            ("gpt2_moe", {"tp": 1, "ep": 2, "dp": 4}, [{"tp": 2, "etp": 1, "ep": 4, "dp": 2, "sp": True}])]:
        ck = os.path.join(args.workdir, f"ckpt_{model}_{name_of(saved)}")
        base = run(args, f"save_{model}_{name_of(saved)}", config(model), saved, checkpoint={"dir": ck, "every": 10},
                   dump=False)
        step10 = os.path.join(ck, "step_00000010")
        if not base or not os.path.isdir(step10):
            check(False, f"{model}: the run at {name_of(saved)} saved step_00000010")
            continue
        with open(os.path.join(step10, "manifest.json")) as f:
            layout = json.load(f)["layout"]
        check(layout.get("etp") == saved.get("etp", saved["tp"]),
              f"{model}: the manifest's layout records the experts' tp ({layout})")
        ref = {s["step"]: s["loss"] for s in base[0]}
        for L in resumed_on:
            name = f"resume_{model}_{name_of(saved)}_on_{name_of(L)}"
            got = run(args, name, config(model), L, checkpoint={"resume": step10}, dump=False)
            if got is None:
                continue
            losses = {s["step"]: s["loss"] for s in got[0]}
            worst = max((rel(losses[s], ref[s]) for s in losses), default=1.0)
            check(sorted(losses) == list(range(11, STEPS + 1)) and worst <= LOSS_RTOL,
                  f"{name}: steps 11..{STEPS} match the uninterrupted run within {LOSS_RTOL:g} (worst {worst:.2e})")


def overlap(args):
    """Chunked, overlapped exchanges: bit for bit the unchunked run, as predicted."""
    for model, L, chunks in [("gpt2_moe", {"tp": 1, "ep": 2, "dp": 4}, 2),
                             ("gpt2_moe", {"tp": 2, "etp": 1, "ep": 4, "dp": 2, "sp": True}, 1),
                             ("deepseek_moe", {"tp": 1, "ep": 2, "dp": 2}, 3),
                             ("deepseek_moe", {"tp": 2, "etp": 1, "ep": 2, "sp": True, "zero": 1}, 4)]:
        if chunks == 1:  # gpt2's 4 experts over ep 4: one local expert, one chunk; take ep 2 instead
            L = dict(L, ep=2)
            chunks = 2
        plain = run(args, f"plain_{model}_{name_of(L)}", config(model), L)
        Lc = dict(L, chunks=chunks)
        got = run(args, f"{model}_{name_of(Lc)}", config(model), Lc)
        if not plain or not got:
            continue
        same = [a["loss"] for a in plain[0]] == [b["loss"] for b in got[0]] and \
            [a["grad_norm"] for a in plain[0]] == [b["grad_norm"] for b in got[0]]
        check(same and len(got[0]) == STEPS,
              f"{model}_{name_of(Lc)}: every step's loss and gradient norm equal the unchunked run's bit for bit")
        bad, seen = harness.comm_mismatches(got[0], exact=False)
        calls = {s["step"]: s.get("comm", {}).get("ep", {}).get("measured", {}).get("all_to_all", {}).get("calls")
                 for s in got[0]}
        check(not bad and seen == expected_groups(L), f"{model}_{name_of(Lc)}: communication as predicted "
                                                      f"(groups {sorted(seen)})")
        moe_blocks = sum(1 for b in range(MODELS[model]["num_layers"])
                         if b % MODELS[model]["moe"].get("every", 1) == 0
                         and b >= MODELS[model]["moe"].get("first_k_dense_replace", 0))
        accum = 8 // (2 * L.get("dp", 1))
        want = (1 + 4 * chunks) * moe_blocks * accum
        check(calls and all(n == want for n in calls.values()),
              f"{model}_{name_of(Lc)}: {want} all-to-alls per step (1 + 4 x {chunks} per block and micro-batch; "
              f"measured {sorted(set(calls.values()))})")


def refusals(args):
    for L, key in [({"tp": 2, "etp": 3, "ep": 1}, "parallel.etp"),
                   ({"tp": 2, "etp": 1, "ep": 3}, "parallel.ep"),
                   ({"tp": 1, "ep": 2, "dp": 2, "chunks": 3}, "parallel.ep_overlap_chunks"),
                   ({"tp": 1, "ep": 1, "dp": 2, "chunks": 2}, "parallel.ep_overlap_chunks")]:
        r = run(args, f"refused_{name_of(L)}", config("gpt2_moe"), L, dump=False, expect=2)
        check(r.returncode == 2 and key in r.stderr,
              f"{name_of(L)}: refused with exit 2 naming {key} ({r.stderr.strip()[-240:]})")


def main():
    args = harness.parse_args()
    for model, layouts in LAYOUTS.items():
        ref = run(args, f"{model}_single", config(model), {"tp": 1})
        if ref is None:
            continue
        harness.check_loss_falls(checks, f"{model} single-rank", [s["loss"] for s in ref[0]])
        for L in layouts:
            name = f"{model}_{name_of(L)}"
            got = run(args, name, config(model), L)
            if got is not None:
                compare(name, ref, got, L)
    # A capacity factor: the shares' drops are the single-rank run's.
    ref = run(args, "capacity_single", config("gpt2_moe", 1.0), {"tp": 1})
    L = {"tp": 2, "etp": 1, "ep": 2, "dp": 2, "sp": True}
    got = run(args, "capacity_" + name_of(L), config("gpt2_moe", 1.0), L)
    if ref and got:
        dropped = sum(l["dropped"] for s in ref[0] for l in s["moe"]["layers"])
        check(dropped > 0, f"capacity factor 1.0: the single-rank run drops tokens ({dropped} over {STEPS} steps)")
        # (rank 0 routes the micro-batch's first rows, which come first for every expert: the drops
        # fall to the other share, and equal losses say they are the single-rank run's)
        compare("capacity_" + name_of(L), ref, got, L)
    resumes(args)
    overlap(args)
    refusals(args)
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
