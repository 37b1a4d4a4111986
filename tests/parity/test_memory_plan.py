"""The memory plan is what the run allocates: the measured peak within 5% of the plan, both ways.

`--dry-run` and the start-up log show a per-rank memory plan computed from the config alone
(trainer/train/memory_plan.h: weights, master weights, gradients, optimizer state, activations
per micro-batch in flight and their scratch, batch, communication buffers, the fp32 staging of the
distributed optimizer's weights, the peak). The CPU backend counts every allocation
(kernels/common/allocation_tally.h) and at the end of a run every rank's measured peak is written
beside its plan (metrics.jsonl's "memory" event). For each configuration below (dense and MoE, with
a shared expert too; dp, ZeRO-1, tp with and without sequence parallelism, pp 1f1b and interleaved,
ep; every recompute mode;
fp32, bf16, fp16, bf16 gradient compression) Tetra trains two steps and every rank must report
  0.95 <= measured peak / planned peak <= 1.05
(a plan below the measurement would let a job run out of memory; one above it hides waste), and
within 0.1% (all the plan leaves out is a few 64-byte scalars: on configs this small, a forgotten
buffer would hide inside 5%), and, for
three of them, the event's plan must be the one `--dry-run` prints for pipeline rank 0.

Usage: /usr/bin/python3 test_memory_plan.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import os
import re
import sys

import harness
from harness import Checks

LOW, HIGH = 0.95, 1.05
EXACT = 1e-3
GPT2 = {"vocab_size": 256, "seq_len": 64, "num_layers": 4, "hidden_size": 64, "num_heads": 4, "ffn_hidden_size": 256}
LLAMA = {"vocab_size": 256, "seq_len": 64, "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 160, "norm": "rmsnorm", "activation": "swiglu", "position": "rope",
         "tie_embeddings": False, "bias": False}
MOE = dict(LLAMA, moe={"num_experts": 4, "top_k": 2, "every": 2, "ffn_hidden_size": 96, "aux_loss_coeff": 0.01})
MOE_CAP = dict(GPT2, moe={"num_experts": 4, "top_k": 1, "ffn_hidden_size": 128, "capacity_factor": 1.25})
# Dropless rows planned for the balanced load (max_load_factor 1): with the router forced to skew
# (TETRA_TEST_MOE_ROUTE) blocks exceed it and run in passes, inside the same plan.
MOE_BOUND = dict(LLAMA, moe=dict(MOE["moe"], max_load_factor=1.0))
# A gated shared expert beside the routed ones (Qwen2-MoE): its fc, act, output and gate kept per slot.
MOE_SHARED = dict(LLAMA, moe=dict(MOE["moe"], shared_expert_ffn_hidden_size=64, shared_expert_gate=True))
SELECTIVE = {"recompute": "selective", "recompute_modules": ["norm", "act", "core_attn"]}

# (name, model, parallel, training overrides)
CONFIGS = [
    ("gpt2_fp32", GPT2, {}, {}),
    ("llama_bf16", LLAMA, {}, {"precision": "bf16"}),
    ("gpt2_fp16", GPT2, {}, {"precision": "fp16"}),
    ("gpt2_dp2_zero1_bf16", GPT2, {"dp": 2, "distributed_optimizer": True}, {"precision": "bf16"}),
    # ZeRO-2: the gradient's shard and the staging pool of the largest bucket instead of the whole
    # gradient; small buckets so that the pool holds fewer buffers than there are buckets.
    ("gpt2_dp2_zero2_bf16", GPT2, {"dp": 2, "zero_stage": 2, "bucket_size": 3000},
     {"precision": "bf16", "global_batch_size": 8}),
    ("llama_dp2_pp2_zero2", LLAMA, {"dp": 2, "pp": 2, "zero_stage": 2, "bucket_size": 3000}, {"global_batch_size": 8}),
    ("moe_dp4_ep2_zero2", MOE, {"dp": 4, "ep": 2, "zero_stage": 2, "bucket_size": 3000}, {"global_batch_size": 16}),
    # ZeRO-3: the compute weights a shard too, two units gathered at a time (fp32: no compute
    # copy, the units gather the master shard).
    ("gpt2_dp2_zero3", GPT2, {"dp": 2, "zero_stage": 3}, {"global_batch_size": 8}),
    # The distributed optimizer with a large embedding bucket and few activations: writing the final
    # weights (that bucket's fp32 gathered from the shards, beside everything but the activations) is
    # the run's peak (the dry run says so: STAGING_PEAK).
    ("gpt2_bigvocab_dp2_zero1_bf16", dict(GPT2, vocab_size=16384), {"dp": 2, "zero_stage": 1},
     {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 2}),
    ("gpt2_dp2_zero3_keep", GPT2, {"dp": 2, "zero_stage": 3, "reshard_after_forward": False}, {"global_batch_size": 8}),
    ("moe_dp4_ep2_zero3", MOE, {"dp": 4, "ep": 2, "zero_stage": 3}, {"global_batch_size": 16}),
    ("llama_dp2_pp2_zero3_bf16", LLAMA, {"dp": 2, "pp": 2, "zero_stage": 3}, {"precision": "bf16", "global_batch_size": 8}),
    ("llama_dp2_tp2_sp_zero3_bf16", LLAMA, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 3},
     {"precision": "bf16", "global_batch_size": 8}),
    ("gpt2_dp2_zero2_bf16_grads", GPT2, {"dp": 2, "zero_stage": 2, "grad_compression": "bf16", "bucket_size": 3000},
     {"global_batch_size": 8}),
    ("gpt2_dp2_bf16_grads", GPT2, {"dp": 2, "grad_compression": "bf16"}, {}),
    ("gpt2_tp2_sp", GPT2, {"tp": 2, "sequence_parallel": True}, {}),
    ("llama_tp2_bf16", LLAMA, {"tp": 2}, {"precision": "bf16"}),
    ("gpt2_pp2_1f1b", GPT2, {"pp": 2}, {"global_batch_size": 8}),
    ("llama_pp2_interleaved", LLAMA, {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
     {"global_batch_size": 8}),
    ("moe_ep2", MOE, {"dp": 2, "ep": 2}, {}),
    # The distributed optimizer shards the experts over expert-DP (dp / ep), the rest over dp.
    ("moe_dp4_ep2_zero1_bf16", MOE, {"dp": 4, "ep": 2, "distributed_optimizer": True}, {"precision": "bf16"}),
    ("moe_capacity_bf16", MOE_CAP, {}, {"precision": "bf16"}),
    ("moe_ep2_bound_balanced", MOE_BOUND, {"dp": 2, "ep": 2}, {}),
    ("moe_ep2_bound_skew", MOE_BOUND, {"dp": 2, "ep": 2}, {}),
    ("moe_dp4_ep4_bound_one_bf16", MOE_BOUND, {"dp": 4, "ep": 4}, {"precision": "bf16"}),
    ("moe_dp4_ep2_pp2_bound_one", MOE_BOUND, {"dp": 4, "ep": 2, "pp": 2}, {"global_batch_size": 16}),
    ("moe_shared_dp2_tp2_sp_ep2", MOE_SHARED, {"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2}, {}),
    # Folded experts: tp 2 with whole experts (etp 1), EP over tp x dp; with the exchanges in 2 chunks.
    ("moe_folded_tp2_etp1_ep4_dp2_sp", MOE_SHARED, {"dp": 2, "tp": 2, "etp": 1, "sequence_parallel": True, "ep": 4,
                                                    "distributed_optimizer": True}, {}),
    ("moe_folded_tp2_etp1_ep2_bound_one", MOE_BOUND, {"dp": 1, "tp": 2, "etp": 1, "sequence_parallel": True, "ep": 2,
                                                      "ep_overlap_chunks": 2}, {}),
    ("moe_shared_ep2_moe_act_bf16", MOE_SHARED, {"dp": 2, "ep": 2},
     {"precision": "bf16", "recompute": "selective", "recompute_modules": ["moe_act"]}),
    ("llama_selective", LLAMA, {}, SELECTIVE),
    ("moe_selective_moe_act", MOE, {}, {"recompute": "selective", "recompute_modules": ["moe_act", "norm"]}),
    ("gpt2_full_uniform2", GPT2, {}, {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 2}),
    ("llama_tp2_sp_full_block1", LLAMA, {"tp": 2, "sequence_parallel": True},
     {"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1}),
]

# The router forced (TETRA_TEST_MOE_ROUTE) on these: each must really exceed the bound.
ROUTED = {"moe_folded_tp2_etp1_ep2_bound_one": "one", "moe_ep2_bound_skew": "skew", "moe_dp4_ep4_bound_one_bf16": "one", "moe_dp4_ep2_pp2_bound_one": "one"}

# --dry-run and the run compute the plan with the same function; three layouts check the printing.
DRY_RUN_CHECKED = {"gpt2_dp2_zero1_bf16", "llama_pp2_interleaved", "moe_dp4_ep2_zero1_bf16", "gpt2_dp2_zero2_bf16",
                   "llama_dp2_tp2_sp_zero3_bf16"}

checks = Checks()
check = checks.check


def config(model, par, training, out):
    t = {"micro_batch_size": 2, "global_batch_size": 2 * par.get("dp", 1), "steps": 2, "threads": 1,
         "peak_gflops": 100, "seed": 3, **training}
    return {"model": model, "training": t, "optimizer": {"lr": 1e-3}, "parallel": {"bucket_size": 20000, **par},
            "data": {"synthetic": True}, "logging": {"level": "warn", "dir": out}}


STAGING_PEAK = {"gpt2_bigvocab_dp2_zero1_bf16"}


def dry_run_peak(args, path):
    """The peak --dry-run prints for pipeline rank 0, in MiB (one decimal), or None; and with
    dp > 1 its "ZeRO stages" line's figure for this run's stage (None where absent)."""
    r = harness.run_tetra(args, ["train", "--config", path, "--dry-run"])
    m = re.search(r"memory per rank:\s+([0-9.]+) MiB at the peak", r.stdout)
    z = re.search(r"ZeRO stages .*?([0-9.]+) MiB \(this run\)", r.stdout)
    return (float(m.group(1)) if r.returncode == 0 and m else None), (float(z.group(1)) if z else None)


def main():
    args = harness.parse_args()
    for name, model, par, training in CONFIGS:
        out = os.path.join(args.workdir, name)
        path = harness.write_config(out, config(model, par, training, out))
        world = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
        env = {"TETRA_TEST_MOE_ROUTE": ROUTED[name]} if name in ROUTED else None
        r = harness.run_tetra(args, ["--config", path], world, env=env)
        if r.returncode != 0:
            check(False, f"{name}: exit code {r.returncode}")
            continue
        if name in ROUTED:
            over = sum(j["moe"]["over_bound"] for _, j in harness.metrics_lines(out) if "moe" in j and "step" in j)
            check(over > 0, f"{name}: blocks exceeded the row bound ({over}), so the plan held them")
        events = [j for _, j in harness.metrics_lines(out) if j.get("event") == "memory"]
        if not check(len(events) == 1, f"{name}: one memory event in metrics.jsonl ({len(events)})"):
            continue
        ranks = events[0]["ranks"]
        check(len(ranks) == world, f"{name}: every rank reports ({len(ranks)} of {world})")
        ratios = [r["measured_peak_bytes"] / r["planned_bytes"] for r in ranks]
        check(all(LOW <= x <= HIGH for x in ratios),
              f"{name}: measured peak / plan within [{LOW}, {HIGH}] on every rank "
              f"({', '.join(f'{x:.4f}' for x in ratios)}; plan {ranks[0]['planned_bytes'] / 2**20:.2f} MiB)")
        # The plan counts every buffer the run allocates but a few 64-byte scalars: on these small
        # configs a forgotten buffer (a pipeline's input gradients are ~1.5% here) hides inside 5%.
        check(all(abs(x - 1.0) <= EXACT for x in ratios),
              f"{name}: and within {EXACT:g} of it (every buffer planned)")
        if name in STAGING_PEAK:  # the end is the peak: the plan's staging moment was measured
            r = harness.run_tetra(args, ["train", "--config", path, "--dry-run"])
            staging = [l for l in r.stdout.splitlines() if l.strip().startswith("staging")]
            check(len(staging) == 1 and "the peak" in staging[0] and "a bucket at a time" in staging[0],
                  f"{name}: the plan's peak is the final weights' bucket-by-bucket moment ({staging})")
        if name in DRY_RUN_CHECKED:
            printed, stage = dry_run_peak(args, path)
            rank0 = ranks[0]["planned_bytes"] / 2**20
            check(printed is not None and abs(printed - rank0) <= 0.051,
                  f"{name}: --dry-run's peak {printed} MiB is the run's plan {rank0:.2f} MiB")
            if par.get("dp", 1) > 1:
                check(stage is not None and abs(stage - rank0) <= 0.051,
                      f"{name}: --dry-run's ZeRO stages line gives this run's stage {stage} MiB, its plan")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
