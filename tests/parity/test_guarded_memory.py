"""Backend memory is not host memory: the trainer reaches it only through the backend.

On a GPU, memory from Backend::alloc is device memory: the host may read or write it only through
copy_to_host / copy_from_host, and collectives on it go through the backend-memory communicators
(trainer/comm/process_groups.h). TETRA_TEST_GUARDED_MEMORY=1 makes the CPU backend's memory
PROT_NONE outside its own ops (kernels/cpu/guarded_backend.h) and stages the backend-memory
collectives through host buffers (trainer/comm/staged_communicator.h), so any host access the
trainer makes to backend memory kills the run, and any backend op given host memory fails it.

Each configuration runs twice, plainly and guarded, and must give bitwise-identical results (the
same CPU kernels run on the same values, and the staging only copies): the losses, validation
losses and gradient norms of every step as metrics.jsonl writes them, the final weights file, the
checkpoints' tensor files and tensor index, the --dump-dir tensors, the text samples and `tetra
generate`'s output. The guarded runs must really be guarded (every rank warns that it is) and their
communication must still match the prediction exactly in every step (each group's volume is the sum
of its host and backend-memory communicators').

Configurations (tiny models, few steps; synthetic data; a byte-level GPT-2 tokenizer written here
for the samples):
  single rank  GPT-2 fp32 (eval, samples, --dump-dir, checkpoint at step 3 then resume, final
               weights, `tetra generate`); Llama bf16 (eval, checkpoint and resume); Llama-style MoE
               with a capacity factor (drops)
  mpirun -np 2 dp2 with the distributed optimizer, bf16 precision and bf16 gradient compression;
               tp2 with sequence parallelism (samples over TP); pp2 1f1b with tied embeddings (eval
               through the stages); MoE ep2; 1-bit Adam (checkpoint in the compressed phase, then
               resume: its error-feedback state); 1-bit Adam with the distributed optimizer
  mpirun -np 4 1-bit Adam on pp2 x dp2 with tied embeddings (the embedding's piece of its own on
               both stages; checkpoint in the compressed phase, then resume); int8 on a MoE model,
               dp4 = expert-DP 2 x ep2, with the distributed optimizer (the dense and expert parts'
               exchanges over DP and expert-DP; checkpoint, then resume: both parts' errors)
  watchdog     tp2, guarded, one rank hanging: the other rank's wait in a staged collective is seen
               by the watchdog, which names the group and ends the job (exit code 3)

Usage: /usr/bin/python3 test_guarded_memory.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import json
import os
import re
import sys

import harness
from harness import Checks

checks = Checks()
check = checks.check


GPT2 = {"vocab_size": 320, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64}
LLAMA = {"vocab_size": 64, "make_vocab_size_divisible_by": 1, "seq_len": 16, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 48, "norm": "rmsnorm", "activation": "swiglu", "position": "rope",
         "tie_embeddings": False, "bias": False}
GPT2_MOE = dict(GPT2, vocab_size=64, make_vocab_size_divisible_by=1,
                moe={"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001})
LLAMA_MOE = dict(LLAMA, moe={"num_experts": 4, "top_k": 1, "every": 2, "ffn_hidden_size": 24, "aux_loss_coeff": 0.01,
                             "capacity_factor": 1.0})


def bytes_to_unicode():
    """GPT-2's byte <-> printable character table (encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(d):
    """A byte-level GPT-2 tokenizer: 256 byte tokens, one merge ("th" = 256), <|endoftext|> = 257."""
    os.makedirs(d, exist_ok=True)
    enc = {c: b for b, c in bytes_to_unicode().items()}
    enc["th"] = 256
    enc["<|endoftext|>"] = 257
    with open(os.path.join(d, "encoder.json"), "w") as f:
        json.dump(enc, f)
    with open(os.path.join(d, "vocab.bpe"), "w") as f:
        f.write("#version: 0.2\nt h\n")
    return "gpt2:" + d


def config(model, steps, precision="fp32", parallel=None, training=None, **extra):
    cfg = {
        "model": model,
        "parallel": dict({"bucket_size": 2000}, **(parallel or {})),
        "training": dict({"micro_batch_size": 2, "global_batch_size": 4, "steps": steps, "threads": 1,
                          "peak_gflops": 100, "seed": 5, "precision": precision}, **(training or {})),
        "optimizer": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0, "weight_decay": 0.1},
        "data": {"synthetic": True},
    }
    cfg.update(extra)
    return cfg


def world_of(cfg):
    p = cfg["parallel"]
    return p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1)


def guard_env(guarded):
    """The environment that guards backend memory, or leaves it plain (whatever the caller's)."""
    return {"TETRA_TEST_GUARDED_MEMORY": "1" if guarded else None}


def run(args, cfg, out, guarded, extra=(), name=""):
    """Runs tetra on cfg with logging.dir = out; returns its combined output (None on failure)."""
    cfg = json.loads(json.dumps(cfg))
    cfg["logging"] = {"dir": out, "level": "info"}
    path = harness.write_config(out, cfg, fresh=False)
    world = world_of(cfg)
    r = harness.run_tetra(args, ["--config", path, *extra], world, timeout=120, env=guard_env(guarded))
    text = r.stdout + r.stderr
    mode = "guarded" if guarded else "plain"
    check(r.returncode == 0, f"{name} ({mode}): exit code {r.returncode}")
    if r.returncode != 0:
        return None
    if guarded:
        warned = text.count("TETRA_TEST_GUARDED_MEMORY=1: backend memory is guarded")
        check(warned == world, f"{name}: every rank runs guarded ({warned} of {world} warned)")
    return text


def metrics(out):
    """The step records of metrics.jsonl: (raw line fields that must match, parsed record)."""
    steps = []
    for line, j in harness.metrics_lines(out):
        if "step" in j:
            raw = {k: harness.raw_field(line, k) for k in ("loss", "grad_norm", "val_loss") if f'"{k}":' in line}
            steps.append((j["step"], raw, j.get("sample"), j))
    return steps


def same_file(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


def compare_runs(name, plain, guarded, checkpoints=(), dumps=False, samples=False):
    """Bitwise comparison of two logging dirs (and their checkpoint dirs)."""
    mp, mg = metrics(plain), metrics(guarded)
    check(len(mp) > 0 and [(s, raw) for s, raw, _, _ in mp] == [(s, raw) for s, raw, _, _ in mg],
          f"{name}: losses, grad norms and val losses identical in every step ({len(mp)} records)")
    mismatched = harness.comm_mismatches([rec for _, _, _, rec in mg], exact=False)[0]
    check(not mismatched, f"{name}: guarded run's communication == prediction every step (mismatched {mismatched})")
    if samples:
        sp = [x for _, _, x, _ in mp if x is not None]
        check(len(sp) > 0 and sp == [x for _, _, x, _ in mg if x is not None],
              f"{name}: text samples identical ({len(sp)} samples)")
    check(same_file(os.path.join(plain, "model.safetensors"), os.path.join(guarded, "model.safetensors")),
          f"{name}: final weights identical")
    for step in checkpoints:
        cp, cg = (os.path.join(d, "ckpt", f"step_{step:08d}") for d in (plain, guarded))
        files = sorted(f for f in os.listdir(cp) if f.endswith(".safetensors"))
        check(len(files) > 0 and files == sorted(f for f in os.listdir(cg) if f.endswith(".safetensors")) and
              all(same_file(os.path.join(cp, f), os.path.join(cg, f)) for f in files),
              f"{name}: checkpoint step {step}: tensor files identical ({len(files)} files)")
        with open(os.path.join(cp, "manifest.json")) as f, open(os.path.join(cg, "manifest.json")) as g:
            check(json.load(f)["tensors"] == json.load(g)["tensors"], f"{name}: checkpoint step {step}: tensor index identical")
    if dumps:
        files = sorted(os.listdir(os.path.join(plain, "dump")))
        check(len(files) == 3 and all(same_file(os.path.join(plain, "dump", f), os.path.join(guarded, "dump", f))
                                      for f in files), f"{name}: --dump-dir tensors identical ({files})")


def main():
    args = harness.parse_args()
    w = args.workdir
    tokenizer = write_tokenizer(os.path.join(w, "tokenizer"))
    samples = {"sample": {"prompt": "the cat", "max_tokens": 6, "temperature": 0.8, "top_k": 20, "seed": 3}}
    evals = {"eval_every": 3, "eval_steps": 1}

    def pair(name, cfg, checkpoints=(), resume_at=0, dumps=False, with_samples=False, generate=False):
        """Runs cfg plainly and guarded (with a stop at resume_at and a resume, when given) and compares."""
        dirs, texts = {}, {}
        for guarded in (False, True):
            mode = "guarded" if guarded else "plain"
            out = os.path.join(w, name, mode)
            c = json.loads(json.dumps(cfg))
            c["checkpoint"] = {"dir": os.path.join(out, "ckpt"), "keep": 5, "save_on_exit": True, "resume": "auto"}
            extra = ["--dump-dir", os.path.join(out, "dump")] if dumps else []
            if resume_at:
                first = json.loads(json.dumps(c))
                first["training"]["exit_interval"] = resume_at
                if run(args, first, out, guarded, extra, f"{name} first {resume_at} steps") is None:
                    return
                extra = []
            if run(args, c, out, guarded, extra, name) is None:
                return
            dirs[guarded] = out
            if generate:
                r = harness.run_tetra(args, ["generate", "--config", os.path.join(out, "config.json"),
                                             "--max-tokens", "10"], timeout=60, env=guard_env(guarded))
                check(r.returncode == 0, f"{name}: tetra generate ({mode})")
                texts[guarded] = r.stdout
        compare_runs(name, dirs[False], dirs[True], checkpoints, dumps, with_samples)
        if generate:
            check(texts[False] == texts[True] and texts[False].startswith("the cat"),
                  f"{name}: tetra generate writes the same text ({texts[False].strip()!r})")

    gpt2 = config(GPT2, 6, training=evals, **samples)
    gpt2["data"]["tokenizer"] = tokenizer
    pair("gpt2_fp32", gpt2, checkpoints=(3, 6), resume_at=3, dumps=True, with_samples=True, generate=True)
    pair("llama_bf16", config(LLAMA, 6, "bf16", training=evals), checkpoints=(3, 6), resume_at=3)
    pair("moe_capacity", config(LLAMA_MOE, 4, training=evals), checkpoints=(4,))

    pair("dp2_distopt_bf16", config(LLAMA, 4, "bf16", {"dp": 2, "distributed_optimizer": True,
                                                        "grad_compression": "bf16"}), checkpoints=(4,))
    tp2 = config(GPT2, 4, parallel={"tp": 2, "sequence_parallel": True}, training=evals, **samples)
    tp2["data"]["tokenizer"] = tokenizer
    pair("tp2_sp", tp2, checkpoints=(4,), with_samples=True)
    pair("pp2_1f1b_tied", config(dict(GPT2, num_layers=4), 4, parallel={"pp": 2, "schedule": "1f1b"},
                                 training=dict(evals, global_batch_size=8)), checkpoints=(4,))
    pair("moe_ep2", config(GPT2_MOE, 4, parallel={"dp": 2, "ep": 2}), checkpoints=(4,))
    pair("onebit_dp2", config(LLAMA, 6, parallel={"dp": 2, "grad_compression": "onebit", "onebit_warmup_steps": 2}),
         checkpoints=(4, 6), resume_at=4)
    pair("onebit_dp2_distopt", config(LLAMA, 4, parallel={"dp": 2, "grad_compression": "onebit",
                                                          "onebit_warmup_steps": 2, "distributed_optimizer": True}),
         checkpoints=(4,))
    pair("onebit_pp2_dp2_tied", config(dict(GPT2, num_layers=4), 6,
                                       parallel={"pp": 2, "dp": 2, "schedule": "1f1b", "grad_compression": "onebit",
                                                 "onebit_warmup_steps": 2},
                                       training={"global_batch_size": 8}), checkpoints=(4, 6), resume_at=4)
    pair("int8_moe_dp4_ep2_distopt", config(GPT2_MOE, 4, parallel={"dp": 4, "ep": 2, "grad_compression": "int8",
                                                                   "distributed_optimizer": True},
                                            training={"global_batch_size": 8}), checkpoints=(2, 4), resume_at=2)

    # The watchdog sees waits on the backend-memory communicators: rank 1 hangs at the start of
    # step 2 (trainer/comm/watchdog.h's test hook); rank 0, waiting in a tensor-parallel collective
    # on activations (a staged one), is reported by the watchdog, which ends the job with exit code 3.
    hang = config(GPT2, 20, parallel={"tp": 2}, training={"collective_timeout_s": 3, "log_every": 100})
    out = os.path.join(w, "watchdog")
    hang["logging"] = {"dir": out}
    path = harness.write_config(out, hang, fresh=False)
    r = harness.run_tetra(args, ["--config", path], 2, timeout=120, expect=None,
                          env={"TETRA_TEST_GUARDED_MEMORY": "1", "TETRA_TEST_HANG_RANK": "1", "TETRA_TEST_HANG_STEP": "2"})
    waiting = re.search(r"watchdog: rank 0 .* waiting [0-9.]+ s in [a-z_]+ on group 'tp'", r.stderr)
    check(r.returncode == 3 and waiting is not None,
          f"watchdog: a hang is reported by the rank waiting in a staged collective (exit code {r.returncode})")
    if not waiting:
        print(r.stderr[-3000:])

    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
