"""`tetra ckpt export-hf` against Hugging Face's conventions and Tetra's own numbers.

For each config in configs/reference_{gpt2,llama}.json (GPT-2-like: layernorm, gelu, learned
positions, biases, tied; Llama-like: rmsnorm, swiglu, rope, GQA, untied), Tetra trains 10 steps in
fp32 with --dump-dir and checkpoint.dir (a checkpoint every 5 steps, both kept), then
`tetra ckpt export-hf` writes each checkpoint as OUT/model.safetensors + OUT/config.json, and:
  (a) the file: the safetensors metadata transformers requires ({"format": "pt"}); exactly the
      state-dict names of GPT2LMHeadModel / LlamaForCausalLM (listed here from those classes, not
      from the exporter), with their shapes; no lm_head.weight when tied;
  (b) config.json: model_type, architectures and every hyperparameter equal to the Tetra config
      (n_embd, n_inner, layer_norm_epsilon, ... / hidden_size, num_key_value_heads, rms_norm_eps,
      rope_theta, max_position_embeddings = seq_len, ...);
  (c) the exported weights of the last checkpoint, mapped back to Tetra's names (concatenating
      q/k/v and gate/up, transposing GPT-2's Conv1D weights), are bit for bit Tetra's own final
      weights (logging.dir/model.safetensors), and the PyTorch reference model (torch_model.py)
      gives the same loss on a dumped batch from either (relative 1e-6);
  (d) an implementation of the Hugging Face forward pass written here from transformers' modeling
      code (Conv1D x W + b, separate q/k/v projections, rotate_half with cat(freqs, freqs),
      repeat_kv, hyperparameters read from config.json alone) gives, on the exported weights, the
      logits of the reference model on Tetra's final weights (relative 1e-9: both float64), and on
      the export of the step-5 checkpoint the loss Tetra itself reported for step 6 on the same
      batch (relative 1e-4, Tetra's fp32 against float64, as in test_parity.py);
  (e) --dtype bf16 writes each value rounded to nearest even (checked against numpy's rounding of
      the fp32 export) and torch_dtype bfloat16; --dtype fp16 writes F16 tensors, each value numpy's
      float16 of the fp32 export (round to nearest even), and torch_dtype float16;
  (f) if transformers can be imported, from_pretrained loads each export and its logits equal (d)'s
      (relative 1e-5: transformers computes in float32); otherwise a note says it was skipped.

Usage: /usr/bin/python3 test_hf_export.py --tetra BIN --workdir DIR [--only gpt2|llama]
Exit status 0 when every check passes, 1 otherwise.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from safetensors_io import read_safetensors  # noqa: E402
from checks import Checks, reference_args, rel, run_each, run_logged  # noqa: E402
import torch_model as tm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
CONFIGS = {"gpt2": os.path.join(REPO, "configs", "reference_gpt2.json"),
           "llama": os.path.join(REPO, "configs", "reference_llama.json")}
STEPS, EVERY = 10, 5

# ---- tolerances ---------------------------------------------------------------------------------
# (c) The export copies fp32 values; mapped back they must be the final weights bit for bit, so the
# reference loss on both is the same float64 computation on the same inputs: 1e-6 leaves room for
# nothing but a difference in summation order, far below what a misplaced row changes (~1e-2).
SAME_WEIGHTS_LOSS_RTOL = 1e-6
# (d) Two float64 implementations of the same function on the same weights: each op rounds at
# ~1e-16 relative, a few hundred ops and reductions of length <= 128 stay below ~1e-13; 1e-9 is
# a wide margin that any real difference (a wrong split, a transposed weight, a missed eps or rope
# convention: 1e-3 and up) still exceeds by orders of magnitude. Measured against the largest
# logit magnitude, so logits near zero do not inflate it.
HF_LOGITS_RTOL = 1e-9
# Tetra's fp32 loss against the float64 forward: relative 1e-4, the bound test_parity.py derives
# for a step's loss (fp32 reductions of length <= 128 through ~30 ops, ~2e-5 pessimistic).
TETRA_LOSS_RTOL = 1e-4
# (f) transformers computes in float32 (u = 6e-8) over the same ~30 ops: 1e-5 relative to the
# largest logit is ~100x the expected error and far below a real mistake.
TRANSFORMERS_LOGITS_RTOL = 1e-5


# ---- Hugging Face names and the mapping back to Tetra's ------------------------------------------

def expected_hf_shapes(kind, spec):
    """{name: shape} of the state dict of GPT2LMHeadModel / LlamaForCausalLM for `spec`, as those
    classes name their parameters (buffers such as GPT-2's attn.bias mask are not saved)."""
    c, v, f, hs = spec.hidden_size, spec.vocab_size, spec.ffn_hidden_size, spec.head_size
    out = {}
    if kind == "gpt2":
        out["transformer.wte.weight"] = (v, c)
        out["transformer.wpe.weight"] = (spec.seq_len, c)
        for i in range(spec.num_layers):
            p = f"transformer.h.{i}."
            out.update({p + "ln_1.weight": (c,), p + "ln_1.bias": (c,),
                        p + "attn.c_attn.weight": (c, 3 * c), p + "attn.c_attn.bias": (3 * c,),
                        p + "attn.c_proj.weight": (c, c), p + "attn.c_proj.bias": (c,),
                        p + "ln_2.weight": (c,), p + "ln_2.bias": (c,),
                        p + "mlp.c_fc.weight": (c, f), p + "mlp.c_fc.bias": (f,),
                        p + "mlp.c_proj.weight": (f, c), p + "mlp.c_proj.bias": (c,)})
        out["transformer.ln_f.weight"] = (c,)
        out["transformer.ln_f.bias"] = (c,)
    else:
        nh, nkv = spec.num_heads, spec.num_kv_heads
        out["model.embed_tokens.weight"] = (v, c)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (c,),
                        p + "self_attn.q_proj.weight": (nh * hs, c),
                        p + "self_attn.k_proj.weight": (nkv * hs, c),
                        p + "self_attn.v_proj.weight": (nkv * hs, c),
                        p + "self_attn.o_proj.weight": (c, nh * hs),
                        p + "post_attention_layernorm.weight": (c,),
                        p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                        p + "mlp.down_proj.weight": (c, f)})
        out["model.norm.weight"] = (c,)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (v, c)
    return out


def hf_to_tetra(hf, kind, num_layers, tied):
    """The exported state dict under Tetra's parameter names and layouts (the inverse of the
    export): GPT-2's Conv1D (in, out) weights transposed back; Llama's q/k/v and gate/up
    concatenated in Tetra's row order [q | k | v], [gate | up]."""
    t = {}
    if kind == "gpt2":
        t["embedding.wte"] = hf["transformer.wte.weight"]
        t["embedding.wpe"] = hf["transformer.wpe.weight"]
        for i in range(num_layers):
            p, q = f"transformer.h.{i}.", f"layers.{i}."
            t[q + "norm1.weight"], t[q + "norm1.bias"] = hf[p + "ln_1.weight"], hf[p + "ln_1.bias"]
            t[q + "attn.qkv.weight"] = hf[p + "attn.c_attn.weight"].T
            t[q + "attn.qkv.bias"] = hf[p + "attn.c_attn.bias"]
            t[q + "attn.proj.weight"] = hf[p + "attn.c_proj.weight"].T
            t[q + "attn.proj.bias"] = hf[p + "attn.c_proj.bias"]
            t[q + "norm2.weight"], t[q + "norm2.bias"] = hf[p + "ln_2.weight"], hf[p + "ln_2.bias"]
            t[q + "mlp.fc.weight"] = hf[p + "mlp.c_fc.weight"].T
            t[q + "mlp.fc.bias"] = hf[p + "mlp.c_fc.bias"]
            t[q + "mlp.proj.weight"] = hf[p + "mlp.c_proj.weight"].T
            t[q + "mlp.proj.bias"] = hf[p + "mlp.c_proj.bias"]
        t["final_norm.weight"] = hf["transformer.ln_f.weight"]
        t["final_norm.bias"] = hf["transformer.ln_f.bias"]
    else:
        t["embedding.wte"] = hf["model.embed_tokens.weight"]
        for i in range(num_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            t[q + "norm1.weight"] = hf[p + "input_layernorm.weight"]
            t[q + "attn.qkv.weight"] = np.concatenate(
                [hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], axis=0)
            t[q + "attn.proj.weight"] = hf[p + "self_attn.o_proj.weight"]
            t[q + "norm2.weight"] = hf[p + "post_attention_layernorm.weight"]
            t[q + "mlp.fc.weight"] = np.concatenate(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], axis=0)
            t[q + "mlp.proj.weight"] = hf[p + "mlp.down_proj.weight"]
        t["final_norm.weight"] = hf["model.norm.weight"]
    if not tied:
        t["lm_head.weight"] = hf["lm_head.weight"]
    return {n: np.ascontiguousarray(a) for n, a in t.items()}


# ---- the Hugging Face forward pass, from transformers' modeling code -----------------------------

def hf_gpt2_logits(sd, cfg, tokens):
    """GPT2LMHeadModel's forward (eval, no cache): Conv1D is x @ W + b with W (in, out); c_attn's
    output splits into q, k, v of n_embd each; attention scaled by 1/sqrt(head_dim)
    (scale_attn_weights); gelu_new is the tanh approximation."""
    c, nh = cfg["n_embd"], cfg["n_head"]
    hd, eps = c // nh, cfg["layer_norm_epsilon"]
    assert cfg["activation_function"] == "gelu_new", cfg["activation_function"]
    b, t = tokens.shape
    assert t <= cfg["n_positions"]

    def heads(x):  # (B,T,C) -> (B,NH,T,HD)
        return x.view(b, t, nh, hd).permute(0, 2, 1, 3)

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))

    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][torch.arange(t)]
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (c,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], eps)
        qkv = h @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]
        q, k, v = (heads(z) for z in qkv.split(c, dim=2))
        w = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        w = torch.where(mask, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        a = (torch.softmax(w, dim=-1) @ v).permute(0, 2, 1, 3).reshape(b, t, c)
        x = x + a @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (c,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], eps)
        h = gelu_new(h @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
        x = x + h @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"], eps)
    head = sd["transformer.wte.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return x @ head.T


def hf_llama_logits(sd, cfg, tokens):
    """LlamaForCausalLM's forward (eval, no cache): LlamaRMSNorm x * rsqrt(mean(x^2) + eps) * w;
    rotary embedding inv_freq = 1 / theta^(arange(0, d, 2) / d), emb = cat(freqs, freqs),
    q * cos + rotate_half(q) * sin with rotate_half(x) = cat(-x2, x1); repeat_kv by expand and
    reshape (query head h reads kv head h // n_rep); down(silu(gate(x)) * up(x))."""
    c, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or c // nh
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    assert cfg["hidden_act"] == "silu", cfg["hidden_act"]
    b, t = tokens.shape
    assert t <= cfg["max_position_embeddings"]
    dtype = sd["model.embed_tokens.weight"].dtype

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def repeat_kv(x, n_rep):
        bb, kv, tt, d = x.shape
        return x[:, :, None, :, :].expand(bb, kv, n_rep, tt, d).reshape(bb, kv * n_rep, tt, d)

    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    mask = torch.triu(torch.full((t, t), float("-inf"), dtype=dtype), diagonal=1)

    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
        w = (q @ k.transpose(2, 3)) * hd ** -0.5 + mask
        a = (torch.softmax(w, dim=-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
        x = x + a @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        g = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + g @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return x @ head.T


def hf_logits(kind, hf, cfg, tokens):
    sd = {n: torch.from_numpy(a.astype(np.float64)) for n, a in hf.items()}
    return (hf_gpt2_logits if kind == "gpt2" else hf_llama_logits)(sd, cfg, tokens)


def mean_loss(logits, sample):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample[:, 1:].reshape(-1)).item()


def logits_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ---- checks -------------------------------------------------------------------------------------

def check_file(out, kind, spec, checks, label):
    """(a): metadata, names and shapes. Returns (tensors, config.json)."""
    hf, meta = read_safetensors(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    checks.check(meta.get("format") == "pt", f"{label}: safetensors metadata format = pt "
                 f"(transformers refuses the file otherwise; found {meta})")
    expected = expected_hf_shapes(kind, spec)
    missing, extra = sorted(set(expected) - set(hf)), sorted(set(hf) - set(expected))
    checks.check(not missing and not extra, f"{label}: the {len(expected)} state-dict names of "
                 f"{'GPT2LMHeadModel' if kind == 'gpt2' else 'LlamaForCausalLM'} (missing "
                 f"{missing}, unexpected {extra})")
    bad = [f"{n}: {list(hf[n].shape)} != {list(s)}" for n, s in expected.items()
           if n in hf and tuple(hf[n].shape) != s]
    checks.check(not bad, f"{label}: shapes {bad if bad else 'as the classes have them'}")
    return hf, cfg


def check_config(cfg, kind, spec, dtype, checks, label):
    """(b): config.json against the Tetra config."""
    m = spec
    if kind == "gpt2":
        want = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "vocab_size": m.vocab_size, "n_embd": m.hidden_size, "n_head": m.num_heads,
                "n_layer": m.num_layers, "n_positions": m.seq_len, "n_inner": m.ffn_hidden_size,
                "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps,
                "tie_word_embeddings": m.tie_embeddings, "torch_dtype": dtype}
    else:
        want = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
                "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
                "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
                "max_position_embeddings": m.seq_len, "tie_word_embeddings": m.tie_embeddings,
                "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}
    bad = [f"{k}: {cfg.get(k, 'absent')!r} != {v!r}" for k, v in want.items() if cfg.get(k) != v]
    checks.check(not bad, f"{label}: config.json matches the config ({len(want)} fields) {bad}")


def bf16_round(a):
    """fp32 -> bf16 -> fp32, round to nearest even (NaN-free input)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (bits.astype(np.uint32) << 16).view(np.float32)


def try_transformers(out, kind, tokens, expected, checks, label):
    """(f): transformers' own classes, where the library is installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"  note: {label}: transformers is not installed (Debian has no python3-transformers "
              f"package); skipped loading with from_pretrained — (d) checks the same conventions")
        return
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits.double()
    err = logits_error(logits, expected)
    checks.check(err < TRANSFORMERS_LOGITS_RTOL, f"{label}: transformers {type(model).__name__} "
                 f"logits = the Hugging Face forward's (rel {err:.2e} < "
                 f"{TRANSFORMERS_LOGITS_RTOL:g})")


def run_config(kind, args, checks):
    config_path = CONFIGS[kind]
    with open(config_path) as f:
        cfg = json.load(f)
    spec = tm.ModelSpec.from_config(cfg)
    work = os.path.join(args.workdir, kind)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    print(f"\n=== {kind}: {config_path}")
    ckpt, logs, dump = (os.path.join(work, d) for d in ("ckpt", "logs", "dump"))
    run_logged([args.tetra, "--config", config_path, "--dump-dir", dump,
                "--set", f"training.steps={STEPS}", "--set", "training.precision=fp32",
                "--set", f"logging.dir={logs}", "--set", f"checkpoint.dir={ckpt}",
                "--set", f"checkpoint.every={EVERY}", "--set", "checkpoint.keep=0"],
               os.path.join(work, "tetra.log"))
    rows = {}
    with open(os.path.join(logs, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line) if line.strip() else {}
            if "loss" in r:
                rows[int(r["step"])] = r
    batches, _ = read_safetensors(os.path.join(dump, "batches.safetensors"))
    final, _ = read_safetensors(os.path.join(logs, "model.safetensors"))
    names = sorted(n for n in os.listdir(ckpt) if n.startswith("step_"))
    checks.check(names == [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)],
                 f"checkpoints written at steps {EVERY} and {STEPS} (found {names})")

    exports = {}
    for step in (EVERY, STEPS):
        for dtype in ("fp32", "bf16") + (("fp16",) if step == STEPS else ()):
            out = os.path.join(work, f"hf_step{step}_{dtype}")
            run_logged([args.tetra, "ckpt", "export-hf", os.path.join(ckpt, f"step_{step:08d}"), out,
                        "--dtype", dtype], out + ".log")
            exports[step, dtype] = out

    # (a), (b)
    hf, hf_cfg = check_file(exports[STEPS, "fp32"], kind, spec, checks, "fp32 export")
    check_config(hf_cfg, kind, spec, "float32", checks, "fp32 export")
    hf_b, hf_cfg_b = check_file(exports[STEPS, "bf16"], kind, spec, checks, "bf16 export")
    check_config(hf_cfg_b, kind, spec, "bfloat16", checks, "bf16 export")
    hf_h, hf_cfg_h = check_file(exports[STEPS, "fp16"], kind, spec, checks, "fp16 export")
    check_config(hf_cfg_h, kind, spec, "float16", checks, "fp16 export")

    # (c) mapped back = Tetra's final weights, bit for bit; the same reference loss.
    back = hf_to_tetra(hf, kind, spec.num_layers, spec.tie_embeddings)
    diff = sorted(set(back) ^ set(final))
    bad = [n for n in final if n in back and (back[n].shape != final[n].shape
                                              or not np.array_equal(back[n], final[n]))]
    checks.check(not diff and not bad, f"step-{STEPS} export mapped back = Tetra's final weights "
                 f"bit for bit (name differences {diff}, differing tensors {bad})")
    sample = torch.from_numpy(batches["step_0"]).long()
    tokens = sample[:, :-1]
    with torch.no_grad():
        ref_final = tm.Model(spec).double()
        ref_final.load_arrays(final)
        ref_logits = ref_final(tokens)
        loss_final = mean_loss(ref_logits, sample)
        ref_back = tm.Model(spec).double()
        ref_back.load_arrays(back)
        loss_back = mean_loss(ref_back(tokens), sample)
    checks.check(rel(loss_back, loss_final) < SAME_WEIGHTS_LOSS_RTOL,
                 f"reference loss on batch step_0: exported weights {loss_back:.9f}, final weights "
                 f"{loss_final:.9f} (rel {rel(loss_back, loss_final):.1e} < "
                 f"{SAME_WEIGHTS_LOSS_RTOL:g})")

    # (d) the Hugging Face forward on the export: the reference's logits; Tetra's own loss.
    with torch.no_grad():
        logits = hf_logits(kind, hf, hf_cfg, tokens)
    err = logits_error(logits, ref_logits)
    checks.check(err < HF_LOGITS_RTOL, f"Hugging Face forward on the step-{STEPS} export = "
                 f"reference logits on the final weights (rel {err:.1e} < {HF_LOGITS_RTOL:g})")
    hf5, _ = read_safetensors(os.path.join(exports[EVERY, "fp32"], "model.safetensors"))
    with open(os.path.join(exports[EVERY, "fp32"], "config.json")) as f:
        hf5_cfg = json.load(f)
    sample5 = torch.from_numpy(batches[f"step_{EVERY}"]).long()
    with torch.no_grad():
        loss5 = mean_loss(hf_logits(kind, hf5, hf5_cfg, sample5[:, :-1]), sample5)
    tetra5 = rows[EVERY + 1]["loss"]
    checks.check(rel(tetra5, loss5) < TETRA_LOSS_RTOL,
                 f"Hugging Face forward on the step-{EVERY} export, batch step_{EVERY}: loss "
                 f"{loss5:.7f} = Tetra's step-{EVERY + 1} loss {tetra5:.7f} (rel "
                 f"{rel(tetra5, loss5):.1e} < {TETRA_LOSS_RTOL:g})")
    # Guard: the two checkpoints differ, so the step-5 check did not read the final weights.
    checks.check(any(not np.array_equal(hf5[n], hf[n]) for n in hf),
                 f"the step-{EVERY} and step-{STEPS} exports differ")

    # (e) bf16: each value is the fp32 value rounded to nearest even.
    bad = [n for n in hf if n in hf_b and not np.array_equal(hf_b[n], bf16_round(hf[n]))]
    inexact = sum(int(np.count_nonzero(hf_b[n] != hf[n])) for n in hf if n in hf_b)
    checks.check(not bad and inexact > 0, f"bf16 export = fp32 export rounded to nearest even "
                 f"(differing tensors {bad}; {inexact} values changed by rounding)")

    # (e) fp16: stored as F16, each value numpy's (round to nearest even) float16 of the fp32 value.
    bad = [n for n in hf if n in hf_h and (hf_h[n].dtype != np.float16
                                           or not np.array_equal(hf_h[n], hf[n].astype(np.float16)))]
    inexact = sum(int(np.count_nonzero(hf_h[n].astype(np.float32) != hf[n])) for n in hf if n in hf_h)
    checks.check(not bad and inexact > 0, f"fp16 export = fp32 export rounded to nearest even fp16 "
                 f"(differing tensors {bad}; {inexact} values changed by rounding)")

    # (f)
    try_transformers(exports[STEPS, "fp32"], kind, tokens, logits, checks, "fp32 export")


def main():
    args = reference_args(__doc__, CONFIGS)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    checks = Checks()
    run_each([args.only] if args.only else sorted(CONFIGS), lambda kind: run_config(kind, args, checks),
             checks, (RuntimeError, ValueError, OSError, KeyError, AssertionError, subprocess.TimeoutExpired))
    return checks.report()


if __name__ == "__main__":
    sys.exit(main())
