#!/usr/bin/env python3
"""Planned per-GPU memory of the published layouts, per recompute mode, beside Megatron's estimator.

For every config in configs/published/ and every recompute mode below, runs

    tetra train --config F --dry-run --set training.recompute=... [--set ...]

reads the plan it prints (the peak, the pipeline rank that holds it, and the activation line) and
prints a markdown table with Megatron-LM's theoretical estimate beside it. Nothing is allocated:
--dry-run only plans, so this runs anywhere in a few seconds.

Usage: scripts/memory_table.py [--tetra BIN] [--configs DIR] [--raw]
       (BIN defaults to $TETRA_BIN, else build-cpu/tetra, else build/tetra)

The estimator is Megatron-LM's megatron/training/theoretical_memory_usage.py
(compute_weight_and_optimizer_memory and compute_activation_memory), written out below with the
conventions of its sequence-parallel path (Korthikanti et al., arXiv 2205.05198, Table 2, as the
code generalises it to s*b*h*(18 + 4*ffn/h)/t bytes per layer). Its known gaps, all kept here so the
column is what Megatron would print, not a corrected figure:
  - recomputation: the code models only selective recompute of the attention core (which flash
    attention makes free), so its figure for `none`, `selective` and any module list is the same;
    `full` is not modelled in the code at all: the column uses Table 2's full-recompute row
    (2*s*b*h per layer, / t under sequence parallelism for the sharded layer input) and does not
    count the one layer being recomputed;
  - MoE: the activation term uses the dense ffn_hidden_size for every layer; routed tokens,
    top_k copies, permutation buffers and the router are not counted (Megatron-LM issue #1784);
  - no context-parallel term, and the distributed optimizer is divided by dp only;
  - the SwiGLU block's fc output is 2*ffn wide, its act output ffn wide: 6*ffn/h bytes per token
    and h, where the formula counts 4*ffn/h; on the other hand it counts dropout masks and
    full-width K and V, which a Llama block with GQA and no dropout does not keep.
Expert parameters are split over ep and etp and their optimizer shard over the expert-DP group
((tp / etp) x dp / ep; dp / ep unfolded),
as the project notes read Megatron's current code; the dense parameters over tp and pp.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
GIB = 1024 * MIB

# (label, overrides). For MoE models "act" has no dense MLP to act on in an all-MoE model, so the
# norm+act modes also recompute the experts' activation (moe_act).
MODES = [
    ("none", {"training.recompute": "none"}),
    ("selective norm+act", {"training.recompute": "selective", "training.recompute_modules": ["norm", "act"]}),
    ("selective norm+act+core_attn",
     {"training.recompute": "selective", "training.recompute_modules": ["norm", "act", "core_attn"]}),
    ("full uniform 1",
     {"training.recompute": "full", "training.recompute_method": "uniform", "training.recompute_num_layers": 1}),
]


def find_tetra(arg):
    for cand in [arg, os.environ.get("TETRA_BIN"), REPO / "build-cpu" / "tetra", REPO / "build" / "tetra"]:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    sys.exit("memory_table: no tetra binary (give --tetra or TETRA_BIN, or build build-cpu/tetra)")


def mode_overrides(overrides, moe):
    o = dict(overrides)
    if moe and "training.recompute_modules" in o:
        o["training.recompute_modules"] = o["training.recompute_modules"] + ["moe_act"]
    return o


def dry_run(tetra, cfg_path, overrides):
    cmd = [tetra, "train", "--config", str(cfg_path), "--dry-run"]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p.stdout


def resolved_config(tetra, cfg_path):
    """The config as tetra resolves it (the files carry comments; derived values filled in)."""
    p = subprocess.run([tetra, "train", "--config", str(cfg_path), "--print-config"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cfg_path}: --print-config exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return json.loads(p.stdout)


NUM = r"([0-9]+(?:\.[0-9]+)?) MiB"


def parse_plan(text):
    """The plan's peak (the largest of the pipeline ranks' lines, else 'memory per rank'), the
    rank holding it, and the activation line's parts."""
    out = {}
    m = re.search(r"^memory per rank:\s+" + NUM, text, re.M)
    if not m:
        raise RuntimeError("no 'memory per rank' line in:\n" + text)
    out["rank0_mib"] = float(m.group(1))
    ranks = [(int(r), float(v)) for r, v in re.findall(r"^\s+rank (\d+)\s+layers .*; " + NUM + r"\s*$", text, re.M)]
    fl = re.search(r"^\s+rank 0\s+layers .*; (\d+) micro-batch\(es\) in flight;", text, re.M)
    out["rank0_in_flight"] = int(fl.group(1)) if fl else None
    if ranks:
        r, v = max(ranks, key=lambda x: x[1])
        out["peak_mib"], out["peak_rank"] = v, r
    else:
        out["peak_mib"], out["peak_rank"] = out["rank0_mib"], 0
    for key, label in [("master", "master weights"), ("compute", "compute weights"), ("grads", "gradients"),
                       ("optimizer", "optimizer"), ("activations", "activations"), ("batch", "batch buffers"),
                       ("buffers", "comm buffers"), ("staging", "staging")]:
        m = re.search(r"^\s+" + label + r"\s+" + NUM, text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    m = re.search(r"^\s+activations\s+.*?: " + NUM + r" kept in (\d+) slot\(s\) of micro-batches in flight .*?\+ "
                  + NUM + " scratch", text, re.M)
    if m:
        out["kept"], out["slots"], out["scratch"] = float(m.group(1)), int(m.group(2)), float(m.group(3))
    else:
        out["kept"] = out["slots"] = out["scratch"] = None
    return out


def megatron_estimate(cfg, mode):
    """Megatron-LM theoretical_memory_usage.py for this config; returns (weights+optimizer, activations)
    in bytes for the first pipeline stage (the one its code reports)."""
    m, par, tr = cfg["model"], cfg.get("parallel", {}), cfg["training"]
    h, L, V, s = m["hidden_size"], m["num_layers"], m["vocab_size"], m["seq_len"]
    a = m["num_heads"]
    g = m.get("num_kv_heads") or a
    ffn = m.get("ffn_hidden_size") or 4 * h
    swiglu = m.get("activation") == "swiglu"
    norm_size = 1 if m.get("norm") == "rmsnorm" else 2
    moe = m.get("moe", {}) or {}
    E = moe.get("num_experts", 0)
    every = moe.get("every", 1)
    ffn_e = moe.get("ffn_hidden_size") or ffn
    t, p, d = par.get("tp", 1), par.get("pp", 1), par.get("dp", 1)
    ep = par.get("ep", 1)
    etp = par.get("etp") or t  # folded experts (parallel.etp): split over etp, ep over (t / etp) x dp
    v = par.get("virtual_stages", 1) if par.get("schedule") == "interleaved" else None
    b = tr["micro_batch_size"]
    m_micro = tr["global_batch_size"] // (b * d)
    dist = par.get("distributed_optimizer", False)
    glu = 1.5 if swiglu else 1.0

    # compute_weight_and_optimizer_memory
    attn = 2 * h * h * (1 + g / a)  # query_projection_size == hidden_size here
    dense_layer = 2 * h * (ffn * glu + norm_size) + attn
    moe_layers = sum(1 for i in range(L) if E and i % every == 0)
    dense_layers = L - moe_layers
    moe_nonexpert = 2 * h * norm_size + attn  # the router (h x E) is not counted, as in the code
    experts_per_layer = 2 * h * ffn_e * E * glu
    embedding = h * V
    block_dense = dense_layer * dense_layers + moe_nonexpert * moe_layers + norm_size * h
    block_expert = experts_per_layer * moe_layers
    shard_dense = (block_dense / p + embedding) / t
    if not m.get("tie_embeddings", True) and p == 1:
        shard_dense += embedding / t
    shard_expert = block_expert / p / ep / etp
    bpp = (6 + 12 / d) if dist else 18
    bpp_e = (6 + 12 / max(1, (t // etp) * d // ep)) if dist else 18
    weights = shard_dense * bpp + shard_expert * bpp_e

    # compute_activation_memory (the sequence-parallel path), first pipeline stage
    if mode.startswith("full"):
        per_layer = 2 * s * b * h  # Table 2, full recompute: the layer input only
    else:
        per_layer = s * b * h * (18 + 4 * ffn / h)
    act = per_layer * L
    act += 8 * s * b * p  # input to the embedding, p micro-batches in flight
    act += s * b * h * p  # embedding dropout
    if v is not None:
        act *= 1 + (p - 1) / (p * v)
    elif p > 1:
        act *= min(1, m_micro / p)
    if p == 1:
        act += s * b * h * 4 * (1 + V / h)  # output layer and loss inputs
    act /= t
    return weights, act


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tetra")
    ap.add_argument("--configs", default=str(REPO / "configs" / "published"))
    ap.add_argument("--raw", action="store_true", help="also print each dry run's memory lines")
    args = ap.parse_args()
    tetra = find_tetra(args.tetra)
    configs = sorted(Path(args.configs).glob("*.json"))
    if not configs:
        sys.exit(f"memory_table: no configs in {args.configs}")

    print(f"Planned by `{os.path.relpath(tetra, REPO) if tetra.startswith(str(REPO)) else tetra} train --dry-run`; "
          "GiB = 2^30 bytes; the peak is the largest pipeline rank's (rank in brackets).\n")
    print("| config | recompute | Tetra peak GiB [rank] | activations GiB (rank 0) | activation slots / in flight (rank 0) "
          "| weights+grads+optimizer GiB | staging GiB | Megatron estimate GiB (weights+opt + act) |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for f in configs:
        cfg = resolved_config(tetra, f)
        moe = bool((cfg["model"].get("moe") or {}).get("num_experts"))
        for label, ov in MODES:
            name = f.stem
            try:
                text = dry_run(tetra, f, mode_overrides(ov, moe))
            except RuntimeError as e:
                print(f"| {name} | {label} | dry run failed | | | | | |")
                print(e, file=sys.stderr)
                failed += 1
                continue
            plan = parse_plan(text)
            if args.raw:
                print("\n".join("    " + l for l in text.splitlines() if "memory" in l or "MiB" in l), file=sys.stderr)
            wo, act = megatron_estimate(cfg, label)
            state = plan["master"] + plan["compute"] + plan["grads"] + plan["optimizer"]
            # The activation line gives the slots rank 0's chunks share, against the schedule's
            # micro-batch chunks in flight at once there.
            held = "-"
            if plan["slots"]:
                held = f"{plan['slots']} / {plan['rank0_in_flight'] or 1}"
            lab = label + (" (+moe_act)" if moe and "norm" in label else "")
            print(f"| {name} | {lab} | {plan['peak_mib'] / 1024:.1f} [{plan['peak_rank']}] "
                  f"| {plan['activations'] / 1024:.1f} | {held} | {state / 1024:.1f} | {plan['staging'] / 1024:.1f} "
                  f"| {(wo + act) / GIB:.1f} ({wo / GIB:.1f} + {act / GIB:.1f}) |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
