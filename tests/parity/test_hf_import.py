"""`tetra ckpt import-hf` and `checkpoint.init` against Hugging Face's own maths.

For each family the test writes a random-weight model directory in Hugging Face's key names and
layout (config.json + model.safetensors; one of them sharded with model.safetensors.index.json,
one stored in bf16):
  - llama: GQA, untied, RoPE scaling "llama3" (all three frequency bands at this head size);
  - qwen2: biases on q/k/v only, tied embeddings, head_dim 24 (not hidden / heads = 16), RoPE
    "linear" given as transformers v5's rope_parameters (with rope_theta inside);
  - qwen3: per-head RMSNorm on q and k (q_norm, k_norm) before RoPE, head_dim 32 (not 16), tied;
  - gpt2: Conv1D weights, learned positions, the original release's names (no "transformer.").
Then `tetra ckpt import-hf` writes a step-0 checkpoint and model.json, and `tetra train` starts from
it (checkpoint.init) for one step on tp 1, tp 2 with sequence parallelism, and pp 2: the loss Tetra
reports for that step equals the Hugging Face forward written here from transformers' modeling
code (float64; rotate-half RoPE with the scaling rules, repeat_kv, RMSNorm, SwiGLU, q/k/v bias,
Conv1D x W + b) on the dumped batch, relative 1e-5 (Tetra computes in fp32). The imported weights
are also checked bit for bit against the files (bf16 values widened exactly).

`tetra ckpt export-hf` of the imported checkpoint gives back the same tensors bit for bit under
the same names, and a config.json with the same RoPE frequencies and head size; with
--max-shard-size below the model's size it writes shards and the index, which import again.

`tetra generate --prompt-ids ... --logits-out` from the HF directory itself and from the imported
checkpoint: the prompt's logits equal the Hugging Face forward's (1e-5 of the largest), and greedy
generation matches it token for token over 10 steps (the window sliding past seq_len).
Import -> 10 steps on dp 2 x tp 2 (SP, distributed optimizer, vocabulary padded to 128 rows) ->
export-hf: the Hugging Face forward of the exported files gives the loss Tetra computes with the
trained weights.

Mixture of Experts: Mixtral (MixtralForCausalLM, gates renormalised over the top-2, stored in
bf16 over two shards), Qwen3-MoE (Qwen3MoeForCausalLM, q/k norms, top-3 of 8, norm_topk_prob) and
Qwen2-MoE (Qwen2MoeForCausalLM, q/k/v biases, top-2 of 8 not renormalised, a shared expert scaled
by sigmoid(h . shared_expert_gate)) go through all of the above, with the HF forward's sparse MoE block written from transformers'
modeling code, and also train one step on dp 2 x tp 2 x ep 2 (SP) and dp 2 x ep 2 x pp 2 against
the HF forward of the same global batch.

Refusals (exit 2, the message naming the key or tensor, nothing written): a sliding window, a
RoPE type Tetra lacks, an unknown model_type, a tensor the model does not have, a missing tensor,
a non-empty OUT; for MoE a shared expert in Qwen3-MoE, DeepSeek (MLA), a decoder_sparse_step other
than 1, dense layers among the experts, router jitter, experts in a dense family.

Usage: /usr/bin/python3 test_hf_import.py --tetra BIN --workdir DIR [--mpirun MPIRUN]
"""
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F

import harness
from harness import Checks, rel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

checks = Checks()
check = checks.check
# Tetra's fp32 loss against a float64 forward of the same function: reductions of length <= 96
# through ~20 ops stay near 1e-6 relative; 1e-5 is far below what a misplaced row or a wrong
# frequency changes (1e-2 and more).
LOSS_RTOL = 1e-5


def bf16(a):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_bf16_safetensors(path, tensors):
    """safetensors with BF16 tensors (the reference writer has no bf16): bits in uint16 relabelled."""
    write_safetensors(path, {n: bf16(a).view(np.float16) for n, a in tensors.items()})
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__":
            v["dtype"] = "BF16"
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + data[8 + n:])


# ---- random models in Hugging Face's layout -----------------------------------------------------

def llama_like(kind):
    rng = np.random.default_rng({"llama": 7, "qwen2": 8, "qwen3": 10, "mixtral": 11, "qwen3_moe": 12,
                                 "qwen2_moe": 13}[kind])
    if kind == "mixtral":  # MixtralForCausalLM: 4 experts, top-2, gates renormalised over the two
        cfg = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 72, "hidden_size": 64,
               "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
               "rope_theta": 1000000.0, "tie_word_embeddings": False, "sliding_window": None,
               "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
               "output_router_logits": False, "router_jitter_noise": 0.0}
        hd = 16
    elif kind == "qwen2_moe":  # Qwen2MoeForCausalLM: q/k/v biases, 8 experts top-2, a gated shared expert
        cfg = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 76,
               "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 24,
               "shared_expert_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
               "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
               "use_sliding_window": False, "sliding_window": None, "max_window_layers": 21, "num_experts": 8,
               "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "router_aux_loss_coef": 0.001, "output_router_logits": False}
        hd = 16
    elif kind == "qwen3_moe":  # Qwen3MoeForCausalLM: q/k norms, 8 experts, top-3, norm_topk_prob
        cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 84,
               "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
               "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
               "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
               "sliding_window": None, "max_window_layers": 28, "num_experts": 8, "num_experts_per_tok": 3,
               "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "router_aux_loss_coef": 0.001, "output_router_logits": False}
        hd = 32
    elif kind == "qwen3":
        cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 88, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "tie_word_embeddings": True, "attention_bias": False,
               "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
        hd = 32
    elif kind == "llama":
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
               "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
        hd = 16
    else:
        cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 80, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 24, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 4096,
               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
        hd = 24
    C, F_, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    NH, NKV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = lambda *s: (rng.standard_normal(s) * 0.08).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": w(V, C), "model.norm.weight": 1 + w(C)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + w(C)
        sd[p + "post_attention_layernorm.weight"] = 1 + w(C)
        sd[p + "self_attn.q_proj.weight"] = w(NH * hd, C)
        sd[p + "self_attn.k_proj.weight"] = w(NKV * hd, C)
        sd[p + "self_attn.v_proj.weight"] = w(NKV * hd, C)
        sd[p + "self_attn.o_proj.weight"] = w(C, NH * hd)
        if kind == "mixtral":
            E, FE = cfg["num_local_experts"], cfg["intermediate_size"]
            sd[p + "block_sparse_moe.gate.weight"] = 4 * w(E, C)
            for e in range(E):
                x = p + f"block_sparse_moe.experts.{e}."
                sd[x + "w1.weight"], sd[x + "w3.weight"], sd[x + "w2.weight"] = w(FE, C), w(FE, C), w(C, FE)
        elif kind in ("qwen3_moe", "qwen2_moe"):
            E, FE = cfg["num_experts"], cfg["moe_intermediate_size"]
            sd[p + "mlp.gate.weight"] = 4 * w(E, C)
            for e in range(E):
                x = p + f"mlp.experts.{e}."
                sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"] = w(FE, C), w(FE, C)
                sd[x + "down_proj.weight"] = w(C, FE)
            if kind == "qwen2_moe":
                FS = cfg["shared_expert_intermediate_size"]
                sd[p + "mlp.shared_expert.gate_proj.weight"], sd[p + "mlp.shared_expert.up_proj.weight"] = w(FS, C), w(FS, C)
                sd[p + "mlp.shared_expert.down_proj.weight"] = w(C, FS)
                sd[p + "mlp.shared_expert_gate.weight"] = 4 * w(1, C)
        else:
            sd[p + "mlp.gate_proj.weight"] = w(F_, C)
            sd[p + "mlp.up_proj.weight"] = w(F_, C)
            sd[p + "mlp.down_proj.weight"] = w(C, F_)
        if kind in ("qwen2", "qwen2_moe"):
            for x, n in (("q", NH), ("k", NKV), ("v", NKV)):
                sd[p + f"self_attn.{x}_proj.bias"] = w(n * hd)
        if kind in ("qwen3", "qwen3_moe"):  # RMSNorm over each head's q and k (one weight of head_dim each)
            sd[p + "self_attn.q_norm.weight"] = 1 + 3 * w(hd)
            sd[p + "self_attn.k_norm.weight"] = 1 + 3 * w(hd)
        sd[p + "self_attn.rotary_emb.inv_freq"] = np.zeros(hd // 2, np.float32)  # a buffer: ignored
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(V, C)
    return cfg, sd


def gpt2_like():
    rng = np.random.default_rng(9)
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 72, "n_positions": 32,
           "n_embd": 48, "n_layer": 2, "n_head": 4, "n_inner": None, "activation_function": "gelu_new",
           "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
    C, V, T = 48, 72, 32
    w = lambda *s: (rng.standard_normal(s) * 0.08).astype(np.float32)  # noqa: E731
    sd = {"wte.weight": w(V, C), "wpe.weight": w(T, C), "ln_f.weight": 1 + w(C), "ln_f.bias": w(C)}
    for i in range(2):
        p = f"h.{i}."
        sd.update({p + "ln_1.weight": 1 + w(C), p + "ln_1.bias": w(C), p + "ln_2.weight": 1 + w(C),
                   p + "ln_2.bias": w(C), p + "attn.c_attn.weight": w(C, 3 * C), p + "attn.c_attn.bias": w(3 * C),
                   p + "attn.c_proj.weight": w(C, C), p + "attn.c_proj.bias": w(C),
                   p + "mlp.c_fc.weight": w(C, 4 * C), p + "mlp.c_fc.bias": w(4 * C),
                   p + "mlp.c_proj.weight": w(4 * C, C), p + "mlp.c_proj.bias": w(C),
                   p + "attn.bias": np.tril(np.ones((1, 1, T, T), np.float32))})  # the mask buffer
    return cfg, sd


def write_hf(d, cfg, sd, shards=1, dtype="fp32"):
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    writer = write_bf16_safetensors if dtype == "bf16" else write_safetensors
    if shards == 1:
        writer(os.path.join(d, "model.safetensors"), sd)
        return
    names = sorted(sd)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        writer(os.path.join(d, file), {n: sd[n] for n in part})
        weight_map.update({n: file for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ---- the Hugging Face forward, from transformers' modeling code ----------------------------------

def inv_freq_hf(cfg, hd):
    """_compute_default / linear / llama3 rope parameters (modeling_rope_utils.py), float64."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "linear":
        return inv / rp["factor"]
    if kind == "llama3":
        factor, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]
        low_wl, high_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, inv_l)
    return inv


def sparse_moe(sd, cfg, p, h):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: softmax over the router's logits, the top-k
    experts, their weights renormalised (Mixtral always, Qwen3-MoE with norm_topk_prob), the
    weighted sum of the chosen SwiGLU experts."""
    mixtral = cfg["model_type"] == "mixtral"
    pre = p + ("block_sparse_moe." if mixtral else "mlp.")
    E = cfg["num_local_experts"] if mixtral else cfg["num_experts"]
    probs = torch.softmax(h @ sd[pre + "gate.weight"].T, dim=-1)
    top, idx = torch.topk(probs, cfg["num_experts_per_tok"], dim=-1)
    if mixtral or cfg.get("norm_topk_prob"):
        top = top / top.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(E):
        x = pre + f"experts.{e}."
        w1, w3, w2 = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
        y = (F.silu(h @ sd[x + w1 + ".weight"].T) * (h @ sd[x + w3 + ".weight"].T)) @ sd[x + w2 + ".weight"].T
        out = out + (top * (idx == e)).sum(dim=-1, keepdim=True) * y
    if pre + "shared_expert_gate.weight" in sd:  # Qwen2-MoE: + sigmoid(h . g) * shared_expert(h)
        x = pre + "shared_expert."
        y = (F.silu(h @ sd[x + "gate_proj.weight"].T) * (h @ sd[x + "up_proj.weight"].T)) @ sd[x + "down_proj.weight"].T
        out = out + torch.sigmoid(h @ sd[pre + "shared_expert_gate.weight"].T) * y
    return out


def llama_logits(sd, cfg, tokens):
    c, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or c // nh
    eps = cfg["rms_norm_eps"]
    b, t = tokens.shape

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)

    def repeat_kv(x, n):
        bb, kv, tt, d = x.shape
        return x[:, :, None].expand(bb, kv, n, tt, d).reshape(bb, kv * n, tt, d)

    def lin(h, p, name):
        y = h @ sd[p + name + ".weight"].T
        return y + sd[p + name + ".bias"] if p + name + ".bias" in sd else y

    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq_hf(cfg, hd))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), diagonal=1)
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = lin(h, p, "self_attn.q_proj").view(b, t, nh, hd)
        k = lin(h, p, "self_attn.k_proj").view(b, t, nkv, hd)
        if p + "self_attn.q_norm.weight" in sd:  # Qwen3: q_norm / k_norm on each head, before RoPE
            q, k = rms(q, sd[p + "self_attn.q_norm.weight"]), rms(k, sd[p + "self_attn.k_norm.weight"])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = lin(h, p, "self_attn.v_proj").view(b, t, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
        a = torch.softmax((q @ k.transpose(2, 3)) * hd ** -0.5 + mask, dim=-1) @ v
        x = x + a.transpose(1, 2).reshape(b, t, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        if cfg["model_type"] in ("mixtral", "qwen3_moe", "qwen2_moe"):
            x = x + sparse_moe(sd, cfg, p, h)
            continue
        g = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + g @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return x @ head.T


def gpt2_logits(sd, cfg, tokens):
    c, nh, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd = c // nh
    b, t = tokens.shape
    heads = lambda z: z.view(b, t, nh, hd).permute(0, 2, 1, 3)  # noqa: E731
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    x = sd["wte.weight"][tokens] + sd["wpe.weight"][torch.arange(t)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        h = F.layer_norm(x, (c,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        q, k, v = (heads(z) for z in (h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]).split(c, 2))
        w = torch.where(mask, (q @ k.transpose(-1, -2)) / math.sqrt(hd), torch.tensor(-1e300, dtype=torch.float64))
        a = (torch.softmax(w, -1) @ v).permute(0, 2, 1, 3).reshape(b, t, c)
        x = x + a @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (c,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        u = h @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]
        u = 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + u @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), sd["ln_f.weight"], sd["ln_f.bias"], eps)
    return x @ sd["wte.weight"].T


# ---- the runs -----------------------------------------------------------------------------------

# (name, parallel, ranks, global batch, the run whose dumped batch it trains on: None = its own)
LAYOUTS = [("tp1", {}, 1, 2, None), ("tp2_sp", {"tp": 2, "sequence_parallel": True}, 2, 2, None),
           ("pp2", {"pp": 2}, 2, 2, None)]
# MoE models also on expert parallelism (carved out of dp 2, which dumps no batch: it trains on the
# same global batch of 4 as the single-rank run before it).
MOE_LAYOUTS = [("tp1_gbs4", {}, 1, 4, None),
               ("dp2_tp2_ep2_sp", {"dp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}, 4, 4, "tp1_gbs4"),
               ("dp2_ep2_pp2", {"dp": 2, "ep": 2, "pp": 2}, 4, 4, "tp1_gbs4")]


def family(args, kind, cfg, sd, shards, dtype, seq_len):
    work = os.path.join(args.workdir, kind)
    hf_dir, out = os.path.join(work, "hf"), os.path.join(work, "imported")
    write_hf(hf_dir, cfg, sd, shards, dtype)
    r = harness.run_tetra(args, ["ckpt", "import-hf", hf_dir, out] + (["--seq-len", str(seq_len)] if seq_len else []))
    check(r.returncode == 0, f"{kind}: import-hf exits 0 ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    with open(os.path.join(out, "model.json")) as f:
        model = json.load(f)["model"]
    ok, why = harness.inspect_checkpoint(args, os.path.join(out, "step_00000000"))
    check(ok, f"{kind}: the imported checkpoint verifies ({why})")
    # The weights as imported, bit for bit (bf16 files widen exactly).
    stored = sd if dtype == "fp32" else {n: (bf16(a).astype(np.uint32) << 16).view(np.float32) for n, a in sd.items()}
    ck = {}
    for fname in os.listdir(os.path.join(out, "step_00000000")):
        if fname.endswith(".safetensors"):
            ck.update(read_safetensors(os.path.join(out, "step_00000000", fname))[0])
    emb_name = "wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    wte = [a for n, a in ck.items() if n.startswith("model/embedding.wte#")]
    check(len(wte) == 1 and np.array_equal(wte[0].reshape(-1), stored[emb_name].reshape(-1)),
          f"{kind}: embedding.wte is the file's {emb_name} bit for bit")
    # Export is the inverse: the same tensors under the same names, bit for bit, and the same maths
    # in config.json (rope, head size, biases).
    exported = os.path.join(work, "exported")
    r = harness.run_tetra(args, ["ckpt", "export-hf", os.path.join(out, "step_00000000"), exported])
    check(r.returncode == 0, f"{kind}: export-hf of the import exits 0 ({r.stderr.strip()[-300:]})")
    if r.returncode == 0:
        back, _ = read_safetensors(os.path.join(exported, "model.safetensors"))
        prefix = "transformer." if kind == "gpt2" else ""
        want = {prefix + n: a for n, a in stored.items() if "rotary_emb" not in n and not n.endswith(".attn.bias")}
        check(sorted(back) == sorted(want) and all(np.array_equal(back[n], want[n]) for n in want),
              f"{kind}: export-hf gives back the imported tensors, names and values "
              f"(missing {sorted(set(want) - set(back))[:3]}, extra {sorted(set(back) - set(want))[:3]})")
        with open(os.path.join(exported, "config.json")) as f:
            ecfg = json.load(f)
        keys = (["n_embd", "n_layer", "n_head", "vocab_size"] if kind == "gpt2" else
                ["model_type", "hidden_size", "num_key_value_heads", "intermediate_size", "vocab_size",
                 "tie_word_embeddings"])
        if kind == "mixtral":
            keys += ["num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"]
        if kind == "qwen2_moe":
            keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                     "shared_expert_intermediate_size", "router_aux_loss_coef"]
        if kind == "qwen3_moe":
            keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                     "router_aux_loss_coef"]
        check(all(ecfg.get(k) == cfg.get(k) for k in keys), f"{kind}: exported config.json keeps {keys} "
              f"({ {k: ecfg.get(k) for k in keys} })")
        if kind != "gpt2":
            hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            same_rope = torch.equal(inv_freq_hf(ecfg, hd), inv_freq_hf(cfg, hd)) and ecfg["head_dim"] == hd
            check(same_rope, f"{kind}: exported config.json has the same RoPE frequencies and head_dim "
                  f"({ecfg.get('rope_theta')}, {ecfg.get('rope_scaling')})")
        if kind == "llama":  # sharded: above --max-shard-size, shards and their index, read back alike
            sharded, again = os.path.join(work, "exported_sharded"), os.path.join(work, "reimported")
            r = harness.run_tetra(args, ["ckpt", "export-hf", os.path.join(out, "step_00000000"), sharded,
                                         "--max-shard-size", "20KB"])
            files = sorted(os.listdir(sharded)) if os.path.isdir(sharded) else []
            shard_files = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
            check(r.returncode == 0 and "model.safetensors.index.json" in files and len(shard_files) >= 2
                  and "model.safetensors" not in files,
                  f"{kind}: export-hf --max-shard-size 20KB writes {len(shard_files)} shards and the index")
            if r.returncode == 0:
                with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
                    index = json.load(f)
                merged = {}
                for fname in shard_files:
                    merged.update(read_safetensors(os.path.join(sharded, fname))[0])
                check(sorted(index["weight_map"]) == sorted(back) and
                      all(np.array_equal(merged[n], back[n]) for n in back) and
                      all(os.path.getsize(os.path.join(sharded, f)) < 20000 + 8192 for f in shard_files),
                      f"{kind}: the shards hold the same tensors as the single file, each shard within the limit")
                r = harness.run_tetra(args, ["ckpt", "import-hf", sharded, again, "--seq-len", str(model["seq_len"])])
                with open(os.path.join(again, "model.json")) as f:
                    model_again = json.load(f)["model"]
                check(r.returncode == 0 and model_again == model,
                      f"{kind}: the sharded export imports again to the same model section")
    ref_sd = {n: torch.from_numpy(a.astype(np.float64)) for n, a in stored.items()}
    T = model["seq_len"]
    moe = "moe" in model
    batch_of = {}
    for name, par, world, gbs, batch_from in LAYOUTS + (MOE_LAYOUTS if moe else []):
        run = os.path.join(work, name)
        # Vocabularies of 72..96 padded to 128 rows on every layout (the last tp 2 rank: 8..32 real
        # rows of 64): the padding must change nothing.
        config = {"model": dict(model, make_vocab_size_divisible_by=32), "parallel": dict({"dp": 1}, **par),
                  "training": {"micro_batch_size": 2, "global_batch_size": gbs, "steps": 1, "threads": 1,
                               "precision": "fp32", "peak_gflops": 10, "seed": 3},
                  "optimizer": {"lr": 1e-3, "warmup_steps": 0},
                  "data": {"synthetic": True},
                  "checkpoint": {"init": out},
                  "logging": {"dir": os.path.join(run, "logs"), "level": "warn"}}
        path = harness.write_config(run, config)
        r = harness.run_tetra(args, ["train", "--config", path, "--dump-dir", os.path.join(run, "dump")], world)
        check(r.returncode == 0, f"{kind} {name}: trains from checkpoint.init ({r.stderr.strip()[-300:]})")
        if r.returncode != 0:
            continue
        loss = harness.step_records(os.path.join(run, "logs"))[0]["loss"]
        if batch_from is None:  # dp 1: the run dumps its batch
            batches, _ = read_safetensors(os.path.join(run, "dump", "batches.safetensors"))
            batch_of[name] = torch.from_numpy(batches["step_0"]).long()
        if batch_from not in (None,) and batch_from not in batch_of:
            check(False, f"{kind} {name}: the batch of {batch_from} to compare with")
            continue
        sample = batch_of[batch_from or name]
        with torch.no_grad():
            logits = (gpt2_logits if kind == "gpt2" else llama_logits)(ref_sd, cfg, sample[:, :T])
            want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample[:, 1:].reshape(-1)).item()
        check(rel(loss, want) < LOSS_RTOL, f"{kind} {name}: Tetra's step-1 loss {loss:.8f} = the Hugging Face "
              f"forward's {want:.8f} (rel {rel(loss, want):.1e} < {LOSS_RTOL:g})")
    forward = gpt2_logits if kind == "gpt2" else llama_logits
    generation(args, kind, cfg, model, ref_sd, forward, work, {"HF directory": hf_dir, "imported checkpoint": out})
    train_export(args, kind, cfg, model, out, work, forward)


def generation(args, kind, cfg, model, ref_sd, forward, work, sources):
    """`tetra generate --prompt-ids` from each weights source: the prompt's logits equal the
    Hugging Face forward's (1e-5 of their largest magnitude), and greedy generation picks the
    reference's token at every step (its window sliding past seq_len)."""
    T, V = model["seq_len"], model["vocab_size"]
    rng = np.random.default_rng(5)
    prompt = [int(i) for i in rng.integers(0, V, size=T - 4)]
    steps = 10  # the window slides past T
    ids = list(prompt)
    want = []
    with torch.no_grad():
        for _ in range(steps):
            window = torch.tensor([ids[-T:]], dtype=torch.long)
            nxt = int(torch.argmax(forward(ref_sd, cfg, window)[0, -1]))
            want.append(nxt)
            ids.append(nxt)
        ref_logits = forward(ref_sd, cfg, torch.tensor([prompt], dtype=torch.long))[0].numpy()
    run_cfg = {"model": model, "training": {"precision": "fp32", "threads": 1, "peak_gflops": 10},
               "data": {"synthetic": True}}
    path = harness.write_config(os.path.join(work, "generate"), run_cfg)
    for what, weights in sources.items():
        logits_file = os.path.join(work, "generate", what.replace(" ", "_") + ".safetensors")
        r = harness.run_tetra(args, ["generate", "--config", path, "--weights", weights, "--prompt-ids",
                                     ",".join(map(str, prompt)), "--logits-out", logits_file, "--temperature", "0",
                                     "--max-tokens", str(steps)])
        check(r.returncode == 0, f"{kind}: tetra generate --weights <{what}> exits 0 ({r.stderr.strip()[-300:]})")
        if r.returncode != 0:
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        check(got["prompt_ids"] == prompt and got["ids"] == want,
              f"{kind}: greedy generation from the {what} matches the Hugging Face forward token for token "
              f"({got['ids']} vs {want})")
        logits = read_safetensors(logits_file)[0]["logits"]
        err = float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max())
        check(logits.shape == ref_logits.shape and err < 1e-5,
              f"{kind}: the prompt's logits from the {what} match the Hugging Face forward's "
              f"({logits.shape}, max error {err:.1e} of the largest logit < 1e-5)")


def train_export(args, kind, cfg, model, imported, work, forward):
    """Import -> 10 steps on dp 2 x tp 2 (distributed optimizer, SP) -> export-hf: the Hugging Face
    forward of the exported files reproduces the loss Tetra computes with the trained weights
    (the loss of a one-step run from the trained checkpoint, computed before its update, on its dumped batch)."""
    ck = os.path.join(work, "trained_ckpt")
    run = os.path.join(work, "dp2_tp2")
    config = {"model": dict(model, make_vocab_size_divisible_by=32),
              "parallel": {"dp": 2, "tp": 2, "sequence_parallel": True, "distributed_optimizer": True},
              "training": {"micro_batch_size": 2, "global_batch_size": 8, "steps": 10, "threads": 1,
                           "precision": "fp32", "peak_gflops": 10, "seed": 4},
              "optimizer": {"lr": 1e-3, "warmup_steps": 2},
              "data": {"synthetic": True},
              "checkpoint": {"init": imported, "dir": ck, "every": 10},
              "logging": {"dir": os.path.join(run, "logs"), "level": "warn"}}
    r = harness.run_tetra(args, ["train", "--config", harness.write_config(run, config)], 4)
    check(r.returncode == 0, f"{kind}: 10 steps on dp 2 x tp 2 from the import ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    losses = [s["loss"] for s in harness.step_records(os.path.join(run, "logs"))]
    check(len(losses) == 10 and losses[-1] < losses[0], f"{kind}: the dp 2 x tp 2 run learns ({losses[0]:.4f} -> "
                                                       f"{losses[-1]:.4f})")
    # The same 10 steps on one rank (4 micro-batches of 2): the layout is invisible, every family's
    # parameters included (qwen3's q_norm and k_norm gradients are partial sums over the tp ranks' heads).
    single = os.path.join(work, "single")
    scfg = dict(config, parallel={}, checkpoint={"init": imported},
                logging={"dir": os.path.join(single, "logs"), "level": "warn"})
    r = harness.run_tetra(args, ["train", "--config", harness.write_config(single, scfg)])
    ref = [s["loss"] for s in harness.step_records(os.path.join(single, "logs"))] if r.returncode == 0 else []
    worst = max((rel(a, b) for a, b in zip(losses, ref)), default=float("inf"))
    check(len(ref) == 10 and worst < LOSS_RTOL, f"{kind}: dp 2 x tp 2 + SP reproduces the single-rank loss curve "
                                               f"(10 steps, worst rel {worst:.1e} < {LOSS_RTOL:g})")
    exported = os.path.join(work, "trained_hf")
    r = harness.run_tetra(args, ["ckpt", "export-hf", os.path.join(ck, "step_00000010"), exported])
    check(r.returncode == 0, f"{kind}: export-hf of the trained checkpoint ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    probe = os.path.join(work, "probe")
    pcfg = {"model": model, "training": {"micro_batch_size": 2, "global_batch_size": 2, "steps": 1, "threads": 1,
                                         "precision": "fp32", "peak_gflops": 10, "seed": 9},
            "optimizer": {"lr": 1e-3, "warmup_steps": 0}, "data": {"synthetic": True},
            "checkpoint": {"init": os.path.join(ck, "step_00000010")},
            "logging": {"dir": os.path.join(probe, "logs"), "level": "warn"}}
    r = harness.run_tetra(args, ["train", "--config", harness.write_config(probe, pcfg), "--dump-dir",
                                 os.path.join(probe, "dump")])
    check(r.returncode == 0, f"{kind}: the probe run from the trained checkpoint ({r.stderr.strip()[-300:]})")
    if r.returncode != 0:
        return
    loss = harness.step_records(os.path.join(probe, "logs"))[0]["loss"]
    sample = torch.from_numpy(read_safetensors(os.path.join(probe, "dump", "batches.safetensors"))[0]["step_0"]).long()
    sd = {n: torch.from_numpy(a.astype(np.float64)) for n, a in
          read_safetensors(os.path.join(exported, "model.safetensors"))[0].items()}
    if kind == "gpt2":  # the export writes transformers' names; the reference reads the original release's
        sd = {n[len("transformer."):] if n.startswith("transformer.") else n: a for n, a in sd.items()}
    T = model["seq_len"]
    with torch.no_grad():
        logits = forward(sd, cfg, sample[:, :T])
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample[:, 1:].reshape(-1)).item()
    check(rel(loss, want) < LOSS_RTOL, f"{kind}: after import, 10 steps on dp 2 x tp 2 and export, the Hugging Face "
                                       f"forward of the export gives Tetra's loss ({want:.8f} vs {loss:.8f}, rel "
                                       f"{rel(loss, want):.1e})")


def refusals(args):
    base_cfg, base_sd = llama_like("llama")
    cases = [
        ("sliding window", dict(base_cfg, model_type="mistral", sliding_window=4096), base_sd, "sliding_window"),
        ("rope type", dict(base_cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0}), base_sd,
         "rope_scaling.rope_type"),
        ("model type", dict(base_cfg, model_type="gemma"), base_sd, "model_type"),
        ("extra tensor", base_cfg, dict(base_sd, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}),
         "model.layers.0.self_attn.q_norm.weight"),
        ("missing tensor", base_cfg, {n: a for n, a in base_sd.items() if n != "model.layers.1.mlp.up_proj.weight"},
         "model.layers.1.mlp.up_proj.weight"),
    ]
    # MoE: what the two MoE families may hold that Tetra does not map.
    moe_cfg, moe_sd = llama_like("qwen3_moe")
    mix_cfg, mix_sd = llama_like("mixtral")
    cases += [
        ("shared expert in qwen3 moe", dict(moe_cfg, shared_expert_intermediate_size=64), moe_sd,
         "shared_expert_intermediate_size"),
        ("deepseek mla", dict(moe_cfg, model_type="deepseek_v3", kv_lora_rank=16), moe_sd, "model_type"),
        ("sparse step", dict(moe_cfg, decoder_sparse_step=2), moe_sd, "decoder_sparse_step"),
        ("dense layers among experts", dict(moe_cfg, mlp_only_layers=[1]), moe_sd, "mlp_only_layers"),
        ("router jitter", dict(mix_cfg, router_jitter_noise=0.1), mix_sd, "router_jitter_noise"),
        ("experts in a dense family", dict(base_cfg, num_local_experts=4), base_sd, "num_local_experts"),
    ]
    for what, cfg, sd, key in cases:
        d = os.path.join(args.workdir, "refuse", what.replace(" ", "_"))
        write_hf(os.path.join(d, "hf"), cfg, sd)
        out = os.path.join(d, "out")
        r = harness.run_tetra(args, ["ckpt", "import-hf", os.path.join(d, "hf"), out], expect=None)
        check(r.returncode == 2 and key in r.stderr and not os.path.exists(os.path.join(out, "step_00000000")),
              f"refused, {what}: exit {r.returncode}, the message names {key}: {r.stderr.strip()[-200:]}")
    d = os.path.join(args.workdir, "refuse", "busy")
    write_hf(os.path.join(d, "hf"), base_cfg, base_sd)
    os.makedirs(os.path.join(d, "out"))
    with open(os.path.join(d, "out", "keep.txt"), "w") as f:
        f.write("x")
    r = harness.run_tetra(args, ["ckpt", "import-hf", os.path.join(d, "hf"), os.path.join(d, "out")], expect=None)
    check(r.returncode == 2 and sorted(os.listdir(os.path.join(d, "out"))) == ["keep.txt"],
          f"refused, a non-empty OUT: exit {r.returncode}, nothing written ({r.stderr.strip()[-200:]})")


def main():
    args = harness.parse_args()
    torch.set_num_threads(1)
    cfg, sd = llama_like("llama")
    family(args, "llama", cfg, sd, shards=2, dtype="fp32", seq_len=32)
    cfg, sd = llama_like("qwen2")
    family(args, "qwen2", cfg, sd, shards=1, dtype="bf16", seq_len=32)
    cfg, sd = llama_like("qwen3")
    family(args, "qwen3", cfg, sd, shards=1, dtype="fp32", seq_len=32)
    cfg, sd = llama_like("mixtral")
    family(args, "mixtral", cfg, sd, shards=2, dtype="bf16", seq_len=32)
    cfg, sd = llama_like("qwen3_moe")
    family(args, "qwen3_moe", cfg, sd, shards=1, dtype="fp32", seq_len=32)
    cfg, sd = llama_like("qwen2_moe")
    family(args, "qwen2_moe", cfg, sd, shards=1, dtype="fp32", seq_len=32)
    cfg, sd = gpt2_like()
    family(args, "gpt2", cfg, sd, shards=1, dtype="fp32", seq_len=0)
    refusals(args)
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
