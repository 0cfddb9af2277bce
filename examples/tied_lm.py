"""A byte-level recurrent language model with tied input/output embeddings, a running
statistic kept in a buffer, and its own loss: an example task for ``diloco local --task
examples/tied_lm.py:build`` (or ``diloco learner``/``compare``, or the chart).

What it shows of the task contract:
- tied weights: ``head.weight`` is ``embed.weight``; the run syncs that storage once and the
  exported ``model.safetensors`` holds both keys;
- buffers: ``hidden_rms`` (a float running mean, synced as the learners' weighted mean)
  and ``batches_seen`` (an int64 counter, kept per learner, never synced);
- its own loss: cross-entropy with label smoothing plus a small penalty on large logits;
- its own data: the interpreter's standard-library sources read as bytes, learner i
  reading every (i mod shards)-th file, a fixed held-out set for evaluation.

Options (``--task-option KEY=VALUE``): hidden (64), context (32), batch_size (16),
shards (4), smoothing (0.05).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import diloco

VOCAB = 256


class TiedGRU(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.05)
        self.register_buffer("hidden_rms", torch.ones(()))
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(x))
        if self.training:
            with torch.no_grad():
                self.hidden_rms.mul_(0.99).add_(0.01 * h.pow(2).mean().sqrt())
                self.batches_seen += 1
        return self.head(self.norm(h / self.hidden_rms))


def _files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)


def _windows(data: torch.Tensor, count: int, context: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - context - 1, (count,), generator=generator)
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()]).long()


def build(ctx: diloco.TaskContext) -> diloco.Task:
    hidden = ctx.option("hidden", 64, int)
    context = ctx.option("context", 32, int)
    batch_size = ctx.option("batch_size", 16, int)
    shards = ctx.option("shards", 4, int)
    smoothing = ctx.option("smoothing", 0.05, float)
    files = _files()
    held_out, train = files[::10], [f for i, f in enumerate(files) if i % 10]
    mine = train[ctx.learner_index % shards :: shards]
    data = torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in mine)), dtype=torch.uint8)
    eval_data = torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in held_out)), dtype=torch.uint8)

    torch.manual_seed(ctx.seed)
    model = TiedGRU(hidden).to(ctx.device)

    def batches():
        generator = torch.Generator().manual_seed(ctx.seed * 7919 + ctx.learner_index)
        while True:
            yield _windows(data, batch_size, context, generator)

    def loss(model: TiedGRU, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(ctx.device)
        logits = model(rows[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1), label_smoothing=smoothing)
        return ce + 1e-4 * logits.pow(2).mean()

    fixed = torch.Generator().manual_seed(12345)
    return diloco.Task(
        model=model,
        batches=batches(),
        loss=loss,
        tokens=lambda rows: rows.shape[0] * (rows.shape[1] - 1),
        eval_batches=[_windows(eval_data, batch_size, context, fixed) for _ in range(8)],
    )
