"""The CUDA backend trains like the CPU backend (the numerical reference).

For a GPT-2-style, a Llama-style (GQA, RoPE, SwiGLU, untied) and a Mixture-of-Experts tiny config,
Tetra trains 20 steps with training.device "cpu" and then "cuda" on the same data and seed, and
checks:
  - fp32: the loss of every step and the gradient norms match (FP32_RTOL), and every parameter's
    step-0 gradient (dumped) matches per tensor (FP32_GRAD_RTOL);
  - bf16: the loss curves match within BF16_RTOL;
  - fp16 (dynamic loss scaling): the loss curves match within FP16_RTOL, no step overflows at the
    default scale on either backend; and started at initial_loss_scale 2^30 both backends skip the
    same leading steps for overflow, halving the scale alike, before training;
  - the loss falls (the comparison is not between two runs that learn nothing).
Where no GPU is visible, Tetra refuses training.device "cuda" with exit code 2 and says so; the
test then exits 77, which ctest reports as skipped (never failed, never silently passed).

Usage: /usr/bin/python3 test_train_parity.py --tetra BIN --workdir DIR
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
import harness  # noqa: E402
from harness import Checks, read_safetensors  # noqa: E402

# ---- tolerances ---------------------------------------------------------------------------------
# fp32 on both backends, but every sum in another order: cuBLASLt splits K differently from
# oneDNN, the attention kernel accumulates its online softmax per tile, norms and the loss reduce
# with warp trees. Each op's result moves by a few fp32 roundings (6e-8) relative; through the ~30
# ops of two blocks a gradient tensor moves by ~1e-6 relative (the same order as a tensor-parallel
# layout, measured there at 3e-7), and over 20 Adam steps the losses stay within ~1e-5. 1e-4
# leaves a margin; a wrong kernel (a missed row, a wrong scale, a dropped bias gradient) moves the
# loss by > 1e-3 within a step or two.
FP32_RTOL = 1e-4
FP32_GRAD_RTOL = 1e-4
# bf16: both backends round activations to 8 mantissa bits (2^-9 = 2e-3 relative) but at values
# computed in different orders, so individual roundings differ by one bf16 ulp; over 20 steps the
# loss curves stay within a few bf16 roundings of the loss: 2e-2 (the bound the layouts use).
BF16_RTOL = 2e-2
# fp16: the same argument with 11 significant bits (2^-12 relative per rounding, 8x finer than
# bf16): 2e-2 / 8 = 2.5e-3, doubled for margin.
FP16_RTOL = 5e-3

STEPS = 20
MODELS = {
    "gpt2": {"vocab_size": 96, "seq_len": 32, "num_layers": 2, "hidden_size": 64, "num_heads": 4,
             "ffn_hidden_size": 128},
    "llama": {"vocab_size": 96, "seq_len": 32, "num_layers": 2, "hidden_size": 64, "num_heads": 4,
              "num_kv_heads": 2, "ffn_hidden_size": 96, "norm": "rmsnorm", "activation": "swiglu",
              "position": "rope", "tie_embeddings": False, "bias": False},
    "moe": {"vocab_size": 96, "seq_len": 32, "num_layers": 2, "hidden_size": 64, "num_heads": 4,
            "ffn_hidden_size": 128, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 64}},
}

checks = Checks()
check = checks.check


def config(model, precision, device):
    return {
        "model": MODELS[model],
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "threads": 2,
                     "peak_gflops": 100, "precision": precision, "seed": 11, "device": device},
        "optimizer": {"lr": 1e-2, "warmup_steps": 3, "grad_clip": 1.0, "weight_decay": 0.1},
        "data": {"synthetic": True},
        "logging": {"level": "warn"},
    }


def run(args, name, cfg):
    out = os.path.join(args.workdir, name)
    cfg["logging"]["dir"] = out
    path = harness.write_config(out, cfg)
    # expect=None: the caller prints the output, or not where the GPU is missing (a skip).
    r = harness.run_tetra(args, ["--config", path, "--dump-dir", os.path.join(out, "dump")], timeout=600,
                          env={"OMP_NUM_THREADS": "2"}, expect=None)
    if r.returncode != 0:
        return r, None
    grads = read_safetensors(os.path.join(out, "dump", "grads_step0.safetensors"))[0]
    return r, (harness.step_records(out), grads)


def main():
    args = harness.parse_args(mpirun=False)

    for model in MODELS:
        for precision in ("fp32", "bf16", "fp16"):
            name = f"{model}_{precision}"
            r, gpu = run(args, name + "_cuda", config(model, precision, "cuda"))
            if gpu is None:
                if r.returncode == 2 and ("no CUDA device is visible" in r.stderr
                                          or "built without the CUDA backend" in r.stderr):
                    print(r.stderr.strip().splitlines()[-1])
                    print("no GPU: skipped")
                    return 77
                print(r.stdout[-3000:], r.stderr[-3000:])
                check(False, f"{name}: cuda run exit code {r.returncode}")
                continue
            log = r.stdout + r.stderr
            check("kernels: attention forward" in log, f"{name}: the log names the attention path that ran")
            if model == "gpt2":  # a GELU MLP: the log says where its GELU ran
                check("MLP GELU" in log, f"{name}: the log names where the MLP's GELU ran")
            r, cpu = run(args, name + "_cpu", config(model, precision, "cpu"))
            if cpu is None:
                print(r.stdout[-3000:], r.stderr[-3000:])
                check(False, f"{name}: cpu run exit code {r.returncode}")
                continue
            cpu_losses = [s["loss"] for s in cpu[0]]
            gpu_losses = [s["loss"] for s in gpu[0]]
            check(len(gpu_losses) == STEPS and len(cpu_losses) == STEPS, f"{name}: {STEPS} steps logged")
            harness.check_loss_falls(checks, name, cpu_losses)
            rtol = {"fp32": FP32_RTOL, "bf16": BF16_RTOL, "fp16": FP16_RTOL}[precision]
            if precision == "fp16":
                check(not any(s["overflow"] for s in cpu[0] + gpu[0]),
                      f"{name}: no overflow at the default loss scale on either backend")
            worst = harness.worst_step_rel(gpu[0], cpu[0])
            check(worst <= rtol, f"{name}: cuda losses of {STEPS} steps within {rtol:g} of cpu (worst {worst:.2e})")
            if precision == "fp32":
                worst_norm = harness.worst_step_rel(gpu[0], cpu[0], "grad_norm")
                check(worst_norm <= 10 * FP32_RTOL, f"{name}: gradient norms within {10 * FP32_RTOL:g} "
                                                    f"(worst {worst_norm:.2e})")
                harness.check_gradients(checks, name, cpu[1], gpu[1], FP32_GRAD_RTOL)
        # fp16 from a scale far too large: the same leading overflow steps on both backends.
        name = f"{model}_fp16_descent"
        runs = {}
        for device in ("cuda", "cpu"):
            cfg = config(model, "fp16", device)
            cfg["training"]["initial_loss_scale"] = 2 ** 30
            r, got = run(args, f"{name}_{device}", cfg)
            if got is None:
                print(r.stdout[-3000:], r.stderr[-3000:])
                check(False, f"{name}: {device} run exit code {r.returncode}")
                break
            runs[device] = got[0]
        if len(runs) == 2:
            def leading(rows):
                k = 0
                while k < len(rows) and rows[k]["overflow"]:
                    k += 1
                return k
            k_gpu, k_cpu = leading(runs["cuda"]), leading(runs["cpu"])
            check(k_gpu == k_cpu >= 3 and
                  [s["loss_scale"] for s in runs["cuda"][:k_gpu + 1]] == [s["loss_scale"] for s in runs["cpu"][:k_cpu + 1]],
                  f"{name}: both backends skip the first {k_cpu} (cpu) / {k_gpu} (cuda) steps for overflow, "
                  f"with the same loss scales")
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
