"""A small GPT with tied embeddings, its generated training data, and the single-process
reference trainer that flatshard's multi-rank runs are compared against.

Only torch; no flatshard import (the reference must not depend on what it checks).
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 97
    block_size: int = 32
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 48


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # No bias on the q/k/v projection: the key bias's gradient is zero in exact
        # arithmetic (softmax ignores a constant added to a row), so what it gets is
        # summation-order noise, which AdamW normalises into full-size updates: those elements
        # would depend on the order of float32 additions, which differs between any
        # data-parallel run and one process (with plain SGD they do not move at all).
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        h = self.n_head
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """wte is tied to lm_head (one Parameter registered at two paths)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, dtype=torch.long).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.no_grad()
def generate(model: GPT, prompt: List[int], new_tokens: int) -> List[int]:
    """Greedy decoding: the argmax token, appended ``new_tokens`` times (the context cut to
    the last block_size tokens)."""
    idx = torch.tensor([prompt], dtype=torch.long)
    for _ in range(new_tokens):
        logits = model.logits(idx[:, -model.cfg.block_size:])
        idx = torch.cat([idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)], dim=1)
    return idx[0, len(prompt):].tolist()


def build_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kw))


def global_batch(step: int, batch: int, cfg: GPTConfig, seed: int = 1234) -> Tuple[torch.Tensor, torch.Tensor]:
    """Deterministic generated data for one step: counting sequences x[i+1] = x[i] + a mod V
    with the stride a (1..3) and x[0] drawn per sequence; after two tokens the rest is
    predictable, so the loss falls quickly. Same on every rank."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    v, t = cfg.vocab_size, cfg.block_size + 1
    a = torch.randint(1, 4, (batch, 1), generator=g)
    x0 = torch.randint(0, v, (batch, 1), generator=g)
    s = (x0 + a * torch.arange(t).unsqueeze(0)) % v
    return s[:, :-1].contiguous(), s[:, 1:].contiguous()


def local_batch(step: int, batch: int, cfg: GPTConfig, rank: int, world_size: int):
    """Rank ``rank``'s equal slice of the global batch (batch % world_size == 0)."""
    if batch % world_size:
        raise ValueError(f"global batch {batch} is not divisible by world size {world_size}")
    x, y = global_batch(step, batch, cfg)
    n = batch // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def make_optimizer(params, lr: float = 3e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


# --precision of the examples: (param_dtype, reduce_dtype) of FSDP's MixedPrecision; None:
# float32 throughout. "bf16" is the everyday recipe (bf16 compute, float32 reductions).
PRECISIONS = {
    "fp32": None,
    "bf16": (torch.bfloat16, torch.float32),
    "bf16-reduce": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
}


def train_reference(steps: int, batch: int, seed: int = 0, lr: float = 3e-3,
                    optimizer: str = "adamw", precision: str = "fp32",
                    **cfg_kw) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The single-process reference: the same model, the same global batches, AdamW (or
    plain SGD with optimizer="sgd"). With a mixed `precision` (PRECISIONS), the same casts
    as FSDP's MixedPrecision: float32 master parameters and optimizer; each step runs forward
    and backward on a copy in param_dtype, the gradient is rounded to reduce_dtype and then
    widened to float32 for the optimizer."""
    model = build_gpt(seed, **cfg_kw)
    if optimizer == "adamw":
        opt = make_optimizer(model.parameters(), lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    mp = PRECISIONS[precision]
    losses = []
    for step in range(steps):
        x, y = global_batch(step, batch, model.cfg)
        opt.zero_grad(set_to_none=True)
        if mp is None:
            loss = model(x, y)
            loss.backward()
        else:
            low = build_gpt(seed, **cfg_kw)
            low.load_state_dict(model.state_dict())
            low.to(mp[0])
            loss = low(x, y)
            loss.backward()
            for p, q in zip(model.parameters(), low.parameters()):
                p.grad = q.grad.to(mp[1]).to(torch.float32)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
