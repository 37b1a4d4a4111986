"""PyTorch peer for Tetra's CPU benchmarks: GPT-2 124M, forward + backward + AdamW per step.

The model is written the way a PyTorch user would write it for speed (nanoGPT style): one fused
qkv Linear, causal attention as q·k^T with a precomputed mask (masked_fill) and softmax (torch
1.13 has no F.scaled_dot_product_attention), F.layer_norm, F.gelu(approximate="tanh"), tied
embeddings, F.cross_entropy, torch.optim.AdamW with the usual two weight-decay groups (its
default single-tensor update: on the CPU the foreach variant measured 2-3x slower, its
temporaries costing more memory traffic than it saves). bf16 means torch.autocast("cpu", dtype=torch.bfloat16) around forward
and loss, with fp32 weights, grads and optimizer state - mixed precision as torch users run it.

Prints one JSON line: median ms/step over the timed steps (after warm-up), tokens/s, GFLOP/s
(6 N + 12 L T C FLOPs per token, N = matmul parameters including the tied lm_head) and the peak
resident set size of the process.

Usage: /usr/bin/python3 tools/bench_torch_gpt.py --seq-len 64 --precision fp32 [--batch 4]
       [--steps 3] [--warmup 2] [--threads 2]
"""
import argparse
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# GPT-2 124M.
VOCAB, LAYERS, HIDDEN, HEADS = 50257, 12, 768, 12


class CausalSelfAttention(nn.Module):
    def __init__(self, c, nh, max_t):
        super().__init__()
        self.nh = nh
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        future = torch.triu(torch.ones(max_t, max_t, dtype=torch.bool), diagonal=1)
        self.register_buffer("future", future.view(1, 1, max_t, max_t), persistent=False)

    def forward(self, x):  # (B,T,C)
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.nh, c // self.nh).transpose(1, 2)  # (B,NH,T,HS)
        k = k.view(b, t, self.nh, c // self.nh).transpose(1, 2)
        v = v.view(b, t, self.nh, c // self.nh).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))  # (B,NH,T,T)
        att = att.masked_fill(self.future[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, c, nh, max_t):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c)
        self.attn = CausalSelfAttention(c, nh, max_t)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, max_t):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(max_t, HIDDEN)
        self.h = nn.ModuleList([Block(HIDDEN, HEADS, max_t) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * LAYERS))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):  # (B,T), (B,T) -> scalar loss
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def make_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("wpe")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("wpe")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def loaded_libraries(*needles):
    """Paths of the shared libraries mapped into this process whose file name contains a needle:
    which BLAS and which allocator torch really runs with (a reference BLAS makes fp32 GEMMs
    ~100x slower, glibc malloc costs a CPU trainer dearly)."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if any(n in os.path.basename(path) for n in needles):
                found.add(os.path.realpath(path))
    return sorted(found)


def main():
    ap = argparse.ArgumentParser(description="PyTorch GPT-2 124M training-step benchmark")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps ({args.steps}) must be >= 1 and --warmup ({args.warmup}) >= 0")

    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    b, t = args.batch, args.seq_len
    model = GPT(t)
    optimizer = make_optimizer(model)
    data = torch.randint(0, VOCAB, (args.warmup + args.steps, b, t + 1))
    bf16 = args.precision == "bf16"

    times_ms, losses = [], []
    for s in range(args.warmup + args.steps):
        inputs, targets = data[s, :, :-1].contiguous(), data[s, :, 1:].contiguous()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = (time.perf_counter() - start) * 1e3
        losses.append(loss.item())
        if s >= args.warmup:
            times_ms.append(elapsed)

    ms = statistics.median(times_ms)
    matmul_params = LAYERS * 12 * HIDDEN * HIDDEN + VOCAB * HIDDEN
    flops_per_token = 6 * matmul_params + 12 * LAYERS * t * HIDDEN
    tokens = b * t
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({
        "impl": "torch", "torch": torch.__version__, "seq_len": t, "batch": b,
        "precision": args.precision, "threads": args.threads,
        "blas": loaded_libraries("blas"), "allocator": loaded_libraries("tcmalloc", "jemalloc"),
        "steps": args.steps, "warmup": args.warmup,
        "ms_per_step": round(ms, 2), "ms_all": [round(x, 2) for x in times_ms],
        "tokens_per_s": round(tokens / (ms / 1e3), 2),
        "gflops": round(flops_per_token * tokens / (ms / 1e3) / 1e9, 2),
        "matmul_params": matmul_params,
        "peak_rss_mib": round(peak_rss_kib / 1024, 1),
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}))


if __name__ == "__main__":
    main()
