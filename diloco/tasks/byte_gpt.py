"""The built-in task: a small decoder-only transformer over bytes (vocabulary 256) trained
on the Python standard library's own source files (or ``--task-option data=PATH``), in
plain PyTorch. It is the default task (``diloco.tasks.byte_gpt:build``) and an example of
the task contract: nothing in diloco.learner, diloco.syncer or diloco.coordinator knows it.

Options (``--task-option KEY=VALUE``; ``diloco local`` and ``diloco learner`` also take
``--width/--depth/--heads/--context/--batch-size/--data`` for it): width, depth, heads,
context, batch_size, data, data_shards, eval_batches. Eval loss is reported in bits per
byte.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from diloco.errors import InvalidArgument
from diloco.task import Task, TaskContext
from diloco.tasks.byte_gpt_options import ModelConfig, Options
from diloco.tasks.corpus import load_corpus

VOCAB_SIZE = 256
EVAL_SEED = 12345
"""The eval batches are the same for every learner and every system."""


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


def loss(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    device = model.head.weight.device
    x, y = batch
    return model(x.to(device), y.to(device))[1]


def tokens(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    return batch[0].numel()


def build(ctx: TaskContext) -> Task:
    opts = Options.parse(ctx)
    context = opts.model.context
    corpus = load_corpus(opts.data, ctx.learner_index % opts.data_shards, opts.data_shards)

    def batches():
        step = 0
        while True:
            yield corpus.train.batch(step, opts.batch_size, context, ctx.seed)
            step += 1

    return Task(
        model=GPT(opts.model).to(ctx.device),
        batches=batches(),
        loss=loss,
        tokens=tokens,
        eval_batches=[corpus.eval.batch(i, opts.batch_size, context, seed=EVAL_SEED) for i in range(opts.eval_batches)],
        eval_unit="bits/byte",
        eval_scale=1 / math.log(2),
    )
