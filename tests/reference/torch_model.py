"""An independent PyTorch implementation of the model and optimizer Tetra trains.

Written plainly from the model specification (not from Tetra's code), so that agreement between the
two means something: nn.Module blocks whose state_dict names are the specification's parameter
names, explicit causal softmax attention, GQA by repeat_interleave of the kv heads, rotate-half
RoPE, tanh GELU, SwiGLU, layernorm via F.layer_norm and a hand-written rmsnorm. The optimizer side
is the specification's LR schedule, its two weight-decay groups, torch's clip_grad_norm_ and
torch.optim.AdamW, with gradient accumulation over micro-batches.

Shapes: B batch, T sequence, C hidden, NH query heads, NKV kv heads, HS head size, F ffn size,
V vocabulary.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelSpec:
    vocab_size: int
    seq_len: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    norm: str          # layernorm | rmsnorm
    norm_eps: float
    activation: str    # gelu | swiglu
    position: str      # learned | rope
    rope_theta: float
    tie_embeddings: bool
    bias: bool
    init_std: float

    @property
    def head_size(self):
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_config(cfg):
        """From a Tetra config dict (its "model" section), with Tetra's documented defaults."""
        m = cfg["model"]
        c = int(m.get("hidden_size", 768))
        nh = int(m.get("num_heads", 12))
        return ModelSpec(
            vocab_size=int(m.get("vocab_size", 50257)), seq_len=int(m.get("seq_len", 1024)),
            num_layers=int(m.get("num_layers", 12)), hidden_size=c, num_heads=nh,
            num_kv_heads=int(m.get("num_kv_heads", 0)) or nh,
            ffn_hidden_size=int(m.get("ffn_hidden_size", 0)) or 4 * c,
            norm=m.get("norm", "layernorm"), norm_eps=float(m.get("norm_eps", 1e-5)),
            activation=m.get("activation", "gelu"), position=m.get("position", "learned"),
            rope_theta=float(m.get("rope_theta", 10000.0)),
            tie_embeddings=bool(m.get("tie_embeddings", True)), bias=bool(m.get("bias", True)),
            init_std=float(m.get("init_std", 0.02)))


class Norm(nn.Module):
    """layernorm: (x - mean) / sqrt(var + eps) * w + b (biased var); rmsnorm: x / rms * w."""

    def __init__(self, spec):
        super().__init__()
        self.kind, self.eps = spec.norm, spec.norm_eps
        self.weight = nn.Parameter(torch.ones(spec.hidden_size))
        has_bias = spec.norm == "layernorm" and spec.bias
        self.bias = nn.Parameter(torch.zeros(spec.hidden_size)) if has_bias else None

    def forward(self, x):  # (B,T,C) -> (B,T,C)
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        rms = torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return x / rms * self.weight


def rope_rotate(x, theta):
    """Rotate-half RoPE on (B, H, T, HS): element i < HS/2 pairs with i + HS/2, angle
    pos * theta^(-2i/HS); (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)."""
    _, _, t, hs = x.shape
    half = hs // 2
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / hs)                                    # (HS/2)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None]  # (T, HS/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        hs, nh, nkv = spec.head_size, spec.num_heads, spec.num_kv_heads
        self.qkv = nn.Linear(spec.hidden_size, (nh + 2 * nkv) * hs, bias=spec.bias)
        self.proj = nn.Linear(nh * hs, spec.hidden_size, bias=spec.bias)

    def forward(self, x):  # (B,T,C) -> (B,T,C)
        s = self.spec
        b, t, _ = x.shape
        hs, nh, nkv = s.head_size, s.num_heads, s.num_kv_heads
        qkv = self.qkv(x)                                                  # (B,T,(NH+2NKV)*HS)
        q, k, v = qkv.split([nh * hs, nkv * hs, nkv * hs], dim=-1)
        q = q.view(b, t, nh, hs).transpose(1, 2)                           # (B,NH,T,HS)
        k = k.view(b, t, nkv, hs).transpose(1, 2)                          # (B,NKV,T,HS)
        v = v.view(b, t, nkv, hs).transpose(1, 2)
        if s.position == "rope":
            q, k = rope_rotate(q, s.rope_theta), rope_rotate(k, s.rope_theta)
        # Query head h reads kv head h // (NH/NKV): repeat each kv head NH/NKV times in place.
        k = k.repeat_interleave(nh // nkv, dim=1)                          # (B,NH,T,HS)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)                 # (B,NH,T,T)
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        a = (probs @ v).transpose(1, 2).reshape(b, t, nh * hs)             # (B,T,NH*HS)
        return self.proj(a)


class Mlp(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.activation, f = spec.activation, spec.ffn_hidden_size
        width = 2 * f if spec.activation == "swiglu" else f
        self.fc = nn.Linear(spec.hidden_size, width, bias=spec.bias)  # swiglu rows: [gate; up]
        self.proj = nn.Linear(f, spec.hidden_size, bias=spec.bias)

    def forward(self, x):  # (B,T,C) -> (B,T,C)
        u = self.fc(x)
        if self.activation == "swiglu":
            gate, up = u.chunk(2, dim=-1)
            g = F.silu(gate) * up
        else:
            g = F.gelu(u, approximate="tanh")
        return self.proj(g)


class Block(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.norm1, self.attn = Norm(spec), Attention(spec)
        self.norm2, self.mlp = Norm(spec), Mlp(spec)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.wte = nn.Parameter(torch.zeros(spec.vocab_size, spec.hidden_size))
        self.wpe = (nn.Parameter(torch.zeros(spec.seq_len, spec.hidden_size))
                    if spec.position == "learned" else None)

    def forward(self, tokens):  # (B,T) int -> (B,T,C)
        x = self.wte[tokens]
        if self.wpe is not None:
            x = x + self.wpe[: tokens.shape[1]]
        return x


class Model(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.embedding = Embedding(spec)
        self.layers = nn.ModuleList([Block(spec) for _ in range(spec.num_layers)])
        self.final_norm = Norm(spec)
        self.lm_head = (None if spec.tie_embeddings
                        else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))

    def forward(self, tokens):  # (B,T) -> logits (B,T,V)
        x = self.embedding(tokens)
        for block in self.layers:
            x = block(x)
        x = self.final_norm(x)
        w = self.embedding.wte if self.lm_head is None else self.lm_head.weight
        return x @ w.t()

    def loss(self, sample):
        """sample (B, T+1) int: mean cross-entropy of sample[:, 1:] given sample[:, :-1]."""
        logits = self(sample[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), sample[:, 1:].reshape(-1))

    def load_arrays(self, arrays):
        """Loads {spec name: np.ndarray}; the name sets must be equal (ValueError naming the
        differences otherwise) and every shape must match."""
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(arrays)), sorted(set(arrays) - set(own))
        if missing or extra:
            raise ValueError(f"parameter names differ from the specification: missing {missing}, "
                             f"unexpected {extra}")
        for name, arr in arrays.items():
            if tuple(arr.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: shape {list(arr.shape)}, specification says "
                                 f"{list(own[name].shape)}")
        dtype = next(self.parameters()).dtype
        self.load_state_dict({n: torch.from_numpy(a.copy()).to(dtype) for n, a in arrays.items()})


def expected_param_shapes(spec):
    """{name: shape} of every parameter, straight from the specification's table."""
    return {n: tuple(p.shape) for n, p in Model(spec).state_dict().items()}


# ---- optimizer ----------------------------------------------------------------------------------

def lr_at(step, opt, steps):
    """The specification's schedule; `opt` is the config's "optimizer" section, step 0-based."""
    lr, min_lr = float(opt.get("lr", 6e-4)), float(opt.get("min_lr", 0.0))
    warmup = int(opt.get("warmup_steps", 0))
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = int(opt.get("decay_steps", 0)) or (steps - warmup)
    decay_steps = max(1, decay_steps)
    p = min(1.0, (step - warmup) / decay_steps)
    kind = opt.get("decay", "cosine")
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr - (lr - min_lr) * p
    if kind == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"optimizer.decay: {kind!r}: expected cosine | linear | constant")


def decays(name, param):
    """Weight decay on every 2-D weight (linear weights, wte, lm_head) except embedding.wpe."""
    return param.dim() == 2 and name != "embedding.wpe"


def make_adamw(model, opt):
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, p)],
         "weight_decay": float(opt.get("weight_decay", 0.1))},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=float(opt.get("lr", 6e-4)),
                             betas=(float(opt.get("beta1", 0.9)), float(opt.get("beta2", 0.95))),
                             eps=float(opt.get("eps", 1e-8)))


def accumulate_grads(model, samples, micro_batch_size):
    """Zeroes the grads, then accumulates the gradient of the mean loss over the global batch
    `samples` (GBS, T+1), one micro-batch of rows at a time, each loss scaled by 1/grad_accum.
    Returns the step loss (mean of the micro-batch mean losses) as a float."""
    n = samples.shape[0]
    if n % micro_batch_size != 0:
        raise ValueError(f"global batch {n} is not a multiple of micro_batch_size "
                         f"{micro_batch_size}")
    accum = n // micro_batch_size
    model.zero_grad(set_to_none=False)
    total = 0.0
    for j in range(accum):
        loss = model.loss(samples[j * micro_batch_size:(j + 1) * micro_batch_size]) / accum
        loss.backward()
        total += loss.item()
    return total


def train_step(model, optimizer, samples, micro_batch_size, lr, grad_clip):
    """One optimizer step. Returns (loss, grad_norm before clipping)."""
    loss = accumulate_grads(model, samples, micro_batch_size)
    params = [p for p in model.parameters()]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip).item()
    else:
        grad_norm = torch.norm(torch.stack([p.grad.norm() for p in params])).item()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return loss, grad_norm
