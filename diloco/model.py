"""The model every learner trains and every shard initialises: a small decoder-only
transformer over bytes (vocabulary 256), in plain PyTorch.

It lives in the shared kernel because shards need it too: the fragment plan comes from
its (name, shape) list, and a shard starts its fragments from the same seeded
initialisation as the learners, so no learner has to upload a starting point (a shard
process, which never loads torch, gets both from ``syncer.initial``). ``ModelConfig`` is
in ``diloco.config``, importable without torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from diloco.config import ModelConfig
from diloco.errors import InvalidArgument

VOCAB_SIZE = 256


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embed = nn.Embedding(VOCAB_SIZE, cfg.width)
        self.pos_embed = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB_SIZE, bias=False)
        if init:
            self._init_weights(torch.Generator().manual_seed(cfg.seed))

    @torch.no_grad()
    def _init_weights(self, g: torch.Generator) -> None:
        # Explicit, generator-driven init: identical on every machine for a given seed.
        residual_scale = 0.02 / math.sqrt(2 * self.cfg.depth)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = residual_scale if name.endswith(("proj.weight", "down.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.context:
            raise InvalidArgument(f"sequence of {t} tokens exceeds the model context {self.cfg.context}")
        x = self.tok_embed(idx) + self.pos_embed(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB_SIZE), targets.reshape(-1))


def named_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The model's ordered (name, shape) list, built without allocating or initialising."""
    with torch.device("meta"):
        model = GPT(cfg, init=False)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def initial_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in GPT(cfg).named_parameters()}
