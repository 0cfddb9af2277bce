"""A small convolutional classifier with BatchNorm on synthetic images: an example task for
``diloco local --task examples/cnn_bn.py:build``.

What it shows of the task contract:
- BatchNorm buffers: ``running_mean``/``running_var`` are synced as the learners' weighted
  mean (never pushed by outer momentum); ``num_batches_tracked`` stays per learner;
- data that is not text: each class is a fixed random 16x16 pattern; an image is its
  class's pattern, shifted by a random offset, plus noise. Learner i draws its own
  stream of images; the eval set is fixed and shared;
- its own optimizer (SGD with momentum) and a token count that is images, not bytes.

Options: width (8), batch_size (32), classes (10), noise (1.0), lr (0.05).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import diloco

SIZE = 16


class SmallCNN(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(8 * width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def _images(patterns: torch.Tensor, count: int, noise: float, generator: torch.Generator):
    labels = torch.randint(0, patterns.shape[0], (count,), generator=generator)
    shifts = torch.randint(-2, 3, (2,), generator=generator).tolist()
    images = torch.roll(patterns[labels], shifts=shifts, dims=(1, 2))
    images = images + noise * torch.randn(images.shape, generator=generator)
    return images.unsqueeze(1), labels


def build(ctx: diloco.TaskContext) -> diloco.Task:
    width = ctx.option("width", 8, int)
    batch_size = ctx.option("batch_size", 32, int)
    classes = ctx.option("classes", 10, int)
    noise = ctx.option("noise", 1.0, float)
    lr = ctx.option("lr", 0.05, float)
    patterns = torch.randn((classes, SIZE, SIZE), generator=torch.Generator().manual_seed(1000 + ctx.seed))
    torch.manual_seed(ctx.seed)
    model = SmallCNN(width, classes).to(ctx.device)

    def batches():
        generator = torch.Generator().manual_seed(ctx.seed * 104729 + ctx.learner_index + 1)
        while True:
            yield _images(patterns, batch_size, noise, generator)

    def loss(model: SmallCNN, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images.to(ctx.device)), labels.to(ctx.device))

    fixed = torch.Generator().manual_seed(4242)
    return diloco.Task(
        model=model,
        batches=batches(),
        loss=loss,
        tokens=lambda batch: batch[1].numel(),
        eval_batches=[_images(patterns, 64, noise, fixed) for _ in range(4)],
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
    )
