"""No rank makes the whole model under the distributed optimizer / ZeRO, and nothing changes for it.

Where the optimizer owns the fp32 master weights (16-bit compute with the distributed optimizer,
or ZeRO-3) each rank generates only its own shard at start-up, and the final model.safetensors is
gathered from the shards a bucket at a time and written a tensor at a time. Both must be exact.
Over two DP replicas, one micro-batch each a step, a gradient's reduction is one addition, the
same in an all-reduce and a reduce-scatter (ZeRO-2/3's per micro-batch too), and without clipping
(grad_clip 0) no norm enters the update: each sharded layout
then trains bit for bit like the same layout without the distributed optimizer, whose whole fp32
weights are written from one buffer. So its final file must be byte for byte that run's, and the
initial weights of its debug dump (gathered whole from the shards) too. Layouts: dp 2 ZeRO-1 bf16,
dp 2 ZeRO-2 (fp32: the whole master weights stay, the path unchanged) and ZeRO-3 fp32, tp 2 x dp 2 ZeRO-3 bf16 + SP, pp 2 x dp 2 ZeRO-1 bf16, a MoE model at
dp 2 x ep 2 ZeRO-2 bf16 and folded (tp 2, etp 1, ep 4, dp 2) ZeRO-1 bf16; the plan prints no
start-up staging for them.

Usage: /usr/bin/python3 test_sharded_weights.py --tetra BIN --workdir DIR
"""
import filecmp
import json
import os
import sys

import harness
from harness import Checks

checks = Checks()
check = checks.check

MODEL = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 4, "hidden_size": 32,
         "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 48, "norm": "rmsnorm", "activation": "swiglu",
         "position": "rope", "tie_embeddings": False, "bias": False}
MOE = dict(MODEL, moe={"num_experts": 4, "top_k": 2, "every": 2, "ffn_hidden_size": 24})


def run(args, name, model, par, precision="fp32", steps=3, checkpoint=None, env=None):
    out = os.path.join(args.workdir, name)
    cfg = {"model": model,
           "training": {"micro_batch_size": 2, "global_batch_size": 2 * par.get("dp", 1), "steps": steps, "threads": 1,
                        "peak_gflops": 100,
                        "seed": 11, "precision": precision},
           "optimizer": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.0},
           "parallel": dict({"bucket_size": 700}, **par),
           "data": {"synthetic": True}, "logging": {"dir": out, "level": "warn"}}
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    path = harness.write_config(out, cfg)
    world = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
    r = harness.run_tetra(args, ["--config", path, "--dump-dir", os.path.join(out, "dump")], world, env=env)
    check(r.returncode == 0, f"{name}: exit code {r.returncode}")
    plan = harness.run_tetra(args, ["--config", path, "--dry-run"], 1)
    return out, plan.stdout


def main():
    args = harness.parse_args()
    for model_name, model, layouts in [
            ("dense", MODEL, [("dp2_zero1_bf16", {"dp": 2, "zero_stage": 1}, "bf16"),
                              ("dp2_zero2_fp32", {"dp": 2, "zero_stage": 2}, "fp32"),
                              ("dp2_zero3_fp32", {"dp": 2, "zero_stage": 3}, "fp32"),
                              ("tp2_dp2_sp_zero3_bf16", {"tp": 2, "dp": 2, "sequence_parallel": True, "zero_stage": 3},
                               "bf16"),
                              ("pp2_dp2_zero1_bf16", {"pp": 2, "dp": 2, "zero_stage": 1}, "bf16")]),
            ("moe", MOE, [("dp2_ep2_zero2_bf16", {"dp": 2, "ep": 2, "zero_stage": 2}, "bf16"),
                          ("tp2_etp1_ep4_dp2_sp_zero1_bf16", {"tp": 2, "etp": 1, "ep": 4, "dp": 2,
                                                              "sequence_parallel": True, "zero_stage": 1}, "bf16")])]:
        for name, par, precision in layouts:
            plain = dict(par, zero_stage=0, distributed_optimizer=False)
            ref, _ = run(args, f"{model_name}_{name}_unsharded", model, plain, precision)
            out, plan = run(args, f"{model_name}_{name}", model, par, precision)
            got = os.path.join(out, "model.safetensors")
            check(os.path.exists(got) and filecmp.cmp(got, os.path.join(ref, "model.safetensors"), shallow=False),
                  f"{model_name} {name}: model.safetensors byte for byte the run without the distributed optimizer's")
            init = os.path.join(out, "dump", "params_init.safetensors")
            check(os.path.exists(init) and not filecmp.cmp(got, init, shallow=False),
                  f"{model_name} {name}: the weights moved in training (the final file is not the initial one)")
            check(os.path.exists(init) and filecmp.cmp(init, os.path.join(ref, "dump", "params_init.safetensors"),
                                                         shallow=False),
                  f"{model_name} {name}: the initial weights, generated shard by shard, are the whole buffer's")
            staging = [l for l in plan.splitlines() if l.strip().startswith("staging")]
            if precision == "fp32" and par.get("zero_stage") != 3:  # the whole fp32 master weights are kept
                check(not staging, f"{model_name} {name}: nothing staged ({staging})")
                continue
            check(len(staging) == 1 and "a bucket at a time" in staging[0] and "start-up" not in staging[0],
                  f"{model_name} {name}: the plan stages one bucket for the final weights, nothing at start-up "
                  f"({staging})")
    # Loading into the shards: a checkpoint saved at step 2 without the distributed optimizer, resumed
    # sharded (each rank reads its shard of the weights, the compute weights gathered over DP), and
    # one saved sharded, resumed unsharded: the final file is the uninterrupted run's, byte for byte.
    for name, saved, resumed, precision in [
            ("zero0_to_zero1_bf16", {"dp": 2}, {"dp": 2, "zero_stage": 1}, "bf16"),
            ("zero3_to_zero0_bf16_tp2", {"dp": 2, "tp": 2, "sequence_parallel": True, "zero_stage": 3},
             {"dp": 2, "tp": 2, "sequence_parallel": True}, "bf16"),
            ("zero0_to_zero3_fp32", {"dp": 2}, {"dp": 2, "zero_stage": 3}, "fp32")]:
        whole, _ = run(args, f"resume_{name}_whole", MODEL, saved, precision, steps=4)
        ck = os.path.join(args.workdir, f"resume_{name}_ckpt")
        run(args, f"resume_{name}_save", MODEL, saved, precision, steps=4, checkpoint={"dir": ck, "every": 2})
        step2 = os.path.join(ck, "step_00000002")
        # (the saved slices read 37 elements at a time, so that each is read in many pieces, the
        # checksum carried across them: TETRA_TEST_CHECKPOINT_PIECE)
        out, _ = run(args, f"resume_{name}_resumed", MODEL, resumed, precision, steps=4, checkpoint={"resume": step2},
                     env={"TETRA_TEST_CHECKPOINT_PIECE": "37"})
        got = os.path.join(out, "model.safetensors")
        check(os.path.isdir(step2) and os.path.exists(got) and
              filecmp.cmp(got, os.path.join(whole, "model.safetensors"), shallow=False),
              f"{name}: resumed at step 2, the final weights are the uninterrupted run's byte for byte")
    # A corrupt slice is still caught when read in pieces: the last byte of a rank file flipped.
    import shutil
    src = os.path.join(args.workdir, "resume_zero0_to_zero1_bf16_ckpt", "step_00000002")
    bad = os.path.join(args.workdir, "corrupt", "step_00000002")
    if os.path.isdir(src):
        shutil.rmtree(os.path.dirname(bad), ignore_errors=True)
        shutil.copytree(src, bad)
        rank_file = os.path.join(bad, "rank_00000.safetensors")
        with open(rank_file, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x40]))
        out = os.path.join(args.workdir, "corrupt_run")
        cfg_path = harness.write_config(out, {
            "model": MODEL, "data": {"synthetic": True}, "logging": {"dir": out, "level": "warn"},
            "training": {"micro_batch_size": 2, "global_batch_size": 4, "steps": 4, "threads": 1, "peak_gflops": 100,
                         "seed": 11, "precision": "bf16"},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.0},
            "parallel": {"bucket_size": 700, "dp": 2, "zero_stage": 1}, "checkpoint": {"resume": bad}})
        r = harness.run_tetra(args, ["--config", cfg_path], 2, env={"TETRA_TEST_CHECKPOINT_PIECE": "37"}, expect=None)
        check(r.returncode != 0 and "fails its checksum" in r.stdout + r.stderr,
              f"a flipped byte in a slice read in pieces is refused as corrupt (exit {r.returncode})")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
